"""The demo's summary and HTML report."""

from __future__ import annotations

from tunerd.demo.report import Sample, bill_table, check_lines, checks, render_html, safe_kv_tokens
from tunerd.demo.scenarios import SCENARIOS, scenario
from tunerd.demo.story import Story
from tunerd.units import GIB

SEED = SCENARIOS["seed"].settings
TUNED = {**SEED, "gpu_memory_utilization": 0.94}


def test_the_four_bills_before_and_after_the_tune() -> None:
    lines = bill_table(scenario("seed"), SEED, TUNED)
    rows = {line[2:26].strip(): line[26:].split() for line in lines[1:]}
    assert rows["weights"] == ["5.37", "5.37"]
    assert rows["KV cache pool"] == ["16.28", "15.57"]  # 0.03 of 23.52 GiB less
    assert rows["activations (peak)"] == ["0.97", "0.97"]
    # the pools the simulated vLLM reports in the seed demo (its /metrics, cache_config_info)
    assert rows["KV pool (tokens)"] == ["133,360", "127,584"]
    assert float(rows["free of the GPU"][1]) - float(rows["free of the GPU"][0]) > 0.7


def test_the_safe_maximum_is_the_pool_at_the_planners_utilization() -> None:
    # `tunerd plan --model llama-3.1-8b --weights awq --kv-dtype fp16 --gpu rtx4090
    #  --concurrency 4 --context 32768 --max-num-batched-tokens 8192 --max-num-seqs 16 --json`
    # recommends 0.92, where vLLM's pool is 123,728 tokens
    assert safe_kv_tokens(scenario("seed"), TUNED) == 123_728


def _tune(story: Story, now: float) -> None:
    row = {"id": int(now), "kind": "tune", "outcome": "succeeded", "policy": "oom", "reason": "",
           "from_settings": SEED, "to_settings": TUNED}  # fmt: skip
    story.on_row(row, now)


def test_the_convergence_checks() -> None:
    story = Story(scenario("seed"))
    story.on_serving(SEED, 133_440, 0.0)
    story.on_crash("cuda_oom", 100.0)
    _tune(story, 100.0)  # the oom policy's restart with tuned settings
    story.on_serving(TUNED, 127_664, 200.0)
    met = {check.name: check for check in checks(story, TUNED, 127_664)}
    assert met["final KV pool / planner's safe maximum"].met
    assert met["final KV pool / planner's safe maximum"].value == "127,664 / 123,728 = 103%"
    assert met["OOMs after converging"].met
    assert met["restarts to converge"].met
    short = {check.name: check for check in checks(story, TUNED, 100_000)}
    assert not short["final KV pool / planner's safe maximum"].met  # 81%: tuned down too far
    story.on_crash("cuda_oom", 900.0)  # after the last change; restarted with the same settings
    again = {check.name: check for check in checks(story, TUNED, 127_664)}
    assert again["OOMs after converging"].value == "1"
    assert not again["OOMs after converging"].met


def test_the_report_is_one_page_with_the_curve_and_the_marks() -> None:
    story = Story(scenario("seed"))
    story.on_serving(SEED, 133_440, 0.0)
    story.on_crash("cuda_oom", 100.0)
    samples = [
        Sample(t, int((20 + t / 100) * GIB), int(19 * GIB), int(24 * GIB), int(22.8 * GIB))
        for t in range(0, 200, 10)
    ]
    page = render_html(story, samples, ["[0:01:40] engine died: <b>OOM</b>"], ["final: …"], "stable")
    assert page.startswith("<!doctype html>")
    assert page.count('class="layer"') == 2  # the engine's, everything else's
    assert page.count('class="line"') == 1  # its budget
    assert '<g class="mark" data-kind="crash" data-time="100.000"' in page
    assert "<title>crash: cuda_oom</title>" in page
    assert (
        "  2      1:40  crash     cuda_oom" in page
    )  # the marks listed as the chart numbers them (1 serving)
    assert "&lt;b&gt;OOM&lt;/b&gt;" in page  # narration is escaped
    assert "http" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")  # nothing fetched


def test_the_chinese_report_and_summary_are_chinese_too() -> None:
    """Issue 21: the narration was Chinese, its tables, headings and chart legend English."""
    story = Story(scenario("seed"), "zh")
    story.on_crash("cuda_oom", 100.0)
    samples = [
        Sample(t, int(22 * GIB), int(21 * GIB), int(24 * GIB), int(22.8 * GIB)) for t in range(0, 200, 10)
    ]
    page = render_html(story, samples, ["[0:01:40] 引擎退出"], ["小结"], "已稳定")
    for words in ('<html lang="zh">', "<h2>标记</h2>", "<h2>经过</h2>", "<h2>小结</h2>", "引擎（vLLM 的进程）",
                  "显卡总量", "开始后的时间", "（标记）", "tunerd 演示 · seed"):  # fmt: skip
        assert words in page, words
    table = bill_table(scenario("seed"), SEED, TUNED, "zh")
    assert table[0].split() == ["账单（GiB）", "之前", "之后"]
    assert table[1].startswith("  权重")
    columns = [sum(2 if ord(ch) > 0x2E7F else 1 for ch in line) for line in table]  # a CJK character: two
    english = bill_table(scenario("seed"), SEED, TUNED)
    assert columns == [len(line) for line in english]  # the numbers line up as in English
    measured = checks(story, TUNED, 127_664)
    assert check_lines(measured, "zh")[0].startswith("  达标    收敛所需的重启次数: ")
