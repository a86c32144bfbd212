"""The NVML backend against a real GPU and driver. Skipped where there is none.

Run these whenever a GPU is available (`python -m pytest tests/gpu -v -s`) and record what they
printed in tests/gpu/RESULTS.md. They check, on real hardware, what tests/fakes/nvml.py
imitates: memory info v2, process accounting, MIG state, XID registration, and a real process
allocating GPU memory step by step as tunerd sees it.
"""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import sys
import time

import pynvml
import pytest

from tunerd.sources.nvml import NvmlSource
from tunerd.sources.smi import SmiSource


def _has_gpu() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    try:
        return bool(pynvml.nvmlDeviceGetCount())
    finally:
        pynvml.nvmlShutdown()


pytestmark = pytest.mark.skipif(not _has_gpu(), reason="no NVIDIA GPU and driver on this machine")
MIB = 1024**2
STEP_MIB = 256
STEPS = 4

ALLOCATOR = f"""
import sys, time, torch
torch.cuda.init()
blocks = []
print("ready", flush=True)
for step in range({STEPS}):
    sys.stdin.readline()
    blocks.append(torch.empty({STEP_MIB} * 1024 * 1024, dtype=torch.uint8, device="cuda:0"))
    torch.cuda.synchronize()
    print("step", step, flush=True)
sys.stdin.readline()
"""


def test_real_nvml_sample_shape() -> None:
    source = NvmlSource(watch_xid=False)
    try:
        reading = source.sample()
    finally:
        source.close()
    print(json.dumps(reading.to_dict(), indent=2))
    assert reading.status == "ok"
    for gpu in reading.gpus:
        assert gpu.uuid is not None
        assert gpu.uuid.startswith(("GPU-", "MIG-"))
        if gpu.status == "mig":
            continue
        assert gpu.memory_total_bytes
        assert gpu.memory_free_bytes is not None
        assert gpu.memory_used_bytes is not None
        assert gpu.memory_used_bytes + gpu.memory_free_bytes <= gpu.memory_total_bytes


@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="nvidia-smi not installed")
def test_real_nvml_agrees_with_nvidia_smi() -> None:
    nvml = NvmlSource(watch_xid=False)
    try:
        by_nvml = {g.uuid: g for g in nvml.sample().gpus}
    finally:
        nvml.close()
    smi = SmiSource().sample()
    print("nvidia-smi fields:", smi.details.get("fields"))
    assert smi.status == "ok", smi.error
    for gpu in smi.gpus:
        mine = by_nvml[gpu.uuid]
        assert gpu.memory_total_bytes == mine.memory_total_bytes // MIB * MIB
        print(
            f"GPU {gpu.index}: total nvml={mine.memory_total_bytes} smi={gpu.memory_total_bytes} "
            f"reserved nvml={mine.memory_reserved_bytes} smi={gpu.memory_reserved_bytes}"
        )


def test_real_process_allocating_step_by_step() -> None:
    """A child allocates 256 MiB four times; tunerd sees its usage rise by about that much."""
    pytest.importorskip("torch")
    child = subprocess.Popen(
        [sys.executable, "-c", ALLOCATOR], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    source = NvmlSource(watch_xid=False)
    try:
        assert child.stdout is not None
        assert child.stdin is not None
        assert child.stdout.readline().strip() == "ready"
        seen: list[int] = []
        for step in range(STEPS):
            child.stdin.write("\n")
            child.stdin.flush()
            assert child.stdout.readline().strip() == f"step {step}"
            time.sleep(0.3)
            gpu = source.sample().gpus[0]
            mine = [p for p in gpu.processes if p.pid == child.pid]
            assert mine, f"pid {child.pid} not among {gpu.processes}"
            assert mine[0].used_bytes is not None
            seen.append(mine[0].used_bytes)
            print(
                f"step {step}: process uses {mine[0].used_bytes / MIB:.0f} MiB, GPU free "
                f"{(gpu.memory_free_bytes or 0) / MIB:.0f} MiB"
            )
        steps = [b - a for a, b in itertools.pairwise(seen)]
        for delta in steps:
            assert STEP_MIB * MIB * 0.9 <= delta <= STEP_MIB * MIB * 1.25
    finally:
        source.close()
        if child.stdin:
            child.stdin.close()
        child.wait(timeout=30)


def test_real_xid_watcher_starts_and_stops() -> None:
    source = NvmlSource(watch_xid=True)
    try:
        reading = source.sample()
        print("events:", reading.events, "details:", dict(reading.details))
        assert reading.status == "ok"
    finally:
        source.close()
