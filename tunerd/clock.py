"""The one clock tunerd's edges use, injected so tests can drive time.

The pure middle never reads a clock: it is handed ``now``. The edges (the engine process, the
restart saga, the run loop) take a :class:`Clock` and use nothing else for time.

:class:`SystemClock`'s ``now()`` never goes backwards. It is the monotonic clock, anchored to
the wall clock when tunerd starts: it follows a forward step of the wall clock (NTP correcting
a slow clock) but not a backward one — after the wall clock went back an hour, ``now()`` goes
on from where it was, an hour ahead of the wall clock, until the wall clock catches up. A
backward step therefore never makes restarts, crashes or cooldowns recorded a moment ago lie
"in the future", where a window would stop counting them (the guards count such times as now
too). What needs the real wall time — a webhook signature a service checks against its own
clock — reads :meth:`SystemClock.wall`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

__all__ = ["SYSTEM_CLOCK", "Clock", "SystemClock"]


class Clock(Protocol):
    def now(self) -> float:
        """Wall-clock seconds since the epoch: what state and history record."""

    def monotonic(self) -> float:
        """Seconds for measuring intervals and deadlines."""

    def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """The system's clock; ``wall`` and ``monotonic`` are the time sources (tests step them)."""

    def __init__(
        self,
        wall: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._wall = wall
        self._monotonic = monotonic
        self._sleep = sleep
        self._lock = threading.Lock()
        self._offset = wall() - monotonic()  # now() = monotonic() + offset; the offset only grows

    def now(self) -> float:
        """Seconds since the epoch, never less than an earlier answer (any thread's)."""
        with self._lock:
            monotonic, wall = self._monotonic(), self._wall()
            # the wall clock stepped (or ran) ahead: follow it; it went back: stay
            self._offset = max(self._offset, wall - monotonic)
            return monotonic + self._offset

    def wall(self) -> float:
        """The wall clock as it is, steps back included: for what another machine checks
        against its own clock (webhook signatures), never for what tunerd records."""
        return self._wall()

    def monotonic(self) -> float:
        return self._monotonic()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            self._sleep(seconds)


SYSTEM_CLOCK = SystemClock()
