"""tunerd's durable state: settings versions, last-known-good, actions and restart intents.

One SQLite file in ``state_dir`` (``tunerd.db``) in WAL mode with ``synchronous=FULL``: a
committed write survives a power cut or a ``kill -9`` of tunerd at any point, and readers
(``tunerd history``, which opens the file read-only) never block the daemon. One daemon per
host holds :class:`HostLock` on ``state_dir/tunerd.lock``. Times are passed in (the daemon's
clock); nothing here reads a clock.

Tables:

- ``versions``: every settings set an engine ran or was meant to run, where it came from
  (``initial``, ``tune``, ``adopt``, ``rollback``, ``pin``), how long it took to start, and
  when it failed; an ``initial`` version also keeps the config's ``command`` it came with, so
  a person's edit of the config is found by comparing config with config;
- ``engines``: per engine, the running version, the last-known-good one, the generation
  (which start of the engine), the hold / pin / pause flags and the adopted process: PID,
  start time, the argv tunerd passed to exec (``spawned_argv``) and the argv ``/proc`` shows
  (``argv``: a console script's shows its interpreter and path in front).

A database written by an older tunerd gains the new columns when it is opened.
- ``actions``: the history records of DESIGN §4.8, updated in place as a restart moves from
  ``applied`` to ``succeeded``/``failed``/``rolled_back``;
- ``observations``: per engine process and settings version, the bills the box showed
  (:class:`tunerd.planner.calibration.Observation`: the start-up figures, the engine's first
  and highest memory, the neighbours at their most, an OOM's need, the pool predicted for
  it), the newest :data:`OBSERVATIONS_KEPT` per engine: what calibrates the planner;
- ``intents``: per engine, the saga in flight — its kind (first start, restart, rollback,
  recovery), the step it has reached, the versions and the history record it moves, and a
  note (why a rollback began) — so a restarted tunerd can finish or undo it.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import fcntl
import json
import os
import sqlite3
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunerd.paths import private_dir, private_fd

__all__ = [
    "ACTION_KINDS",
    "OUTCOMES",
    "EngineRecord",
    "HostLock",
    "Intent",
    "State",
    "StateError",
    "StateTrouble",
    "StateUnwritable",
    "Version",
]

DB_NAME = "tunerd.db"
#: observations kept per engine (older ones are dropped as new ones are written)
OBSERVATIONS_KEPT = 50
#: incidents kept (each holds minutes of samples, compressed, at most 4 MiB) and for how long
INCIDENTS_KEPT = 200
INCIDENT_RETENTION_S = 30 * 86400.0
LOCK_NAME = "tunerd.lock"
ACTION_KINDS = ("tune", "restart", "rollback", "hold", "resume", "pin", "adopt", "notify", "gate")
OUTCOMES = ("proposed", "applied", "succeeded", "failed", "rolled_back", "skipped")
SOURCES = ("initial", "tune", "adopt", "rollback", "pin")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS versions (
    id INTEGER PRIMARY KEY,
    engine TEXT NOT NULL,
    settings TEXT NOT NULL,
    created REAL NOT NULL,
    source TEXT NOT NULL,
    startup_seconds REAL,
    failed_at REAL,
    command TEXT
);
CREATE TABLE IF NOT EXISTS engines (
    engine TEXT PRIMARY KEY,
    running INTEGER REFERENCES versions(id),
    last_known_good INTEGER REFERENCES versions(id),
    generation INTEGER NOT NULL DEFAULT 0,
    held INTEGER NOT NULL DEFAULT 0,
    pinned INTEGER NOT NULL DEFAULT 0,
    paused TEXT,
    pid INTEGER,
    pid_start REAL,
    argv TEXT,
    spawned_argv TEXT
);
CREATE TABLE IF NOT EXISTS actions (
    id INTEGER PRIMARY KEY,
    time REAL NOT NULL,
    engine TEXT NOT NULL,
    policy TEXT,
    kind TEXT NOT NULL,
    mode TEXT NOT NULL,
    from_settings TEXT,
    to_settings TEXT,
    outcome TEXT NOT NULL,
    reason TEXT NOT NULL,
    evidence TEXT NOT NULL,
    updated REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS actions_by_engine ON actions(engine, id);
CREATE TABLE IF NOT EXISTS observations (
    engine TEXT NOT NULL,
    version INTEGER NOT NULL,
    pid INTEGER NOT NULL,
    data TEXT NOT NULL,
    updated REAL NOT NULL,
    PRIMARY KEY (engine, version, pid)
);
CREATE TABLE IF NOT EXISTS intents (
    engine TEXT PRIMARY KEY,
    action_id INTEGER NOT NULL REFERENCES actions(id),
    step TEXT NOT NULL,
    from_version INTEGER REFERENCES versions(id),
    to_version INTEGER REFERENCES versions(id),
    started REAL NOT NULL,
    updated REAL NOT NULL,
    kind TEXT NOT NULL DEFAULT 'restart',
    note TEXT
);
CREATE TABLE IF NOT EXISTS incidents (
    id INTEGER PRIMARY KEY,
    engine TEXT NOT NULL,
    kind TEXT NOT NULL,
    at REAL NOT NULL,
    summary TEXT NOT NULL,
    action_ids TEXT NOT NULL,
    detail TEXT NOT NULL,
    recording BLOB NOT NULL,
    complete INTEGER NOT NULL DEFAULT 0,
    updated REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS incidents_by_engine ON incidents(engine, id);
"""
#: columns added since the first release: (table, column, type), added to older databases
_ADDED_COLUMNS = (
    ("versions", "command", "TEXT"),
    ("engines", "spawned_argv", "TEXT"),
    ("intents", "kind", "TEXT NOT NULL DEFAULT 'restart'"),
    ("intents", "note", "TEXT"),
)


