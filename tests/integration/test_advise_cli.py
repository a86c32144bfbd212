"""`tunerd advise` as a user runs it: on a real vLLM 0.32 engine's recorded page and start-up
log (tests/data/vllm, see PROVENANCE), and on the simulator under load (real processes on
loopback)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_sim import FAST, SEED_MODEL, load, sim

RECORDED = Path(__file__).parents[1] / "data" / "vllm"


def _advise(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tunerd", "advise", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_recorded_real_engine_under_load() -> None:
    done = _advise("tiny", "--metrics-file", str(RECORDED / "metrics-0.32-load-2.txt"),
                   "--log", str(RECORDED / "startup-ok-0.32.log"), "--min-requests", "5", "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["kv_cache_tokens"] == 4096
    assert result["calibrated"] is False
    seqs = result["recommendation"]["max_num_seqs"]
    assert (seqs["target"], seqs["lower"], seqs["upper"]) == (1, 1, 2)
    assert set(result["recommendation"]) == {
        "gpu_memory_utilization", "max_num_batched_tokens", "max_model_len", "max_num_seqs", "kv_cache_dtype"
    }  # fmt: skip
    for item in result["recommendation"].values():
        assert set(item) == {"current", "target", "lower", "upper", "reason", "predicted_kv_cache_tokens"}
    text = _advise("tiny", "--metrics-file", str(RECORDED / "metrics-0.32-load-2.txt"),
                   "--log", str(RECORDED / "startup-ok-0.32.log"), "--min-requests", "5")  # fmt: skip
    assert "tiny: right-sizing from 5 requests served" in text.stdout
    assert "requests were preempted" in text.stdout


@pytest.mark.slow
def test_the_simulator_under_load(tmp_path: Path) -> None:
    settings = ["--gpu-memory-utilization", "0.9", "--max-model-len", "32768", "--max-num-seqs", "64",
                "--max-num-batched-tokens", "2048", "--kv-cache-dtype", "fp8"]  # fmt: skip
    with sim(tmp_path, *SEED_MODEL, *settings, *FAST) as engine:
        result = load(engine.url, concurrency=8, prompt_tokens=3000, max_tokens=200, requests=24)
        assert result.returncode == 0, result.stdout + result.stderr
        done = _advise("sim", "--url", engine.url, "--log", str(engine.log), "--json")
    assert done.returncode == 0, done.stderr
    advice = json.loads(done.stdout)["recommendation"]
    # 3,000 + 200 tokens a request (the buckets: 5,000 + 200), on a pool of about 257K tokens
    assert advice["max_model_len"]["target"] == 6144  # 5,200 rounded up to 1,024
    assert advice["max_model_len"]["lower"] == 5000 + 200
    seqs = advice["max_num_seqs"]
    assert seqs["lower"] <= seqs["target"] <= seqs["upper"]
    assert 40 <= seqs["target"] <= 60  # about 257K tokens / 5,200
    assert advice["gpu_memory_utilization"]["target"] == 0.9  # nothing calibrated: kept
