"""The daemon's scheduler (tunerd.scheduler) with real threads: a job that asks the scheduler
for something while tunerd stops must not hang the stop (found as a `tunerd run` that never
exited after SIGTERM: APScheduler's shutdown(wait=True) holds its job-store lock while it waits
for the running job, and the job was waiting for that lock in get_job). And the progress the
watchdog reads: a job stuck past its interval and a margin — and one waiting behind it on its
thread — is stalled until it completes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from tunerd.scheduler import LOGS, LOOP, Jobs


def test_a_job_that_touches_the_scheduler_during_shutdown_does_not_hang_it() -> None:
    errors: list[BaseException] = []
    jobs = Jobs(lambda job, error, trace: errors.append(error))
    running = threading.Event()
    finished = threading.Event()

    def tick() -> None:
        running.set()
        time.sleep(0.5)  # the stop is asked for meanwhile
        jobs.run_soon("tick")  # as the daemon's tick brings its next run forward
        jobs.run_within("tick", 1.0)
        finished.set()

    jobs.every("tick", 60, tick, LOOP)
    assert running.wait(5)
    stopped = threading.Event()
    threading.Thread(target=lambda: (jobs.shutdown(), stopped.set()), daemon=True).start()
    assert stopped.wait(10), "shutdown hung on a job that touched the scheduler"
    assert finished.is_set()  # the job in progress was waited for, not abandoned
    assert errors == []


def test_shutdown_waits_for_the_job_in_progress_but_not_forever() -> None:
    jobs = Jobs(lambda job, error, trace: None)
    release = threading.Event()
    running = threading.Event()

    def stuck() -> None:
        running.set()
        release.wait(30)

    jobs.every("stuck", 60, stuck, LOOP)
    assert running.wait(5)
    began = time.monotonic()
    jobs.shutdown(timeout=1.0)
    assert time.monotonic() - began < 5  # a job stuck past the deadline is left behind
    release.set()


def _within(check: Callable[[], object], seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not check() and time.monotonic() < deadline:
        time.sleep(0.02)
    return bool(check())


def test_a_job_stuck_past_its_interval_and_margin_is_stalled_until_it_completes() -> None:
    jobs = Jobs(lambda job, error, trace: None)
    release = threading.Event()
    ticks: list[float] = []

    def tick() -> None:
        ticks.append(time.monotonic())
        if len(ticks) == 3:
            release.wait(30)  # the loop freezes in its third tick

    jobs.every("tick", 0.1, tick, LOOP)
    jobs.every("housekeeping", 0.1, lambda: None, LOOP)  # behind it on the loop's one thread
    jobs.every("engine-logs", 0.1, lambda: None, LOGS)  # a thread of its own: goes on
    try:
        assert _within(lambda: len(ticks) >= 3)
        assert _within(lambda: jobs.stalled(margin=0.5) == ["housekeeping", "tick"])
        assert jobs.stalled(margin=60) == []  # within a generous margin: not yet
        assert jobs.stalled(margin=60, now=time.monotonic() + 120) == ["engine-logs", "housekeeping", "tick"]
        release.set()
        assert _within(lambda: jobs.stalled(margin=0.5) == [])  # it completed: it moves again
        jobs.remove("tick")
        assert "tick" not in jobs.stalled(margin=0, now=time.monotonic() + 120)  # removed: not watched
    finally:
        release.set()
        jobs.shutdown()
    assert jobs.stalled(margin=0, now=time.monotonic() + 120) == []  # stopping: nothing to restart for
