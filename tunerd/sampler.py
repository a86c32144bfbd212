"""The GPU sampling loop, on its own thread, and the systemd watchdog it feeds.

Every ``interval`` it takes one reading from the GPU source and keeps it as the latest; the
run loop's ticks use that reading, so a tick never waits for the GPU and an engine restart of
minutes (which blocks the tick, not this loop) never silences the watchdog. After each reading
it sends ``WATCHDOG=1`` when half of systemd's watchdog timeout has passed since the last — so
the pings stop exactly when sampling stops (a wedged driver, a hung read), and systemd restarts
tunerd (reference/integrations-facts.md §2.1: ping from the sampling loop, not a free-running
thread).
"""

from __future__ import annotations

import threading

from tunerd.clock import SYSTEM_CLOCK, Clock
from tunerd.sdnotify import Notifier
from tunerd.sources.gpu import GpuReading, GpuSource

__all__ = ["Sampler"]


class Sampler:
    def __init__(
        self, gpu: GpuSource, interval: float, notifier: Notifier | None = None, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        self.gpu = gpu
        self.interval = interval
        self.notifier = notifier or Notifier({})
        self.clock = clock
        self.samples = 0
        self.errors = 0  # readings that raised (a source is meant to return an error status)
        self.last_error: str | None = None
        self._latest: GpuReading | None = None
        self._latest_at: float | None = None
        self._last_ping: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tunerd-gpu-sampler", daemon=True)

    @property
    def latest(self) -> GpuReading | None:
        return self._latest

    def age(self) -> float | None:
        """Seconds since the newest reading (None before the first)."""
        return None if self._latest_at is None else self.clock.monotonic() - self._latest_at

    def start(self) -> Sampler:
        self.sample_once()  # the first reading before anything asks for one
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def sample_once(self) -> GpuReading:
        reading = self.gpu.sample()
        now = self.clock.monotonic()
        self._latest, self._latest_at = reading, now
        self.samples += 1
        interval = self.notifier.watchdog_interval
        if interval is not None and (self._last_ping is None or now - self._last_ping >= interval):
            self.notifier.watchdog()
            self._last_ping = now
        return reading

    def _loop(self) -> None:
        while not self._stop.wait(self._wait()):
            try:
                self.sample_once()
            except Exception as error:  # a bug in a source: no ping this time, and go on sampling
                self.errors += 1
                self.last_error = f"{type(error).__name__}: {error}"

    def _wait(self) -> float:
        """Until the next reading: the sampling interval, or sooner when a ping falls due."""
        interval = self.notifier.watchdog_interval
        if interval is None or self._last_ping is None:
            return self.interval
        return max(0.0, min(self.interval, self._last_ping + interval - self.clock.monotonic()))
