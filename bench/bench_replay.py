"""Replaying an hour of 4 Hz ticks with the shipped policies (issue 20's bar: ≤ 2 s).

A loop like the daemon's runs an hour at 4 Hz over one engine — GPU and engine memory every
tick, the engine's metrics every other, the pool saturating for ten minutes, an OOM — with the
shipped policies, keeping the tape; the recording is cut, written to JSON lines and read back;
then ``tunerd.recording.replay`` runs over it, REPEATS times. Printed: the median replay, the
cut, the file's size, and whether the replay decided exactly as recorded.

    python bench/bench_replay.py [REPEATS]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from common import figure

from tunerd.outcomes import Mode
from tunerd.policy.engine import EngineContext, evaluate, new_states
from tunerd.policy.schema import load_policy_files
from tunerd.recording import Tape, compare, iter_json_lines, parse_lines, replay
from tunerd.store import Event, Store

SHIPPED = Path(__file__).parents[1] / "policies" / "default.yaml"
ENGINE = "main"
GIB = 1 << 30
HOUR_AT_4HZ = 4 * 3600


def record() -> tuple[Store, Tape]:
    policies = load_policy_files([SHIPPED])
    store, tape = Store.for_retention(3600, 0.25), Tape(capacity=HOUR_AT_4HZ)
    states = new_states(policies)
    settings = {"gpu_memory_utilization": 0.92, "max_num_seqs": 64, "max_num_batched_tokens": 8192}
    bounds = {"gpu_memory_utilization": [0.7, 0.95], "max_num_seqs": [8, 256]}
    generation = 0
    for tick in range(HOUR_AT_4HZ):
        now = 1_800_000_000.0 + tick * 0.25
        values: dict[str, float | None] = {
            "gpu_memory_used_bytes": 22.4 * GIB + (tick % 13) * 4e6,
            "gpu_memory_total_bytes": 24.0 * GIB,
            "gpu_memory_free_bytes": 1.6 * GIB - (tick % 13) * 4e6,
            "engine_memory_bytes": 21.2 * GIB + (tick // 2000) * 20e6,
            "engine_over_budget_bytes": -0.1 * GIB,
            "other_processes_memory_bytes": 1.2 * GIB,
            "engine_up": 1.0,
        }
        if tick % 2 == 0:
            saturated = 4 * 1200 <= tick < 4 * 1800
            values |= {
                "kv_cache_usage": 0.96 if saturated else 0.55,
                "num_requests_waiting_capacity": 2.0 if saturated else 0.0,
                "num_requests_running": 48.0,
                "num_preemptions_total": float(tick // 4000),
                "prompt_tokens_total": tick * 310.0,
            }
        store.record_many(ENGINE, now, values, generation)
        if tick == 4 * 3000:
            store.add_event(Event(now, "engine_crash", ENGINE, generation, {"kind": "cuda_oom"}))
        context = EngineContext(ENGINE, dict(settings), bounds=bounds, mode=Mode.ACT, observed_since=0.0)
        before = states
        states, plan = evaluate(policies, before, store, context, now)
        tape.tick(now, context, before, plan)
        if plan is not None and plan.changes and not plan.hold:
            settings, generation = dict(plan.after), generation + 1
    return store, tape


def main() -> int:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    policies = load_policy_files([SHIPPED])
    store, tape = record()
    started = time.perf_counter()
    text = "".join(iter_json_lines(tape.lines(store, ENGINE, 0, 2e9)))
    recording = parse_lines(text.splitlines(), "bench")
    cut = time.perf_counter() - started
    runs, decisions = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        plans = replay(recording, policies)
        runs.append(time.perf_counter() - started)
        decisions = compare(recording, plans)
    same = all(d.recorded and d.replayed for d in decisions)
    median = statistics.median(runs)
    size = len(text) / 2**20
    print(f"recording: {recording.ticks} ticks, {size:.1f} MiB of JSON lines, cut and read in {cut:.2f} s")
    print(f"replay: {median:.2f} s median of {repeats} ({median / recording.ticks * 1e6:.0f} µs a tick)")
    print(f"decisions: {len(decisions)}, {'all as recorded' if same else 'DIFFERENT from the recording'}")
    figure("replay of an hour at 4 Hz, shipped policies", f"{median:.2f} s", "≤ 2 s", median <= 2.0 and same)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
