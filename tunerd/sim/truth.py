"""The simulator's own ground truth: the largest settings that really are safe for a load on a
box, found by running the simulated engine itself — never by asking the planner. Pure.

"Safe" means: the engine starts (vLLM's free-memory and pool checks pass) and serves the load
— ``concurrency`` requests of ``prompt_tokens`` + ``max_tokens``, all at once, until the last
finishes — without a CUDA OOM, with the caching allocator fragmented to its ceiling from the
first step (what hours of traffic do to it) and the neighbours as they hold now. The search
keeps every other setting and looks for the highest ``gpu_memory_utilization`` (to 0.001) that
is safe; safety falls as utilization rises (a bigger pool leaves less room for the same
activations), so a bisection finds it. The answer's KV pool is what the judge compares
tunerd's final pool with (``GET /sim/truth``, the demo, ``bench/bench_boxes.py``); the daemon
never reads it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from tunerd.sim.engine import CudaOutOfMemory, EngineSettings, Request, SimEngine, StartupFailure

__all__ = ["SafeMax", "TruthLoad", "safe_max", "survives"]

#: The finest utilization step searched (vLLM takes any fraction; 0.001 of 24 GiB is 24 MiB).
STEP = 0.001
#: Steps one load may take in the search before it counts as served (a bound, never reached by
#: a load that fits: 4 × 28K-token prompts at 512 batched tokens take under 2,000).
MAX_STEPS = 200_000


@dataclass(frozen=True)
class TruthLoad:
    """The load the truth is for: ``concurrency`` requests at once, each ``prompt_tokens`` in
    and ``max_tokens`` out (generated to the end)."""

    concurrency: int
    prompt_tokens: int
    max_tokens: int

    def to_dict(self) -> dict[str, int]:
        return {
            "concurrency": self.concurrency,
            "prompt_tokens": self.prompt_tokens,
            "max_tokens": self.max_tokens,
        }


@dataclass(frozen=True)
class SafeMax:
    """The highest safe utilization for the other settings given, and its pool."""

    settings: EngineSettings
    kv_cache_tokens: int
    num_gpu_blocks: int
    evaluated: int  # engines started by the search

    def to_dict(self) -> dict[str, Any]:
        settings = self.settings
        return {
            "settings": {
                "gpu_memory_utilization": settings.gpu_memory_utilization,
                "max_model_len": settings.max_model_len,
                "max_num_seqs": settings.max_num_seqs,
                "max_num_batched_tokens": settings.max_num_batched_tokens,
                "kv_cache_dtype": settings.kv_cache_dtype,
            },
            "kv_cache_tokens": self.kv_cache_tokens,
            "num_gpu_blocks": self.num_gpu_blocks,
            "engines_evaluated": self.evaluated,
        }


def survives(engine: SimEngine, load: TruthLoad) -> bool:
    """Whether ``engine`` serves ``load`` to the end without a CUDA OOM."""
    length = min(load.prompt_tokens, max(1, engine.max_model_len - load.max_tokens))
    for number in range(load.concurrency):
        engine.submit(Request(f"truth-{number}", length, load.max_tokens, 0.0, ignore_eos=True))
    now = 0.0
    try:
        for _ in range(MAX_STEPS):
            if not engine.has_work:
                return True
            result = engine.step(now)
            now += result.duration or 0.01
    except CudaOutOfMemory:
        return False
    return True


def safe_max(
    factory: Callable[[EngineSettings], SimEngine], settings: EngineSettings, load: TruthLoad
) -> SafeMax | None:
    """The highest safe ``gpu_memory_utilization`` for ``settings``' other knobs, by bisection
    over 0.001 steps; ``factory`` makes a fresh worst-case engine of given settings (a
    :class:`StartupFailure` is unsafe). None when no utilization is safe."""
    evaluated = 0
    found: dict[int, tuple[int, int] | None] = {}

    def safe_at(milli: int) -> tuple[int, int] | None:
        """(pool tokens, blocks) when safe at milli-utilization ``milli``; None when not."""
        nonlocal evaluated
        if milli not in found:
            evaluated += 1
            try:
                engine = factory(replace(settings, gpu_memory_utilization=milli / 1000))
            except StartupFailure:
                found[milli] = None
            else:
                pool = (engine.pool.tokens, engine.num_blocks)
                found[milli] = pool if survives(engine, load) else None
        return found[milli]

    # Down from 1.00 in hundredths to the first safe one: the safe range's top lies within the
    # hundredth above it, where the bisection looks.
    top = next((centi * 10 for centi in range(100, 0, -1) if safe_at(centi * 10) is not None), None)
    if top is None:
        return None
    low, high = top, min(1000, top + 9)
    while low < high:
        middle = (low + high + 1) // 2
        if safe_at(middle) is not None:
            low = middle
        else:
            high = middle - 1
    tokens, blocks = found[low] or (0, 0)
    return SafeMax(
        settings=replace(settings, gpu_memory_utilization=low / 1000),
        kv_cache_tokens=tokens,
        num_gpu_blocks=blocks,
        evaluated=evaluated,
    )
