"""Bounded time series and an event log, in memory. No clock, no I/O: times are passed in.

Each series is a ring of fixed capacity holding ``(time, value, generation)`` in three typed
arrays, allocated once: memory is the same after a minute and after a month. ``None``
(an absent reading) is stored as NaN and comes back as ``None``. Every sample carries the
engine *generation* (which start of the engine it came from); window queries only return
samples of one generation, so no ``for``, window or rate ever spans a restart.
"""

from __future__ import annotations

import bisect
import math
import sys
from array import array
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar, cast

from tunerd.signals import SIGNALS

__all__ = ["Event", "Sample", "Series", "Store", "retention_capacity"]

T = TypeVar("T")


@dataclass(frozen=True)
class Sample:
    time: float
    value: float | None
    generation: int


@dataclass(frozen=True)
class Event:
    """Something that happened at one moment: ``engine_crash``, ``gpu_lost``, ``engine_start``…"""

    time: float
    kind: str
    scope: str  # the engine name or GPU UUID it concerns
    generation: int = 0
    data: Mapping[str, Any] = field(default_factory=dict)


class Extremes(NamedTuple):
    """A window's summary: whether it holds samples, how many are present (not missing), their
    least and most, and the latest present one; and, read as a counter, the first present
    reading after its last reset (a reading below the one before it) as (time, value), and
    the latest as (time, value)."""

    exists: bool
    present: int
    low: float | None
    high: float | None
    latest: float | None
    since_reset: tuple[float, float] | None = None
    newest: tuple[float, float] | None = None


_NOTHING = Extremes(False, 0, None, None, None)


#: the window lengths a series keeps sliding extremes for (the detectors ask two or three; one
#: that asks a new length each tick — the ratchet's prompt-flow window — must not pile them up)
SLIDING_KEPT = 8


class _Sliding:
    """The least and most of one series' present readings over a window that moves forward
    (monotonic deques of absolute sample numbers): each sample is looked at once however many
    ticks ask, where a scan would look at the whole window at every tick."""

    __slots__ = ("drops", "first", "generation", "highs", "lows", "missing", "next", "start")

    def __init__(self, generation: int, start: int) -> None:
        self.generation = generation
        self.start = start  # the first sample number of the window last asked
        self.next = start  # the first sample number not yet looked at
        self.lows: deque[tuple[int, float]] = deque()  # increasing values: the front is the least
        self.highs: deque[tuple[int, float]] = deque()  # decreasing values: the front is the most
        self.missing: deque[int] = deque()  # numbers of the missing readings looked at
        #: the present readings in the window, oldest first, as (number, time, value)
        self.first: deque[tuple[int, float, float]] = deque()
        self.drops: deque[tuple[int, float, float]] = deque()  # readings below the one before them


