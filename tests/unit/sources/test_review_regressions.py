"""Bugs found in review of the telemetry sources; each test failed before its fix."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from tests.fakes.nvml import FakeDevice, FakeNvml, FakeProcess
from tunerd.diagnosis import diagnose
from tunerd.gpu import GpuProcess, GpuSample
from tunerd.signals import engine_memory
from tunerd.sources.engine_log import FileFollower, PipeReader
from tunerd.sources.nvml import NvmlSource
from tunerd.sources.smi import CommandResult, SmiSource
from tunerd.sources.vllm_metrics import parse

DATA = Path(__file__).parents[2] / "data"
GIB = 1024**3
MIB = 1024**2


def test_engine_memory_lost_gpu_does_not_hide_healthy_one() -> None:
    healthy = GpuSample(
        0, "GPU-0", "x", 24 * GIB, 20 * GIB, 4 * GIB, None, 0.5, (GpuProcess(1, None, 20 * GIB),)
    )
    lost = GpuSample(1, "GPU-1", None, None, None, None, None, None, (), status="gpu_lost")
    memory = engine_memory([healthy, lost], engine_pids={1}, gpu_memory_utilization=0.92)
    assert memory.gpu_index == 0
    assert memory.engine_memory_bytes == 20 * GIB


def test_unreadable_process_list_is_unknown_not_empty() -> None:
    nvml = FakeNvml(
        [FakeDevice(uuid="GPU-0", processes=[FakeProcess(7, 20 * GIB)], processes_readable=False)]
    )
    gpu = NvmlSource(nvml, watch_xid=False).sample().gpus[0]
    assert gpu.processes is None
    assert gpu.to_dict()["processes"] is None
    memory = engine_memory([gpu], engine_pids={7}, gpu_memory_utilization=0.92)
    assert memory.engine_memory_bytes is None
    assert memory.engine_over_budget_bytes is None


def test_smi_failed_process_query_is_unknown() -> None:
    def runner(argv: list[str], timeout: float) -> CommandResult:
        if argv[1].startswith("--query-gpu"):
            return CommandResult(0, "0, GPU-a, X, 24564, 100, 23984, 480, 0\n", "")
        return CommandResult(4, "Insufficient Permissions\n", "")

    assert SmiSource(runner=runner).sample().gpus[0].processes is None  # type: ignore[arg-type]


def test_smi_gpu_fallen_off_the_bus() -> None:
    reading = SmiSource(
        runner=lambda argv, timeout: CommandResult(
            15, "Unable to determine the device handle for GPU0000:01:00.0: GPU is lost.\n", ""
        )
    ).sample()
    assert reading.status == "error"
    assert "fallen off the bus" in (reading.error or "")


def test_log_client_text_cannot_fake_a_crash_or_a_shutdown() -> None:
    startup = (DATA / "vllm" / "startup-ok-0.32.log").read_text().splitlines()
    oom = (DATA / "vllm-failures" / "oom-27466.log").read_text().splitlines()
    fake_oom = 'INFO:     127.0.0.1:5555 - "GET /OutOfMemoryError HTTP/1.1" 404 Not Found'
    fake_stop = 'INFO:     127.0.0.1:5555 - "GET /KeyboardInterrupt HTTP/1.1" 404 Not Found'
    assert diagnose([*startup, fake_oom]).crash is None
    result = diagnose([*startup, fake_stop, *oom], exit_code=1)
    assert not result.shutdown_requested
    assert result.crash is not None
    assert (result.crash.kind, result.crash.phase) == ("cuda_oom", "runtime")


def test_log_validation_error_after_start_is_not_invalid_config() -> None:
    startup = (DATA / "vllm" / "startup-ok-0.32.log").read_text().splitlines()
    request_error = "(APIServer pid=1) ERROR 11-29 10:00:00 [serving.py:1] pydantic_core._pydantic_core.ValidationError: 1 validation error for CompletionRequest"
    oom = (DATA / "vllm-failures" / "oom-27466.log").read_text().splitlines()
    crash = diagnose([*startup, request_error, *oom]).crash
    assert crash is not None
    assert (crash.kind, crash.phase) == ("cuda_oom", "runtime")


def test_log_failed_restart_after_clean_stop_is_a_new_run() -> None:
    """argparse's failure prints no start-up banner; its usage line starts the new run."""
    stop = (DATA / "vllm" / "shutdown-sigterm-0.32.log").read_text().splitlines()
    fail = (DATA / "vllm" / "startup-fail-unrecognized-0.32.log").read_text().splitlines()
    crash = diagnose([*stop, *fail], exit_code=2).crash
    assert crash is not None
    assert crash.kind == "invalid_config"