class StateError(Exception):
    """The state cannot be opened or used; the message says why in one line."""


class StateUnwritable(StateError):
    """The state takes no writes now: the disk is full, the file or its folder is read-only
    or not tunerd's, or the disk failed the write. It may pass (space is freed): what failed is
    tried again."""


#: SQLite's primary result codes that mean the file takes no writes (full, read-only, not ours)
_UNWRITABLE_SQLITE = frozenset(
    (
        sqlite3.SQLITE_FULL,
        sqlite3.SQLITE_READONLY,
        sqlite3.SQLITE_PERM,
        sqlite3.SQLITE_CANTOPEN,
        sqlite3.SQLITE_IOERR,
    )
)
_UNWRITABLE_ERRNO = frozenset((errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO))


def state_error(error: sqlite3.Error | OSError, where: object) -> StateError:
    """``error`` as a :class:`StateError` that says where in one line:
    :class:`StateUnwritable` when the disk is full, the file read-only or not ours."""
    if isinstance(error, sqlite3.Error):
        code = getattr(error, "sqlite_errorcode", None)
        unwritable = code is not None and code & 0xFF in _UNWRITABLE_SQLITE
        text = str(error)
    else:
        unwritable = error.errno in _UNWRITABLE_ERRNO
        text = error.strerror or str(error)
    kind = StateUnwritable if unwritable else StateError
    return kind(f"{where}: {text}")


TROUBLE_FIRST_S = 0.5  # a refused write is tried again this soon, then twice as late each time
TROUBLE_MAX_S = 15.0  # … at most this late: once space is freed, tunerd goes on within it


def retry_after(attempts: int) -> float:
    """Seconds until a write the state refused ``attempts`` times in a row is tried again."""
    return min(TROUBLE_MAX_S, TROUBLE_FIRST_S * 2.0 ** max(0, attempts - 1))


@dataclass
class StateTrouble:
    """Writes the state refused, tried again with backoff until one goes through: what they
    were for, why the last failed, since when (the daemon clock's ``now()``), how many tries,
    and when the next is (on its ``monotonic()``: a clock step neither hurries nor stalls it)."""

    what: str
    error: str
    unwritable: bool
    since: float
    attempts: int
    next_try: float

    @classmethod
    def first(cls, what: str, error: StateError, now: float, monotonic: float) -> StateTrouble:
        unwritable = isinstance(error, StateUnwritable)
        return cls(what, str(error), unwritable, now, 1, monotonic + retry_after(1))

    def again(self, what: str, error: StateError, monotonic: float) -> None:
        """The retry failed too: later still."""
        self.what, self.error, self.unwritable = what, str(error), isinstance(error, StateUnwritable)
        self.attempts += 1
        self.next_try = monotonic + retry_after(self.attempts)

    def due(self, monotonic: float) -> bool:
        return monotonic >= self.next_try

    def to_dict(self, now: float, monotonic: float) -> dict[str, Any]:
        """For ``tunerd status``: ``next_try`` on the clock's ``now()``."""
        return {
            "what": self.what,
            "error": self.error,
            "unwritable": self.unwritable,
            "since": self.since,
            "attempts": self.attempts,
            "next_try": now + max(0.0, self.next_try - monotonic),
        }


@dataclass(frozen=True)
class Version:
    id: int
    engine: str
    settings: dict[str, Any]
    created: float
    source: str
    startup_seconds: float | None
    failed_at: float | None
    command: list[str] | None = None  # an initial version's: the config's command it came with


