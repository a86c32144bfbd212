"""Detectors: the derived signals of DESIGN §4.7, pure functions over the store and a time.

Each returns a :class:`Detection`: ``active`` (True; False, also when the series is absent;
None when readings are missing or too few to say) and the ``evidence`` an operator needs to
believe it. Windows never span engine
generations (the store's rule).

- :func:`memory_ratchet` — the engine's memory makes a new high-water mark above its settled
  level while prompt tokens flow, and stays there (vLLM's caching allocator keeps what it
  took: the seed's "plateau" as vLLM really shows it). A rise that falls back is not a
  ratchet (:func:`classify_rises` tells the two shapes apart); :func:`plateaus` reports both
  shapes with what was in flight while they stood.
- :func:`over_budget` — engine memory above ``ceil(utilization × total)``.
- :func:`neighbour_growth` — other processes on the engine's GPU grew.
- :func:`pool_saturation` — the KV pool is nearly full *and* requests wait for capacity or
  get preempted; a full pool with nobody waiting is healthy.
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tunerd.store import Sample, Store

__all__ = [
    "Detection",
    "Plateau",
    "Rise",
    "classify_rises",
    "counter_rate",
    "memory_ratchet",
    "neighbour_growth",
    "over_budget",
    "plateaus",
    "pool_saturation",
]

MIB = 1024**2
#: A ratchet is a step of at least this much (smaller moves are allocator noise).
RATCHET_MIN_STEP = 64 * MIB
#: A ratchet counts for this long after its step was confirmed.
RATCHET_RECENT_S = 60.0
#: How far back a ratchet's "settled level before" is looked for.
RATCHET_LOOKBACK_S = 600.0
#: What was in flight as a step that stays rose: read over this long from its rise.
STEP_IN_FLIGHT_S = 30.0


@dataclass(frozen=True)
class Detection:
    active: bool | None
    evidence: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Rise:
    """A rise of a memory series: ``step`` if it stayed up, ``transient`` if it fell back."""

    start: float
    before: float
    peak: float
    kind: str  # step | transient | rising (not yet known)
    end: float | None = None  # when a transient fell back


def _present(samples: Sequence[Sample] | Sequence[tuple[float, float | None]]) -> list[tuple[float, float]]:
    pairs = [(item.time, item.value) if isinstance(item, Sample) else item for item in samples]
    return [(time, value) for time, value in pairs if value is not None and not math.isnan(value)]


def _points(
    store: Store, signal: str, scope: str, now: float, seconds: float
) -> tuple[bool, list[float], list[float]]:
    """(whether the series has samples in the window, the present readings' times and values),
    found once a tick however many policies ask; read-only."""
    return store.derived(
        ("present", signal, scope, now, seconds), lambda: _present_points(store, signal, scope, now, seconds)
    )


def _present_points(
    store: Store, signal: str, scope: str, now: float, seconds: float
) -> tuple[bool, list[float], list[float]]:
    times, values = store.points(signal, scope, now, seconds)
    if not any(map(math.isnan, values)):  # the usual case, at C speed: every reading present
        return bool(times), times, values
    kept = [(t, v) for t, v in zip(times, values, strict=True) if not math.isnan(v)]
    return True, [t for t, _ in kept], [v for _, v in kept]


def classify_rises(
    samples: Sequence[Sample] | Sequence[tuple[float, float | None]], min_step: float = RATCHET_MIN_STEP
) -> list[Rise]:
    """Every rise of at least ``min_step`` above the running high-water mark, and whether it
    stayed (``step``), fell back below half its height (``transient``) or is too fresh to tell
    (``rising``: fewer than two samples at the new level)."""
    points = _present(samples)
    return _rises([t for t, _ in points], [v for _, v in points], min_step)


def _rises(times: list[float], values: list[float], min_step: float) -> list[Rise]:
    """:func:`classify_rises` of present readings."""
    if len(values) < 2 or max(values) - min(values) < min_step:
        return []  # a window narrower than a step holds no rise
    # No reading as far as ``min_step`` above the high-water mark before it, nor as far below
    # it (what a steady engine shows, tick after tick): no rise, found without a Python loop
    # over the window
    highs = list(itertools.accumulate(values, max))
    if (
        max(map(operator.sub, values[1:], highs)) < min_step
        and min(map(operator.sub, values, highs)) > -min_step
    ):
        return []
    return _walk_rises(list(zip(times, values, strict=True)), min_step)


def _walk_rises(points: list[tuple[float, float]], min_step: float) -> list[Rise]:
    """The rises, point by point (what :func:`_rises` does when its quick looks find one)."""
    rises: list[Rise] = []
    high = None
    index = 0
    while index < len(points):
        time, value = points[index]
        if high is None:
            high = value
            index += 1
            continue
        if value - high >= min_step:
            before = high
            threshold = before + (value - before) / 2
            peak = value
            end = None
            later = points[index + 1 :]
            for later_time, later_value in later:
                if later_value < threshold:
                    end = later_time
                    break
                peak = max(peak, later_value)
            if end is not None:
                rises.append(Rise(time, before, peak, "transient", end))
                # skip to where it fell back; the high-water mark stays where it was
                index = next(i for i, (t, _) in enumerate(points) if t == end)
                continue
            kind = "step" if len(later) >= 1 else "rising"
            rises.append(Rise(time, before, peak, kind))
            high = peak
            index += 1 + len(later)
            continue
        if high - value >= min_step:
            # a fall as far as a step: what the window began on was the top of a rise that
            # came before it and falls back now — the settled level is here (otherwise every
            # rectangle as tall as that one, later in the window, would go unseen)
            high = value
        high = max(high, value)
        index += 1
    return rises


def counter_rate(store: Store, signal: str, scope: str, now: float, window: float) -> float | None:
    """Per-second increase of a counter over ``window`` (one generation; a decrease is a
    reset, and only what follows it counts). None with fewer than two samples."""
    found = store.extremes(signal, scope, now, window)
    if found.since_reset is None or found.newest is None:
        return None
    (first_time, first), (last_time, last) = found.since_reset, found.newest
    if last_time <= first_time:  # fewer than two readings since the reset
        return None
    return (last - first) / (last_time - first_time)


def _latest(store: Store, signal: str, scope: str, now: float) -> float | None:
    sample = store.at(signal, scope, now)
    return None if sample is None else sample.value


def _lookback_rises(store: Store, scope: str, now: float) -> tuple[bool, list[Rise] | None]:
    """(whether the engine's memory has samples in the look-back, every rise there — None with
    fewer than three readings), derived once a tick."""
    return store.derived(("rises", scope, now), lambda: _scan_rises(store, scope, now))


def _scan_rises(store: Store, scope: str, now: float) -> tuple[bool, list[Rise] | None]:
    window = store.extremes("engine_memory_bytes", scope, now, RATCHET_LOOKBACK_S)
    if window.present < 3:
        return window.exists, None
    if window.high is not None and window.low is not None and window.high - window.low < RATCHET_MIN_STEP:
        return True, []  # a window narrower than a step holds no rise: known without a scan
    exists, times, values = _points(store, "engine_memory_bytes", scope, now, RATCHET_LOOKBACK_S)
    return exists, _rises(times, values, RATCHET_MIN_STEP)


def _steps(store: Store, scope: str, now: float) -> tuple[bool, list[Rise] | None]:
    """(whether the engine's memory has samples in the look-back, its confirmed steps there —
    None with fewer than three readings)."""
    exists, rises = _lookback_rises(store, scope, now)
    return exists, None if rises is None else [rise for rise in rises if rise.kind == "step"]


@dataclass(frozen=True)
class Plateau:
    """A rise of the engine's memory, as an operator asks about it: the seed's "prefill plateau"
    (the rectangle ``nvidia-smi -l 1`` draws). ``kind`` ``step``: it stayed (vLLM's caching
    allocator keeps what a prefill took: what :func:`memory_ratchet` acts on); ``transient``: it
    fell back (below half its height) at ``end``; ``rising``: too fresh to tell. With it what
    was in flight — while a transient stood, or in a step's first :data:`STEP_IN_FLIGHT_S`: the
    prompt tokens the engine prefilled (its counter's increase), the most requests running, and
    — behind a gate — the most prompt tokens in flight there and the longest prompt."""

    kind: str
    start: float
    end: float | None
    before_bytes: int
    peak_bytes: int
    prompt_tokens: int | None
    running: int | None
    gate_prompt_tokens_in_flight: int | None
    gate_longest_prompt: int | None
    in_flight_until: float | None = None  # the in-flight figures are read from ``start`` to this

    @property
    def height_bytes(self) -> int:
        return self.peak_bytes - self.before_bytes

    def duration_s(self, now: float) -> float:
        """How long it stood: to its fall for a transient, so far for the others."""
        return (self.end if self.end is not None else now) - self.start

    def to_dict(self, now: float) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "at": self.start,
            "end": self.end,
            "height_bytes": self.height_bytes,
            "duration_s": round(self.duration_s(now), 3),
            "before_bytes": self.before_bytes,
            "peak_bytes": self.peak_bytes,
            "prompt_tokens": self.prompt_tokens,
            "running": self.running,
            "gate_prompt_tokens_in_flight": self.gate_prompt_tokens_in_flight,
            "gate_longest_prompt": self.gate_longest_prompt,
            "in_flight_until": self.in_flight_until,
        }


def plateaus(store: Store, scope: str, now: float) -> list[Plateau] | None:
    """Every rise of the engine's memory in the last :data:`RATCHET_LOOKBACK_S` — those that
    stayed and those that fell back — oldest first, each with what was in flight meanwhile;
    None while its memory is not read (fewer than three readings there)."""
    _, rises = _lookback_rises(store, scope, now)
    if rises is None:
        return None
    found = []
    for rise in rises:
        # what was in flight: over a transient's whole stand; for one that stays, over its first
        # :data:`STEP_IN_FLIGHT_S` (after that it only holds; vLLM counts a prompt's tokens when
        # its prefill completes, a moment after the step). The prefill that raised it began
        # before the first reading at the new level: the counter is read from the one before
        # (:func:`_between`)
        span = (rise.start, rise.end if rise.end is not None else min(now, rise.start + STEP_IN_FLIGHT_S))
        found.append(
            Plateau(
                kind=rise.kind,
                start=rise.start,
                end=rise.end,
                before_bytes=int(rise.before),
                peak_bytes=int(rise.peak),
                prompt_tokens=_increase(store, "prompt_tokens_total", scope, now, span),
                running=_most(store, "num_requests_running", scope, now, span),
                gate_prompt_tokens_in_flight=_most(store, "gate_in_flight_prompt_tokens", scope, now, span),
                gate_longest_prompt=_most(store, "gate_longest_prompt_in_flight", scope, now, span),
                in_flight_until=span[1],
            )
        )
    return found


def _between(
    store: Store, signal: str, scope: str, now: float, span: tuple[float, float]
) -> list[tuple[float, float]]:
    """The present readings of ``signal`` around ``span`` (start, until) in the look-back: the
    last one before it, those within, the first one after — readings come a tick apart, and a
    plateau of a few seconds may hold none of a slower series. The look-back's readings are
    gathered once a tick, each span found by bisection (a card drawing a rectangle every few
    seconds has a hundred in ten minutes)."""
    start, until = span
    _, times, values = _points(store, signal, scope, now, RATCHET_LOOKBACK_S)
    first = bisect.bisect_left(times, start)
    last = min(bisect.bisect_left(times, until), len(times) - 1)
    return list(zip(times[max(0, first - 1) : last + 1], values[max(0, first - 1) : last + 1], strict=True))


def _increase(store: Store, signal: str, scope: str, now: float, span: tuple[float, float]) -> int | None:
    """How much a counter rose from the reading before ``span`` to the first after it (at a
    reset: what follows it)."""
    pairs = _between(store, signal, scope, now, span)
    if len(pairs) < 2:
        return None
    rise = 0.0
    for (_, before), (_, after) in itertools.pairwise(pairs):
        rise += after - before if after >= before else after
    return int(rise)


def _most(store: Store, signal: str, scope: str, now: float, span: tuple[float, float]) -> int | None:
    """The most a gauge read from the start of ``span`` to the first reading after it."""
    values = [v for t, v in _between(store, signal, scope, now, span) if t >= span[0]]
    return int(max(values)) if values else None


def memory_ratchet(store: Store, scope: str, now: float, headroom_below: float | None = None) -> Detection:
    """A confirmed step of the engine's memory within the last minute, while prompt tokens
    flowed; with ``headroom_below``, only when free memory at the top is below it."""
    exists, steps = store.derived(("ratchet_steps", scope, now), lambda: _steps(store, scope, now))
    if not exists:
        return Detection(False)  # an absent series makes its conditions false
    if steps is None:
        return Detection(None)
    recent = [rise for rise in steps if now - rise.start <= RATCHET_RECENT_S]
    if not recent:
        return Detection(False)
    rise = recent[-1]
    flowing = counter_rate(store, "prompt_tokens_total", scope, now, max(now - rise.start + 30, 60))
    if flowing is not None and flowing <= 0:
        return Detection(False, {"reason": "no prompt tokens flowed: not a prefill ratchet"})
    headroom = _latest(store, "gpu_memory_free_bytes", scope, now)
    evidence = {
        "height_bytes": int(rise.peak - rise.before),
        "at": rise.start,
        "before_bytes": int(rise.before),
        "after_bytes": int(rise.peak),
        "headroom_bytes": int(headroom) if headroom is not None else None,
    }
    over = _latest(store, "engine_over_budget_bytes", scope, now)
    if over is not None:
        evidence["over_budget_bytes"] = int(over)
    if headroom_below is not None:
        if headroom is None:
            return Detection(None, evidence)
        if headroom >= headroom_below:
            return Detection(False, evidence)
    return Detection(True, evidence)


def over_budget(store: Store, scope: str, now: float, by: float | None = None) -> Detection:
    """The engine holds more than vLLM's budget *and* what lives outside it
    (``engine_outside_budget_bytes``: its CUDA context) by more than ``by``: the slack is
    being eaten. A warm engine at its budget holds its context beyond it, which is not."""
    if store.latest("engine_over_budget_bytes", scope) is None:
        return Detection(False)
    over = _latest(store, "engine_over_budget_bytes", scope, now)
    if over is None:
        return Detection(None)
    outside = _latest(store, "engine_outside_budget_bytes", scope, now) or 0
    excess = over - outside
    return Detection(
        excess > (by or 0),
        {"over_budget_bytes": int(over), "outside_budget_bytes": int(outside), "excess_bytes": int(excess)},
    )


def neighbour_growth(
    store: Store, scope: str, now: float, by: float | None = None, window: float = 600.0
) -> Detection:
    """Other processes' memory on the engine's GPU rose by ``by`` (default 512 MiB) from its
    lowest point in ``window``."""
    found = store.extremes("other_processes_memory_bytes", scope, now, window)
    if not found.exists:
        return Detection(False)
    if found.low is None or found.latest is None:
        return Detection(None)
    lowest, latest = found.low, found.latest
    grown = latest - lowest
    threshold = by if by is not None else 512 * MIB
    return Detection(
        grown >= threshold, {"grown_bytes": int(grown), "from_bytes": int(lowest), "to_bytes": int(latest)}
    )


def pool_saturation(store: Store, scope: str, now: float, usage_above: float = 0.85) -> Detection:
    if store.latest("kv_cache_usage", scope) is None:
        return Detection(False)
    usage = _latest(store, "kv_cache_usage", scope, now)
    if usage is None:
        return Detection(None)
    waiting = _latest(store, "num_requests_waiting_capacity", scope, now)
    preemptions = counter_rate(store, "num_preemptions_total", scope, now, 60.0)
    pressure = (waiting or 0) > 0 or (preemptions or 0) > 0
    evidence = {
        "kv_cache_usage": usage,
        "num_requests_waiting_capacity": waiting,
        "preemptions_per_s": preemptions,
    }
    return Detection(usage > usage_above and pressure, evidence)
