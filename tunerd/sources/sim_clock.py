"""``clock: {source: sim, url}``: tunerd's clock runs at the simulator's rate.

The simulator (``tunerd sim serve --time-scale N``) answers ``/sim/clock`` with its simulated
seconds and its ``time_scale``. With this clock every window, ``for``, cooldown, settle period,
restart budget and backoff of the daemon follows simulated time, so a ``for: 10m`` policy plays
out in seconds in the demo (DESIGN §3).

What is followed is the simulator's *rate*, not its reading: a simulated engine's clock starts
again at 0 each time the engine restarts, and tunerd's time must never run backwards. Until the
simulator first answers (in supervise mode tunerd starts it) the clock runs at wall speed from
the wall time; from the first answer on at ``time_scale`` times that, continuing from where it
was. :meth:`SimulatorClock.sync` does the one HTTP call; the daemon calls it each tick until it
succeeds, so :meth:`now` never waits on the network.

Deadlines of real processes — start-up and drain timeouts, probation, the GPU-memory wait — are
measured with :meth:`monotonic` and :meth:`sleep` in wall seconds: the simulator's processes
start and stop in real time, whatever its scale.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx

__all__ = ["SimulatorClock", "time_scale"]


def time_scale(client: httpx.Client, url: str) -> float | None:
    """The simulator's time scale from ``url/sim/clock``, or None (a real vLLM, or no answer)."""
    try:
        response = client.get(f"{url}/sim/clock")
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    try:
        scale = float(response.json().get("time_scale", 1.0))
    except (ValueError, AttributeError):
        return None
    return scale if scale > 0 else None


class SimulatorClock:
    """A :class:`~tunerd.clock.Clock` whose :meth:`now` runs at the simulator's rate."""

    def __init__(
        self,
        url: str,
        wall: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.url = url.rstrip("/")
        self.scale = 1.0
        self.synced = False
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._base_now = wall()
        self._base_at = monotonic()

    def now(self) -> float:
        with self._lock:
            return self._base_now + (self._monotonic() - self._base_at) * self.scale

    def monotonic(self) -> float:
        return self._monotonic()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)

    def sync(self, timeout: float = 0.5) -> bool:
        """Learn the simulator's time scale (once); False while it does not answer."""
        if self.synced:
            return True
        with httpx.Client(timeout=timeout) as client:
            scale = time_scale(client, self.url)
        if scale is None:
            return False
        with self._lock:
            at = self._monotonic()
            self._base_now += (at - self._base_at) * self.scale  # continue from here, faster
            self._base_at = at
            self.scale = scale
            self.synced = True
        return True