@dataclass(frozen=True)
class EngineRecord:
    engine: str
    running: int | None
    last_known_good: int | None
    generation: int
    held: bool
    pinned: bool
    paused: str | None
    pid: int | None
    pid_start: float | None
    argv: list[str] | None  # as /proc/PID/cmdline showed it
    spawned_argv: list[str] | None = None  # as tunerd passed it to exec


@dataclass(frozen=True)
class Intent:
    engine: str
    action_id: int
    step: str
    from_version: int | None
    to_version: int | None
    started: float
    updated: float
    kind: str = "restart"  # first_start | restart | rollback | recover (tunerd.outcomes.SagaKind)
    note: str | None = None


class HostLock:
    """One tunerd per host: an exclusive ``flock`` on ``state_dir/tunerd.lock``, released by
    the kernel when the process dies (so a ``kill -9`` never leaves it stuck)."""

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.path = Path(state_dir) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        try:
            private_dir(self.path.parent)
            fd = private_fd(self.path, os.O_RDWR)
        except OSError as error:
            raise StateError(f"{self.path}: {error.strerror or error}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise StateError(f"{self.path} is held by tunerd pid {holder}: one tunerd per host") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def _iso(timestamp: float) -> str:
    return dt.datetime.fromtimestamp(timestamp, tz=dt.UTC).isoformat(timespec="seconds")


class State:
    """The state database. ``readonly`` opens an existing file for reading only."""

    def __init__(self, path: str | os.PathLike[str], readonly: bool = False) -> None:
        self.path = Path(path)
        self._depth = 0  # transactions open: 1 the outermost, more its savepoints
        self.commits = 0  # transactions committed: a caller sees whether its writes went through
        try:
            if readonly:
                if not self.path.exists():
                    raise StateError(f"{self.path}: no state yet")
                self._db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, isolation_level=None)
                if self._db.execute("SELECT 1 FROM sqlite_master WHERE name = 'engines'").fetchone() is None:
                    self._db.close()  # the daemon has created the file, not yet its tables
                    raise StateError(f"{self.path}: no state yet")
            else:
                # created 0600 in a 0700 folder before SQLite opens it: its -wal and -shm files
                # take the database's mode
                private_dir(self.path.parent)
                os.close(private_fd(self.path, os.O_RDONLY))
                # the daemon opens it at start-up and its loop thread uses it from then on
                # (tunerd.scheduler); never two threads at once, so sqlite3's check is relaxed
                self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA synchronous=FULL")
                self._db.executescript(_SCHEMA)
                self._add_columns()
            self._db.execute("PRAGMA foreign_keys=ON")
            self._db.row_factory = sqlite3.Row
        except sqlite3.Error as error:
            raise StateError(f"{self.path}: {error}") from None
        except OSError as error:  # the folder or the file is not ours to read or write
            raise StateError(f"{self.path}: {error.strerror or error}") from None

    def _add_columns(self) -> None:
        """Columns a database written by an older tunerd lacks (SQLite adds them in place)."""
        for table, column, kind in _ADDED_COLUMNS:
            have = {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}
            if column not in have:
                self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")

    @classmethod
    def open(cls, state_dir: str | os.PathLike[str], readonly: bool = False) -> State:
        return cls(Path(state_dir) / DB_NAME, readonly=readonly)

    def close(self) -> None:
        self._db.close()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """All or nothing: ``BEGIN IMMEDIATE`` … ``COMMIT``, rolled back on an exception.

        One opened inside another is a savepoint of it: its writes commit with the outer one,
        or roll back alone when it raises. SQLite's failures — a full disk at the ``COMMIT``
        (where a write-ahead log grows) included — are rolled back and raised as
        :class:`StateError` (:class:`StateUnwritable` for a full disk, a read-only file…):
        the connection is never left inside a transaction, so the next write can succeed.
        What belongs together goes in one; what must follow only a durable write (a log line,
        a callback) follows the outermost ``with`` block."""
        if self._depth:
            yield from self._savepoint()
            return
        try:
            self._db.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as error:
            raise state_error(error, self.path) from error
        self._depth = 1
        try:
            yield self._db
            self._db.execute("COMMIT")
        except BaseException as error:
            self._rollback()
            if isinstance(error, sqlite3.Error):
                raise state_error(error, self.path) from error
            raise
        finally:
            self._depth = 0
        self.commits += 1

    def _savepoint(self) -> Iterator[sqlite3.Connection]:
        name = f"tunerd_{self._depth}"
        try:
            self._db.execute(f"SAVEPOINT {name}")
        except sqlite3.Error as error:
            raise state_error(error, self.path) from error
        self._depth += 1
        try:
            yield self._db
            self._db.execute(f"RELEASE {name}")
        except BaseException as error:
            if self._db.in_transaction:  # SQLite may have rolled the whole transaction back
                with contextlib.suppress(sqlite3.Error):
                    self._db.execute(f"ROLLBACK TO {name}")
                    self._db.execute(f"RELEASE {name}")
            if isinstance(error, sqlite3.Error):
                raise state_error(error, self.path) from error
            raise
        finally:
            self._depth -= 1

    def _rollback(self) -> None:
        if self._db.in_transaction:  # after some failures SQLite has rolled back already
            with contextlib.suppress(sqlite3.Error):
                self._db.execute("ROLLBACK")

    def _read(self, sql: str, parameters: tuple[Any, ...] = ()) -> sqlite3.Cursor:
        """A query; SQLite's failure as a :class:`StateError`."""
        try:
            return self._db.execute(sql, parameters)
        except sqlite3.Error as error:
            raise state_error(error, self.path) from error

    # -- settings versions and engines ---------------------------------------------------
    def add_version(
        self,
        engine: str,
        settings: Mapping[str, Any],
        source: str,
        now: float,
        command: list[str] | None = None,
    ) -> int:
        """A new settings version; ``command`` is the config's, for ``initial`` versions."""
        if source not in SOURCES:
            raise ValueError(f"unknown version source '{source}'")
        with self.transaction() as db:
            cursor = db.execute(
                "INSERT INTO versions (engine, settings, created, source, command) VALUES (?, ?, ?, ?, ?)",
                (
                    engine,
                    json.dumps(dict(settings), sort_keys=True),
                    now,
                    source,
                    None if command is None else json.dumps(list(command)),
                ),
            )
            db.execute("INSERT OR IGNORE INTO engines (engine) VALUES (?)", (engine,))
            return int(cursor.lastrowid or 0)

    def version(self, version_id: int) -> Version:
        row = self._read("SELECT * FROM versions WHERE id = ?", (version_id,)).fetchone()
        if row is None:
            raise StateError(f"no settings version {version_id}")
        return _version(row)

    def base(self, engine: str) -> Version | None:
        """What the config last said: the engine's newest ``initial`` version, its settings and
        command (written when tunerd first started the engine, and again each time a person
        changed the config)."""
        row = self._read(
            "SELECT * FROM versions WHERE engine = ? AND source = 'initial' ORDER BY id DESC LIMIT 1",
            (engine,),
        ).fetchone()
        return None if row is None else _version(row)

    def pending_base(self, engine: str) -> Version | None:
        """A base a person wrote in the config that the engine does not run yet (mode observe
        or advise recorded it without restarting a healthy engine): newer than the running
        version and never failed. None when there is none."""
        record = self.engine(engine)
        base = self.base(engine)
        if record is None or base is None or record.running is None:
            return None
        return base if base.id > record.running and base.failed_at is None else None

    def base_settings(self, engine: str) -> dict[str, Any] | None:
        base = self.base(engine)
        return None if base is None else base.settings

    def set_command(self, version_id: int, command: list[str]) -> None:
        """Record the config's command beside a version written before tunerd kept it."""
        with self.transaction() as db:
            db.execute(
                "UPDATE versions SET command = ? WHERE id = ?", (json.dumps(list(command)), version_id)
            )

    def engine(self, engine: str) -> EngineRecord | None:
        row = self._read("SELECT * FROM engines WHERE engine = ?", (engine,)).fetchone()
        if row is None:
            return None
        return EngineRecord(
            row["engine"],
            row["running"],
            row["last_known_good"],
            row["generation"],
            bool(row["held"]),
            bool(row["pinned"]),
            row["paused"],
            row["pid"],
            row["pid_start"],
            json.loads(row["argv"]) if row["argv"] else None,
            _json_column(row, "spawned_argv"),
        )

    def set_running(
        self,
        engine: str,
        version_id: int,
        *,
        pid: int | None = None,
        pid_start: float | None = None,
        argv: list[str] | None = None,
        spawned_argv: list[str] | None = None,
    ) -> int:
        """A new start of the engine with ``version_id``; returns its generation. ``argv`` is
        what /proc shows, ``spawned_argv`` what tunerd passed to exec (None: not tunerd's)."""
        with self.transaction() as db:
            db.execute("INSERT OR IGNORE INTO engines (engine) VALUES (?)", (engine,))
            db.execute(
                "UPDATE engines SET running = ?, generation = generation + 1, pid = ?, pid_start = ?, "
                "argv = ?, spawned_argv = ? WHERE engine = ?",
                (version_id, pid, pid_start, _dump_list(argv), _dump_list(spawned_argv), engine),
            )
            row = db.execute("SELECT generation FROM engines WHERE engine = ?", (engine,)).fetchone()
            return int(row["generation"])

    def promote(self, engine: str, version_id: int, startup_seconds: float | None = None) -> None:
        """``version_id`` passed probation: it is the last-known-good now."""
        with self.transaction() as db:
            db.execute("UPDATE engines SET last_known_good = ? WHERE engine = ?", (version_id, engine))
            if startup_seconds is not None:
                db.execute(
                    "UPDATE versions SET startup_seconds = ? WHERE id = ?", (startup_seconds, version_id)
                )

    def mark_failed(self, version_id: int, now: float) -> None:
        with self.transaction() as db:
            db.execute("UPDATE versions SET failed_at = ? WHERE id = ?", (now, version_id))

    def failed_values(self, engine: str, since: float) -> dict[str, list[Any]]:
        """Knob values of versions that failed since ``since`` and differ from the
        last-known-good: never stepped up to again (DESIGN §4.9's 7-day rule)."""
        record = self.engine(engine)
        good = self.version(record.last_known_good).settings if record and record.last_known_good else {}
        failed: dict[str, list[Any]] = {}
        rows = self._read(
            "SELECT settings FROM versions WHERE engine = ? AND failed_at IS NOT NULL AND failed_at >= ?",
            (engine, since),
        ).fetchall()
        for row in rows:
            for knob, value in json.loads(row["settings"]).items():
                if good.get(knob) != value and value not in failed.setdefault(knob, []):
                    failed[knob].append(value)
        return {knob: values for knob, values in failed.items() if values}

    def set_flags(
        self,
        engine: str,
        *,
        held: bool | None = None,
        pinned: bool | None = None,
        paused: str | bool | None = False,
    ) -> None:
        """Set hold / pin; ``paused`` is a reason (None clears it; False leaves it)."""
        with self.transaction() as db:
            db.execute("INSERT OR IGNORE INTO engines (engine) VALUES (?)", (engine,))
            if held is not None:
                db.execute("UPDATE engines SET held = ? WHERE engine = ?", (int(held), engine))
            if pinned is not None:
                db.execute("UPDATE engines SET pinned = ? WHERE engine = ?", (int(pinned), engine))
            if paused is not False:
                db.execute("UPDATE engines SET paused = ? WHERE engine = ?", (paused, engine))

    # -- actions ---------------------------------------------------------------------------
    def record_action(
        self,
        *,
        engine: str,
        kind: str,
        mode: str,
        outcome: str,
        reason: str,
        now: float,
        policy: str | None = None,
        from_settings: Mapping[str, Any] | None = None,
        to_settings: Mapping[str, Any] | None = None,
        evidence: Mapping[str, Any] | None = None,
    ) -> int:
        if kind not in ACTION_KINDS:
            raise ValueError(f"unknown action kind '{kind}'")
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown outcome '{outcome}'")
        body = {"signals": {}, "log_lines": [], **dict(evidence or {})}
        with self.transaction() as db:
            cursor = db.execute(
                "INSERT INTO actions (time, engine, policy, kind, mode, from_settings, to_settings, outcome, "
                "reason, evidence, updated) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    now,
                    engine,
                    policy,
                    kind,
                    mode,
                    _dump(from_settings),
                    _dump(to_settings),
                    outcome,
                    " ".join(reason.split()),
                    json.dumps(body, sort_keys=True, default=str),
                    now,
                ),
            )
            return int(cursor.lastrowid or 0)

    def update_action(self, action_id: int, outcome: str, now: float, reason: str | None = None) -> None:
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown outcome '{outcome}'")
        with self.transaction() as db:
            if reason is None:
                db.execute(
                    "UPDATE actions SET outcome = ?, updated = ? WHERE id = ?", (outcome, now, action_id)
                )
            else:
                db.execute(
                    "UPDATE actions SET outcome = ?, reason = ?, updated = ? WHERE id = ?",
                    (outcome, " ".join(reason.split()), now, action_id),
                )

    def note_action(self, action_id: int, note: str) -> None:
        """Append ``note`` to an action's reason (its outcome is left as it is)."""
        with self.transaction() as db:
            db.execute("UPDATE actions SET reason = reason || '; ' || ? WHERE id = ?", (note, action_id))

    def add_start(self, action_id: int, start: Mapping[str, Any]) -> None:
        """One start of the engine made for an action (its generation, PID, version, when and
        how): appended to the action's ``evidence.starts``, so every start is in history with
        the action it was for — a rollback's, a resumed one's after tunerd restarted."""
        with self.transaction() as db:
            row = db.execute("SELECT evidence FROM actions WHERE id = ?", (action_id,)).fetchone()
            if row is None:
                raise StateError(f"{self.path}: no action {action_id} to record a start for")
            evidence = json.loads(row["evidence"])
            evidence["starts"] = [*evidence.get("starts", []), dict(start)]
            db.execute(
                "UPDATE actions SET evidence = ? WHERE id = ?",
                (json.dumps(evidence, sort_keys=True, default=str), action_id),
            )

    def save_observation(
        self, engine: str, version: int, pid: int, data: Mapping[str, Any], now: float
    ) -> None:
        """Write (or replace) what one engine process at one version showed; the oldest past
        :data:`OBSERVATIONS_KEPT` of the engine's go."""
        with self.transaction() as db:
            db.execute(
                "INSERT OR REPLACE INTO observations (engine, version, pid, data, updated) "
                "VALUES (?, ?, ?, ?, ?)",
                (engine, version, pid, json.dumps(dict(data), sort_keys=True, default=str), now),
            )
            db.execute(
                "DELETE FROM observations WHERE engine = ? AND rowid NOT IN (SELECT rowid FROM observations "
                "WHERE engine = ? ORDER BY updated DESC, rowid DESC LIMIT ?)",
                (engine, engine, OBSERVATIONS_KEPT),
            )

    def observations(self, engine: str, limit: int = OBSERVATIONS_KEPT) -> list[dict[str, Any]]:
        """The engine's observations, the latest written first (a record that does not read as
        JSON is skipped)."""
        rows = self._read(
            "SELECT data FROM observations WHERE engine = ? ORDER BY updated DESC, rowid DESC LIMIT ?",
            (engine, limit),
        ).fetchall()
        found = []
        for row in rows:
            with contextlib.suppress(ValueError):
                data = json.loads(row["data"])
                if isinstance(data, dict):
                    found.append(data)
        return found

    def history(self, engine: str | None = None, limit: int = 50) -> list[dict[str, Any]]:
        """DESIGN §4.8's history records, newest first."""
        query = (
            "SELECT * FROM actions" + (" WHERE engine = ?" if engine else "") + " ORDER BY id DESC LIMIT ?"
        )
        rows = self._read(query, ((engine, limit) if engine else (limit,))).fetchall()
        return [_action(row) for row in rows]

    def history_after(self, engine: str, action_id: int) -> list[dict[str, Any]]:
        """The engine's history records newer than ``action_id``, oldest first."""
        rows = self._read(
            "SELECT * FROM actions WHERE engine = ? AND id > ? ORDER BY id LIMIT 100", (engine, action_id)
        ).fetchall()
        return [_action(row) for row in rows]

    def action(self, action_id: int) -> dict[str, Any] | None:
        """One history record by its id."""
        row = self._read("SELECT * FROM actions WHERE id = ?", (action_id,)).fetchone()
        return None if row is None else _action(row)

    # -- incidents (docs/incidents.md) ------------------------------------------------------
    def add_incident(
        self,
        *,
        engine: str,
        kind: str,
        at: float,
        summary: str,
        detail: Mapping[str, Any],
        recording: bytes,
        now: float,
        action_ids: Sequence[int] = (),
        keep: int = INCIDENTS_KEPT,
        retention: float = INCIDENT_RETENTION_S,
    ) -> int:
        """Write an incident (its recording compressed by the caller) in one transaction, and
        drop the oldest past ``keep`` or older than ``retention``."""
        with self.transaction() as db:
            cursor = db.execute(
                "INSERT INTO incidents (engine, kind, at, summary, action_ids, detail, recording, complete, "
                "updated) VALUES (?, ?, ?, ?, ?, ?, ?, 0, ?)",
                (
                    engine,
                    kind,
                    at,
                    summary,
                    json.dumps(list(action_ids)),
                    json.dumps(detail, sort_keys=True, default=str),
                    recording,
                    now,
                ),
            )
            db.execute("DELETE FROM incidents WHERE at < ?", (now - retention,))
            db.execute(
                "DELETE FROM incidents WHERE id NOT IN (SELECT id FROM incidents ORDER BY id DESC LIMIT ?)",
                (keep,),
            )
            return int(cursor.lastrowid or 0)

    def update_incident(
        self,
        incident_id: int,
        now: float,
        *,
        action_ids: Sequence[int] | None = None,
        detail: Mapping[str, Any] | None = None,
        recording: bytes | None = None,
        complete: bool | None = None,
        summary: str | None = None,
    ) -> None:
        sets: list[str] = ["updated = ?"]
        values: list[Any] = [now]
        for column, value in (
            ("action_ids", None if action_ids is None else json.dumps(list(action_ids))),
            ("detail", None if detail is None else json.dumps(detail, sort_keys=True, default=str)),
            ("recording", recording),
            ("complete", None if complete is None else int(complete)),
            ("summary", summary),
        ):
            if value is not None:
                sets.append(f"{column} = ?")
                values.append(value)
        with self.transaction() as db:
            db.execute(f"UPDATE incidents SET {', '.join(sets)} WHERE id = ?", (*values, incident_id))

    def incidents(self, engine: str | None = None, limit: int = 50) -> list[dict[str, Any]]:
        """Incidents newest first, without their recordings."""
        where = " WHERE engine = ?" if engine else ""
        rows = self._read(
            "SELECT id, engine, kind, at, summary, action_ids, complete FROM incidents"
            + where
            + " ORDER BY id DESC LIMIT ?",
            ((engine, limit) if engine else (limit,)),
        ).fetchall()
        return [_incident(row) for row in rows]

    def incident(self, incident_id: int) -> dict[str, Any] | None:
        """One incident with its detail and its recording (compressed bytes)."""
        row = self._read("SELECT * FROM incidents WHERE id = ?", (incident_id,)).fetchone()
        if row is None:
            return None
        return _incident(row) | {"detail": json.loads(row["detail"]), "recording": bytes(row["recording"])}

    def checkpoint(self) -> None:
        """Fold the write-ahead log into the database (it otherwise grows between automatic
        checkpoints while readers such as ``tunerd history`` hold it open)."""
        try:
            self._db.execute("PRAGMA wal_checkpoint(PASSIVE)")
        except sqlite3.Error as error:
            raise state_error(error, self.path) from error

    def action_counts(self) -> list[tuple[str, str, str, str, int]]:
        """(engine, policy or "", kind, outcome, count) over the whole history: tunerd's
        actions counter."""
        rows = self._read(
            "SELECT engine, COALESCE(policy, '') AS policy, kind, outcome, COUNT(*) AS n FROM actions "
            "GROUP BY engine, policy, kind, outcome ORDER BY engine, policy, kind, outcome"
        ).fetchall()
        return [(row["engine"], row["policy"], row["kind"], row["outcome"], int(row["n"])) for row in rows]

    def requested_rollbacks(self, engine: str, kind: str = "rollback") -> list[dict[str, Any]]:
        """Rollbacks a person asked for (``tunerd rollback``) that no tunerd has carried out
        yet, oldest first: ``id``, ``to_settings`` and ``reason``. ``kind`` ``rollback``: of the
        engine's settings; ``gate``: of its gate's limits."""
        rows = self._read(
            "SELECT id, to_settings, reason, evidence FROM actions WHERE engine = ? AND kind = ? "
            "AND outcome = 'proposed' ORDER BY id",
            (engine, kind),
        ).fetchall()
        return [
            {"id": row["id"], "to_settings": json.loads(row["to_settings"]), "reason": row["reason"]}
            for row in rows
            if row["to_settings"] and json.loads(row["evidence"]).get("asked_by")
        ]

    def last_change(
        self, engine: str, kinds: tuple[str, ...] = ("tune", "rollback")
    ) -> dict[str, Any] | None:
        """The last change of ``kinds`` that took: by default of the settings (a tune or a
        rollback that succeeded); ``("gate",)``: of the gate's limits."""
        unknown = set(kinds) - set(ACTION_KINDS)
        if unknown or not kinds:
            raise ValueError(f"unknown action kinds {sorted(unknown)}")
        marks = ", ".join("?" * len(kinds))
        row = self._read(
            f"SELECT id FROM actions WHERE engine = ? AND kind IN ({marks}) "
            "AND outcome = 'succeeded' AND from_settings IS NOT NULL ORDER BY id DESC LIMIT 1",
            (engine, *kinds),
        ).fetchone()
        if row is None:
            return None
        return next(item for item in self.history(engine, limit=10**6) if item["id"] == row["id"])

    def restart_times(self, engine: str, since: float) -> list[float]:
        """When each restart of ``engine`` since ``since`` began (tunerd's and crash restarts;
        cancelled and merely proposed ones do not count)."""
        rows = self._read(
            "SELECT time FROM actions WHERE engine = ? AND time >= ? "
            "AND kind IN ('tune', 'restart', 'rollback') "
            "AND outcome IN ('applied', 'succeeded', 'failed', 'rolled_back') ORDER BY time",
            (engine, since),
        ).fetchall()
        return [row["time"] for row in rows]

    def crashes(self, engine: str, since: float) -> list[dict[str, Any]]:
        """The settings each crash since ``since`` happened with, oldest first."""
        rows = self._read(
            "SELECT from_settings FROM actions WHERE engine = ? AND time >= ? "
            "AND json_extract(evidence, '$.crash') IS NOT NULL ORDER BY id",
            (engine, since),
        ).fetchall()
        return [json.loads(row["from_settings"]) for row in rows if row["from_settings"]]

    def unfinished_actions(self, engine: str) -> list[int]:
        """The restarts of ``engine`` still ``applied`` (begun, no outcome yet), oldest first:
        only the one its intent moves should be — any other was left by a tunerd that stopped
        without an intent for it (an older tunerd wrote them apart)."""
        rows = self._read(
            "SELECT id FROM actions WHERE engine = ? AND outcome = 'applied' "
            "AND kind IN ('tune', 'restart', 'rollback', 'adopt') ORDER BY id",
            (engine,),
        ).fetchall()
        return [int(row["id"]) for row in rows]

    def last_outcome(self, engine: str, kind: str, since: float) -> str | None:
        row = self._read(
            "SELECT outcome FROM actions WHERE engine = ? AND kind = ? AND time >= ? "
            "ORDER BY id DESC LIMIT 1",
            (engine, kind, since),
        ).fetchone()
        return None if row is None else str(row["outcome"])

    # -- intents ---------------------------------------------------------------------------
    def begin_intent(
        self,
        engine: str,
        action_id: int,
        step: str,
        now: float,
        *,
        from_version: int | None,
        to_version: int | None,
        kind: str = "restart",
        note: str | None = None,
    ) -> None:
        with self.transaction() as db:
            db.execute(
                "INSERT OR REPLACE INTO intents (engine, action_id, step, from_version, to_version, "
                "started, updated, kind, note) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (engine, action_id, step, from_version, to_version, now, now, kind, note),
            )

    def retarget_intent(
        self, engine: str, *, kind: str, step: str, to_version: int, note: str | None, now: float
    ) -> None:
        """The saga in flight turns into another (a failed restart into its rollback)."""
        with self.transaction() as db:
            changed = db.execute(
                "UPDATE intents SET kind = ?, step = ?, to_version = ?, note = ?, updated = ? "
                "WHERE engine = ?",
                (kind, step, to_version, note, now, engine),
            )
            if changed.rowcount != 1:
                raise StateError(f"no restart in flight for {engine}")

    def advance_intent(self, engine: str, step: str, now: float) -> None:
        with self.transaction() as db:
            changed = db.execute(
                "UPDATE intents SET step = ?, updated = ? WHERE engine = ?", (step, now, engine)
            )
            if changed.rowcount != 1:
                raise StateError(f"no restart in flight for {engine}")

    def clear_intent(self, engine: str) -> None:
        with self.transaction() as db:
            db.execute("DELETE FROM intents WHERE engine = ?", (engine,))

    def intents(self) -> list[Intent]:
        rows = self._read("SELECT * FROM intents ORDER BY started").fetchall()
        return [
            Intent(
                r["engine"],
                r["action_id"],
                r["step"],
                r["from_version"],
                r["to_version"],
                r["started"],
                r["updated"],
                r["kind"] if "kind" in r.keys() else "restart",  # noqa: SIM118 - a Row's `in` reads values
                r["note"] if "note" in r.keys() else None,  # noqa: SIM118
            )
            for r in rows
        ]

    def intent(self, engine: str) -> Intent | None:
        """The saga in flight for ``engine``, or None."""
        return next((intent for intent in self.intents() if intent.engine == engine), None)


