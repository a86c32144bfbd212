"""A daemon on the system clock while the wall clock is stepped (issue 16): tunerd's time never
goes back, so a restart recorded before the wall clock went back an hour still counts against
the restart budget, and the ticks go on (the signal store refuses samples older than the last
one: on the wall clock, every tick after the step failed and tunerd stopped itself)."""

from __future__ import annotations

import os
import signal
import time
from datetime import datetime
from pathlib import Path

import pytest
import yaml

from tests.integration.sim_daemon import close_daemon, sim_daemon, started, ticked
from tunerd.clock import SystemClock

pytestmark = pytest.mark.slow


class SteppedWall:
    """The real wall clock plus a step a test sets (what NTP or a person does to it)."""

    def __init__(self) -> None:
        self.step = 0.0

    def __call__(self) -> float:
        return time.time() + self.step


def test_a_backward_step_buys_no_restart_and_stops_no_tick(tmp_path: Path) -> None:
    policy = tmp_path / "policies.yaml"
    policy.write_text(
        yaml.safe_dump(
            {
                "version": 1,
                "policies": [
                    {
                        "name": "fewer-seqs",
                        "description": "a test policy that fires at once",
                        "when": {"metric": "num_requests_running", "below": 1},
                        "then": [{"tune": {"max_num_seqs": "step_down"}}, {"restart": {"drain": "0s"}}],
                    }
                ],
            }
        )
    )
    wall = SteppedWall()
    daemon = sim_daemon(
        tmp_path,
        policies=(str(policy),),
        guards={"max_restarts": 2, "window": "1h"},  # the first start and one change
        bounds={"max_num_seqs": [2, 8]},
        clock=SystemClock(wall=wall),
    )
    try:
        started(daemon)
        ticked(daemon)  # the policy's restart: the last one the budget allows this hour
        [restart] = [row for row in daemon.state.history(limit=20) if row["kind"] == "tune"]
        assert restart["outcome"] == "succeeded", restart["reason"]
        before = daemon.clock.now()
        wall.step = -3600.0  # the wall clock goes back an hour
        assert daemon.clock.now() >= before
        daemon.tick()  # raised "older than the last one" on the wall clock
        ticked(daemon)
        guards = daemon.status()["engines"][0]["guards"]
        assert (guards["restarts_in_window"], guards["budget_left"]) == (2, 0)
        tunes = [row for row in daemon.state.history(limit=20) if row["kind"] == "tune"]
        assert [row["outcome"] for row in tunes if row["outcome"] == "succeeded"] == ["succeeded"]
        refused = [row["reason"] for row in tunes if row["outcome"] != "succeeded"]
        assert refused  # the policy asked again after the step: refused for the budget
        assert all("budget" in reason for reason in refused), refused
        times = [datetime.fromisoformat(row["time"]).timestamp() for row in daemon.state.history(limit=50)]
        assert max(times) <= daemon.clock.now()  # nothing recorded "in the future" of tunerd's now
    finally:
        close_daemon(daemon, kill=True)


def test_a_forward_step_is_followed_and_stops_no_tick(tmp_path: Path) -> None:
    """The wall clock jumps a day ahead (a box whose clock was wrong until NTP answered): the
    ticks go on, the engine serves on untouched, and what tunerd records after the step — here
    the restart of an engine that crashed — carries the corrected time."""
    wall = SteppedWall()
    daemon = sim_daemon(tmp_path, clock=SystemClock(wall=wall))
    try:
        started(daemon)
        record = daemon.state.engine("main")
        assert record is not None
        ticks = daemon.ticks
        wall.step = 86400.0
        for _ in range(2):
            daemon._tick_job()  # what the tick job runs: tick, publish, count
        assert daemon.ticks == ticks + 2
        assert daemon.troubles() == []
        assert daemon.state.engine("main") == record  # untouched: same PID, generation, settings
        os.killpg(record.pid, signal.SIGKILL)  # type: ignore[arg-type]
        deadline = time.monotonic() + 30
        while len(daemon.state.history(limit=20)) < 2 or daemon.in_flight():
            assert time.monotonic() < deadline, daemon.in_flight()
            ticked(daemon)
            time.sleep(0.1)
        crash, first = daemon.state.history(limit=20)
        assert (crash["kind"], crash["outcome"]) == ("restart", "succeeded"), crash
        stamped = datetime.fromisoformat(crash["time"]).timestamp()
        assert stamped >= time.time() + 86400 - 60  # after the step: the corrected time
        assert datetime.fromisoformat(first["time"]).timestamp() < time.time()
    finally:
        close_daemon(daemon, kill=True)
