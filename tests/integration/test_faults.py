"""The fault tier (issue 16): tunerd killed with SIGKILL at every step of a crash restart and
of a rollback, killed twice while it reconciles, and a state that refuses writes — a database
made full, a real 4 MiB disk that fills in the middle of a restart — with real processes:
tunerd daemons (tests/integration/sim_daemon.py) over the simulator, the killed ones in a
process of their own.

After every fault each test asserts the same: the loop keeps ticking, the engine ends up
serving the configuration the state records (its own argv says so, ``/health`` answers, one
engine and never two), every action ends in a final outcome with no intent left, and every
start of the engine is in the history record of its action (their count is its generation).

One engine per test, its kill points in turn: the module stays within a minute and a half on a
loaded two-core machine."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.sim_daemon import BEFORE, free_port, sim_daemon, started, ticked
from tests.unit.engine.test_saga import FullDisk
from tunerd.daemon import Daemon
from tunerd.engine.args import settings_from_argv
from tunerd.engine.process import read_identity
from tunerd.state import State

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]
# crashes seconds apart are not a crash loop here, and the budget never runs out: each kill
# point is a crash of its own
GUARDS = {"window": "50ms", "max_restarts": 100}
TOP: dict[str, object] = {"metrics": {"interval": "250ms"}}
# 128K tokens of 16-bit KV do not fit in half a 4090: vLLM (the simulator) refuses to start
DOOMED = {**BEFORE, "gpu_memory_utilization": 0.5, "max_model_len": 131072}
FINAL = ("succeeded", "failed", "rolled_back", "skipped")

# tunerd as `tunerd run` runs it — a Daemon, its jobs on its loop — killed with SIGKILL when
# its saga reaches a step (Daemon._on_step is told each step after it is written). It arms
# once its first start (or adoption) is done: `crash` — the test then kills the engine;
# `restart` — it restarts the engine with the settings given (DOOMED: a rollback follows);
# `resume` — armed at once, it dies while reconciling what the tunerd before it left.
# `rollback:STEP` dies at STEP only once the restart has turned into its rollback.
DRIVER = r"""
import json, os, signal, sys, threading
from pathlib import Path
root, tmp, port, die_at, scenario, settings = sys.argv[1:7]
sys.path.insert(0, root)
from tests.integration.sim_daemon import sim_daemon, started
daemon = sim_daemon(Path(tmp), int(port), guards=json.loads(os.environ["FAULT_GUARDS"]),
                    top=json.loads(os.environ["FAULT_TOP"]))
armed = scenario == "resume"
rollback = die_at.startswith("rollback:")
target = die_at.removeprefix("rollback:")
tell = daemon._on_step
def on_step(engine, step):
    global rollback
    if step.startswith("rolling back"):
        rollback = False
    if armed and not rollback and step.startswith(target):
        os.kill(os.getpid(), signal.SIGKILL)
    tell(engine, step)
daemon._on_step = on_step
started(daemon)
armed = True
if scenario == "restart":
    daemon.engines[0].supervisor.begin_restart(json.loads(settings), reason="fault test")
print("ready", flush=True)
daemon.run(threading.Event())
"""


def _engines(port: int) -> list[int]:
    """The live simulator engines serving ``port`` (zombies aside)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        identity = read_identity(int(entry.name))
        if identity is None or "serve" not in identity.argv or "--port" not in identity.argv:
            continue
        if identity.argv[identity.argv.index("--port") + 1] == str(port):
            found.append(identity.pid)
    return sorted(found)


