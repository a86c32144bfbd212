"""``clock: {source: sim, url}`` against the real simulator (a process on loopback, time ×50):
tunerd's clock runs at the simulator's rate once it answers, never backwards, and a policy's
``for:`` plays out in simulated time."""

from __future__ import annotations

import contextlib
import subprocess
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.integration.sim_daemon import close_daemon, free_port, sim_command, sim_daemon, started
from tunerd.sources.sim_clock import SimulatorClock

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def simulator(port: int) -> Iterator[str]:
    url = f"http://127.0.0.1:{port}"
    argv = [*sim_command(port), "--max-model-len", "32768"]  # 128K does not fit a 4090's pool
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while process.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.05)
        else:
            raise AssertionError(f"the simulator did not come up (exit {process.poll()})")
        yield url
    finally:
        process.kill()
        process.wait()


def _rate(clock: SimulatorClock, wall: float = 1.0) -> float:
    """Simulated seconds per wall second, over ``wall`` seconds (a pause of the test between
    two reads of a pair skews it by that pause over ``wall``)."""
    before, started = clock.now(), time.monotonic()
    time.sleep(wall)
    return (clock.now() - before) / (time.monotonic() - started)


def test_the_clock_runs_at_the_simulators_rate_once_it_answers_and_never_backwards() -> None:
    port = free_port()
    clock = SimulatorClock(f"http://127.0.0.1:{port}")
    start = time.time()
    assert not clock.sync()  # nothing listens yet: wall speed from the wall time
    assert abs(clock.now() - start) < 1
    assert 0.9 < _rate(clock) < 1.2
    with simulator(port):
        before = clock.now()
        assert clock.sync()
        assert clock.scale == 50
        assert clock.now() >= before  # continues from where it was
        assert 44 < _rate(clock) < 56
    # the simulated engine is gone (it would restart at its time 0): tunerd's time goes on
    before = clock.now()
    assert clock.sync()  # learnt once
    assert clock.now() >= before
    assert 44 < _rate(clock) < 56


def test_a_policys_for_plays_out_in_simulated_time(tmp_path: Path) -> None:
    """``for: 2m`` with the metrics read every 200 ms: at ×50 the policy fires after ~2.4 s of
    wall time, and the history says two simulated minutes passed."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    policies = tmp_path / "policies.yaml"
    policies.write_text(
        yaml.safe_dump(
            {
                "version": 1,
                "policies": [
                    {
                        "name": "up-two-minutes",
                        "when": {"metric": "engine_up", "above": 0.5, "for": "2m"},
                        "then": [{"notify": {"severity": "warning"}}],
                    }
                ],
            }
        )
    )
    said: list[dict[str, Any]] = []
    daemon = sim_daemon(
        tmp_path,
        port,
        policies=(str(policies),),
        top={"clock": {"source": "sim", "url": url}, "metrics": {"interval": "200ms"}},
        said=said,
    )
    assert isinstance(daemon.clock, SimulatorClock)
    stop = threading.Event()
    runner = threading.Thread(target=daemon.run, args=(stop,))
    try:
        started(daemon)
        first = daemon.state.history()[0]["time"]  # the first start, at wall speed
        wall = time.monotonic()
        runner.start()
        deadline = wall + 30
        while not any(e["event"] == "alert" for e in said) and time.monotonic() < deadline:
            time.sleep(0.05)
        elapsed = time.monotonic() - wall
        assert any(e["event"] == "alert" for e in said), said[-5:]
        assert daemon.clock.scale == 50
        assert elapsed < 20  # two minutes of wall time with the system clock
        notify = next(h for h in daemon.state.history() if h["kind"] == "notify")
        assert notify["policy"] == "up-two-minutes"
        assert _seconds(notify["time"]) - _seconds(first) >= 120
    finally:
        stop.set()
        if runner.is_alive():
            runner.join(30)
        close_daemon(daemon, kill=True)


def _seconds(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()
