"""Signal names (DESIGN §4.7) and the engine-memory signals derived from a GPU sample. Pure.

One name per quantity, the same in policies, tests, status and tunerd's own metrics; every
name is documented in ``docs/signals.md``. Units are in the names (``_bytes``, ``_ratio``,
``_total``); absent readings are ``None``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tunerd.gpu import GpuSample
from tunerd.planner.bills import CUDA_CONTEXT_BYTES
from tunerd.units import GIB

__all__ = [
    "ENGINE_MEMORY_SIGNALS",
    "ENGINE_METRIC_SIGNALS",
    "GATE_SIGNALS",
    "GPU_SIGNALS",
    "SIGNALS",
    "EngineMemory",
    "engine_gpus",
    "engine_memory",
    "gate_signals",
    "gpu_room",
    "gpu_signals",
    "share_a_gpu",
]

#: vLLM's ``--gpu-memory-utilization`` when none is given.
VLLM_DEFAULT_UTILIZATION = 0.92  # vLLM 0.21+ (0.9 before; reference/vllm-facts.md §4)

#: Per GPU; an engine sees the GPUs it runs on and takes the worst.
GPU_SIGNALS = (
    "gpu_memory_used_bytes",
    "gpu_memory_total_bytes",
    "gpu_memory_free_bytes",
    "gpu_memory_used_ratio",
    "gpu_utilization_ratio",
)
#: Derived from the GPU sample and the engine's PIDs.
ENGINE_MEMORY_SIGNALS = (
    "engine_memory_bytes",
    "engine_over_budget_bytes",
    "engine_outside_budget_bytes",
    "other_processes_memory_bytes",
)
#: From vLLM's /metrics (DESIGN §4.3 names), plus whether the engine answers at all.
ENGINE_METRIC_SIGNALS = (
    "kv_cache_usage",
    "num_requests_running",
    "num_requests_waiting",
    "num_requests_waiting_capacity",
    "num_preemptions_total",
    "prompt_tokens_total",
    "generation_tokens_total",
    "engine_up",
)
#: From the KV-aware gate in front of the engine, when there is one (docs/gate.md): what it let
#: in and holds, the prompts in flight, and the requests it shed (429 for a full queue, 503 for
#: one that waited past its max_wait) as a running count.
GATE_SIGNALS = (
    "gate_in_flight",
    "gate_in_flight_prompt_tokens",
    "gate_longest_prompt_in_flight",
    "gate_queued",
    "gate_queued_tokens",
    "gate_shed_total",
)
SIGNALS = frozenset(GPU_SIGNALS + ENGINE_MEMORY_SIGNALS + ENGINE_METRIC_SIGNALS + GATE_SIGNALS)


#: the gate's refusals that shed load (429: its queue full); a malformed or too large request
#: (400) is the client's doing, not load shed
SHED_REJECTIONS = frozenset({"rejected/queue_full", "rejected/queue_tokens"})


def gate_signals(snapshot: Mapping[str, Any]) -> dict[str, float | None]:
    """The gate's signals from its status of one engine (``GET /gate/status``'s entry)."""

    def number(key: str) -> float | None:
        value = snapshot.get(key)
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    decisions = snapshot.get("decisions")
    shed = None
    if isinstance(decisions, Mapping):
        shed = float(
            sum(
                count
                for key, count in decisions.items()
                if isinstance(key, str)
                and isinstance(count, (int, float))
                and (key.startswith("timed_out/") or key in SHED_REJECTIONS)
            )
        )
    return {
        "gate_in_flight": number("in_flight"),
        "gate_in_flight_prompt_tokens": number("in_flight_prompt_tokens"),
        "gate_longest_prompt_in_flight": number("longest_prompt_in_flight"),
        "gate_queued": number("queued"),
        "gate_queued_tokens": number("queued_tokens"),
        "gate_shed_total": shed,
    }


def gpu_signals(sample: GpuSample) -> dict[str, float | None]:
    """The per-GPU signals of one sample (used ratio only when both numbers are known)."""
    used, total = sample.memory_used_bytes, sample.memory_total_bytes
    return {
        "gpu_memory_used_bytes": used,
        "gpu_memory_total_bytes": total,
        "gpu_memory_free_bytes": sample.memory_free_bytes,
        "gpu_memory_used_ratio": used / total if used is not None and total else None,
        "gpu_utilization_ratio": sample.utilization_ratio,
    }


def cuda_total_bytes(gpu: GpuSample) -> int | None:
    """The total vLLM's budget is a share of: what CUDA reports, i.e. NVML's total less the
    driver-reserved memory where the backend reports it (RTX 4090: 24,564 MiB − 480 MiB)."""
    if gpu.memory_total_bytes is None:
        return None
    return gpu.memory_total_bytes - (gpu.memory_reserved_bytes or 0)


def engine_gpus(gpus: Iterable[GpuSample], selectors: Sequence[int | str]) -> list[GpuSample]:
    """The GPUs an engine runs on, by index or UUID (``GPU-…``); an empty selector is all."""
    gpus = list(gpus)
    if not selectors:
        return gpus
    wanted_indexes = {s for s in selectors if isinstance(s, int)}
    wanted_uuids = {s for s in selectors if isinstance(s, str)}
    return [g for g in gpus if g.index in wanted_indexes or (g.uuid is not None and g.uuid in wanted_uuids)]


def share_a_gpu(
    first: Sequence[int | str], second: Sequence[int | str], gpus: Iterable[GpuSample] = ()
) -> bool:
    """Whether two engines' GPU selectors (indexes, UUIDs; empty: all) can name the same GPU.
    With a reading the selectors are resolved (one engine may name GPU 0 by index, the other by
    its UUID); without one, an empty selector shares with everything and the rest compare as
    written."""
    if not first or not second:
        return True
    seen = list(gpus)
    if seen:
        ours = {gpu.index for gpu in engine_gpus(seen, first)}
        theirs = {gpu.index for gpu in engine_gpus(seen, second)}
        if ours and theirs:
            return bool(ours & theirs)
    return bool(set(first) & set(second))


@dataclass(frozen=True)
class EngineMemory:
    """The engine's memory on its worst GPU, and what else lives there."""

    engine_memory_bytes: int | None
    engine_over_budget_bytes: int | None
    other_processes_memory_bytes: int | None
    gpu_index: int | None  # the GPU these numbers come from
    #: what the engine holds that vLLM's budget does not cover (its CUDA context, NCCL's
    #: buffers): a healthy engine reads this much over budget once it is warm
    engine_outside_budget_bytes: int | None = None

    def as_signals(self) -> dict[str, float | None]:
        return {
            "engine_memory_bytes": self.engine_memory_bytes,
            "engine_over_budget_bytes": self.engine_over_budget_bytes,
            "engine_outside_budget_bytes": self.engine_outside_budget_bytes,
            "other_processes_memory_bytes": self.other_processes_memory_bytes,
        }


