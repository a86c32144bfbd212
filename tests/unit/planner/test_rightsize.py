"""Right-sizing (tunerd.planner.rightsize) from the request histograms of a real vLLM 0.32
engine under load (tests/data/vllm/metrics-0.32-load-2.txt: six 1,200-token prompts with 800
tokens out on a 4,096-token pool of 128-token blocks, preempted; see its PROVENANCE) and on a
calibrated simulated box."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.planner.test_calibration import BOXES, START, _observe
from tunerd.planner.rightsize import Workload, advice_to_dict, advise
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