class Series:
    """A fixed-capacity ring of samples; appends must not go back in time."""

    __slots__ = (
        "_appended",
        "_count",
        "_generations",
        "_last_time",
        "_next",
        "_sliding",
        "_times",
        "_values",
        "capacity",
    )

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("a series holds at least one sample")
        self.capacity = capacity
        self._times = array("d", bytes(8 * capacity))
        self._values = array("d", bytes(8 * capacity))
        self._generations = array("q", bytes(8 * capacity))
        self._next = 0
        self._count = 0
        self._last_time = -math.inf
        self._appended = 0  # samples ever appended: a sample's number is its place in that count
        self._sliding: dict[float, _Sliding] = {}  # window length → its sliding extremes

    def __len__(self) -> int:
        return self._count

    def append(self, time: float, value: float | None, generation: int = 0) -> None:
        if time < self._last_time:
            raise ValueError(f"sample at {time} is older than the last one at {self._last_time}")
        self._last_time = time
        self._times[self._next] = time
        self._values[self._next] = math.nan if value is None else float(value)
        self._generations[self._next] = generation
        self._next = (self._next + 1) % self.capacity
        self._count = min(self._count + 1, self.capacity)
        self._appended += 1

    def _at(self, position: int) -> Sample:
        """The ``position``-th oldest sample held."""
        index = (self._next - self._count + position) % self.capacity
        value = self._values[index]
        return Sample(self._times[index], None if math.isnan(value) else value, self._generations[index])

    def latest(self) -> Sample | None:
        return self._at(self._count - 1) if self._count else None

    def at(self, now: float) -> Sample | None:
        """The newest sample taken at or before ``now`` (usually the latest: O(1))."""
        for position in range(self._count - 1, -1, -1):
            index = (self._next - self._count + position) % self.capacity
            if self._times[index] <= now:
                return self._at(position)
        return None

    def __iter__(self) -> Iterator[Sample]:
        for position in range(self._count):
            yield self._at(position)

    def resized(self, capacity: int) -> Series:
        """A series of ``capacity`` holding the newest of these samples."""
        resized = Series(capacity)
        times, values, generations = self._ordered()
        keep = min(self._count, capacity)
        for position in range(self._count - keep, self._count):
            resized._times[position - self._count + keep] = times[position]
            resized._values[position - self._count + keep] = values[position]
            resized._generations[position - self._count + keep] = generations[position]
        resized._count = keep
        resized._appended = keep  # numbered afresh: sample n is at n % capacity
        resized._next = keep % capacity
        resized._last_time = self._last_time
        return resized

    def _ordered(self) -> tuple[array[float], array[float], array[int]]:
        """The held samples oldest first, as array copies (two slices of the ring)."""
        start = (self._next - self._count) % self.capacity
        if start + self._count <= self.capacity:
            end = start + self._count
            return self._times[start:end], self._values[start:end], self._generations[start:end]
        tail = self._count - (self.capacity - start)
        return (
            self._times[start:] + self._times[:tail],
            self._values[start:] + self._values[:tail],
            self._generations[start:] + self._generations[:tail],
        )

    def points(
        self, now: float, seconds: float, generation: int | None = None
    ) -> tuple[list[float], list[float]]:
        """Times and values (NaN for a missing reading) of :meth:`window`, without building a
        :class:`Sample` per point: what detectors scan every tick."""
        if not self._count:
            return [], []
        if generation is None:
            generation = self._generations[(self._next - 1) % self.capacity]
        # Time only moves forward and generations only go up, so both are sorted: bisect, in
        # the ring's two sorted runs, copying only the window (not the whole ring).
        low = max(
            self._find(self._times, now - seconds, False), self._find(self._generations, generation, False)
        )
        high = min(self._find(self._times, now, True), self._find(self._generations, generation, True))
        if low >= high:
            return [], []
        return self._slice(self._times, low, high), self._slice(self._values, low, high)

    def extremes(self, now: float, seconds: float) -> Extremes:
        """:class:`Extremes` of :meth:`window` (the latest sample's generation) — the same as
        scanning it, in O(1) amortized while ``now`` moves forward (it always does, in the
        daemon and in a replay); a window that moved back or jumped is looked at afresh."""
        if not self._count:
            return _NOTHING
        generation = self._generations[(self._next - 1) % self.capacity]
        low = max(
            self._find(self._times, now - seconds, False), self._find(self._generations, generation, False)
        )
        high = min(self._find(self._times, now, True), self._find(self._generations, generation, True))
        if low >= high:
            return _NOTHING
        base = self._appended - self._count  # the number of the oldest sample held
        first, end = base + low, base + high
        sliding = self._sliding.get(seconds)
        if (
            sliding is None
            or sliding.generation != generation
            or first < sliding.start
            or end < sliding.next
            or sliding.next < first
        ):
            sliding = self._sliding[seconds] = _Sliding(generation, first)
            while len(self._sliding) > SLIDING_KEPT:  # a caller whose window length varies
                del self._sliding[next(iter(self._sliding))]
        sliding.start = first
        for number in range(sliding.next, end):
            value = self._values[number % self.capacity]
            if math.isnan(value):
                sliding.missing.append(number)
                continue
            while sliding.lows and sliding.lows[-1][1] >= value:
                sliding.lows.pop()
            sliding.lows.append((number, value))
            while sliding.highs and sliding.highs[-1][1] <= value:
                sliding.highs.pop()
            sliding.highs.append((number, value))
            time = self._times[number % self.capacity]
            if sliding.first and value < sliding.first[-1][2]:
                sliding.drops.append((number, time, value))
            sliding.first.append((number, time, value))
        sliding.next = end
        for ordered in (sliding.lows, sliding.highs):
            while ordered and ordered[0][0] < first:
                ordered.popleft()
        for numbered in (sliding.first, sliding.drops):
            while numbered and numbered[0][0] < first:
                numbered.popleft()
        while sliding.missing and sliding.missing[0] < first:
            sliding.missing.popleft()
        present = end - first - len(sliding.missing)
        if not present or not sliding.first:
            return Extremes(True, 0, None, None, None)
        start = sliding.drops[-1] if sliding.drops else sliding.first[0]  # after the last reset
        newest = sliding.first[-1]
        return Extremes(
            True,
            present,
            sliding.lows[0][1],
            sliding.highs[0][1],
            newest[2],
            (start[1], start[2]),
            (newest[1], newest[2]),
        )

    def _runs(self) -> tuple[int, int]:
        """Where the oldest sample is in the ring and how many follow it before the ring's end."""
        start = (self._next - self._count) % self.capacity
        return start, min(self._count, self.capacity - start)

    def _find(self, column: array[Any], value: float, right: bool) -> int:
        """The position (0 = the oldest held) where ``value`` goes in ``column``'s order."""
        start, first = self._runs()
        search = bisect.bisect_right if right else bisect.bisect_left
        found = search(column, value, start, start + first)
        if found < start + first or first == self._count:
            return found - start
        return first + search(column, value, 0, self._count - first)

    def _slice(self, column: array[Any], low: int, high: int) -> list[Any]:
        """Positions ``low`` to ``high`` (oldest = 0) of ``column``, as a list."""
        start, first = self._runs()
        if high <= first:
            return column[start + low : start + high].tolist()
        if low >= first:
            return column[low - first : high - first].tolist()
        return column[start + low : start + first].tolist() + column[: high - first].tolist()

    def span(self, since: float, until: float) -> list[Sample]:
        """Every sample with ``since ≤ time ≤ until``, of any generation, oldest first (a
        recording's window: it may span a restart)."""
        if not self._count:
            return []
        low, high = self._find(self._times, since, False), self._find(self._times, until, True)
        if low >= high:
            return []
        times = self._slice(self._times, low, high)
        values = self._slice(self._values, low, high)
        generations = self._slice(self._generations, low, high)
        return [
            Sample(t, None if math.isnan(v) else v, g)
            for t, v, g in zip(times, values, generations, strict=True)
        ]

    def window(self, now: float, seconds: float, generation: int | None = None) -> list[Sample]:
        """Samples with ``now − seconds ≤ time ≤ now`` of one generation (default: the latest
        sample's), oldest first."""
        times, values = self.points(now, seconds, generation)
        if not times:
            return []
        if generation is None:
            latest = self.latest()
            generation = latest.generation if latest is not None else 0
        return [
            Sample(t, None if math.isnan(v) else v, generation) for t, v in zip(times, values, strict=True)
        ]

    def nbytes(self) -> int:
        """Bytes this series holds (its three arrays and the object), fixed at creation."""
        arrays = sum(a.buffer_info()[1] * a.itemsize for a in (self._times, self._values, self._generations))
        return arrays + sys.getsizeof(self)


