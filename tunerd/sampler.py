"""The GPU sampling job and the systemd watchdog it feeds.

Every :attr:`Sampler.period` the daemon's scheduler (:mod:`tunerd.scheduler`, on a thread of
its own) takes one reading from the GPU source and keeps it as the latest; the ticks use that
reading, so a tick never waits for the GPU and an engine restart of minutes (which blocks the
tick, not this job) never silences the watchdog. After a reading it sends ``WATCHDOG=1`` when
half of systemd's watchdog timeout has passed since the last — so the pings stop exactly when
sampling stops (a wedged driver, a hung read), and systemd restarts tunerd
(reference/integrations-facts.md §2.1: ping from the sampling loop, not a free-running thread).
"""

from __future__ import annotations

from collections.abc import Callable

from tunerd.clock import SYSTEM_CLOCK, Clock
from tunerd.gpu import GpuReading
from tunerd.scheduler import GPU, Jobs
from tunerd.sdnotify import Notifier
from tunerd.sources.gpu import GpuSource

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

    @property
    def latest(self) -> GpuReading | None:
        return self._latest

    @property
    def period(self) -> float:
        """How often to sample: the configured interval, or the watchdog's if that is shorter."""
        ping = self.notifier.watchdog_interval
        return self.interval if ping is None else min(self.interval, ping)

    def age(self) -> float | None:
        """Seconds since the newest reading (None before the first)."""
        return None if self._latest_at is None else self.clock.monotonic() - self._latest_at

    def schedule(self, jobs: Jobs, then: Callable[[], object] | None = None) -> None:
        """Take the first reading now (before anything asks for one), then every period on the
        scheduler's ``gpu`` thread; ``then`` runs after each reading (the daemon's look for a
        dead engine: one scheduled run instead of two)."""
        self.sample_once()

        def job() -> None:
            self.sample_job()
            if then is not None:
                then()

        jobs.every("gpu-sample", self.period, job, GPU, now=False)

    def sample_once(self) -> GpuReading:
        reading = self.gpu.sample()
        now = self.clock.monotonic()
        self._latest, self._latest_at = reading, now
        self.samples += 1
        interval = self.notifier.watchdog_interval
        # half a period of slack: a run a hair early must not push the ping a whole period late
        if interval is not None and (
            self._last_ping is None or now - self._last_ping >= interval - self.period / 2
        ):
            self.notifier.watchdog()
            self._last_ping = now
        return reading

    def sample_job(self) -> None:
        """The scheduled job: one reading; an exception (a bug in a source) is counted, no ping
        is sent for it, and sampling goes on."""
        try:
            self.sample_once()
        except Exception as error:
            self.errors += 1
            self.last_error = f"{type(error).__name__}: {error}"
