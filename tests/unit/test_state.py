"""The state database: versions, last-known-good, actions, intents; durable across kill -9."""

from __future__ import annotations

import datetime as dt
import json
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tunerd.state import (
    TROUBLE_MAX_S,
    HostLock,
    State,
    StateError,
    StateTrouble,
    StateUnwritable,
    retry_after,
)

SEED = {"gpu_memory_utilization": 0.92, "max_num_seqs": 8}


def test_versions_running_and_last_known_good(tmp_path: Path) -> None:
    state = State.open(tmp_path)
    first = state.add_version("llama", SEED, "initial", now=10.0)
    assert state.set_running("llama", first, pid=4242, pid_start=99.5, argv=["vllm", "serve"]) == 1
    state.promote("llama", first, startup_seconds=61.0)
    second = state.add_version("llama", {**SEED, "max_num_seqs": 6}, "tune", now=20.0)
    assert state.set_running("llama", second) == 2
    record = state.engine("llama")
    assert record is not None
    assert (record.running, record.last_known_good, record.generation) == (second, first, 2)
    assert state.version(first).startup_seconds == 61.0
    assert state.version(second).settings == {"gpu_memory_utilization": 0.92, "max_num_seqs": 6}
    assert state.engine("other") is None


def test_failed_values_are_the_knobs_that_differed(tmp_path: Path) -> None:
    state = State.open(tmp_path)
    good = state.add_version("e", SEED, "initial", now=0.0)
    state.promote("e", good)
    bad = state.add_version("e", {**SEED, "max_num_seqs": 12}, "tune", now=100.0)
    state.mark_failed(bad, now=200.0)
    assert state.failed_values("e", since=0.0) == {"max_num_seqs": [12]}
    assert state.failed_values("e", since=300.0) == {}


def test_history_contract_newest_first_and_update_in_place(tmp_path: Path) -> None:
    state = State.open(tmp_path)
    first = state.record_action(
        engine="e", kind="notify", mode="observe", outcome="proposed", reason="a", now=1_800_000_000.0
    )
    restart = state.record_action(
        engine="e",
        kind="restart",
        mode="act",
        outcome="applied",
        reason="pool saturated\nfor 10m",
        now=1_800_000_060.0,
        policy="kv-pool-saturated",
        from_settings=SEED,
        to_settings={**SEED, "max_num_seqs": 6},
        evidence={"signals": {"kv_cache_usage": 0.93}},
    )
    state.update_action(restart, "succeeded", now=1_800_000_200.0)
    history = state.history()
    assert [h["id"] for h in history] == [restart, first]
    newest = history[0]
    assert set(newest) == {
        "id",
        "time",
        "engine",
        "policy",
        "kind",
        "mode",
        "from_settings",
        "to_settings",
        "outcome",
        "reason",
        "evidence",
        "epoch",  # an extension of DESIGN §4.8's record: the time in seconds, for ordering
    }
    assert newest["time"] == "2027-01-15T08:01:00+00:00"
    assert newest["epoch"] == dt.datetime.fromisoformat(newest["time"]).timestamp()
    assert newest["outcome"] == "succeeded"
    assert newest["reason"] == "pool saturated for 10m"  # one line
    assert newest["evidence"] == {"signals": {"kv_cache_usage": 0.93}, "log_lines": []}
    assert state.history(engine="nope") == []
    assert len(state.history(limit=1)) == 1


def test_invalid_kinds_and_outcomes_refused(tmp_path: Path) -> None:
    state = State.open(tmp_path)
    with pytest.raises(ValueError, match="unknown action kind"):
        state.record_action(engine="e", kind="explode", mode="act", outcome="applied", reason="", now=0.0)
    with pytest.raises(ValueError, match="unknown outcome"):
        state.record_action(engine="e", kind="tune", mode="act", outcome="maybe", reason="", now=0.0)


def test_intents_track_an_inflight_restart(tmp_path: Path) -> None:
    state = State.open(tmp_path)
    action = state.record_action(
        engine="e", kind="restart", mode="act", outcome="applied", reason="r", now=0.0
    )
    old = state.add_version("e", SEED, "initial", now=0.0)
    new = state.add_version("e", {**SEED, "max_num_seqs": 6}, "tune", now=1.0)
    state.begin_intent("e", action, "drain", now=1.0, from_version=old, to_version=new)
    state.advance_intent("e", "stop", now=2.0)
    [intent] = state.intents()
    assert (intent.step, intent.from_version, intent.to_version, intent.updated) == ("stop", old, new, 2.0)
    state.clear_intent("e")
    assert state.intents() == []
    with pytest.raises(StateError, match="no restart in flight"):
        state.advance_intent("e", "start", now=3.0)


