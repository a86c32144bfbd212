"""tunerd's files are its own (issue 16): the state folder it creates is 0700, and the
database (its -wal and -shm while open), the host lock, the engines' logs and their rotated
copies, the hooks' log and the notify dead-letter file are 0600 — whatever the umask, with or
without systemd's StateDirectoryMode. A folder that was there before (the operator's) keeps
its mode."""

from __future__ import annotations

import os
import socket
import stat
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tunerd.engine.process import EngineProcess, HookRun, copytruncate
from tunerd.notify.alert import Alert, fingerprint
from tunerd.notify.dispatch import DEAD_LETTER, Dispatcher
from tunerd.notify.sink import Target
from tunerd.paths import open_private, private_dir
from tunerd.state import DB_NAME, LOCK_NAME, HostLock, State


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def open_umask() -> Iterator[None]:
    """The widest umask: what a shell with ``umask 000`` would start tunerd with."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _dead_letter(state_dir: Path) -> Path:
    """An alert that cannot be delivered (a refused connection, one try): the dead-letter file."""
    target = Target("ops", "webhook", f"http://127.0.0.1:{_closed_port()}/hook")
    dispatcher = Dispatcher([target], state_dir, max_attempts=1, backoff_base=0.01, timeout=2.0).start()
    dispatcher.submit(
        Alert(
            severity="warning",
            status="firing",
            title="kv-pool-saturated",
            summary="KV pool 97 % used",
            engine="main",
            host="box",
            time=time.time(),
            policy="kv-pool-saturated",
            fingerprint=fingerprint("main", "kv-pool-saturated"),
        )
    )
    path = state_dir / DEAD_LETTER
    deadline = time.monotonic() + 10
    while not (path.exists() and path.stat().st_size) and time.monotonic() < deadline:
        time.sleep(0.02)
    dispatcher.close()
    return path


@pytest.mark.usefixtures("open_umask")
def test_state_files_are_private_whatever_the_umask(tmp_path: Path) -> None:
    state_dir = tmp_path / "var" / "tunerd"  # neither folder exists yet: tunerd makes both
    lock = HostLock(state_dir)
    lock.acquire()
    state = State.open(state_dir)
    try:
        state.add_version("main", {"max_num_seqs": 8}, "initial", now=0.0)  # a write: -wal, -shm
        database = state_dir / DB_NAME
        files = [database, Path(f"{database}-wal"), Path(f"{database}-shm"), state_dir / LOCK_NAME]
        assert {path.name: _mode(path) for path in files} == {path.name: 0o600 for path in files}

        log = state_dir / "engines" / "main.log"
        for _ in range(2):  # the second spawn rotates the first log to main.log.1
            engine = EngineProcess.spawn([sys.executable, "-c", "print('serving')"], log)
            assert engine.wait_exit(20)
        assert copytruncate(log, 0)  # a copy aside while the engine runs: main.log.1 again
        hooks = state_dir / "engines" / "main.hooks.log"
        hook = HookRun(
            "pre_stop", [sys.executable, "-c", "print('out of rotation')"], timeout=20, log_path=hooks, env={}
        )
        deadline = time.monotonic() + 20
        while hook.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert hook.result is not None
        assert hook.result.ok
        dead = _dead_letter(state_dir)
        assert dead.stat().st_size > 0

        created = [tmp_path / "var", state_dir, state_dir / "engines"]
        assert {str(path): _mode(path) for path in created} == {str(path): 0o700 for path in created}
        logs = [log, log.with_name("main.log.1"), log.with_name("main.log.2"), hooks, dead]
        assert {path.name: _mode(path) for path in logs} == {path.name: 0o600 for path in logs}
    finally:
        state.close()
        lock.release()


@pytest.mark.usefixtures("open_umask")
def test_a_folder_that_was_there_keeps_its_mode(tmp_path: Path) -> None:
    """state_dir: a folder the operator made (their home, /var/lib): tunerd never changes its
    mode; what tunerd creates in it is private all the same."""
    operator = tmp_path / "operator"
    operator.mkdir()
    operator.chmod(0o755)
    State.open(operator).close()
    assert _mode(operator) == 0o755
    assert _mode(operator / DB_NAME) == 0o600
    assert private_dir(operator / "engines" / "deep") == operator / "engines" / "deep"
    assert (_mode(operator), _mode(operator / "engines"), _mode(operator / "engines" / "deep")) == (
        0o755,
        0o700,
        0o700,
    )


def test_open_private_keeps_an_existing_file_and_appends(tmp_path: Path) -> None:
    path = tmp_path / "log"
    with open_private(path, "a", encoding="utf-8") as out:
        out.write("one\n")
    path.chmod(0o640)  # the operator's choice for a file that exists: kept
    with open_private(path, "a", encoding="utf-8") as out:
        out.write("two\n")
    assert path.read_text() == "one\ntwo\n"
    assert _mode(path) == 0o640
    with pytest.raises(NotADirectoryError):
        private_dir(path / "below")