def engine_memory(
    gpus: Iterable[GpuSample], engine_pids: Iterable[int], gpu_memory_utilization: float | None
) -> EngineMemory:
    """Engine memory per DESIGN §4.7 on the engine's GPUs, taking the worst one.

    ``engine_memory_bytes`` sums the engine's processes on a GPU, ``other_processes`` the rest
    of the listed processes; ``engine_over_budget_bytes = engine − ceil(utilization × total)``
    (vLLM's own budget arithmetic, on the CUDA-visible total: :func:`cuda_total_bytes`).
    ``engine_outside_budget_bytes`` is what a healthy engine holds beyond vLLM's budget: the
    planner's CUDA context (400 MiB), an estimate until tunerd measures the box — the
    ``over_budget`` detector subtracts it, so a warm engine at its budget does not read as
    eating the slack.
    The worst GPU is the one most over budget (or, without a budget, the one where the engine
    uses most); a GPU whose numbers are unknown (lost, MIG, an unreadable process list) only
    counts when no GPU is known. A process whose usage the driver does not report makes the
    sum unknown (``None``), never smaller.
    """
    pids = set(engine_pids)
    worst: EngineMemory | None = None
    worst_key: tuple[int, float] = (-1, -math.inf)
    for gpu in gpus:
        mine: int | None = None
        others: int | None = None
        if gpu.processes is not None and gpu.status == "ok":
            mine, others = 0, 0
            for process in gpu.processes:
                if process.pid in pids:
                    mine = None if mine is None or process.used_bytes is None else mine + process.used_bytes
                else:
                    others = (
                        None if others is None or process.used_bytes is None else others + process.used_bytes
                    )
        over = None
        total = cuda_total_bytes(gpu)
        if mine is not None and total and gpu_memory_utilization is not None:
            over = mine - math.ceil(total * gpu_memory_utilization)
        outside = CUDA_CONTEXT_BYTES if mine else None
        candidate = EngineMemory(mine, over, others, gpu.index, outside)
        # Known beats unknown: a lost or unreadable GPU never hides a healthy one's numbers.
        if over is not None:
            key: tuple[int, float] = (2, over)
        elif mine is not None:
            key = (1, mine)
        else:
            key = (0, 0.0)
        if worst is None or key > worst_key:
            worst, worst_key = candidate, key
    return worst or EngineMemory(None, None, None, None)


def gpu_room(gpus: Iterable[GpuSample], settings: Mapping[str, Any]) -> str | None:
    """Why an engine started now with ``settings`` would not find its budget free on ``gpus``;
    None when it would, or when nothing can tell (no reading, a pool sized in bytes).

    vLLM refuses to start when a GPU's free memory is below ``ceil(utilization × total)`` of
    the total CUDA reports (``Free memory on device ... is less than desired GPU memory
    utilization``; NVML's total less the driver's reservation, :func:`cuda_total_bytes`), so a
    restart waits for the old engine's memory to come back before it spends a start on that
    failure. Without ``gpu_memory_utilization`` in the settings, vLLM 0.33's default (0.92).
    """
    if settings.get("kv_cache_memory_bytes") is not None:
        return None  # the pool is sized in bytes; vLLM does not check the utilization share
    utilization = float(settings.get("gpu_memory_utilization", VLLM_DEFAULT_UTILIZATION))
    short = []
    for gpu in gpus:
        total = cuda_total_bytes(gpu)
        if gpu.status != "ok" or total is None or gpu.memory_free_bytes is None:
            continue
        need = math.ceil(utilization * total)  # vLLM's requested_memory (v1/worker/utils.py:723)
        if gpu.memory_free_bytes < need:
            short.append(
                f"GPU {gpu.index}: {gpu.memory_free_bytes / GIB:.2f} GiB free, "
                f"{utilization:g} × {total / GIB:.2f} GiB = {need / GIB:.2f} GiB needed"
            )
    return "; ".join(short) or None
