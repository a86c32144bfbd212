"""The demo's narration and judgement, fed the history records of real demo runs
(tests/data/demo/, provenance in tests/data/PROVENANCE.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tunerd.demo.scenarios import SCENARIOS, scenario
from tunerd.demo.story import TEXTS, Story, clock_text

DATA = Path(__file__).parents[2] / "data" / "demo"


def _rows(name: str) -> list[dict[str, Any]]:
    return list(reversed(json.loads((DATA / f"{name}-history.json").read_text())["actions"]))


def _play(story: Story, rows: list[dict[str, Any]], crashes_before: set[int]) -> list[str]:
    """Feed the records oldest first, a simulated minute apart; an engine_crash event before
    each record in ``crashes_before`` (as the daemon's log says it first)."""
    said: list[str] = []
    for minute, row in enumerate(rows, start=1):
        now = minute * 60.0
        if row["id"] in crashes_before:
            said += story.on_crash("cuda_oom", now - 1)
        said += story.on_row(row, now)
    return said


def test_the_seed_story_is_told_and_converges() -> None:
    story = Story(scenario("seed"))
    said = story.on_serving(SCENARIOS["seed"].settings, 133_440, 0.0)
    assert said == [
        "tunerd starts vLLM (simulated): gpu_memory_utilization 0.97, kv_cache_dtype float16, "
        "max_model_len 32768, max_num_batched_tokens 8192, max_num_seqs 16",
        "serving: KV pool 133,440 tokens (4.07× 32,768-token requests)",
    ]
    rows = _rows("seed")
    tune = next(row for row in rows if row["kind"] == "tune")
    said = _play(story, rows, {tune["id"]})
    assert said[0].startswith("memory ratchet: engine 416 MiB over its budget, 6 MiB free → ")
    assert "engine died: CUDA out of memory (cuda_oom)" in said
    assert "tune (oom): gpu_memory_utilization 0.97→0.94" in said
    assert said.count("tune (oom): gpu_memory_utilization 0.97→0.94") == 1  # said when it began
    assert story.restarts_used() == 1  # the first start is not one
    changed = story.last_change
    story.on_serving({**SCENARIOS["seed"].settings, "gpu_memory_utilization": 0.94}, 127_664, changed + 90)
    assert story.verdict(changed + 599) is None  # ten minutes without a change, not yet
    verdict = story.verdict(changed + 600)
    assert verdict is not None
    assert verdict.ok
    assert verdict.why == "stable for 10 simulated minutes"


def test_a_crash_while_waiting_for_stability_restarts_the_count() -> None:
    story = Story(scenario("seed"))
    story.on_serving(SCENARIOS["seed"].settings, 133_440, 0.0)
    story.last_change = 0.0
    story.on_crash("cuda_oom", 500.0)
    assert story.verdict(700.0) is None  # down, and the crash was 200 s ago


def test_the_neighbour_story_alerts_tunes_nothing_and_holds() -> None:
    story = Story(scenario("neighbour"))
    story.on_serving(SCENARIOS["neighbour"].settings, 251_440, 0.0)
    rows = _rows("neighbour")
    crashed = [
        row["id"] for row in rows if row["kind"] == "restart" and row["reason"].startswith("engine crashed")
    ]
    said = _play(story, rows, set(crashed))
    assert "restarted with the same settings (the engine was not at fault)" in said
    assert "alert (critical): oom-neighbour on main" in said
    assert any(line.startswith("HOLD (crash loop after cuda_oom): tuning stopped") for line in said)
    assert story.tunes() == []
    verdict = story.verdict(len(rows) * 60.0)
    assert verdict is not None
    assert verdict.ok
    assert verdict.why == "alerted (oom-neighbour) and tuned nothing; held after the crash loop"


def test_a_converging_story_that_ends_held_failed() -> None:
    """The seed scenario expects convergence: the neighbour's hold is a failure there."""
    story = Story(scenario("seed"))
    story.on_serving(SCENARIOS["seed"].settings, 133_440, 0.0)
    _play(story, _rows("neighbour"), set())
    verdict = story.verdict(10_000.0)
    assert verdict is not None
    assert not verdict.ok
    assert verdict.why.startswith("held: crash loop after cuda_oom")


def test_an_alert_from_another_policy_is_not_the_neighbours() -> None:
    story = Story(scenario("neighbour"))
    story.on_serving(SCENARIOS["neighbour"].settings, 251_440, 0.0)
    ratchet_alert = next(r for r in _rows("seed") if r["kind"] == "notify" and "firing" in r["reason"])
    story.on_row(ratchet_alert, 60.0)
    assert story.verdict(5_000.0) is None  # stable, but not the story it is about


def test_past_the_deadline_it_failed() -> None:
    story = Story(scenario("seed"))
    verdict = story.verdict(SCENARIOS["seed"].deadline)
    assert verdict is not None
    assert not verdict.ok
    assert verdict.why == "no end after 3 simulated hours"


def test_every_line_has_a_chinese_twin() -> None:
    assert TEXTS["en"].keys() == TEXTS["zh"].keys()
    story = Story(scenario("seed"), language="zh")
    said = story.on_serving(SCENARIOS["seed"].settings, 133_440, 0.0)
    assert said[1] == "开始服务：KV 池 133,440 token（4.07 倍的 32,768 token 请求）"
    assert story.on_crash("cuda_oom", 60.0) == ["引擎退出：CUDA 显存不足（cuda_oom）"]


def test_simulated_time_reads_as_hours_minutes_seconds() -> None:
    assert clock_text(0) == "0:00:00"
    assert clock_text(3 * 3600 + 5 * 60 + 7.9) == "3:05:07"
    assert clock_text(90_000) == "25:00:00"


def test_a_quiet_stretch_says_what_is_going_on_in_both_languages() -> None:
    story = Story(scenario("seed"))
    assert story.quiet(30.0, None, None) == (
        "… the engine is not serving yet; ? of ? used on the GPU; 0:00:30 without a change "
        "(the story ends 0:10:00 after the last)"
    )
    story.on_serving(dict(scenario("seed").settings), 133_440, 100.0)
    line = story.quiet(700.0, int(22.5 * 2**30), 24 * 2**30)
    assert line.startswith("… serving; 22.50 GiB of 24.00 GiB used on the GPU; ")
    chinese = Story(scenario("seed"), "zh")
    assert chinese.quiet(30.0, None, None).startswith("…… 引擎尚未开始服务；")
