"""Store.extremes (the sliding window the detectors read each tick) must say exactly what a
scan of the same window says: random series with missing readings, restarts (generations),
counter resets, windows that move forward, jump, go back, and a ring that wraps and is resized."""

from __future__ import annotations

import math
import random

import pytest

from tunerd import detect
from tunerd.signals import gate_signals
from tunerd.store import Store


def _scanned(store: Store, signal: str, now: float, seconds: float) -> tuple[object, ...]:
    times, values = store.points(signal, "e", now, seconds)
    present = [(t, v) for t, v in zip(times, values, strict=True) if not math.isnan(v)]
    if not times:
        return (False, 0, None, None, None, None, None)
    if not present:
        return (True, 0, None, None, None, None, None)
    start = 0
    for position in range(len(present) - 1, 0, -1):  # the old counter_rate's reset rule
        if present[position][1] < present[position - 1][1]:
            start = position
            break
    return (
        True,
        len(present),
        min(v for _, v in present),
        max(v for _, v in present),
        present[-1][1],
        present[start],
        present[-1],
    )


@pytest.mark.parametrize("seed", range(12))
def test_the_sliding_window_says_what_a_scan_says(seed: int) -> None:
    rng = random.Random(seed)
    store = Store(capacity=rng.choice([50, 300, 5000]))
    generation, t, value = 0, 1_000.0, 100.0
    windows = [5.0, 30.0, 60.0]
    for step in range(1500):
        t += rng.choice([0.25, 0.25, 0.5, 2.0, 40.0])
        if rng.random() < 0.01:
            generation += 1  # a restart
        value = 0.0 if rng.random() < 0.02 else value + rng.choice([0.0, 1.0, 5.0, -3.0])  # resets too
        store.record("num_preemptions_total", "e", t, None if rng.random() < 0.05 else value, generation)
        if rng.random() < 0.002:
            store.resize(rng.choice([40, 400]))
        now = t if rng.random() < 0.9 else t - rng.choice([0.1, 3.0, 100.0])  # sometimes asked back in time
        for seconds in windows:
            found = store.extremes("num_preemptions_total", "e", now, seconds)
            assert tuple(found) == _scanned(store, "num_preemptions_total", now, seconds), (
                seed,
                step,
                seconds,
            )


def test_counter_rate_and_the_detectors_read_it() -> None:
    store = Store()
    for i, value in enumerate([1.0, 3.0, 5.0, 0.0, 2.0, 6.0]):  # a reset after the third
        store.record("num_preemptions_total", "e", 100.0 + i, value)
    assert detect.counter_rate(store, "num_preemptions_total", "e", 105.0, 60.0) == pytest.approx(3.0)
    assert detect.counter_rate(store, "num_preemptions_total", "e", 102.0, 60.0) == pytest.approx(2.0)
    assert detect.counter_rate(store, "num_preemptions_total", "e", 103.0, 0.5) is None  # one reading
    for i, grown in enumerate([0, 0, 600, 700]):  # MiB
        store.record("other_processes_memory_bytes", "e", 100.0 + i, 1e9 + grown * 2**20)
    found = detect.neighbour_growth(store, "e", 103.0)
    assert found.active is True
    assert found.evidence["grown_bytes"] == 700 * 2**20


def test_a_window_length_asked_anew_each_tick_does_not_pile_up() -> None:
    """Found in review: the ratchet's prompt-flow window is a new length each tick; each kept
    its own sliding window for ever."""
    store = Store()
    for i in range(200):
        store.record("prompt_tokens_total", "e", float(i), float(i))
        store.extremes("prompt_tokens_total", "e", float(i), 30.0 + i * 0.37)
    series = store.series("prompt_tokens_total", "e")
    assert len(series._sliding) <= 8


def test_the_gates_shed_count_is_load_refused_not_bad_requests() -> None:
    found = gate_signals(
        {
            "decisions": {
                "rejected/queue_full": 3,
                "rejected/queue_tokens": 1,
                "timed_out/max_wait": 2,
                "rejected/too_large": 5,
                "rejected/malformed": 7,  # a client's bad JSON: a 400, not load shed
                "admitted/short": 40,
            }
        }
    )
    assert found["gate_shed_total"] == 6.0