@pytest.fixture
def world(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    port = free_port()
    try:
        yield tmp_path, port
    finally:
        for pid in _engines(port):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


def _recorded(tmp_path: Path) -> int:
    state = State.open(tmp_path / "state", readonly=True)
    try:
        record = state.engine("main")
        assert record is not None
        assert record.pid is not None
        return record.pid
    finally:
        state.close()


def _killed_tunerd(
    tmp_path: Path, port: int, die_at: str, scenario: str, settings: dict[str, Any] | None = None
) -> None:
    """A tunerd in a process of its own, SIGKILLed at ``die_at`` (see DRIVER); with
    ``scenario == "crash"`` the engine is killed once that tunerd serves it."""
    env = {**os.environ, "FAULT_GUARDS": json.dumps(GUARDS), "FAULT_TOP": json.dumps(TOP)}
    argv = [sys.executable, "-c", DRIVER, str(ROOT), str(tmp_path), str(port), die_at, scenario]
    errors = (tmp_path / f"tunerd-{die_at.replace(':', '-').replace(' ', '-')}.err").open("w")
    driver = subprocess.Popen(
        [*argv, json.dumps(settings or {})], stdout=subprocess.PIPE, stderr=errors, text=True, env=env
    )
    assert driver.stdout is not None
    try:
        if scenario == "crash":
            ready = driver.stdout.readline()
            assert ready.strip() == "ready", ready
            os.killpg(_recorded(tmp_path), signal.SIGKILL)  # the engine dies; tunerd restarts it
        driver.wait(timeout=90)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        errors.close()
    said = Path(errors.name).read_text()
    assert driver.returncode == -signal.SIGKILL, f"tunerd was to be killed at {die_at!r}:\n{said[-3000:]}"


def _next_tunerd(tmp_path: Path, port: int) -> Daemon:
    """The tunerd after a kill: it reconciles (finishes or undoes what was left), its loop
    ticks; it is closed again with the engine left serving, as tunerd leaves it."""
    daemon = sim_daemon(tmp_path, port, guards=GUARDS, top=TOP)
    try:
        started(daemon)
        ticked(ticked(daemon))  # the loop goes on: two ticks, nothing left in flight
        assert daemon.troubles() == []
    finally:
        daemon.close()
    return daemon


def _assert_after_fault(tmp_path: Path, port: int, settings: dict[str, Any]) -> list[dict[str, Any]]:
    """What must hold after any fault; the history but alerts, newest first."""
    state = State.open(tmp_path / "state", readonly=True)
    try:
        assert state.intents() == []
        history = state.history("main", limit=10**6)
        begun = [action for action in history if action["kind"] in ("tune", "restart", "rollback", "adopt")]
        unfinished = [(a["id"], a["kind"], a["outcome"]) for a in begun if a["outcome"] not in FINAL]
        assert unfinished == [], unfinished
        record = state.engine("main")
        assert record is not None
        assert record.running is not None
        starts = [start for action in history for start in action["evidence"].get("starts", [])]
        assert sorted(start["generation"] for start in starts) == list(range(1, record.generation + 1))
        running = state.version(record.running).settings
        assert running == settings
        assert record.pid is not None
        live = read_identity(record.pid)
        assert live is not None, "the recorded engine is not running"
        assert live.start_ticks == record.pid_start
        assert settings_from_argv(live.argv) == {knob: v for knob, v in settings.items() if v is not None}
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
        assert _engines(port) == [record.pid]  # one engine, never two
        return [action for action in history if action["kind"] != "notify"]
    finally:
        state.close()


def test_tunerd_killed_at_each_step_of_a_crash_restart(world: tuple[Path, int]) -> None:
    """The engine crashes; tunerd restarts it and is killed at each step in turn — the
    restart begun (its intent written with its action: stopping), starting, right after the
    spawn (the new engine not yet recorded), verifying. The next tunerd finishes it."""
    tmp_path, port = world
    for step in ("stopping", "starting", "spawned", "verifying"):
        _killed_tunerd(tmp_path, port, step, "crash")
        _next_tunerd(tmp_path, port)
        history = _assert_after_fault(tmp_path, port, BEFORE)
        crash = history[0]
        assert (crash["kind"], crash["outcome"]) == ("restart", "succeeded"), (step, crash)
        assert crash["evidence"]["crash"]["kind"], crash  # what killed it, from its log
        assert len(crash["evidence"]["starts"]) == 1, (step, crash["evidence"]["starts"])
    restarts = [a for a in history if a["kind"] == "restart"]
    assert len(restarts) == 5  # the first start and one per crash: none lost, none doubled


def test_tunerd_killed_at_each_step_of_a_tuned_restart(world: tuple[Path, int]) -> None:
    """A restart with new settings (what a policy's tune begins); tunerd is killed at each step
    in turn. Killed with only the intent written (the old engine still serves, nothing stopped),
    the next tunerd lets it go: skipped, the old settings serve on, the policy may ask again.
    Killed at any later step — stopping (the drain), starting, right after the spawn,
    verifying, probation — the next tunerd finishes it: the engine serves the new settings and
    the action succeeded. The settings alternate, so every round is a real change."""
    tmp_path, port = world
    settings = [BEFORE, {**BEFORE, "max_num_seqs": 4}]
    serving = 0
    for step in ("intent", "stopping", "starting", "spawned", "verifying", "probation"):
        target = 1 - serving
        _killed_tunerd(tmp_path, port, step, "restart", settings[target])
        _next_tunerd(tmp_path, port)
        if step != "intent":
            serving = target
        history = _assert_after_fault(tmp_path, port, settings[serving])
        tune = history[0]
        assert tune["kind"] == "tune", (step, tune)
        assert tune["to_settings"] == settings[target], (step, tune)
        if step == "intent":
            assert tune["outcome"] == "skipped", (step, tune)
            assert not tune["evidence"].get("starts"), (step, tune)  # nothing was started
        else:
            assert tune["outcome"] == "succeeded", (step, tune)
            assert len(tune["evidence"]["starts"]) == 1, (step, tune["evidence"]["starts"])
    assert [a["kind"] for a in history].count("tune") == 6  # one per round: none lost, none doubled


def test_tunerd_killed_at_each_step_of_a_rollback(world: tuple[Path, int]) -> None:
    """A restart with settings that cannot start turns into its rollback; tunerd is killed at
    each step of the rollback in turn — as it turns (its intent retargeted), starting, right
    after last-known-good's spawn, verifying. The next tunerd finishes the rollback."""
    tmp_path, port = world
    for step in ("rolling back", "starting", "spawned", "verifying"):
        _killed_tunerd(tmp_path, port, f"rollback:{step}", "restart", DOOMED)
        _next_tunerd(tmp_path, port)
        history = _assert_after_fault(tmp_path, port, BEFORE)
        tune = history[0]
        assert (tune["kind"], tune["outcome"]) == ("tune", "rolled_back"), (step, tune)
        assert "estimated maximum model length" in tune["reason"]
        # both starts of the action are in its record: the doomed settings', last-known-good's
        assert len(tune["evidence"]["starts"]) == 2, (step, tune["evidence"]["starts"])


def test_tunerd_killed_twice_while_reconciling(world: tuple[Path, int]) -> None:
    """Double faults. A tunerd killed right after a crash restart's spawn; the next finds that
    engine by its argv, records it, and is killed as it resumes; a third verifies it. Then:
    killed as a crash restart begins; the next killed right after its own spawn; a third finds
    that engine. One engine serves at the end of each, the starts all accounted for."""
    tmp_path, port = world
    _killed_tunerd(tmp_path, port, "spawned", "crash")
    _killed_tunerd(tmp_path, port, "resumed at verifying", "resume")
    _next_tunerd(tmp_path, port)
    history = _assert_after_fault(tmp_path, port, BEFORE)
    [start] = history[0]["evidence"]["starts"]
    assert start["how"] == "spawned by the tunerd before, found by its argv"

    _killed_tunerd(tmp_path, port, "stopping", "crash")
    _killed_tunerd(tmp_path, port, "spawned", "resume")
    _next_tunerd(tmp_path, port)
    history = _assert_after_fault(tmp_path, port, BEFORE)
    assert [(a["kind"], a["outcome"]) for a in history if a["kind"] == "restart"] == [
        ("restart", "succeeded")
    ] * 3


def _look(daemon: Daemon, looks: int = 1) -> None:
    """What the daemon's jobs do, on this thread: a tick, then the sagas."""
    for _ in range(looks):
        daemon._tick_job()
        daemon.advance_sagas()
        time.sleep(0.1)


def _until(daemon: Daemon, done: Any, seconds: float = 40) -> None:
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline, (daemon.in_flight(), daemon.published)
        _look(daemon)


def test_a_state_that_refuses_writes_is_tried_again_while_the_loop_goes_on(world: tuple[Path, int]) -> None:
    """The database is full (SQLite's real SQLITE_FULL) when tunerd starts, and again when the
    engine crashes. The first start and the crash restart cannot be written: nothing is
    started behind the state's back, the engine is not taken for reconciled, the ticks go on,
    `tunerd status` says what is refused and why, one alert fires — and once there is room
    both go on by themselves, the alert resolved, without a restart of tunerd."""
    tmp_path, port = world
    said: list[dict[str, Any]] = []
    daemon = sim_daemon(tmp_path, port, guards=GUARDS, top=TOP, said=said)
    loop = daemon.engines[0]
    disk = FullDisk(daemon.state)
    try:
        disk.fill()
        daemon.start()
        _look(daemon, 5)
        assert daemon.in_flight() == ["main"]  # not reconciled: looked at again
        assert daemon.ticks == 5
        [trouble] = daemon.published["state_trouble"]  # type: ignore[index]
        assert (trouble["engine"], trouble["what"]) == ("main", "reconcile")
        assert "database or disk is full" in trouble["error"]
        assert _engines(port) == []
        disk.free()
        _until(daemon, lambda: loop.reconciled and not loop.supervisor.in_flight() and loop.healthy)
        _assert_after_fault(tmp_path, port, BEFORE)

        disk.fill()  # full again; the engine crashes
        os.killpg(_recorded(tmp_path), signal.SIGKILL)
        _until(daemon, lambda: daemon.state_troubles.get(("tick", "main")) is not None, 10)
        ticks = daemon.ticks
        _look(daemon, 5)
        assert daemon.ticks == ticks + 5
        assert not loop.supervisor.in_flight()  # the restart could not be begun: no half of it
        assert daemon.status_line().endswith("database or disk is full")
        disk.free()
        _until(daemon, lambda: loop.healthy and not loop.supervisor.in_flight() and not daemon.troubles())
        history = _assert_after_fault(tmp_path, port, BEFORE)
        assert (history[0]["kind"], history[0]["outcome"]) == ("restart", "succeeded")
        assert daemon.published["state_trouble"] == []  # type: ignore[index]
    finally:
        daemon.close()
    alerts = [(e["policy"], e["status"]) for e in said if e["event"] == "alert"]
    assert alerts == [("state-unwritable", "firing"), ("state-unwritable", "resolved")] * 2
    assert [e["event"] for e in said].count("state_refused") == 2  # said once each time, not at each try


def _fill(folder: Path) -> Path:
    """Write to ``folder`` until its disk is full; the file that holds the space."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        for size in (1 << 16, 512):  # then the last few KiB
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * size)
    finally:
        os.close(fd)
    return filler


def _gone(pid: int) -> bool:
    identity = read_identity(pid)
    return identity is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="tmpfs and /proc: Linux only")
def test_a_state_disk_that_fills_after_the_old_engine_stopped(world: tuple[Path, int]) -> None:
    """The state folder on a 4 MiB disk (tmpfs) that fills the moment the old engine of a
    restart has stopped: the write of the next step is refused (in WAL mode, at the COMMIT —
    a reader such as `tunerd history` holds the log open, so each write must grow it). Before,
    the connection stayed inside the failed transaction and the engine stayed down until
    tunerd was restarted, with a status that looked fresh. Now the daemon keeps ticking, its
    status (over the socket) names the stuck step and why, and once space is freed the restart
    completes on its own."""
    tmp_path, port = world
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a 4 MiB tmpfs for the state needs root (CAP_SYS_ADMIN)")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(state_dir)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    said: list[dict[str, Any]] = []
    daemon: Daemon | None = None
    stop = threading.Event()
    runner: threading.Thread | None = None
    reader: sqlite3.Connection | None = None
    filler: list[Path] = []
    try:
        (tmp_path / "engines").mkdir()
        (state_dir / "engines").symlink_to(tmp_path / "engines")  # the engine's log elsewhere
        socket = tmp_path / "run" / "tunerd.sock"
        listen: dict[str, object] = {"metrics": "127.0.0.1:0", "status": str(socket)}
        daemon = sim_daemon(tmp_path, port, guards=GUARDS, top={**TOP, "listen": listen}, said=said)
        started(daemon)
        old = _recorded(tmp_path)
        reader = sqlite3.connect(f"file:{state_dir / 'tunerd.db'}?mode=ro", uri=True, check_same_thread=False)
        reader.execute("BEGIN")
        reader.execute("SELECT COUNT(*) FROM actions").fetchone()  # a reader holds the log open

        def fill_once_stopped() -> None:
            deadline = time.monotonic() + 30
            while not _gone(old) and time.monotonic() < deadline:
                time.sleep(0.002)
            filler.append(_fill(state_dir))

        watcher = threading.Thread(target=fill_once_stopped)
        watcher.start()
        fewer = {**BEFORE, "max_num_seqs": 4}
        assert daemon.engines[0].supervisor.begin_restart(fewer, reason="fault test: the disk fills") is None
        runner = threading.Thread(target=daemon.run, args=(stop,))
        runner.start()
        watcher.join(35)
        assert filler, "the old engine never stopped"

        status: dict[str, Any] = {}
        deadline = time.monotonic() + 20
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(socket)), timeout=5) as client:
            while not status.get("state_trouble"):
                assert time.monotonic() < deadline, status
                time.sleep(0.2)
                status = client.get("http://tunerd/status").json()
            ticks = daemon.ticks
            time.sleep(1.5)
            assert daemon.ticks >= ticks + 2  # the loop goes on (a tick each 250 ms)
            status = client.get("http://tunerd/status").json()
        [engine] = status["engines"]
        assert engine["state"] in ("draining", "restarting")  # draining: stuck at `stopping`
        assert engine["stuck"] is not None, status
        assert "database or disk is full" in engine["stuck"]["error"]
        assert engine["restart"]["step"] in ("stopping", "starting", "verifying", "probation")
        assert status["state_trouble"][0]["unwritable"] is True
        if engine["restart"]["step"] == "stopping":  # the first write after the stop: nothing spawned
            assert _engines(port) == []
        filler[0].unlink()  # space again
        reader.rollback()
        deadline = time.monotonic() + 40
        while daemon.in_flight() or daemon.troubles() or not daemon.engines[0].healthy:
            assert time.monotonic() < deadline, (daemon.in_flight(), daemon.published)
            time.sleep(0.2)
        history = _assert_after_fault(tmp_path, port, fewer)
        assert (history[0]["kind"], history[0]["outcome"]) == ("tune", "succeeded")
        assert daemon.published is not None
        assert daemon.published["state_trouble"] == []
    finally:
        stop.set()
        if runner is not None:
            runner.join(60)
        if daemon is not None:
            daemon.close()
        if reader is not None:
            reader.close()
        for pid in _engines(port):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        subprocess.run(["umount", "-l", str(state_dir)], check=False)
    events = [e["event"] for e in said]
    assert events.count("state_trouble") == 1  # once, not at each try
    assert "state_trouble_over" in events
    alerts = [(e["policy"], e["status"]) for e in said if e["event"] == "alert"]
    assert alerts == [("state-unwritable", "firing"), ("state-unwritable", "resolved")]


def test_an_unexpected_error_in_a_step_pages_shows_and_the_engine_serves_on(world: tuple[Path, int]) -> None:
    """Not the state but a bug (or systemctl gone) raises inside a step of a running daemon's
    restart — the spawn of the new settings. The step fails, not the loop: the restart turns
    into its rollback, which starts last-known-good; the history says why, `tunerd status`
    shows it, a critical alert goes out, and the ticks never stopped."""
    tmp_path, port = world
    said: list[dict[str, Any]] = []
    daemon = sim_daemon(tmp_path, port, guards=GUARDS, top=TOP, said=said)
    loop = daemon.engines[0]
    try:
        started(daemon)
        runner = loop.supervisor.runner
        real = runner.start
        broke: list[object] = []

        def start(argv: Any) -> Any:
            if not broke:  # the first spawn only: the rollback's goes through
                broke.append(argv)
                raise RuntimeError("the runner broke")
            return real(argv)

        runner.start = start  # type: ignore[method-assign]
        ticks = daemon.ticks
        fewer = {**BEFORE, "max_num_seqs": 4}
        assert loop.supervisor.begin_restart(fewer, reason="fault test: a bug in a step") is None
        _until(daemon, lambda: broke and not daemon.in_flight() and loop.healthy)
        assert daemon.ticks > ticks
        history = _assert_after_fault(tmp_path, port, BEFORE)
        tune = history[0]
        assert (tune["kind"], tune["outcome"]) == ("tune", "rolled_back"), tune
        assert "starting failed: RuntimeError: the runner broke" in tune["reason"]
        [engine] = daemon.status()["engines"]
        changes = [a for a in engine["last_actions"] if a["kind"] != "notify"]
        assert (changes[0]["id"], changes[0]["outcome"]) == (tune["id"], "rolled_back")
        notes = [a["reason"] for a in engine["last_actions"] if a["kind"] == "notify"]
        assert any(note.startswith("critical firing") for note in notes), notes
        assert engine["state"] == "running"
    finally:
        daemon.close()
    alerts = [(e["severity"], e["status"]) for e in said if e["event"] == "alert"]
    assert ("critical", "firing") in alerts, said
