"""The GPU sampling job and the systemd watchdog it feeds.

Every :attr:`Sampler.period` the daemon's scheduler (:mod:`tunerd.scheduler`, on a thread of
its own) takes one reading from the GPU source and keeps it as the latest; the ticks use that
reading, so a tick never waits for the GPU and an engine restart of minutes (which blocks the
tick, not this job) never silences the watchdog. After a reading it sends ``WATCHDOG=1`` when
half of systemd's watchdog timeout has passed since the last — so the pings stop exactly when
sampling stops (a wedged driver, a hung read), and systemd restarts tunerd
(reference/integrations-facts.md §2.1: ping from the sampling loop, not a free-running thread).

A read that *returns* — with a good reading, an error status, or even an exception out of a
source (turned into an error reading here) — is not a hang: the ping goes on. A source that
keeps failing is **degraded** instead (:class:`SourceHealth`): failing for
:data:`DEGRADED_AFTER_S` and :data:`DEGRADED_AFTER_READINGS` in a row, it is shown in
``tunerd status``, counted in tunerd's metrics and alerted once by the daemon — a driver
without a function, a permission missing, a driver reloaded must not have systemd restart
tunerd again and again. Only a read that never comes back silences the watchdog.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from tunerd.clock import SYSTEM_CLOCK, Clock
from tunerd.gpu import ERROR, NO_GPU, OK, GpuReading
from tunerd.scheduler import GPU, Jobs
from tunerd.sdnotify import Notifier
from tunerd.sources.gpu import GpuSource

__all__ = ["DEGRADED_AFTER_READINGS", "DEGRADED_AFTER_S", "Sampler", "SourceHealth"]

DEGRADED_AFTER_S = 30.0  # failing this long (an engine's own restart may blank a sim's GPU for less)
DEGRADED_AFTER_READINGS = 8  # and this many readings in a row


@dataclass(frozen=True)
class SourceHealth:
    """How the GPU source is doing: ``ok``, ``failing`` (its latest readings failed) or
    ``degraded`` (failing long enough to tell people). ``since`` is the first failure of the
    run (tunerd's time), ``error`` the latest reason; ``failures_total`` counts every failed
    reading since tunerd started, ``unsupported`` what the driver lacks (NVML)."""

    source: str
    state: str
    failures_in_a_row: int = 0
    failures_total: int = 0
    since: float | None = None
    error: str | None = None
    unsupported: str | None = None

    @property
    def degraded(self) -> bool:
        return self.state == "degraded"

    def to_dict(self) -> dict[str, object]:
        return {
            "source": self.source,
            "state": self.state,
            "failures_in_a_row": self.failures_in_a_row,
            "failures_total": self.failures_total,
            "since": self.since,
            "error": self.error,
            "unsupported": self.unsupported,
        }


def failed(reading: GpuReading) -> bool:
    """A reading that saw no GPU it should have: any status but ``ok`` — ``no_gpu`` only from a
    backend that looks for one (the ``none`` backend's is its answer, not a failure)."""
    return reading.status != OK and not (reading.status == NO_GPU and reading.source == "none")


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
        self._lock = threading.Lock()  # the health is written here, read by the loop thread
        self._health = SourceHealth(getattr(gpu, "name", "?"), "ok")
        self._failing_since: float | None = None  # monotonic

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
        """One reading, kept as the latest. A source that raises (it is meant to return an
        error status) gives an error reading instead; either way the read came back, so the
        watchdog is pinged."""
        reading = self.read()
        now = self.clock.monotonic()
        self._latest, self._latest_at = reading, now
        self.samples += 1
        self._judge(reading, now)
        interval = self.notifier.watchdog_interval
        # half a period of slack: a run a hair early must not push the ping a whole period late
        if interval is not None and (
            self._last_ping is None or now - self._last_ping >= interval - self.period / 2
        ):
            self.notifier.watchdog()
            self._last_ping = now
        return reading

    def read(self) -> GpuReading:
        """One reading from the source, never an exception: what a source raises (it is meant
        to return an error status) is counted and read as an error reading. Not kept as the
        latest: for who needs one now (a start's room check) besides the sampling."""
        try:
            return self.gpu.sample()
        except Exception as error:
            self.errors += 1
            self.last_error = f"{type(error).__name__}: {error}"
            return GpuReading(
                source=self._health.source, status=ERROR, error=f"the source raised {self.last_error}"
            )

    def sample_job(self) -> None:
        """The scheduled job: one reading (:meth:`sample_once` never raises for the source)."""
        self.sample_once()

    def health(self) -> SourceHealth:
        with self._lock:
            return self._health

    def _judge(self, reading: GpuReading, now: float) -> None:
        health = self._health
        unsupported = reading.details.get("unsupported") if reading.details else None
        unsupported = str(unsupported) if unsupported else health.unsupported
        if not failed(reading):
            self._failing_since = None
            health = SourceHealth(health.source, "ok", 0, health.failures_total, None, None, unsupported)
        else:
            if self._failing_since is None:
                self._failing_since = now
            count = health.failures_in_a_row + 1
            long_enough = now - self._failing_since >= DEGRADED_AFTER_S and count >= DEGRADED_AFTER_READINGS
            health = SourceHealth(
                health.source,
                "degraded" if long_enough else "failing",
                count,
                health.failures_total + 1,
                health.since if health.since is not None else self.clock.now(),
                reading.error or reading.status,
                unsupported,
            )
        with self._lock:
            self._health = health