def test_log_own_process_memory_parsed() -> None:
    line = (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of "
        "23.52 GiB of which 6.00 MiB is free. Process 4194305 has 300.00 MiB memory in use. Including "
        "non-PyTorch memory, this process has 23.22 GiB memory in use."
    )
    crash = diagnose([line]).crash
    assert crash is not None
    assert crash.own_bytes == round(23.22 * GIB)
    assert crash.other_processes == ((4194305, 300 * MIB),)


def test_log_follower_joining_mid_run_knows_it_was_serving() -> None:
    crash = diagnose((DATA / "vllm-failures" / "oom-27466.log").read_text().splitlines(), serving=True).crash
    assert crash is not None
    assert crash.phase == "runtime"


def test_nvml_lost_gpu_keeps_uuid_and_xid_and_does_not_reinit_every_poll() -> None:
    nvml = FakeNvml([FakeDevice(uuid="GPU-0"), FakeDevice(uuid="GPU-1")])
    source = NvmlSource(nvml, watch_xid=True)
    try:
        source.sample()
        nvml.raise_xid(1, 79)
        time.sleep(0.2)  # the watcher has it queued
        nvml.devices[1].lost = True
        lost = source.sample()
        kinds = [(e.kind, e.gpu_uuid, e.data) for e in lost.events]
        assert ("gpu_lost", "GPU-1", None) in kinds
        assert ("xid", "GPU-1", 79) in kinds
        inits = nvml.calls.count("nvmlInit")
        source.sample()
        source.sample()
        assert nvml.calls.count("nvmlInit") == inits + 1  # one fresh session, not one per poll
    finally:
        source.close()


def test_nvml_xid_unsupported_not_retried_every_poll() -> None:
    nvml = FakeNvml([FakeDevice(uuid="GPU-0", supports_xid=False)])
    source = NvmlSource(nvml, watch_xid=True)
    for _ in range(5):
        source.sample()
    source.close()
    assert nvml.calls.count("nvmlEventSetCreate") == 1


def test_pipe_reader_close_does_not_hang_with_live_writer() -> None:
    read_end, write_end = os.pipe()
    reader = PipeReader(os.fdopen(read_end, "rb"))
    done = threading.Event()
    threading.Thread(target=lambda: (reader.close(), done.set()), daemon=True).start()
    assert done.wait(3)
    os.close(write_end)


def test_file_follower_rotation_with_small_reads_loses_nothing(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_text("")
    follower = FileFollower(log, max_read=100)
    with log.open("a") as handle:
        handle.writelines(f"line {n:03d}\n" for n in range(50))
    log.rename(tmp_path / "engine.log.1")
    log.write_text("new\n")
    lines: list[str] = []
    for _ in range(20):
        lines += follower.read_lines()
    assert lines == [f"line {n:03d}" for n in range(50)] + ["new"]


def test_file_follower_unreadable_file_is_not_a_crash(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.mkdir()  # opening a directory fails with an OSError other than "not found"
    follower = FileFollower(log)
    assert follower.read_lines() == []
    assert follower.error is not None


def test_metrics_infinite_value_is_junk() -> None:
    snapshot = parse('vllm:kv_cache_usage_perc{engine="0"} +Inf\nvllm:num_requests_running{engine="0"} 1\n')
    assert not snapshot.ok
    assert snapshot.kv_cache_usage is None
    assert "out of range" in snapshot.problems[0]
