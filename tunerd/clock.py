"""The one clock tunerd's edges use, injected so tests can drive time.

The pure middle never reads a clock: it is handed ``now``. The edges (the engine process, the
restart saga, the run loop) take a :class:`Clock` and use nothing else for time.
"""

from __future__ import annotations

import time
from typing import Protocol

__all__ = ["SYSTEM_CLOCK", "Clock", "SystemClock"]


class Clock(Protocol):
    def now(self) -> float:
        """Wall-clock seconds since the epoch: what state and history record."""

    def monotonic(self) -> float:
        """Seconds for measuring intervals and deadlines."""

    def sleep(self, seconds: float) -> None: ...


class SystemClock:
    def now(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


SYSTEM_CLOCK = SystemClock()
