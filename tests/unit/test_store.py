"""The store: bounded series tagged with generations, windows that never span a restart."""

from __future__ import annotations

import math
import random
import tracemalloc

import pytest

from tunerd.store import Event, Series, Store


class TestSeries:
    def test_series_window_returns_samples_in_range(self) -> None:
        series = Series(capacity=100)
        for second in range(10):
            series.append(float(second), second * 1.5)
        window = series.window(now=9.0, seconds=3.0)
        assert [(s.time, s.value) for s in window] == [(6.0, 9.0), (7.0, 10.5), (8.0, 12.0), (9.0, 13.5)]

    def test_series_window_never_spans_generations(self) -> None:
        """An engine restart starts a new generation: the window only sees the new one."""
        series = Series(capacity=100)
        for second in range(5):
            series.append(float(second), 0.9, generation=1)
        for second in range(5, 8):
            series.append(float(second), 0.2, generation=2)
        assert [s.time for s in series.window(now=7.0, seconds=60.0)] == [5.0, 6.0, 7.0]
        assert [s.time for s in series.window(now=7.0, seconds=60.0, generation=1)] == [0, 1, 2, 3, 4]

    def test_series_ring_keeps_newest(self) -> None:
        series = Series(capacity=3)
        for second in range(10):
            series.append(float(second), float(second))
        assert len(series) == 3
        assert [s.value for s in series] == [7.0, 8.0, 9.0]
        latest = series.latest()
        assert latest is not None
        assert latest.value == 9.0

    @pytest.mark.parametrize("capacity", [2, 5, 8])
    def test_a_resized_series_keeps_the_newest_and_goes_on(self, capacity: int) -> None:
        """A reload that changes the sampling interval resizes every series (wrapped or not,
        smaller or larger); what it holds stays in order and appends continue the ring."""
        series = Series(capacity=5)
        for second in range(7):  # wrapped: holds 2..6
            series.append(float(second), None if second == 4 else float(second), generation=second // 3)
        resized = series.resized(capacity)
        held = list(series)[-capacity:]
        assert list(resized) == held
        for second in range(7, 17):
            resized.append(float(second), float(second), generation=3)
        assert [s.time for s in resized] == [float(t) for t in range(17 - capacity, 17)]
        with pytest.raises(ValueError, match="older"):
            resized.append(1.0, 1.0)

    def test_series_absent_reading_is_none_not_nan(self) -> None:
        series = Series(capacity=4)
        series.append(1.0, None)
        series.append(2.0, 0.0)
        assert [s.value for s in series] == [None, 0.0]

    def test_series_refuses_time_going_back(self) -> None:
        series = Series(capacity=4)
        series.append(5.0, 1.0)
        with pytest.raises(ValueError, match="older than the last one"):
            series.append(4.0, 1.0)

    def test_series_empty(self) -> None:
        series = Series(capacity=4)
        assert series.latest() is None
        assert series.window(10.0, 5.0) == []


class TestStore:
    def test_store_unknown_signal_refused(self) -> None:
        with pytest.raises(KeyError, match="unknown signal 'kv_cache_usge'"):
            Store().record("kv_cache_usge", "llama", 0.0, 0.5)

    def test_store_scopes_are_separate(self) -> None:
        store = Store(capacity=10)
        store.record("kv_cache_usage", "a", 1.0, 0.5)
        store.record("kv_cache_usage", "b", 1.0, 0.9)
        latest = store.latest("kv_cache_usage", "b")
        assert latest is not None
        assert latest.value == 0.9
        assert store.window("kv_cache_usage", "missing", 1.0, 10.0) == []
        assert store.scopes() == {"a", "b"}

    def test_store_events_bounded_and_filtered(self) -> None:
        store = Store(capacity=10, max_events=3)
        for second in range(5):
            store.add_event(Event(float(second), "engine_crash" if second % 2 else "engine_start", "a"))
        assert [e.time for e in store.events()] == [2.0, 3.0, 4.0]
        assert [e.time for e in store.events(kind="engine_crash")] == [3.0]
        assert [e.time for e in store.events(since=4.0)] == [4.0]

    def test_store_for_retention_capacity(self) -> None:
        assert Store.for_retention(3600, 0.25).capacity == 14_401

    def test_store_memory_flat_over_a_simulated_day(self) -> None:
        """A day of 4 Hz GPU samples, 0.5 Hz engine metrics and an event a minute: once the
        rings and the event log are full, neither the store's own accounting nor the
        allocator sees it grow."""
        store = Store.for_retention(retention_seconds=600, interval_seconds=0.25, max_events=32)

        def run(start: int, stop: int) -> None:
            for tick in range(start, stop):
                now = tick * 0.25
                store.record("gpu_memory_used_bytes", "GPU-0", now, 20e9 + tick % 97)
                if tick % 8 == 0:
                    store.record("kv_cache_usage", "llama", now, (tick % 100) / 100)
                if tick % 240 == 0:
                    store.add_event(Event(now, "engine_start", "llama", generation=tick // 240))

        run(0, 4 * 3600)  # the first hour fills every ring and the event log
        size_after_hour = store.nbytes()
        tracemalloc.start()
        try:
            before, _ = tracemalloc.get_traced_memory()
            run(4 * 3600, 4 * 86400)
            after, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert store.nbytes() == size_after_hour
        assert after - before < 64 * 1024  # no growth beyond allocator noise


@pytest.mark.parametrize("capacity", [1, 2, 7, 50])
def test_windows_and_spans_match_a_plain_list_whatever_the_ring_wrap(capacity: int) -> None:
    """The window is found by bisecting the ring's two sorted runs in place (no copy of the
    whole ring per query): checked against a plain list of what the ring should hold, at every
    wrap position, across generations and equal times."""
    rng = random.Random(capacity)
    series, kept = Series(capacity), []
    t, generation = 0.0, 0
    for _ in range(300):
        t += rng.choice([0.0, 0.25, 1.0])
        generation += rng.random() < 0.05
        value = None if rng.random() < 0.1 else rng.random()
        series.append(t, value, generation)
        kept = [*kept, (t, value, generation)][-capacity:]
        now = t - rng.choice([0.0, 0.5, 3.0])
        seconds = rng.choice([0.0, 1.0, 5.0, 1e9])
        want = kept[-1][2] if rng.random() < 0.7 else rng.randint(0, generation)
        expected = [(a, v) for a, v, g in kept if now - seconds <= a <= now and g == want]
        times, values = series.points(now, seconds, want)
        got = [(a, None if math.isnan(v) else v) for a, v in zip(times, values, strict=True)]
        assert got == expected
        since, until = sorted((rng.uniform(0, t), rng.uniform(0, t)))
        assert [(s.time, s.value, s.generation) for s in series.span(since, until)] == [
            item for item in kept if since <= item[0] <= until
        ]
