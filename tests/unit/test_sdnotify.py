"""systemd's notify protocol against a real unix datagram socket (the receiving end systemd
holds), and the sampler's watchdog: pings while it samples, none once a read hangs — and none
while a hold says why (a loop job stalled past its interval), though sampling goes on."""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakes.gpu_sources import MismatchedGpu
from tunerd.clock import SystemClock
from tunerd.gpu import OK, GpuReading
from tunerd.sampler import Sampler
from tunerd.scheduler import LOOP, Jobs
from tunerd.sdnotify import Notifier
from tunerd.sources.gpu import NoGpuSource


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[tuple[str, socket.socket]]:
    path = str(tmp_path / "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(2)
    yield path, sock
    sock.close()


def test_messages_are_key_value_lines_in_one_datagram(receiver: tuple[str, socket.socket]) -> None:
    path, sock = receiver
    notifier = Notifier({"NOTIFY_SOCKET": path})
    assert notifier.ready("act: main running")
    assert sock.recv(4096) == b"READY=1\nSTATUS=act: main running"
    assert notifier.reloading()
    reloading = sock.recv(4096).decode().split("\n")
    assert reloading[0] == "RELOADING=1"
    assert abs(int(reloading[1].removeprefix("MONOTONIC_USEC=")) - time.monotonic_ns() // 1000) < 5_000_000
    assert notifier.stopping()
    assert sock.recv(4096) == b"STOPPING=1"
    notifier.close()


def test_an_abstract_socket_is_named_with_an_at_sign() -> None:
    name = f"tunerd-test-{os.getpid()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(2)
    try:
        assert Notifier({"NOTIFY_SOCKET": "@" + name}).status("one line\nnot two")
        assert sock.recv(4096) == b"STATUS=one line not two"
    finally:
        sock.close()


def test_outside_systemd_nothing_is_sent_and_nothing_raises(tmp_path: Path) -> None:
    assert not Notifier({}).ready()
    assert not Notifier({"NOTIFY_SOCKET": "vsock:2:1234"}).enabled
    assert not Notifier({"NOTIFY_SOCKET": str(tmp_path / "gone")}).ready()  # nobody listens: False


def test_the_watchdog_belongs_to_the_process_systemd_named() -> None:
    assert Notifier({"WATCHDOG_USEC": "30000000"}).watchdog_interval == 15.0
    assert Notifier({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}).watchdog_interval == 15.0
    assert Notifier({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}).watchdog_interval is None
    assert Notifier({"WATCHDOG_USEC": "0"}).watchdog_interval is None


class HangingGpu:
    """A GPU source whose reads hang once ``hang`` is set: a wedged driver."""

    name = "hanging"

    def __init__(self) -> None:
        self.hang = threading.Event()
        self.release = threading.Event()

    def sample(self) -> GpuReading:
        if self.hang.is_set():
            self.release.wait()
        return GpuReading(source=self.name, status=OK)

    def close(self) -> None:
        self.release.set()


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


def test_watchdog_pings_come_from_sampling_and_stop_when_a_read_hangs(
    receiver: tuple[str, socket.socket],
) -> None:
    path, sock = receiver
    gpu = HangingGpu()
    # WatchdogSec=0.4: a ping every 0.2 s, whatever the sampling interval (1 s here)
    sampler = Sampler(
        gpu, interval=1.0, notifier=Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "400000"})
    )
    jobs = Jobs(on_error=lambda *failed: None)
    sampler.schedule(jobs)
    try:
        alive = _pings(sock, 1.2)
        assert len(alive) >= 4, alive
        gaps = [b - a for a, b in itertools.pairwise(alive)]
        assert max(gaps) < 0.4  # within systemd's timeout, always
        gpu.hang.set()
        time.sleep(0.3)  # a ping already on its way may still land
        _pings(sock, 0.01)
        assert _pings(sock, 1.0) == []  # the read hangs: no more pings, systemd would restart tunerd
    finally:
        gpu.release.set()
        jobs.shutdown()


class BrokenOnceGpu:
    """A source with a bug: its second read raises instead of returning an error status."""

    name = "broken"

    def __init__(self) -> None:
        self.reads = 0

    def sample(self) -> GpuReading:
        self.reads += 1
        if self.reads == 2:
            raise KeyError("memory_used_bytes")
        return GpuReading(source=self.name, status=OK)

    def close(self) -> None:
        pass


def test_a_source_that_raises_does_not_end_sampling() -> None:
    gpu = BrokenOnceGpu()
    sampler = Sampler(gpu, interval=0.05)
    jobs = Jobs(on_error=lambda *failed: None)
    sampler.schedule(jobs)
    try:
        deadline = time.monotonic() + 5
        while gpu.reads < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gpu.reads >= 5  # the job went on after the exception
        assert sampler.errors == 1
        assert sampler.last_error == "KeyError: 'memory_used_bytes'"
    finally:
        jobs.shutdown()


