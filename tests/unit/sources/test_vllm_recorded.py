"""Pages and logs recorded from a real vLLM (the CPU build, tests/data/vllm/PROVENANCE.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tunerd.diagnosis import diagnose
from tunerd.sources.engine_log import passed_through
from tunerd.sources.vllm_metrics import parse

VLLM = Path(__file__).parents[2] / "data" / "vllm"
PAGES = sorted(VLLM.glob("metrics-*.txt"))


def _oracle(text: str) -> dict[str, float]:
    """The same numbers through prometheus_client's full parser (the reference parser)."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, labels = sample.name, sample.labels
            if name == "vllm:num_requests_waiting_by_reason" and labels.get("reason") == "capacity":
                values["num_requests_waiting_capacity"] = (
                    values.get("num_requests_waiting_capacity", 0) + sample.value
                )
                continue
            key = {
                "vllm:num_requests_running": "num_requests_running",
                "vllm:num_requests_waiting": "num_requests_waiting",
                "vllm:kv_cache_usage_perc": "kv_cache_usage",
                "vllm:num_preemptions_total": "num_preemptions_total",
                "vllm:prompt_tokens_total": "prompt_tokens_total",
                "vllm:generation_tokens_total": "generation_tokens_total",
            }.get(name)
            if key:
                values[key] = values.get(key, 0) + sample.value
            if name == "vllm:cache_config_info":
                values["kv_cache_size_tokens"] = float(labels["kv_cache_size_tokens"])
    return values


def test_recorded_pages_exist() -> None:
    assert len(PAGES) >= 4


@pytest.mark.parametrize("page", PAGES, ids=lambda path: path.name)
def test_parse_recorded_page_agrees_with_prometheus_client(page: Path) -> None:
    """Our prefiltered parse gives the numbers the full reference parser gives."""
    text = page.read_text()
    snapshot = parse(text)
    assert snapshot.ok, snapshot.problems
    expected = _oracle(text)
    assert expected  # the page has the families
    for key, value in expected.items():
        assert getattr(snapshot, key) == pytest.approx(value), key


def test_parse_recorded_page_under_load() -> None:
    """Six concurrent 1,200-token prompts on a 4,096-token pool: full, queueing, preempting."""
    snapshot = parse((VLLM / "metrics-0.32-load.txt").read_text())
    assert snapshot.kv_cache_usage == 1.0
    assert (snapshot.num_requests_running, snapshot.num_requests_waiting) == (2, 2)
    assert snapshot.num_requests_waiting_capacity == 2
    assert snapshot.num_preemptions_total == 2
    assert snapshot.kv_cache_size_tokens == 4096
    assert (snapshot.num_gpu_blocks, snapshot.block_size) == (32, 128)  # the CPU build's blocks
    assert snapshot.model_name == "tiny-llama"
    assert snapshot.engines[0].engine == "0"


def test_parse_recorded_fresh_page() -> None:
    snapshot = parse((VLLM / "metrics-0.32-fresh.txt").read_text())
    assert (snapshot.kv_cache_usage, snapshot.num_requests_running, snapshot.prompt_tokens_total) == (
        0.0,
        0,
        0,
    )
    assert snapshot.gpu_memory_utilization == 0.92
    assert snapshot.cache_dtype == "auto"


def test_diagnose_recorded_startup() -> None:
    result = diagnose((VLLM / "startup-ok-0.32.log").read_text().splitlines())
    assert result.crash is None
    assert result.ready
    assert result.kv_cache_size_tokens == 4096
    assert (result.max_concurrency, result.max_model_len) == (2.0, 2048)
    assert result.model_loading_gib is None  # the CPU build does not print a GiB figure
    assert result.available_kv_cache_gib == 0.0  # "Explicitly set (0.0/8.21) GiB for KV cache"


def test_diagnose_recorded_sigterm_drain_is_not_a_crash() -> None:
    result = diagnose((VLLM / "shutdown-sigterm-0.32.log").read_text().splitlines(), exit_code=0)
    assert result.shutdown_requested
    assert result.crash is None


@pytest.mark.parametrize("log", ["runtime-crash-0.32.log", "runtime-crash-idle-0.32.log"])
def test_diagnose_recorded_engine_core_killed(log: str) -> None:
    """The engine core SIGKILLed while serving: a runtime engine death, not a shutdown."""
    result = diagnose((VLLM / log).read_text().splitlines())
    assert result.crash is not None
    assert (result.crash.kind, result.crash.phase) == ("engine_dead", "runtime")
    assert not result.shutdown_requested


def test_diagnose_recorded_max_model_len_failure() -> None:
    result = diagnose((VLLM / "startup-fail-max-model-len-0.32.log").read_text().splitlines(), exit_code=1)
    assert result.crash is not None
    assert (result.crash.kind, result.crash.phase) == ("max_model_len_exceeds_kv", "startup")
    assert result.crash.estimated_max_model_len == 1920


def test_diagnose_recorded_unrecognized_flag() -> None:
    result = diagnose((VLLM / "startup-fail-unrecognized-0.32.log").read_text().splitlines(), exit_code=2)
    assert result.crash is not None
    assert (result.crash.kind, result.crash.phase) == ("invalid_config", "startup")
    assert "unrecognized arguments: --swap-space" in result.crash.message


def test_a_real_start_up_failure_passes_its_warnings_and_errors_into_tunerds_log() -> None:
    """``log_passthrough: warnings`` on vLLM's own log: its WARNING and ERROR lines and the
    raw traceback its process printed pass; its INFO lines stay in the engine's log."""
    lines = (VLLM / "startup-fail-max-model-len-0.32.log").read_text().splitlines()
    levels = [passed_through(line, "warnings") for line in lines]
    passed = [line for line, level in zip(lines, levels, strict=True) if level is not None]
    assert not [line for line in passed if ") INFO " in line]
    assert sum(") INFO " in line for line in lines) > 20
    assert [line for line in passed if ") WARNING " in line] == [
        line for line in lines if ") WARNING " in line
    ]
    assert levels[
        lines.index(next(line for line in lines if "ERROR" in line and "EngineCore failed" in line))
    ] == ("error")
    assert "Traceback (most recent call last):" in passed  # printed without vLLM's prefix
    assert "Process EngineCore:" in passed
    assert all(passed_through(line, "all") is not None for line in lines if line.strip())
    assert all(passed_through(line, "none") is None for line in lines)
    # uvicorn's own lines, which vLLM's API server prints too, keep their level
    assert passed_through("INFO:     Application startup complete.", "warnings") is None
    assert passed_through("WARNING:  Invalid HTTP request received.", "warnings") == "warning"
