"""`tunerd pin` / `tunerd resume` as a person runs them, against a real state database."""

from __future__ import annotations

from pathlib import Path

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
