"""`tunerd pin` / `tunerd resume` as a person runs them, against a real state database."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.integration.cli import TUNERD
from tests.integration.cli import run_tunerd as _tunerd
from tunerd.engine.guards import EngineFacts, GuardConfig, may_change
from tunerd.state import State


def _facts(state_dir: Path) -> EngineFacts:
    state = State.open(state_dir, readonly=True)
    record = state.engine("main")
    state.close()
    assert record is not None
    return EngineFacts(restarts=[], held=record.held, pinned=record.pinned, paused=record.paused)


def test_pin_then_resume(tmp_path: Path) -> None:
    state = State.open(tmp_path)
    version = state.add_version("main", {"max_num_seqs": 8}, "initial", now=0.0)
    state.set_running("main", version)
    state.set_flags("main", held=True, paused="argv changed by a person")
    state.close()

    pinned = _tunerd("pin", "main", "--state-dir", str(tmp_path), "--reason", "launch week")
    assert pinned.returncode == 0, pinned.stderr
    assert "main: pinned" in pinned.stdout
    assert (
        f"(no tunerd answered on {tmp_path / 'tunerd.sock'}: it acts on this when it next runs)"
        in pinned.stdout
    )
    refusal = may_change(_facts(tmp_path), GuardConfig(), now=0.0)
    assert refusal is not None
    assert "pinned" in refusal.reason

    resumed = _tunerd("resume", "main", "--state-dir", str(tmp_path))
    assert resumed.returncode == 0, resumed.stderr
    assert may_change(_facts(tmp_path), GuardConfig(), now=0.0) is None  # pin, hold and pause cleared

    history = _tunerd("history", "--state-dir", str(tmp_path))
    assert "main resume (act) succeeded" in history.stdout
    assert "by hand: launch week" in history.stdout


def test_unknown_engine_and_missing_state_are_clear_errors(tmp_path: Path) -> None:
    missing = _tunerd("pin", "main", "--state-dir", str(tmp_path / "nowhere"))
    assert missing.returncode == 2
    assert "no state in" in missing.stderr
    State.open(tmp_path).close()
    unknown = _tunerd("resume", "mian", "--state-dir", str(tmp_path))
    assert unknown.returncode == 2
    assert "no engine 'mian'" in unknown.stderr


def _as_another_user() -> list[str] | None:
    """The command prefix that runs a command as a user who is not root (``setpriv`` to
    ``nobody`` when the suite runs as root); None when there is no such way here."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        return None
    if setpriv is None:
        return None
    return [setpriv, f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups"]


def test_a_user_who_cannot_write_the_state_gets_one_line_not_a_traceback() -> None:
    """`tunerd pin`/`resume`/`rollback` by a user the state is not writable for (or not even
    readable: tunerd makes it 0700): one line saying so, exit 2."""
    prefix = _as_another_user()
    if prefix is None:
        pytest.skip("no way to run a command as a user other than root here (setpriv, nobody)")
    # outside pytest's own temporary folder, which only its owner may enter
    top = Path(tempfile.mkdtemp(prefix="tunerd-perm-"))
    try:
        top.chmod(0o755)
        shared = top / "shared"  # an older tunerd's state: the folder 0755, the database 0644
        shared.mkdir(mode=0o755)
        shared.chmod(0o755)
        state = State.open(shared)
        version = state.add_version("main", {"max_num_seqs": 8}, "initial", now=0.0)
        state.set_running("main", version)
        state.close()
        (shared / "tunerd.db").chmod(0o644)
        shared.chmod(0o555)  # read-only for everyone (root still writes: hence another user)
        private = top / "private"  # tunerd's own state now: 0700, nobody else gets in
        State.open(private).close()
        if prefix == [] and os.access(shared, os.W_OK):
            pytest.skip("this user can write a read-only folder")

        def run(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [*prefix, *TUNERD, *args, "--socket", str(top / "none.sock")],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
                cwd=top,
                env={**os.environ, "HOME": str(top)},
            )

        for args, says in (
            (("pin", "main", "--state-dir", str(shared)), "cannot change the state in"),
            (("resume", "main", "--state-dir", str(shared)), "cannot change the state in"),
            (("rollback", "main", "--state-dir", str(shared)), "cannot change the state in"),
            (("pin", "main", "--state-dir", str(private)), "cannot read the state in"),
            (("resume", "main", "--state-dir", str(private)), "cannot read the state in"),
        ):
            done = run(*args)
            assert done.returncode == 2, (args, done.stdout, done.stderr)
            assert "Traceback" not in done.stderr, done.stderr
            [line] = done.stderr.splitlines()
            assert line.startswith(f"tunerd {args[0]}: error: {says}"), line
            assert "permission" in line.lower() or "readonly" in line.lower(), line
    finally:
        for folder in top.rglob("*"):
            if folder.is_dir():
                folder.chmod(0o755)
        shutil.rmtree(top)