def test_wal_mode_and_readonly_reader(tmp_path: Path) -> None:
    writer = State.open(tmp_path)
    writer.record_action(engine="e", kind="tune", mode="advise", outcome="proposed", reason="r", now=0.0)
    mode = sqlite3.connect(tmp_path / "tunerd.db").execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"
    reader = State.open(tmp_path, readonly=True)
    assert len(reader.history()) == 1
    with pytest.raises(sqlite3.OperationalError):
        reader._db.execute("DELETE FROM actions")
    with pytest.raises(StateError, match="no state yet"):
        State.open(tmp_path / "empty", readonly=True)


def test_committed_actions_survive_kill_9(tmp_path: Path) -> None:
    """A writer SIGKILLed mid-stream: every action it committed is there, none half-written."""
    script = (
        "import sys, time\n"
        "from tunerd.state import State\n"
        f"state = State.open({str(tmp_path)!r})\n"
        "for n in range(100000):\n"
        "    state.record_action(engine='e', kind='tune', mode='act', outcome='applied', reason=str(n), now=float(n))\n"
        "    print(n, flush=True)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    seen = -1
    deadline = time.monotonic() + 20
    while seen < 50 and time.monotonic() < deadline:
        seen = int(child.stdout.readline())
    child.send_signal(signal.SIGKILL)
    child.wait()
    reasons = [int(h["reason"]) for h in State.open(tmp_path).history(limit=1_000_000)]
    assert reasons == list(range(len(reasons) - 1, -1, -1))  # no gaps, none lost before the last printed
    assert len(reasons) >= seen + 1


def test_host_lock_one_tunerd_per_host(tmp_path: Path) -> None:
    first = HostLock(tmp_path)
    first.acquire()
    script = f"from tunerd.state import HostLock\nHostLock({str(tmp_path)!r}).acquire()\n"
    other = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=30, check=False
    )
    assert other.returncode != 0
    assert "one tunerd per host" in other.stderr
    first.release()
    again = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=30, check=False
    )
    assert again.returncode == 0