def retention_capacity(retention_seconds: float, interval_seconds: float) -> int:
    """How many samples ``retention_seconds`` of readings every ``interval_seconds`` are."""
    return math.ceil(retention_seconds / interval_seconds) + 1


class Store:
    """Series per (signal, scope) and a bounded event log.

    ``scope`` is an engine name for engine signals and a GPU UUID (or index) for GPU signals.
    Unknown signal names are refused, so a typo in a policy or a source shows up at once.
    """

    def __init__(self, capacity: int = 14_400, max_events: int = 10_000) -> None:
        self.capacity = capacity  # 1 h at 4 Hz by default
        self._series: dict[tuple[str, str], Series] = {}
        self._events: deque[Event] = deque(maxlen=max_events)
        #: the windows asked since the last write: several policies look at the same window at
        #: one tick (two ask for the memory ratchet, two for the neighbours), it is found once
        self._asked: dict[tuple[Any, ...], Any] = {}

    @classmethod
    def for_retention(
        cls, retention_seconds: float, interval_seconds: float, max_events: int = 10_000
    ) -> Store:
        """A store keeping ``retention_seconds`` of samples taken every ``interval_seconds``."""
        return cls(capacity=retention_capacity(retention_seconds, interval_seconds), max_events=max_events)

    def resize(self, capacity: int) -> None:
        """Hold ``capacity`` samples per series from now on, keeping the newest (the sampling
        interval changed on a reload)."""
        self.capacity = capacity
        self._series = {key: series.resized(capacity) for key, series in self._series.items()}
        self._asked.clear()

    def series(self, signal: str, scope: str) -> Series:
        key = (signal, scope)
        series = self._series.get(key)
        if series is None:
            if signal not in SIGNALS:
                raise KeyError(f"unknown signal '{signal}' (see docs/signals.md)")
            series = self._series[key] = Series(self.capacity)
        return series

    def record(self, signal: str, scope: str, time: float, value: float | None, generation: int = 0) -> None:
        self.series(signal, scope).append(time, value, generation)
        if self._asked:
            self._asked.clear()

    def record_many(
        self, scope: str, time: float, values: Mapping[str, float | None], generation: int = 0
    ) -> None:
        for signal, value in values.items():
            self.record(signal, scope, time, value, generation)

    def recorded(self) -> list[tuple[str, str]]:
        """Every (signal, scope) recorded so far."""
        return list(self._series)

    def latest(self, signal: str, scope: str) -> Sample | None:
        series = self._series.get((signal, scope))
        return series.latest() if series is not None else None

    def at(self, signal: str, scope: str, now: float) -> Sample | None:
        """The newest sample of ``signal`` taken at or before ``now``."""
        series = self._series.get((signal, scope))
        return series.at(now) if series is not None else None

    def window(
        self, signal: str, scope: str, now: float, seconds: float, generation: int | None = None
    ) -> list[Sample]:
        series = self._series.get((signal, scope))
        return series.window(now, seconds, generation) if series is not None else []

    def points(
        self, signal: str, scope: str, now: float, seconds: float, generation: int | None = None
    ) -> tuple[list[float], list[float]]:
        key = (signal, scope, now, seconds, generation)
        found = self._asked.get(key)
        if found is None:
            series = self._series.get((signal, scope))
            found = series.points(now, seconds, generation) if series is not None else ([], [])
            if len(self._asked) < 256:
                self._asked[key] = found
        # a copy of the lists, so that no caller's change reaches the next one
        return list(found[0]), list(found[1])

    def extremes(self, signal: str, scope: str, now: float, seconds: float) -> Extremes:
        """The least, most and latest present reading of :meth:`window` (the latest sample's
        generation), and how many there are, as a window moving forward is kept: O(1)
        amortized per tick (:meth:`Series.extremes`)."""
        series = self._series.get((signal, scope))
        return series.extremes(now, seconds) if series is not None else _NOTHING

    def span(self, signal: str, scope: str, since: float, until: float) -> list[Sample]:
        series = self._series.get((signal, scope))
        return series.span(since, until) if series is not None else []

    def derived(self, key: tuple[Any, ...], compute: Callable[[], T]) -> T:
        """``compute()``, kept until the next write: what several policies derive from the same
        window at one tick (the memory ratchet's rises) is derived once. ``key`` names the
        derivation and everything it depends on besides the store's contents."""
        full = ("derived", *key)
        if full in self._asked:
            return cast(T, self._asked[full])
        value = compute()
        if len(self._asked) < 256:
            self._asked[full] = value
        return value

    def scopes(self) -> set[str]:
        return {scope for _, scope in self._series}

    def add_event(self, event: Event) -> None:
        self._events.append(event)

    def events(
        self, since: float | None = None, kind: str | None = None, scope: str | None = None
    ) -> list[Event]:
        return [
            event
            for event in self._events
            if (since is None or event.time >= since)
            and (kind is None or event.kind == kind)
            and (scope is None or event.scope == scope)
        ]

    def nbytes(self) -> int:
        """Memory held by samples and events: fixed per series, and bounded by ``max_events``."""
        # The deque's own blocks shift by one as it rotates; count what it holds.
        events = sum(sys.getsizeof(event) for event in self._events)
        return sum(series.nbytes() for series in self._series.values()) + events