def _action(row: sqlite3.Row) -> dict[str, Any]:
    return {
        "id": row["id"],
        "time": _iso(row["time"]),
        "epoch": row["time"],  # the same moment in seconds since the epoch, to the microsecond
        "engine": row["engine"],
        "policy": row["policy"],
        "kind": row["kind"],
        "mode": row["mode"],
        "from_settings": json.loads(row["from_settings"]) if row["from_settings"] else None,
        "to_settings": json.loads(row["to_settings"]) if row["to_settings"] else None,
        "outcome": row["outcome"],
        "reason": row["reason"],
        "evidence": json.loads(row["evidence"]),
    }


def _incident(row: sqlite3.Row) -> dict[str, Any]:
    return {
        "id": row["id"],
        "engine": row["engine"],
        "kind": row["kind"],
        "at": _iso(row["at"]),
        "time": row["at"],
        "summary": row["summary"],
        "action_ids": json.loads(row["action_ids"]),
        "complete": bool(row["complete"]),
    }


def _version(row: sqlite3.Row) -> Version:
    return Version(
        row["id"],
        row["engine"],
        json.loads(row["settings"]),
        row["created"],
        row["source"],
        row["startup_seconds"],
        row["failed_at"],
        _json_column(row, "command"),
    )


def _json_column(row: sqlite3.Row, column: str) -> Any:
    """A JSON column that a database written by an older tunerd, opened read-only, may lack."""
    # sqlite3.Row's `in` looks at the values, not the column names: keys() it must be
    return json.loads(row[column]) if column in row.keys() and row[column] else None  # noqa: SIM118


def _dump_list(argv: list[str] | None) -> str | None:
    return None if argv is None else json.dumps(list(argv))


def _dump(settings: Mapping[str, Any] | None) -> str | None:
    return None if settings is None else json.dumps(dict(settings), sort_keys=True)
