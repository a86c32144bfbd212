"""Quiet periods through the daemon (issue 7): a `restart: {quiet: true}` waits until the engine
has had no request running for `guards.quiet.for`; if that does not happen within
`guards.quiet.within` it alerts instead of restarting. Real daemon, simulated engine and load."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.integration.sim_daemon import BEFORE, close_daemon, sim_daemon, started, ticked
from tunerd.daemon import Daemon

pytestmark = pytest.mark.slow


def _always(tmp_path: Path) -> str:
    """A test policy that fires at every tick and asks for a quiet restart."""
    policy = tmp_path / "policies.yaml"
    policy.write_text(
        yaml.safe_dump(
            {
                "version": 1,
                "policies": [
                    {
                        "name": "fewer-seqs",
                        "description": "fewer sequences, in a quiet moment (a test policy)",
                        "when": {"metric": "kv_cache_usage", "below": 2},
                        "then": [
                            {"tune": {"max_num_seqs": "step_down"}},
                            {"restart": {"drain": "0s", "quiet": True}},
                            {"notify": {"severity": "info"}},
                        ],
                        "cooldown": "1h",
                    }
                ],
            }
        )
    )
    return str(policy)


def _ticks(daemon: Daemon, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        ticked(daemon)
        time.sleep(0.2)


def test_a_quiet_restart_waits_for_an_idle_engine(tmp_path: Path) -> None:
    daemon = sim_daemon(
        tmp_path,
        policies=(_always(tmp_path),),
        guards={"quiet": {"max_running": 0, "for": "1s", "within": "1h"}},
        bounds={"max_num_seqs": [4, 8]},
    )
    try:
        started(daemon)
        ticked(daemon)  # fires; one idle reading is not a second of quiet
        assert daemon.engines[0].supervisor.running_settings() == BEFORE
        alert = daemon.state.history(limit=1)[0]
        assert alert["kind"] == "notify"
        assert "what tunerd did: waiting for a quiet period" in alert["reason"]
        _ticks(daemon, 1.5)  # idle for a second: the restart goes ahead
        assert daemon.engines[0].supervisor.running_settings() == {**BEFORE, "max_num_seqs": 6}
        tunes = [h for h in daemon.state.history() if h["kind"] == "tune"]
        assert [t["outcome"] for t in tunes] == ["succeeded"]
    finally:
        close_daemon(daemon, kill=True)


def test_a_busy_engine_gets_an_alert_not_a_restart(tmp_path: Path) -> None:
    daemon = sim_daemon(
        tmp_path,
        policies=(_always(tmp_path),),
        guards={"quiet": {"max_running": 0, "for": "1s", "within": "2s"}},
        bounds={"max_num_seqs": [4, 8]},
    )
    load = None
    try:
        started(daemon)
        pid = daemon.state.engine("main").pid
        argv = [
            sys.executable, "-m", "tunerd", "sim", "load", "--url", daemon.config.engines[0].url,
            "--concurrency", "4", "--prompt-tokens", "8000", "--max-tokens", "2000", "--duration", "30s",
        ]  # fmt: skip
        load = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # requests in flight before the policy looks
        _ticks(daemon, 3.5)
        history = daemon.state.history()
        assert daemon.state.engine("main").pid == pid  # never restarted
        tunes = [h for h in history if h["kind"] == "tune"]
        assert [t["outcome"] for t in tunes] == ["skipped"]
        assert "not applied: no quiet period (≤ 0 running for 1 s) within 2 s" in tunes[0]["reason"]
        alerts = [h for h in history if h["kind"] == "notify"]
        assert alerts[0]["reason"].startswith("critical firing: ")  # giving up pages a person
        assert (
            "what tunerd did: not applied: no quiet period (≤ 0 running for 1 s) within 2 s"
            in alerts[0]["reason"]
        )
    finally:
        if load is not None:
            load.kill()
            load.wait()
        close_daemon(daemon, kill=True)


class _Jumping:
    """The system clock plus an offset the test moves: ticks minutes apart in clock time, as
    under the simulator's clock at a high time scale (or a long metrics interval)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def now(self) -> float:
        return time.time() + self.offset

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(max(seconds, 0))


def test_readings_further_apart_than_a_minute_still_show_a_quiet_period(tmp_path: Path) -> None:
    """Found by `tunerd demo --scenario over-conservative` (×1000: a reading every 500 clock
    seconds): the quiet check looked back only `for` + 60 s, saw no reading old enough, and
    waited forever on an idle engine."""
    clock = _Jumping()
    daemon = sim_daemon(
        tmp_path,
        policies=(_always(tmp_path),),
        guards={"quiet": {"max_running": 0, "for": "2m", "within": "1h"}},
        bounds={"max_num_seqs": [4, 8]},
        clock=clock,
    )
    try:
        started(daemon)
        ticked(daemon)  # fires and waits: one reading is not two minutes of quiet
        assert daemon.engines[0].supervisor.running_settings() == BEFORE
        for _ in range(2):
            clock.offset += 100  # the next reading 100 s later, idle
            ticked(daemon)
        assert daemon.engines[0].supervisor.running_settings() == {**BEFORE, "max_num_seqs": 6}
    finally:
        close_daemon(daemon, kill=True)


def test_an_engines_ladder_replaces_the_knobs_notches(tmp_path: Path) -> None:
    """`ladders:` in the engine's config reach the policies: 8 steps down to the rung below (3),
    not the default notch (6)."""
    daemon = sim_daemon(
        tmp_path,
        policies=(_always(tmp_path),),
        guards={"quiet": {"max_running": 0, "for": "0s", "within": "1h"}},
        bounds={"max_num_seqs": [2, 8]},
        ladders={"max_num_seqs": [2, 3, 8]},
    )
    try:
        started(daemon)
        _ticks(daemon, 0.5)
        assert daemon.engines[0].supervisor.running_settings() == {**BEFORE, "max_num_seqs": 3}
    finally:
        close_daemon(daemon, kill=True)
