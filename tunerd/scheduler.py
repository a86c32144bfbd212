"""The daemon's jobs on APScheduler 3: when each piece of work runs, and on which thread.

Two one-thread executors keep the daemon's two rules:

- ``gpu`` runs the GPU sampling job alone, so a tick blocked for minutes by an engine restart,
  a slow webhook or a slow scrape never delays a reading — nor the systemd watchdog ping that
  follows each reading (a hung driver read stops the pings, and systemd restarts tunerd);
- ``loop`` runs every job that reads or changes the state database — the tick and
  housekeeping — one at a time on one thread, so two engines' restarts never overlap
  and the database is never used by two threads at once;
- ``logs`` passes the engines' log lines into tunerd's log, also while a restart holds the
  loop (the new engine's start-up lines are the ones a person wants to see then).

Every job has ``max_instances=1`` (a tick still running when the next falls due is skipped,
not stacked) and ``coalesce=True`` with a misfire grace of one interval (runs missed while the
host was suspended or starved become one late run, not a burst). Skips and errors are counted
per job; a job's exception is handed to ``on_error`` (the daemon logs it and, after a few in a
row, stops so that systemd restarts it clean).

APScheduler decides *when* a job runs, on the wall clock; what a job sees as *now* comes from
the daemon's injected :class:`~tunerd.clock.Clock` (a test's, or the simulator's).

Progress: each job's last completion is kept (monotonic time), and :meth:`Jobs.stalled` names
the jobs that have not completed for their interval plus a margin — one stuck in a run, or
never started because the job ahead of it on its thread is stuck. The daemon withholds the
systemd watchdog's ping while any is (a frozen loop is restarted, not only a wedged sampler).

Stopping: APScheduler's ``shutdown(wait=True)`` holds its job-store lock while it waits for the
jobs in progress, so a job that asks the scheduler for anything then (the tick bringing its
next run forward) waits for that lock forever, and so does tunerd's exit. :meth:`Jobs.shutdown`
therefore stops the scheduler without waiting, then waits — with a deadline — for the jobs in
progress itself; from the moment it begins, what jobs ask of the scheduler is a no-op.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from apscheduler.events import (
    EVENT_JOB_ERROR,
    EVENT_JOB_MAX_INSTANCES,
    JobEvent,
    JobExecutionEvent,
)
from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.schedulers.background import BackgroundScheduler

__all__ = ["GPU", "LOGS", "LOOP", "STALL_MARGIN_S", "Jobs"]

GPU = "gpu"
LOOP = "loop"
LOGS = "logs"
#: how long past its interval a job may go without completing before it counts as stalled: more
#: than the longest step a job may block for (a ``systemctl`` call's 30 s, a scrape's deadline)
STALL_MARGIN_S = 60.0

# APScheduler logs a skipped run as a WARNING on every occurrence (each tick that fell due while a
# restart holds the loop thread): the counts below say it once, in tunerd's status and metrics.
_QUIET = logging.getLogger("tunerd.scheduler")
_QUIET.setLevel(logging.CRITICAL)
_QUIET.propagate = False


class Jobs:
    """A started ``BackgroundScheduler`` with the ``gpu``, ``loop`` and ``logs`` executors."""

    def __init__(self, on_error: Callable[[str, BaseException, str | None], None]) -> None:
        self.on_error = on_error
        self.skipped: Counter[str] = Counter()  # runs not started: the previous still running
        self.errors: Counter[str] = Counter()  # runs that raised
        self._closing = False
        self._running = 0  # jobs in progress
        self._idle = threading.Condition()
        # job id → (interval, monotonic time of its last completion, or of when it was added)
        self._progress: dict[str, tuple[float, float]] = {}
        self.scheduler = BackgroundScheduler(
            executors={GPU: ThreadPoolExecutor(1), LOOP: ThreadPoolExecutor(1), LOGS: ThreadPoolExecutor(1)},
            job_defaults={"max_instances": 1, "coalesce": True},
            timezone=UTC,
            logger=_QUIET,
        )
        # every job's runs fall on this anchor plus whole intervals, so jobs whose intervals
        # divide each other (0.25 s sampling, 1 s logs, 2 s tick) share the scheduler's wake-ups
        self._anchor = datetime.now(UTC)
        self.scheduler.add_listener(self._on_event, EVENT_JOB_ERROR | EVENT_JOB_MAX_INSTANCES)
        self.scheduler.start()

    def every(
        self, job_id: str, seconds: float, func: Callable[[], object], executor: str, now: bool = True
    ) -> None:
        """Run ``func`` every ``seconds`` on ``executor`` (first at once when ``now``)."""
        if self._closing:
            return
        first = {"next_run_time": datetime.now(UTC)} if now else {}  # None would add it paused

        def counted() -> None:
            with self._idle:
                self._running += 1
            try:
                func()
            finally:
                with self._idle:
                    self._running -= 1
                    if job_id in self._progress:  # not removed meanwhile
                        self._progress[job_id] = (self._progress[job_id][0], time.monotonic())
                    self._idle.notify_all()

        self.scheduler.add_job(
            counted,
            "interval",
            seconds=seconds,
            start_date=self._anchor,
            id=job_id,
            executor=executor,
            misfire_grace_time=max(1, round(seconds)),
            replace_existing=True,
            **first,
        )
        with self._idle:  # added again (a reload's new interval): its last completion still counts
            last = self._progress.get(job_id, (seconds, time.monotonic()))[1]
            self._progress[job_id] = (seconds, last)

    def remove(self, job_id: str) -> None:
        """Stop running ``job_id`` (nothing when it is not scheduled)."""
        if self.has(job_id):
            self.scheduler.remove_job(job_id)
        with self._idle:
            self._progress.pop(job_id, None)

    def stalled(self, margin: float = STALL_MARGIN_S, now: float | None = None) -> list[str]:
        """The jobs that have not completed for more than their interval plus ``margin``
        seconds at ``now`` (monotonic; default: now): stuck in a run, or waiting behind one
        that is. None while stopping."""
        now = time.monotonic() if now is None else now
        with self._idle:
            if self._closing:
                return []
            return sorted(job for job, (every, last) in self._progress.items() if now - last > every + margin)

    def has(self, job_id: str) -> bool:
        return not self._closing and self.scheduler.get_job(job_id) is not None

    def run_soon(self, job_id: str) -> None:
        """Bring ``job_id``'s next run forward to now (it still waits for a run in progress)."""
        if self.has(job_id):
            self.scheduler.modify_job(job_id, next_run_time=datetime.now(UTC))

    def run_within(self, job_id: str, seconds: float) -> None:
        """Bring ``job_id``'s next run forward to ``seconds`` from now, unless it is due sooner."""
        if not self.has(job_id):
            return
        when = datetime.now(UTC) + timedelta(seconds=max(seconds, 0.0))
        job = self.scheduler.get_job(job_id)
        if job is not None and (job.next_run_time is None or when < job.next_run_time):
            self.scheduler.modify_job(job_id, next_run_time=when)

    def shutdown(self, timeout: float = 8.0) -> bool:
        """Stop scheduling and wait, at most ``timeout`` seconds, for the jobs in progress to
        finish (each does one short step: a restart in flight stays in the state). False when
        one was still running at the deadline."""
        self._closing = True
        if self.scheduler.running:
            self.scheduler.shutdown(wait=False)
        with self._idle:
            return self._idle.wait_for(lambda: self._running == 0, timeout)

    def _on_event(self, event: JobEvent) -> None:
        if event.code == EVENT_JOB_MAX_INSTANCES:
            self.skipped[event.job_id] += 1
        elif isinstance(event, JobExecutionEvent) and event.exception is not None:
            self.errors[event.job_id] += 1
            self.on_error(event.job_id, event.exception, event.traceback)
