"""Evaluating 50 policies over one tick, on a store holding an hour of samples.

The shipped policies (plus the examples) are cloned under new names up to 50 and evaluated
against one engine's store, the way the daemon evaluates them every metrics tick. Printed: the
median cost of one tick (all 50 policies) and per policy, from ``timeit`` repeats.

    python bench/bench_policy_eval.py
"""

from __future__ import annotations

import statistics
import timeit
from pathlib import Path

from tunerd.policy.engine import EngineContext, evaluate, new_states
from tunerd.policy.schema import Policy, load_policy_files
from tunerd.store import Store

ROOT = Path(__file__).parents[1] / "policies"
POLICIES = 50
REPEATS = 15


def policies() -> list[Policy]:
    base = load_policy_files([ROOT / "default.yaml", *sorted((ROOT / "examples").glob("*.yaml"))])
    return [
        base[i % len(base)].model_copy(update={"name": f"{base[i % len(base)].name}-{i}"})
        for i in range(POLICIES)
    ]


def store() -> Store:
    """An hour of a busy engine: GPU memory at 4 Hz, engine metrics at 0.5 Hz."""
    data = Store.for_retention(3600, 0.25)
    for tick in range(4 * 3600):
        now = tick * 0.25
        data.record("engine_memory_bytes", "e", now, 21e9 + (tick // 2000) * 80e6)
        data.record("gpu_memory_free_bytes", "e", now, 1.2e9 - (tick // 2000) * 80e6)
        data.record("other_processes_memory_bytes", "e", now, 3e8)
        data.record("engine_over_budget_bytes", "e", now, -1e8)
        if tick % 8 == 0:
            data.record("kv_cache_usage", "e", now, 0.5 + 0.4 * ((tick // 800) % 2))
            data.record("num_requests_waiting_capacity", "e", now, (tick // 800) % 3)
            data.record("num_preemptions_total", "e", now, tick // 400)
            data.record("prompt_tokens_total", "e", now, tick * 300)
    return data


def main() -> int:
    chosen = policies()
    data = store()
    context = EngineContext(
        name="e",
        settings={"max_num_seqs": 8, "max_num_batched_tokens": 2048, "gpu_memory_utilization": 0.92},
        bounds={"max_num_seqs": [4, 16], "gpu_memory_utilization": [0.8, 0.95]},
        mode="act",
    )
    states = new_states(chosen)
    clock = [3600.0]

    def tick() -> None:
        nonlocal states
        clock[0] += 2.0
        states, _ = evaluate(chosen, states, data, context, clock[0])

    number = 20
    runs = timeit.repeat(tick, number=number, repeat=REPEATS)
    per_tick = statistics.median(runs) / number
    print(f"{len(chosen)} policies over a store of {data.nbytes() / 2**20:.1f} MiB (an hour at 4 Hz)")
    print(f"one tick (all policies): {per_tick * 1e3:.3f} ms median of {REPEATS}")
    print(f"per policy:              {per_tick / len(chosen) * 1e6:.1f} µs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
