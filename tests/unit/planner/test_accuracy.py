"""The planner against real start-ups (issue 17): the KV pool it predicts beside the one vLLM
allocated, on every record of tests/data/vllm_startup_records.json whose model, GPU and
settings are known. Its provenance is in tests/data/PROVENANCE.md; the table these tests print
(`pytest -s`) is docs/planner.md's accuracy table.

A predicted pool larger than the real one is the dangerous direction: the planner would
promise room that is not there. Goal: median |error| ≤ 0.05 GiB and no record optimistic by
more than 0.05 GiB.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tunerd.planner.gpus import GpuProfile, gpu_profile
from tunerd.planner.recommend import Settings, evaluate
from tunerd.planner.shapes import ModelShape, ShapeError, builtin_model

RECORDS = Path(__file__).parents[2] / "data" / "vllm_startup_records.json"
GIB = 2**30
#: The GPU each record names → its profile (CUDA-visible total): a GCE a2-highgpu-1g is one
#: A100 40GB.
PROFILES = {
    "NVIDIA GeForce RTX 3090": "rtx3090",
    "NVIDIA L4": "l4",
    "NVIDIA H200": "h200",
    "NVIDIA A100 (GCE a2-highgpu-1g)": "a100-40g",
}
WEIGHTS = ("bf16", "fp16", "awq", "gptq", "int4", "int8", "fp8")


@dataclass(frozen=True)
class Checked:
    record: str
    version: str
    gpu: str
    model: str
    predicted_gib: float
    measured_gib: float

    @property
    def error_gib(self) -> float:
        """Predicted − measured: positive is optimistic."""
        return self.predicted_gib - self.measured_gib


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split("+", maxsplit=1)[0].split(".")[:2]
    return int(major), int(minor)


def _checked(record: dict[str, Any]) -> Checked | str:
    """The record priced by the planner, or why it cannot be."""
    try:
        shape: ModelShape = builtin_model(record["model"])
    except ShapeError:
        return "no built-in shape"
    profile_name = PROFILES.get(record["gpu"] or "")
    if profile_name is None:
        return "the GPU's CUDA total is not known"
    if record["weights"] not in WEIGHTS or record["vllm_version"] is None:
        return "weights or version not known"
    gpu: GpuProfile = gpu_profile(profile_name)
    version = _version(record["vllm_version"])
    large = gpu.total_bytes >= 70 * GIB and not profile_name.startswith("a100")  # vLLM's defaults
    settings = Settings(
        gpu_memory_utilization=record["gpu_memory_utilization"] or (0.92 if version >= (0, 21) else 0.9),
        max_num_batched_tokens=record["max_num_batched_tokens"] or (8192 if large else 2048),
        max_num_seqs=record["max_num_seqs"] or (1024 if large else 256),
        enforce_eager=bool(record["enforce_eager"]),
        vllm_version=version,
    )
    length = record["max_model_len"] or shape.max_position_embeddings
    scenario = evaluate(
        shape,
        gpu,
        weights_format=record["weights"],
        kv_dtype="auto",
        context=length,
        concurrency=1,
        settings=settings,
    )
    return Checked(
        record=record["id"],
        version=record["vllm_version"],
        gpu=profile_name,
        model=shape.name,
        predicted_gib=scenario.pool.available_bytes / GIB,
        measured_gib=record["available_kv_cache_gib"],
    )


def _all() -> tuple[list[Checked], dict[str, str]]:
    checked, skipped = [], {}
    for record in json.loads(RECORDS.read_text())["records"]:
        result = _checked(record)
        if isinstance(result, str):
            skipped[record["id"]] = result
        else:
            checked.append(result)
    return checked, skipped


CHECKED, SKIPPED = _all()


def test_the_records_are_real_and_enough() -> None:
    """Each record quotes its log lines, and its figures are in them verbatim."""
    records = json.loads(RECORDS.read_text())["records"]
    assert len(records) >= 20
    for record in records:
        said = "\n".join(record["lines"])
        assert record["url"], record["id"]
        for figure in ("model_loading_gib", "available_kv_cache_gib"):
            assert str(record[figure]) in said, (record["id"], figure)
    assert len(CHECKED) >= 9, SKIPPED


def test_the_pool_is_predicted_within_five_hundredths_of_a_gib_never_optimistic() -> None:
    errors = [item.error_gib for item in CHECKED]
    rows = "\n".join(
        f"| {item.record} | {item.version} | {item.gpu} | {item.model} | {item.measured_gib:.2f} | "
        f"{item.predicted_gib:.2f} | {item.error_gib:+.3f} |"
        for item in CHECKED
    )
    print(f"\n{rows}\nmedian |error| {statistics.median(abs(e) for e in errors):.3f} GiB")
    assert statistics.median(abs(error) for error in errors) <= 0.05
    optimistic = [(item.record, round(item.error_gib, 3)) for item in CHECKED if item.error_gib > 0.05]
    assert optimistic == []


@pytest.mark.parametrize("version", [(0, 11), (0, 17), (0, 33)])
def test_the_profile_run_grows_with_the_sequences_sampled(version: tuple[int, int]) -> None:
    """The sampler's pass over max_num_seqs rows is what an H100/H200 at vLLM's large-GPU
    defaults (1,024 sequences) pays for: GiBs, not the fraction of one a 24 GiB card's 256 do."""
    shape = builtin_model("llama-3.1-8b")
    gpu = gpu_profile("h200")
    small, large = (
        evaluate(
            shape,
            gpu,
            weights_format="bf16",
            kv_dtype="auto",
            context=1024,
            concurrency=1,
            settings=Settings(0.9, tokens, seqs, vllm_version=version),
        ).activation.bytes
        / GIB
        for tokens, seqs in ((2048, 256), (8192, 1024))
    )
    assert large > 3 * small
    assert math.isfinite(large)
