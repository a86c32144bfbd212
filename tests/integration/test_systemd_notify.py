"""`tunerd run` under a stand-in for systemd's notify socket: a datagram socket this test owns
and passes as NOTIFY_SOCKET, with WATCHDOG_USEC as WatchdogSec=2 would set it. The engine is
the simulator (real processes on loopback). And the daemon in-process with its loop frozen
(the tick stuck reading the clock): the watchdog pings stop while sampling goes on, and come
back when the loop moves again."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.sim_daemon import kill_recorded_engine, running, sim_config, sim_daemon
from tunerd.clock import SystemClock

pytestmark = pytest.mark.slow


def test_ready_then_watchdog_pings_at_half_the_timeout_then_stopping_on_sigterm(tmp_path: Path) -> None:
    notify = tmp_path / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(notify))
    config, _ = sim_config(tmp_path)
    env = {"NOTIFY_SOCKET": str(notify), "WATCHDOG_USEC": "2000000"}  # WatchdogSec=2
    tunerd = subprocess.Popen(
        [sys.executable, "-m", "tunerd", "run", "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **env},
    )
    messages: list[tuple[float, str]] = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(m.startswith("READY=1") for _, m in messages):
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            messages.append((time.monotonic(), sock.recv(4096).decode()))
        ready = next(m for _, m in messages if m.startswith("READY=1"))
        # READY as soon as the sources answer, before the engine's start (which may take minutes)
        assert ready == "READY=1\nSTATUS=advise: starting 1 engine(s)", ready
        # five seconds of watching (times are when this end read them: on a busy machine a ping
        # can be read late and the next one right after it, so the period is the average over
        # the whole span, and the worst gap is checked against the timeout)
        until = time.monotonic() + 5
        while (left := until - time.monotonic()) > 0:
            sock.settimeout(left)
            try:
                messages.append((time.monotonic(), sock.recv(4096).decode()))
            except TimeoutError:
                break
        pings = [at for at, m in messages if m == "WATCHDOG=1"]
        assert len(pings) >= 4, messages
        gaps = [b - a for a, b in itertools.pairwise(pings)]
        period = (pings[-1] - pings[0]) / len(gaps)
        assert 0.8 < period < 1.35, gaps  # half of WatchdogSec=2, + one sampling interval
        assert max(gaps) < 2.0, gaps  # never as late as the timeout
        assert any(m == "STATUS=advise: main running (util 0.92, seqs 8)" for _, m in messages), messages

        tunerd.send_signal(signal.SIGHUP)  # systemctl reload: RELOADING=1, then READY=1 again
        reload = []
        sock.settimeout(10)
        while not any(m.startswith("READY=1") for m in reload):
            reload.append(sock.recv(4096).decode())
        reloading = next(m for m in reload if m.startswith("RELOADING=1"))
        assert "MONOTONIC_USEC=" in reloading
        assert reload.index(reloading) < len(reload) - 1
        assert tunerd.poll() is None

        tunerd.send_signal(signal.SIGTERM)
        assert tunerd.wait(timeout=30) == 0
        assert '"event": "reloaded"' in (tunerd.stdout.read() if tunerd.stdout else "")
        sock.settimeout(2)
        rest = []
        with contextlib.suppress(TimeoutError):
            while True:
                rest.append(sock.recv(4096).decode())
        assert "STOPPING=1" in rest, rest
    finally:
        if tunerd.poll() is None:
            tunerd.kill()
        sock.close()
        kill_recorded_engine(tmp_path / "state")


def _pings(sock: socket.socket, seconds: float) -> list[float]:
    arrived = []
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            if sock.recv(4096) == b"WATCHDOG=1":
                arrived.append(time.monotonic())
        except TimeoutError:
            break
    return arrived


def test_a_frozen_loop_silences_the_watchdog_while_sampling_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU sampler fed the watchdog whatever the loop did: a tick stuck for minutes was
    never restarted by systemd. Now a loop job late past its interval by ``stall_margin``
    withholds WATCHDOG=1."""
    notify = tmp_path / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(notify))
    monkeypatch.setenv("NOTIFY_SOCKET", str(notify))
    monkeypatch.setenv("WATCHDOG_USEC", "1000000")  # WatchdogSec=1: a ping every 0.5 s
    moving = threading.Event()
    moving.set()

    def wall() -> float:  # the loop's clock: the tick's now() waits here while the loop is frozen
        moving.wait(60)
        return time.time()

    said: list[dict[str, Any]] = []
    daemon = sim_daemon(tmp_path, clock=SystemClock(wall=wall), said=said)
    daemon.stall_margin = 1.0  # the tick's interval (2 s) and 1 s: stalled 3 s after its last end
    try:
        with running(daemon):
            assert len(_pings(sock, 2.0)) >= 2
            moving.clear()  # the next tick freezes
            deadline = time.monotonic() + 8
            while not any(e["event"] == "watchdog_withheld" for e in said) and time.monotonic() < deadline:
                time.sleep(0.05)
            withheld = next(e for e in said if e["event"] == "watchdog_withheld")
            assert "tick" in withheld["reason"]
            _pings(sock, 0.3)  # one already on its way
            samples = daemon.sampler.samples
            assert _pings(sock, 2.0) == []  # systemd would restart tunerd now
            assert daemon.sampler.samples > samples  # though the sampler samples on
            moving.set()
            assert len(_pings(sock, 3.0)) >= 2  # the loop moves again: so do the pings
            assert any(e["event"] == "watchdog_resumed" for e in said)
    finally:
        moving.set()
        sock.close()