def test_a_receiver_that_never_reads_costs_messages_not_a_frozen_loop(tmp_path: Path) -> None:
    """A notify socket nobody reads fills up; sends then fail at once (found when a test's
    socket was never read and SIGTERM waited on a blocked STOPPING=1)."""
    path = tmp_path / "notify"
    deaf = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    deaf.bind(str(path))
    notifier = Notifier({"NOTIFY_SOCKET": str(path)})
    sent = []
    done = threading.Event()

    def flood() -> None:
        sent.extend(notifier.status(f"tick {n}") for n in range(5000))
        done.set()

    threading.Thread(target=flood, daemon=True).start()
    try:
        assert done.wait(10), "a send blocked on the full socket"
        assert sent[0] is True
        assert sent[-1] is False  # the queue is full: dropped, not waited for
        assert notifier.stopping() is False
    finally:
        deaf.close()
        notifier.close()


def test_a_hold_withholds_the_ping_and_a_hold_that_raises_does_not(
    receiver: tuple[str, socket.socket],
) -> None:
    path, sock = receiver
    notifier = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "400000"})
    why: list[str | None] = ["the loop is stuck"]
    notifier.hold = lambda: why[0]
    assert notifier.watchdog() is False
    assert notifier.withheld == "the loop is stuck"
    why[0] = None
    assert notifier.watchdog() is True
    assert sock.recv(4096) == b"WATCHDOG=1"

    def broken() -> str | None:
        raise RuntimeError("a bug in the check")

    notifier.hold = broken  # a broken check must not get a working tunerd restarted
    assert notifier.watchdog() is True
    assert sock.recv(4096) == b"WATCHDOG=1"
    notifier.close()


def test_pings_stop_while_a_loop_job_is_stalled_though_sampling_goes_on(
    receiver: tuple[str, socket.socket],
) -> None:
    """Before the hold, the sampler fed the watchdog whatever the loop did: a tick stuck for
    minutes (a /metrics page trickling in) never got tunerd restarted."""
    path, sock = receiver
    notifier = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "400000"})
    sampler = Sampler(HangingGpu(), interval=1.0, notifier=notifier)
    jobs = Jobs(on_error=lambda *failed: None)
    notifier.hold = lambda: ", ".join(jobs.stalled(margin=0.3)) or None
    frozen = threading.Event()
    release = threading.Event()

    def tick() -> None:
        if frozen.is_set():
            release.wait(30)

    jobs.every("tick", 0.1, tick, LOOP)
    sampler.schedule(jobs)
    try:
        assert len(_pings(sock, 1.0)) >= 3  # the loop moves: pings
        frozen.set()
        time.sleep(0.8)  # its interval and margin pass; a ping already on its way may land
        _pings(sock, 0.01)
        samples = sampler.samples
        assert _pings(sock, 1.0) == []  # stalled: no pings, systemd would restart tunerd
        assert sampler.samples > samples  # while sampling goes on
        assert notifier.withheld == "tick"
        release.set()
        assert len(_pings(sock, 1.0)) >= 2  # it moves again: pings again
    finally:
        release.set()
        jobs.shutdown()


def test_a_source_that_keeps_failing_is_degraded_and_the_watchdog_still_fed(
    receiver: tuple[str, socket.socket],
) -> None:
    """Each read comes back (with an exception): not a hang, so systemd keeps getting its ping
    and does not restart tunerd over and over. The source is failing, then degraded once it
    has failed for 30 s and 8 readings; one good reading makes it ok again."""
    path, sock = receiver
    now = [100.0]
    clock = SystemClock(wall=lambda: 1.7e9 + now[0], monotonic=lambda: now[0])
    gpu = MismatchedGpu()
    sampler = Sampler(gpu, 0.25, Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "400000"}), clock=clock)
    jobs = Jobs(on_error=lambda *failed: None)
    try:
        sampler.schedule(jobs)  # its first read raised out of the daemon's start before
    finally:
        jobs.shutdown()
    assert sock.recv(4096) == b"WATCHDOG=1"
    for _ in range(8):
        now[0] += 0.25
        sampler.sample_once()
        assert sock.recv(4096) == b"WATCHDOG=1"
    health = sampler.health()
    assert (health.state, health.failures_in_a_row) == ("failing", 9)
    assert "NVMLLibraryMismatchError" in (health.error or "")
    assert sampler.latest is not None
    assert sampler.latest.status == "error"
    now[0] += 30
    sampler.sample_once()
    assert sampler.health().degraded
    assert sampler.health().since == pytest.approx(1.7e9 + 100.0)
    gpu.fixed = True
    now[0] += 0.25
    sampler.sample_once()
    health = sampler.health()
    assert (health.state, health.failures_in_a_row, health.failures_total, health.since) == (
        "ok",
        0,
        10,
        None,
    )


def test_the_none_source_is_not_a_failing_one() -> None:
    sampler = Sampler(NoGpuSource(), 0.25)
    for _ in range(20):
        sampler.sample_once()
    assert sampler.health().state == "ok"
