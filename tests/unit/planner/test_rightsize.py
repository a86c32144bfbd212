"""Right-sizing (tunerd.planner.rightsize) from the request histograms of a real vLLM 0.32
engine under load (tests/data/vllm/metrics-0.32-load-2.txt: six 1,200-token prompts with 800
tokens out on a 4,096-token pool of 128-token blocks, preempted; see its PROVENANCE) and on a
calibrated simulated box."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.planner.test_calibration import BOXES, START, _observe
from tunerd.planner.rightsize import Workload, advice_to_dict, advise, materially_different, seqs_fit
from tunerd.sources.vllm_metrics import histograms, parse

PAGE = (Path(__file__).parents[2] / "data" / "vllm" / "metrics-0.32-load-2.txt").read_text()


def test_the_histograms_of_a_real_page() -> None:
    found = histograms(PAGE)
    prompt = found["vllm:request_prompt_tokens"]
    assert prompt.count == 5
    assert prompt.total == 4813  # the five finished prompts (prompt_tokens_total counts running ones too)
    assert prompt.quantile(0.5) == 2000  # the bucket (1000, 2000] holds the median
    assert found["vllm:request_num_preemptions"].total == 2


def test_a_preempting_real_engine_is_told_how_many_requests_its_pool_holds() -> None:
    snapshot = parse(PAGE)
    workload = Workload.from_histograms(histograms(PAGE))
    advice = advice_to_dict(
        advise(
            {"max_model_len": 2048},
            workload,
            pool_tokens=snapshot.kv_cache_size_tokens,
            min_requests=5,
            block_size=snapshot.block_size or 16,
        )
    )
    seqs = advice["max_num_seqs"]
    assert snapshot.kv_cache_size_tokens == 4096
    assert (seqs["target"], seqs["lower"], seqs["upper"]) == (1, 1, 2)
    assert "preempted" in seqs["reason"]
    assert advice["max_model_len"]["target"] == 2048  # never above what it is
    assert advice["gpu_memory_utilization"]["reason"].startswith("kept: nothing calibrated")


def test_too_few_requests_size_nothing() -> None:
    advice = advice_to_dict(
        advise({"max_model_len": 2048}, Workload.from_histograms(histograms(PAGE)), pool_tokens=4096)
    )
    assert all(item["target"] == item["current"] for item in advice.values())
    assert "only 5 requests seen" in advice["max_num_seqs"]["reason"]


def test_a_calibrated_box_gets_its_fits_and_predicted_pools() -> None:
    observation = _observe(BOXES[0])
    workload = Workload(
        requests=100,
        prompt={0.5: 20000, 0.9: 28000, 0.95: 28000, 0.999: 30000, 1.0: 30000},
        generation={0.5: 500, 0.9: 512, 0.95: 512, 0.999: 512, 1.0: 512},
        mean_length=24000,
    )
    advice = advice_to_dict(
        advise(START, workload, pool_tokens=observation.kv_cache_tokens, observation=observation)
    )
    utilization = advice["gpu_memory_utilization"]
    assert utilization["target"] > START["gpu_memory_utilization"]  # the box has room
    assert utilization["lower"] < utilization["target"] == utilization["upper"]
    assert utilization["predicted_kv_cache_tokens"] > (observation.kv_cache_tokens or 0)
    assert advice["max_model_len"]["target"] == 30720  # 30,512 rounded up to 1,024
    assert advice["max_model_len"]["lower"] == 30512
    assert advice["max_model_len"]["predicted_kv_cache_tokens"] is not None
    seqs = advice["max_num_seqs"]
    assert seqs["lower"] <= seqs["target"] <= seqs["upper"]
    assert advice["kv_cache_dtype"]["target"] in {"fp8", "float16"}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([
    'vllm:request_prompt_tokens_bucket{le="10"} 3', 'vllm:request_prompt_tokens_bucket{le="+Inf"} 2',
    'vllm:request_prompt_tokens_bucket{le="x"} 1', 'vllm:request_prompt_tokens_count 1e400',
    'vllm:request_prompt_tokens_sum -5', 'vllm:request_generation_tokens_bucket{le="NaN"} 1',
    'vllm:request_generation_tokens_bucket{le="5"} 9', "vllm:request_num_preemptions_sum nan", "garbage {",
]), max_size=20), st.text(max_size=40))  # fmt: skip
def test_a_hostile_page_never_raises(lines: list[str], junk: str) -> None:
    found = histograms("\n".join([*lines, junk]))
    workload = Workload.from_histograms(found)
    advise({"max_model_len": 4096}, workload, pool_tokens=8192, min_requests=1)


def test_max_num_seqs_fit_is_the_right_sizing_target() -> None:
    snapshot = parse(PAGE)
    workload = Workload.from_histograms(histograms(PAGE))
    fit = seqs_fit({"max_model_len": 2048}, workload, pool_tokens=4096, block_size=128, min_requests=5)
    assert fit.value == 1
    assert "preempted" in fit.reason
    assert seqs_fit({}, workload, pool_tokens=snapshot.kv_cache_size_tokens).value is None  # 5 < 20 requests
    assert seqs_fit({}, None, pool_tokens=4096).reason == "no request histograms read yet"


def test_what_is_posted_again_is_what_moved_materially() -> None:
    def item(current: object, target: object) -> dict[str, object]:
        return {"current": current, "target": target}

    now = {
        "gpu_memory_utilization": item(0.92, 0.948),
        "max_num_seqs": item(256, 12),
        "max_model_len": item(32768, 32768),  # already right: never posted
        "kv_cache_dtype": item("auto", "fp8"),
    }
    assert materially_different(None, now) == ["gpu_memory_utilization", "max_num_seqs", "kv_cache_dtype"]
    last = {"gpu_memory_utilization": 0.94, "max_num_seqs": 11, "kv_cache_dtype": "fp8"}
    assert materially_different(last, now) == []  # 0.008 and one sequence: not material
    assert materially_different({**last, "max_num_seqs": 20}, now) == ["max_num_seqs"]
