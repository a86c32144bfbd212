"""Log diagnosis: start-up figures and crash kinds (DESIGN §4.4) on real failure texts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tunerd.diagnosis import LogDiagnoser, diagnose

DATA = Path(__file__).parents[1] / "data"
FAILURES = DATA / "vllm-failures"
MIB = 1024**2
GIB = 1024**3


def _diagnose_file(name: str, exit_code: int | None = None):  # type: ignore[no-untyped-def]
    return diagnose((FAILURES / name).read_text().splitlines(), exit_code=exit_code)


class TestReferenceFailureTexts:
    @pytest.mark.parametrize(
        ("file", "kind", "phase"),
        [
            ("oom-runtime-club3090-58.log", "cuda_oom", "runtime"),
            ("oom-27466.log", "cuda_oom", "startup"),  # one line: nothing says it was serving
            ("oom-26863.log", "cuda_oom", "startup"),
            ("no-kv-memory-27508.log", "no_kv_cache_memory", "startup"),
            ("no-kv-memory-033-format.log", "no_kv_cache_memory", "startup"),
            ("insufficient-free-nosana-170.log", "insufficient_free_memory", "startup"),
            ("max-len-v0-10517.log", "max_model_len_exceeds_kv", "startup"),
            ("max-len-033-format.log", "max_model_len_exceeds_kv", "startup"),
            ("max-len-v0.10-models-typo.log", "max_model_len_exceeds_kv", "startup"),
            ("weights-oom-033-format.log", "cuda_oom", "startup"),
            ("engine-died-v0.10-27549.log", "engine_dead", "runtime"),
            ("engine-dead-v0-13252.log", "engine_dead", "runtime"),
            ("insufficient-free-external-weights-032-format.log", "insufficient_free_memory", "startup"),
        ],
    )
    def test_diagnose_failure_kind_and_phase(self, file: str, kind: str, phase: str) -> None:
        crash = _diagnose_file(file).crash
        assert crash is not None
        assert (crash.kind, crash.phase) == (kind, phase)

    def test_diagnose_oom_extracts_allocation_and_neighbours(self) -> None:
        crash = _diagnose_file("oom-27466.log").crash
        assert crash is not None
        assert crash.tried_to_allocate_bytes == 960 * MIB
        assert crash.other_processes == ((854401, round(78.43 * GIB)),)

    @pytest.mark.parametrize(
        ("file", "total_gib"),
        [
            ("oom-27466.log", 79.14),
            ("oom-runtime-club3090-58.log", 23.56),
            ("weights-oom-033-format.log", 23.52),
            ("oom-26863.log", 23.57),
        ],
    )
    def test_diagnose_oom_reads_torchs_total_capacity(self, file: str, total_gib: float) -> None:
        """torch's "GPU 0 has a total capacity of X of which Y is free": the CUDA total, the
        one figure calibration needs that a box without a GPU reading lacks."""
        crash = _diagnose_file(file).crash
        assert crash is not None
        assert crash.total_bytes == round(total_gib * GIB)
        assert crash.free_at_start_bytes is None

    def test_diagnose_oom_root_cause_wins_over_engine_dead(self) -> None:
        """The EngineDeadError line comes first; the OOM below it is the cause."""
        crash = _diagnose_file("oom-runtime-club3090-58.log").crash
        assert crash is not None
        assert crash.kind == "cuda_oom"
        assert crash.tried_to_allocate_bytes == 50 * MIB
        assert crash.message.startswith("torch.OutOfMemoryError")

    @pytest.mark.parametrize(
        ("file", "estimate"),
        [
            ("max-len-033-format.log", 15728),
            ("max-len-v0.10-models-typo.log", 15728),
            ("max-len-v0-10517.log", 23648),
        ],
    )
    def test_diagnose_estimated_max_model_len(self, file: str, estimate: int) -> None:
        crash = _diagnose_file(file).crash
        assert crash is not None
        assert crash.estimated_max_model_len == estimate

    def test_diagnose_weights_oom_allocation(self) -> None:
        crash = _diagnose_file("weights-oom-033-format.log").crash
        assert crash is not None
        assert crash.tried_to_allocate_bytes == round(1.96 * GIB)


class TestStartupFigures:
    def test_diagnose_one_line_kv_size_format(self) -> None:
        result = diagnose(
            [
                "(EngineCore pid=107) INFO 07-06 22:52:01 [gpu_model_runner.py:5089] Model loading took "
                "14.99 GiB memory and 6.720924 seconds",
                "(EngineCore pid=107) INFO 07-06 22:52:09 [gpu_worker.py:773] Available KV cache memory: 5.98 GiB",
                "(EngineCore pid=107) INFO 07-06 22:52:09 [kv_cache_utils.py:1148] GPU KV cache size: 567,978 "
                "tokens, Maximum concurrency for 131,072 tokens per request: 4.33x",
            ]
        )
        assert result.model_loading_gib == 14.99
        assert result.available_kv_cache_gib == 5.98
        assert result.kv_cache_size_tokens == 567_978
        assert (result.max_concurrency, result.max_model_len) == (4.33, 131_072)
        assert result.crash is None

    def test_the_cuda_graph_estimate_is_read(self) -> None:
        """A real H200 start (vLLM 0.20.2, tests/data/vllm_startup_records.json): the graphs'
        share of the budget, which calibration takes out of the activation peak."""
        records = json.loads((Path(__file__).parents[1] / "data" / "vllm_startup_records.json").read_text())
        record = next(r for r in records["records"] if r["id"] == "h200-gemma4-26b-a4b-it-v0202")
        assert diagnose(record["lines"]).cuda_graph_gib == 0.88
        assert diagnose(["Estimated CUDA graph memory: 1..2 GiB total"]).cuda_graph_gib is None

    def test_diagnose_two_line_kv_size_format_with_colours(self) -> None:
        """v0.24 (club-3090#612) printed the two figures on two lines; colours on a TTY."""
        result = diagnose(
            [
                "\x1b[1;36m(EngineCore pid=107)\x1b[0;0m INFO 07-06 22:52:09 [kv_cache_utils.py:2146] "
                "GPU KV cache size: 567,978 tokens",
                "(EngineCore pid=107) INFO 07-06 22:52:09 [kv_cache_utils.py:2147] Maximum concurrency for "
                "131,072 tokens per request: 4.33x",
            ]
        )
        assert result.kv_cache_size_tokens == 567_978
        assert result.max_concurrency == 4.33

    def test_diagnose_v0_blocks_and_loading(self) -> None:
        """V0 (vllm#12330): weights in 'GB' and the pool as 16-token blocks."""
        result = diagnose(
            [
                "INFO 01-21 10:00:00 model_runner.py:1099] Loading model weights took 14.9595 GB",
                "INFO 01-21 10:00:05 executor_base.py:115] # GPU blocks: 5691, # CPU blocks: 2048",
                "INFO 01-21 10:00:05 executor_base.py:120] Maximum concurrency for 8192 tokens per request: 11.12x",
            ]
        )
        assert result.model_loading_gib == 14.9595
        assert result.kv_cache_size_tokens == 5691 * 16
        assert result.max_concurrency == 11.12

    def test_diagnose_kv_cache_memory_bytes_variant(self) -> None:
        result = diagnose(
            [
                "INFO [gpu_worker.py:300] Reserved 2.0 GiB... reserved 4.0 GiB memory for KV Cache as "
                "specified by kv_cache_memory_bytes config and skipped memory profiling."
            ]
        )
        assert result.available_kv_cache_gib == 4.0


class TestShutdownAndRuns:
    def test_diagnose_requested_shutdown_is_not_a_crash(self) -> None:
        lines = [
            "INFO Starting vLLM API server 0 on http://0.0.0.0:8000",
            "INFO [launcher.py:46] [shutdown] API server: received signal=SIGTERM, stopping",
            "ERROR vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.",
        ]
        result = diagnose(lines, exit_code=0)
        assert result.shutdown_requested
        assert result.crash is None

    def test_diagnose_unexplained_exit_is_unknown(self) -> None:
        result = diagnose(["INFO starting", "INFO loading weights"], exit_code=1)
        assert result.crash is not None
        assert (result.crash.kind, result.crash.phase) == ("unknown", "startup")

    def test_diagnose_killed_by_sigterm_without_log_is_not_a_crash(self) -> None:
        assert diagnose(["INFO up"], exit_code=-15).crash is None

    def test_diagnose_new_run_resets(self) -> None:
        """A log file with two runs: the crash of the first does not stick to the second."""
        lines = [
            "INFO vLLM API server version 0.33.0",
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 50.00 MiB.",
            "INFO vLLM API server version 0.33.0",
            "INFO GPU KV cache size: 100,000 tokens",
            "INFO Application startup complete.",
        ]
        result = diagnose(lines)
        assert result.crash is None
        assert result.kv_cache_size_tokens == 100_000
        assert result.ready

    @pytest.mark.parametrize(
        "start",
        [
            "(APIServer pid=1) INFO 12-01 10:00:00 [api_utils.py:327] vLLM server version 0.33.0, serving model m",
            "(APIServer pid=1) INFO 12-01 10:00:00 [api_utils.py:347]  ▄▄ ▄█ █     █     █ ▀▄▀ █  version 0.33.0",
            "(APIServer pid=1) INFO 12-01 10:00:00 [api_utils.py:286] non-default args: {'port': 8000}",
        ],
        ids=["plain", "logo", "args"],
    )
    def test_diagnose_each_start_line_of_0_32_and_0_33_begins_a_run(self, start: str) -> None:
        """The ways vLLM 0.32/0.33 announce a new server (the version line, plain or as the
        logo; the non-default args), and ``Starting vLLM server on`` as the server being up."""
        lines = [
            start,
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 50.00 MiB.",
            start,
            "(APIServer pid=2) INFO 12-01 10:01:00 [entry.py:140] Starting vLLM server on http://0.0.0.0:8000",
        ]
        result = diagnose(lines)
        assert result.crash is None
        assert result.ready
        assert diagnose(lines[:2]).crash is not None

    def test_diagnoser_incremental_equals_whole(self) -> None:
        text = (FAILURES / "oom-27466.log").read_text().splitlines()
        diagnoser = LogDiagnoser()
        for line in text:
            diagnoser.feed(line)
        assert diagnoser.result() == diagnose(text)


class TestMalformedNumbers:
    """One log line with a number vLLM never prints (``1.2.3``, ``.``, ``1e400``, 400 digits)
    killed ``tunerd inspect log`` and the daemon's first start with a ValueError or an
    OverflowError (issue 16). Such a line is not the line it resembles: it is ignored."""

    @pytest.mark.parametrize(
        "line",
        [
            "INFO Model loading took 1.2.3 GiB memory and 6.7 seconds",
            "INFO Loading model weights took . GB",
            "INFO Model loading took " + "9" * 400 + " GiB memory",
            "INFO Available KV cache memory: 5..98 GiB",
            "INFO reserved 1.2.3 GiB memory for KV Cache as specified by kv_cache_memory_bytes",
            "INFO Explicitly set (1.2.3/4) GiB for KV cache",
            "INFO GPU KV cache size: , tokens",
            "INFO GPU KV cache size: 1,,2 tokens",
            "INFO GPU KV cache size: 56,7978 tokens",
            "INFO Maximum concurrency for 131,072 tokens per request: 4.3.3x",
            "INFO Maximum concurrency for ,, tokens per request: 4.33x",
            "INFO Maximum concurrency for 8192 tokens per request: " + "9" * 400 + "x",
            "INFO # GPU blocks: " + "9" * 5000,
        ],
    )
    def test_diagnose_malformed_startup_figure_is_ignored(self, line: str) -> None:
        good = [
            "INFO Model loading took 14.99 GiB memory and 6.7 seconds",
            "INFO Available KV cache memory: 5.98 GiB",
            "INFO GPU KV cache size: 567,978 tokens, Maximum concurrency for 131,072 tokens per request: 4.33x",
        ]
        result = diagnose([*good, line])
        assert result.model_loading_gib == 14.99
        assert result.available_kv_cache_gib == 5.98
        assert result.kv_cache_size_tokens == 567_978
        assert (result.max_concurrency, result.max_model_len) == (4.33, 131_072)
        assert diagnose([line]).to_dict() == diagnose([]).to_dict() | {"lines": 1}

    def test_diagnose_oom_with_malformed_details_keeps_the_well_formed_ones(self) -> None:
        lines = [
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.2.3 GiB. Process 12 has . GiB "
            "memory in use. Process 13 has 2.00 GiB memory in use. Process 14 has "
            + "9" * 400
            + " TiB memory in use. Of the allocated memory this process has 1e400 GiB memory in use.",
            "estimated maximum model length is " + "9" * 5000,
        ]
        crash = diagnose(lines).crash
        assert crash is not None
        assert crash.kind == "cuda_oom"
        assert crash.tried_to_allocate_bytes is None
        assert crash.other_processes == ((13, 2 * GIB),)
        assert crash.own_bytes is None
        assert crash.estimated_max_model_len is None

    def test_diagnose_huge_allocation_is_unknown_not_overflow(self) -> None:
        crash = diagnose(["CUDA out of memory. Tried to allocate " + "9" * 400 + " TiB"]).crash
        assert crash is not None
        assert crash.tried_to_allocate_bytes is None


def test_a_start_refused_for_free_memory_says_how_much_was_free() -> None:
    """nosana-ci/pipeline-templates#170's real text (tests/data/vllm-failures): the free and
    total memory vLLM saw, which a `fit` of the utilization starts from."""
    text = (
        Path(__file__).parents[1] / "data" / "vllm-failures" / "insufficient-free-nosana-170.log"
    ).read_text()
    crash = diagnose(text.splitlines(), exit_code=1).crash
    assert crash is not None
    assert crash.kind == "insufficient_free_memory"
    assert (crash.free_at_start_bytes, crash.total_bytes) == (round(18.78 * GIB), round(23.5 * GIB))
    assert crash.to_dict()["free_at_start_bytes"] == round(18.78 * GIB)
