"""Engine memory derived from a GPU sample: the engine's PIDs, its budget, its neighbours."""

from __future__ import annotations

import math

from tunerd.gpu import GpuProcess, GpuSample
from tunerd.signals import engine_gpus, engine_memory, gpu_room, gpu_signals, share_a_gpu

GIB = 1024**3


def _gpu(index: int, processes: list[tuple[int, int | None]], total: int = 24 * GIB) -> GpuSample:
    used = sum(p[1] or 0 for p in processes)
    return GpuSample(
        index=index,
        uuid=f"GPU-{index}",
        name="NVIDIA GeForce RTX 4090",
        memory_total_bytes=total,
        memory_used_bytes=used,
        memory_free_bytes=total - used,
        memory_reserved_bytes=None,
        utilization_ratio=0.5,
        processes=tuple(GpuProcess(pid, None, size) for pid, size in processes),
    )


def test_engine_memory_over_budget_against_ceil_of_budget() -> None:
    gpu = _gpu(0, [(100, 22 * GIB), (200, GIB // 2)])
    memory = engine_memory([gpu], engine_pids={100}, gpu_memory_utilization=0.9)
    assert memory.engine_memory_bytes == 22 * GIB
    assert memory.other_processes_memory_bytes == GIB // 2
    assert memory.engine_over_budget_bytes == 22 * GIB - math.ceil(24 * GIB * 0.9)


def test_engine_memory_worst_gpu_decides() -> None:
    """Tensor parallel: two ranks; the GPU most over budget is the engine's number."""
    calm = _gpu(0, [(100, 20 * GIB)])
    hot = _gpu(1, [(101, 23 * GIB), (300, GIB)])
    memory = engine_memory([calm, hot], engine_pids={100, 101}, gpu_memory_utilization=0.92)
    assert memory.gpu_index == 1
    assert memory.engine_memory_bytes == 23 * GIB
    assert memory.other_processes_memory_bytes == GIB


def test_engine_memory_unknown_usage_is_none_not_smaller() -> None:
    gpu = _gpu(0, [(100, 20 * GIB), (101, None)])
    memory = engine_memory([gpu], engine_pids={100, 101}, gpu_memory_utilization=0.9)
    assert memory.engine_memory_bytes is None
    assert memory.engine_over_budget_bytes is None


def test_engine_memory_no_gpus() -> None:
    memory = engine_memory([], engine_pids={1}, gpu_memory_utilization=0.9)
    assert memory.as_signals() == {
        "engine_memory_bytes": None,
        "engine_over_budget_bytes": None,
        "engine_outside_budget_bytes": None,
        "other_processes_memory_bytes": None,
    }


def test_engine_gpus_by_index_or_uuid() -> None:
    gpus = [_gpu(0, []), _gpu(1, []), _gpu(2, [])]
    assert [g.index for g in engine_gpus(gpus, [0, "GPU-2"])] == [0, 2]
    assert [g.index for g in engine_gpus(gpus, [])] == [0, 1, 2]


def test_gpu_signals_ratio_only_when_known() -> None:
    gpu = _gpu(0, [(1, 12 * GIB)])
    assert gpu_signals(gpu)["gpu_memory_used_ratio"] == 0.5
    unknown = GpuSample(0, None, None, None, 5, None, None, None)
    assert gpu_signals(unknown)["gpu_memory_used_ratio"] is None


def test_engine_memory_budget_on_cuda_total_when_reserved_known() -> None:
    """NVML v2 reports 24,564 MiB total and 480 MiB reserved on a 4090; CUDA (and so vLLM's
    budget) sees the difference."""
    mib = 1024**2
    gpu = GpuSample(
        0,
        "GPU-0",
        "RTX 4090",
        24564 * mib,
        21000 * mib,
        3084 * mib,
        480 * mib,
        0.5,
        (GpuProcess(7, None, 21000 * mib),),
    )
    memory = engine_memory([gpu], engine_pids={7}, gpu_memory_utilization=0.92)
    assert memory.engine_over_budget_bytes == 21000 * mib - math.ceil(24084 * mib * 0.92)


def test_gpu_room_is_vllms_own_start_up_check() -> None:
    """vLLM starts only if free memory covers utilization × total (23.52 GiB CUDA-visible on a
    4090, as in docs/planner.md): the old engine's 21 GiB still held means wait."""
    total = int(23.52 * GIB)
    draining = _gpu(0, [(100, 21 * GIB)], total=total)
    free = _gpu(0, [(300, GIB // 2)], total=total)  # a 0.5 GiB neighbour stays
    assert gpu_room([draining], {"gpu_memory_utilization": 0.92}) == (
        "GPU 0: 2.52 GiB free, 0.92 × 23.52 GiB = 21.64 GiB needed"
    )
    assert gpu_room([free], {"gpu_memory_utilization": 0.92}) is None
    assert gpu_room([free], {"gpu_memory_utilization": 0.98}) is not None  # the neighbour's 0.5 GiB
    assert gpu_room([draining], {}) is not None  # vLLM's default 0.92 applies
    assert gpu_room([draining], {"kv_cache_memory_bytes": 4 * GIB}) is None  # sized in bytes: no check
    assert gpu_room([], {"gpu_memory_utilization": 0.92}) is None  # nothing to tell


def test_gpu_room_takes_the_total_cuda_reports_not_nvmls() -> None:
    """vLLM's budget is a share of cudaMemGetInfo's total, which leaves out the driver's
    reservation NVML counts (a 4090: 24,564 MiB in NVML, 24,084 MiB in CUDA). 22,200 MiB free
    covers 0.92 of CUDA's total (22,157.3 MiB) — vLLM starts — though not 0.92 of NVML's."""
    mib = 1024**2
    gpu = GpuSample(0, "GPU-0", "RTX 4090", 24564 * mib, 1884 * mib, 22200 * mib, 480 * mib, 0.0, ())
    assert gpu_room([gpu], {"gpu_memory_utilization": 0.92}) is None
    assert gpu_room([gpu], {}) is None  # 0.92 is the default
    assert gpu_room([gpu], {"gpu_memory_utilization": 0.93}) == (
        "GPU 0: 21.68 GiB free, 0.93 × 23.52 GiB = 21.87 GiB needed"
    )


def test_two_engines_share_a_gpu_however_each_names_it() -> None:
    """One engine names GPU 0 by index, the other by its UUID; an empty list is every GPU."""
    gpus = [
        GpuSample(0, "GPU-aaa", "H100", 80 * 1024**3, 0, 80 * 1024**3, None, None),
        GpuSample(1, "GPU-bbb", "H100", 80 * 1024**3, 0, 80 * 1024**3, None, None),
    ]
    assert share_a_gpu([0], ["GPU-aaa"], gpus)
    assert not share_a_gpu([0], ["GPU-bbb"], gpus)
    assert share_a_gpu([], [1], gpus)
    assert share_a_gpu([0], [0])  # no reading: as written
    assert not share_a_gpu([0], ["GPU-aaa"])  # no reading: a UUID cannot be resolved