def test_history_command_reads_while_daemon_is_down(tmp_path: Path) -> None:
    state = State.open(tmp_path)
    state.record_action(
        engine="llama",
        kind="tune",
        mode="act",
        outcome="succeeded",
        reason="oom",
        policy="oom",
        from_settings=SEED,
        to_settings={**SEED, "gpu_memory_utilization": 0.89},
        now=1_800_000_000.0,
    )
    state.close()
    run = [sys.executable, "-m", "tunerd", "history", "--state-dir", str(tmp_path)]
    result = subprocess.run([*run, "--json"], capture_output=True, text=True, timeout=30, check=True)
    [action] = json.loads(result.stdout)["actions"]
    assert action["to_settings"]["gpu_memory_utilization"] == 0.89
    text = subprocess.run(run, capture_output=True, text=True, timeout=30, check=True).stdout
    assert "llama tune (act) succeeded — gpu_memory_utilization 0.92→0.89" in text
    empty = subprocess.run(
        [sys.executable, "-m", "tunerd", "history", "--state-dir", str(tmp_path / "none"), "--json"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert empty.returncode == 0
    assert json.loads(empty.stdout) == {"actions": []}


def test_restart_times_and_crashes_for_the_guards(tmp_path: Path) -> None:
    state = State.open(tmp_path)
    lower = {**SEED, "gpu_memory_utilization": 0.88}
    common = {"engine": "e", "mode": "act", "reason": "r"}
    state.record_action(kind="tune", outcome="succeeded", now=10.0, **common)
    state.record_action(kind="tune", outcome="skipped", now=20.0, **common)  # never happened
    state.record_action(kind="tune", outcome="proposed", now=30.0, **common)  # advise mode
    state.record_action(
        kind="restart",
        outcome="succeeded",
        now=40.0,
        from_settings=SEED,
        evidence={"crash": {"kind": "cuda_oom"}},
        **common,
    )
    state.record_action(
        kind="restart", outcome="succeeded", now=50.0, from_settings=lower, **common
    )  # not a crash
    state.record_action(kind="rollback", outcome="failed", now=60.0, **common)
    state.record_action(kind="tune", outcome="rolled_back", now=70.0, engine="other", mode="act", reason="r")
    assert state.restart_times("e", since=0) == [10.0, 40.0, 50.0, 60.0]
    assert state.restart_times("e", since=45) == [50.0, 60.0]
    assert state.crashes("e", since=0) == [SEED]
    assert state.crashes("e", since=41) == []
    assert state.last_outcome("e", "tune", since=0) == "proposed"
    assert state.last_outcome("other", "tune", since=0) == "rolled_back"
    assert state.last_outcome("e", "hold", since=0) is None


def test_a_reader_that_comes_before_the_tables_is_told_there_is_no_state_yet(tmp_path: Path) -> None:
    """Found by a CI run of `tunerd demo`: it opened the state read-only as soon as the daemon had
    created the file, before its tables, and failed with `no such table: engines`."""
    (tmp_path / "tunerd.db").write_bytes(b"")  # what sqlite3.connect leaves before the schema
    with pytest.raises(StateError, match="no state yet"):
        State.open(tmp_path, readonly=True)


OLD_SCHEMA = """
CREATE TABLE versions (id INTEGER PRIMARY KEY, engine TEXT NOT NULL, settings TEXT NOT NULL,
    created REAL NOT NULL, source TEXT NOT NULL, startup_seconds REAL, failed_at REAL);
CREATE TABLE engines (engine TEXT PRIMARY KEY, running INTEGER, last_known_good INTEGER,
    generation INTEGER NOT NULL DEFAULT 0, held INTEGER NOT NULL DEFAULT 0,
    pinned INTEGER NOT NULL DEFAULT 0, paused TEXT, pid INTEGER, pid_start REAL, argv TEXT);
INSERT INTO versions VALUES (1, 'main', '{"max_num_seqs": 8}', 0, 'initial', 12.5, NULL);
INSERT INTO engines VALUES ('main', 1, 1, 1, 0, 0, NULL, 4242, 99, '["python3", "vllm"]');
"""


def test_a_database_from_before_commands_were_kept_is_read_and_upgraded(tmp_path: Path) -> None:
    """An older tunerd's state: a reader opens it as it is; the daemon adds the new columns and
    keeps every row."""
    (tmp_path / "state").mkdir()
    old = sqlite3.connect(tmp_path / "state" / "tunerd.db")
    old.executescript(OLD_SCHEMA)
    old.close()
    reader = State.open(tmp_path / "state", readonly=True)
    assert reader.base("main").command is None
    assert reader.engine("main").spawned_argv is None
    reader.close()
    state = State.open(tmp_path / "state")
    assert state.base("main").settings == {"max_num_seqs": 8}
    assert state.engine("main").argv == ["python3", "vllm"]
    state.set_command(1, ["vllm", "serve", "m"])
    assert state.base("main").command == ["vllm", "serve", "m"]
    state.set_running(
        "main", 1, pid=1, pid_start=2, argv=["python3", "/venv/bin/vllm"], spawned_argv=["vllm"]
    )
    assert state.engine("main").spawned_argv == ["vllm"]
    state.close()


# -- a state that refuses writes (issue 16): each failed before its fix ---------------------------


def _fill(state: State) -> None:
    """The database may not grow (SQLite's own max_page_count) and its free pages are taken:
    the next write that needs a page gets SQLite's real SQLITE_FULL."""
    db = state._db
    db.execute("CREATE TABLE IF NOT EXISTS test_filler (x BLOB)")
    pages = db.execute("PRAGMA page_count").fetchone()[0]
    db.execute(f"PRAGMA max_page_count = {pages}")
    while True:
        try:
            db.execute("INSERT INTO test_filler VALUES (zeroblob(512))")
        except sqlite3.OperationalError as error:
            if "full" not in str(error):
                raise
            return


def _free(state: State) -> None:
    state._db.execute("PRAGMA max_page_count = 1073741823")


def test_a_commit_that_fails_is_rolled_back_and_the_next_write_goes_through(tmp_path: Path) -> None:
    """SQLite refused the COMMIT (here a foreign key checked at the commit; on a full disk, the
    write-ahead log that could not grow). The connection stayed inside the transaction, so
    every later write failed — 'cannot start a transaction within a transaction' — until
    tunerd was restarted. Now the transaction is rolled back and the failure is a StateError."""
    state = State.open(tmp_path)

    def refused_at_the_commit() -> None:
        with state.transaction() as db:
            db.execute("PRAGMA defer_foreign_keys = ON")  # checked at the COMMIT, not the INSERT
            db.execute(
                "INSERT INTO intents (engine, action_id, step, started, updated) VALUES ('e', 999, 'x', 0, 0)"
            )

    with pytest.raises(StateError, match="FOREIGN KEY"):
        refused_at_the_commit()
    assert not state._db.in_transaction
    assert state.intents() == []
    state.record_action(engine="e", kind="restart", mode="act", outcome="applied", reason="r", now=1.0)
    assert len(state.history()) == 1


def test_a_full_database_is_unwritable_until_there_is_room_again(tmp_path: Path) -> None:
    state = State.open(tmp_path)
    state.record_action(engine="e", kind="restart", mode="act", outcome="applied", reason="r", now=1.0)
    commits = state.commits
    _fill(state)
    big = {"log_lines": ["x" * 200] * 40}  # more than a page: it needs new ones
    with pytest.raises(StateUnwritable, match="database or disk is full"):
        state.record_action(
            engine="e", kind="restart", mode="act", outcome="applied", reason="r", now=2.0, evidence=big
        )
    assert not state._db.in_transaction
    assert state.commits == commits  # nothing went through
    _free(state)
    state.record_action(
        engine="e", kind="restart", mode="act", outcome="applied", reason="r", now=3.0, evidence=big
    )
    assert state.commits == commits + 1
    assert len(state.history()) == 2


def test_transactions_nest_and_are_all_or_nothing(tmp_path: Path) -> None:
    """Writes that belong together (a saga's end and its history record) go in one
    transaction; one opened inside it is a savepoint."""
    state = State.open(tmp_path)

    def interrupted() -> None:
        with state.transaction():
            state.add_version("e", SEED, "initial", now=0.0)
            state.record_action(
                engine="e", kind="restart", mode="act", outcome="applied", reason="r", now=0.0
            )
            raise RuntimeError("between two writes")

    with pytest.raises(RuntimeError):
        interrupted()
    assert state.history() == []
    assert state.engine("e") is None
    with state.transaction():
        version = state.add_version("e", SEED, "initial", now=0.0)
        with pytest.raises(StateError, match="no restart in flight"):
            state.advance_intent("e", "starting", now=1.0)  # rolled back alone
        state.record_action(engine="e", kind="restart", mode="act", outcome="applied", reason="r", now=0.0)
    assert state.version(version).settings == SEED
    assert len(state.history()) == 1


def test_each_start_is_appended_to_the_history_record_of_its_action(tmp_path: Path) -> None:
    state = State.open(tmp_path)
    action = state.record_action(
        engine="e", kind="tune", mode="act", outcome="applied", reason="r", now=0.0, evidence={"crash": {}}
    )
    state.add_start(action, {"generation": 2, "pid": 10, "how": "spawned"})
    state.add_start(action, {"generation": 3, "pid": 11, "how": "spawned"})
    [record] = state.history()
    assert [start["pid"] for start in record["evidence"]["starts"]] == [10, 11]
    assert record["evidence"]["crash"] == {}  # the rest of the evidence is kept
    with pytest.raises(StateError, match="no action 99"):
        state.add_start(99, {})


def test_unfinished_actions_are_the_restarts_still_applied(tmp_path: Path) -> None:
    state = State.open(tmp_path)

    def record(kind: str, outcome: str) -> int:
        return state.record_action(engine="e", kind=kind, mode="act", outcome=outcome, reason="r", now=0.0)

    begun = record("restart", "applied")
    record("notify", "applied")  # an alert sent: final as it is
    record("tune", "succeeded")
    record("rollback", "proposed")  # a person's, waiting for tunerd
    tune = record("tune", "applied")
    assert state.unfinished_actions("e") == [begun, tune]


def test_a_refused_write_is_tried_again_later_and_later_on_the_monotonic_clock() -> None:
    trouble = StateTrouble.first("moving to starting", StateUnwritable("db: full"), now=100.0, monotonic=5.0)
    assert (trouble.attempts, trouble.unwritable, trouble.next_try) == (1, True, 5.0 + retry_after(1))
    assert not trouble.due(5.1)
    trouble.again("moving to starting", StateError("db: locked"), monotonic=6.0)
    assert (trouble.attempts, trouble.unwritable) == (2, False)
    assert trouble.next_try == 6.0 + 2 * retry_after(1)
    assert retry_after(100) == TROUBLE_MAX_S
    shown = trouble.to_dict(now=200.0, monotonic=6.0)
    assert shown["next_try"] == 200.0 + 2 * retry_after(1)
    assert shown["since"] == 100.0
