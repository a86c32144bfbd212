"""Supervise mode's engine process: spawn, adopt, stop. Linux only (reads ``/proc``).

The engine runs as tunerd's child in its own session and process group (``setsid``), from an
argv list (no shell), with tunerd's environment minus its secrets (every ``TUNERD_*`` variable
and every variable the config names as a secret: :func:`engine_environment`) plus the engine's
``env``. Its stdout and stderr go to a log file in ``state_dir`` (0600, :mod:`tunerd.paths`)
opened for appending, so nothing ties
the engine to tunerd: when tunerd dies the engine keeps serving, and the next tunerd adopts it
by :class:`Identity` — PID and the kernel's start time for that PID (so a recycled PID is never
mistaken for the engine). The argv ``/proc`` shows is kept for people and evidence, never
compared as text with the argv tunerd spawned: a console script shows its interpreter and its
path in front (:func:`runs_as` says when the two are one engine).

Stopping follows DESIGN §4.9: SIGTERM to the engine's main process only — vLLM's API server
then drains in-flight requests for ``--shutdown-timeout`` seconds and stops its own engine
core; a SIGTERM to the whole group would reach the engine core directly and abort the drain
(measured on vLLM's CPU build, DESIGN §7) — then SIGKILL to the whole group if the main
process outlives the timeout, then wait until no process of the group is left.

The log is rotated at each spawn (``engine.log`` → ``engine.log.1`` …) and copy-truncated
while it runs (:meth:`EngineProcess.rotate_log_if_large`): the engine writes with
``O_APPEND``, so after a truncate its next line lands at the new end, and
:class:`tunerd.sources.engine_log.FileFollower` reads it from there.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tunerd.clock import SYSTEM_CLOCK, Clock
from tunerd.paths import open_private, private_dir, private_fd

__all__ = [
    "SECRET_ENV_PREFIXES",
    "EngineProcess",
    "HookResult",
    "HookRun",
    "Identity",
    "ProcessError",
    "ProcessRunner",
    "Started",
    "StopResult",
    "Successor",
    "copytruncate",
    "engine_environment",
    "find_listener",
    "find_spawned",
    "group_members",
    "process_tree",
    "read_identity",
    "rotate",
    "runs_as",
]

#: Environment variables tunerd keeps to itself (webhook secrets and tokens live under these);
#: the variables the config names as secrets (``url_env``, ``secret_env``) are kept too, by name.
SECRET_ENV_PREFIXES = ("TUNERD_",)
_POLL_S = 0.05


class ProcessError(RuntimeError):
    """The engine could not be started or signalled; the message says why."""


@dataclass(frozen=True)
class Identity:
    """Which process the engine is: enough to re-adopt it and never a recycled PID."""

    pid: int
    start_ticks: int  # /proc/PID/stat field 22: clock ticks after boot the process started
    argv: tuple[str, ...]


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # comm (field 2) is in parentheses and may hold spaces or ')': split after the last ')'.
    return text[text.rindex(")") + 2 :].split()


def read_identity(pid: int) -> Identity | None:
    """The identity of a live (not zombie) process, or None."""
    fields = _stat_fields(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return None
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    argv = tuple(part.decode(errors="surrogateescape") for part in raw.split(b"\0")[:-1])
    return Identity(pid, int(fields[19]), argv)


def _identity_after_exec(pid: int, clock: Clock, timeout: float = 1.0) -> Identity | None:
    """The identity of a child ``subprocess.Popen`` has just started. Popen returns once the
    exec has closed its close-on-exec pipe, but the kernel sets up the new program's arguments
    a moment after that: read in between, ``/proc/PID/cmdline`` is empty (measured here: about
    1 read in 100 right after Popen returned). An engine recorded with no argv would later look
    like one a person restarted with another command."""
    deadline = clock.monotonic() + timeout
    while True:
        identity = read_identity(pid)
        if identity is None or identity.argv or clock.monotonic() >= deadline:
            return identity
        clock.sleep(0.001)


def runs_as(spawned: Sequence[str], seen: Sequence[str]) -> bool:
    """Whether a process whose ``/proc/PID/cmdline`` reads ``seen`` is what exec of ``spawned``
    became. exec rewrites the front of argv on the way: a script's shebang puts its interpreter
    (and the interpreter's one argument) first and the script's path, found on ``PATH``, where
    ``argv[0]`` was — pip's console scripts show ``…/bin/python …/bin/vllm serve …`` for
    ``vllm serve …``; ``env`` and wrapper scripts exec what they wrap with the same arguments;
    an interpreter reached through a symlink keeps the name it was called by. None of them
    changes the arguments, so ``seen`` ends in ``spawned[1:]`` — and those hold tunerd's own
    flags (the tunables, ``--shutdown-timeout``), which makes the match specific."""
    spawned, seen = tuple(spawned), tuple(seen)
    if seen == spawned:
        return True
    tail = spawned[1:]
    return bool(tail) and len(seen) > len(tail) and seen[-len(tail) :] == tail


def find_spawned(argv: Sequence[str]) -> Identity | None:
    """A live process that exec of ``argv`` became (:func:`runs_as`) and that leads its own
    session, as tunerd starts engines: one started just before tunerd died, before its
    identity was written down."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        fields = _stat_fields(pid)
        if fields is None or int(fields[3]) != pid:  # field 6: the session; tunerd's engines lead one
            continue
        identity = read_identity(pid)
        if identity is not None and runs_as(argv, identity.argv):
            return identity
    return None


def find_listener(port: int) -> Identity | None:
    """The live process listening on TCP ``port`` (any address, IPv4 or IPv6), or None: the
    engine a person started by hand where tunerd's used to be. Read from ``/proc/net/tcp{,6}``
    (state ``0A`` is LISTEN) and the sockets in ``/proc/PID/fd``."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return None
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fds = list(os.scandir(f"/proc/{entry.name}/fd"))
        except OSError:
            continue  # gone, or not ours to read
        links = set()
        for fd in fds:
            with contextlib.suppress(OSError):  # closed while we looked
                links.add(os.readlink(fd.path))
        if inodes & links:
            return read_identity(int(entry.name))
    return None


def group_members(pgid: int) -> list[int]:
    """Live processes in process group ``pgid`` (zombies excluded: they hold no memory)."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields is not None and fields[0] not in ("Z", "X") and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return sorted(members)


def process_tree(pid: int) -> list[int]:
    """``pid`` and its live descendants, read from ``/proc/PID/task/TID/children`` — a few small
    reads instead of a scan of all of ``/proc``, cheap enough for every tick. A kernel without
    those files (``CONFIG_PROC_CHILDREN``) gets :func:`group_members` instead."""
    if not os.path.exists(f"/proc/{pid}/task/{pid}/children"):
        return group_members(pid)
    found: set[int] = set()
    todo = [pid]
    while todo:
        current = todo.pop()
        fields = _stat_fields(current)
        if current in found or fields is None or fields[0] in ("Z", "X"):
            continue
        found.add(current)
        try:
            threads = os.listdir(f"/proc/{current}/task")
        except OSError:
            continue
        for thread in threads:
            with contextlib.suppress(OSError, ValueError):
                todo += [
                    int(child)
                    for child in Path(f"/proc/{current}/task/{thread}/children").read_text().split()
                ]
    return sorted(found)


def engine_environment(
    base: Mapping[str, str],
    extra: Mapping[str, str],
    secret_names: Collection[str] = frozenset(),
    *,
    secret_prefixes: Sequence[str] = SECRET_ENV_PREFIXES,
) -> dict[str, str]:
    """tunerd's environment without its secrets — every ``TUNERD_*`` variable and every one in
    ``secret_names`` (the config's ``url_env``/``secret_env``, whatever their names) — plus
    the engine's (or hook's) own ``env``, which the config gives on purpose."""
    names = frozenset(secret_names)
    prefixes = tuple(secret_prefixes)
    env = {key: value for key, value in base.items() if key not in names and not key.startswith(prefixes)}
    env.update(extra)
    return env


@dataclass(frozen=True)
class HookResult:
    """One run of a ``pre_stop``/``post_start`` hook."""

    ok: bool
    summary: str  # e.g. "exit 0 in 0.1 s", "exit 3 in 0.2 s: out of rotation failed", "timed out after 60 s"


class HookRun:
    """One run of a ``pre_stop``/``post_start`` hook (an argv list from the config, never a
    shell), started at once and looked at with :meth:`poll` — nobody waits on it. It runs in a
    session of its own with tunerd's environment minus its secrets (``TUNERD_*`` and
    ``secret_names``) plus ``env``, and writes its output straight into ``log_path`` (0600; so
    it can outlive a tunerd that stops meanwhile); a run past ``timeout`` has its whole group
    killed."""

    def __init__(
        self,
        hook: str,
        argv: Sequence[str],
        *,
        timeout: float,
        log_path: str | os.PathLike[str],
        env: Mapping[str, str],
        clock: Clock = SYSTEM_CLOCK,
        secret_names: Collection[str] = frozenset(),
    ) -> None:
        self.hook = hook
        self.argv = list(argv)
        self.timeout = timeout
        self.path = Path(log_path)
        self.clock = clock
        self.started = clock.monotonic()
        self.result: HookResult | None = None
        private_dir(self.path.parent)
        self._write(f"{hook}: {' '.join(self.argv)}\n")
        self._offset = self.path.stat().st_size
        fd = private_fd(self.path, os.O_WRONLY | os.O_APPEND)
        try:
            self._popen: subprocess.Popen[bytes] | None = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=fd,
                stderr=subprocess.STDOUT,
                env=engine_environment(os.environ, env, secret_names),
                start_new_session=True,
                close_fds=True,
            )
        except OSError as error:
            self._popen = None
            self._finish(HookResult(False, f"could not run {self.argv[0]}: {error.strerror or error}"))
        finally:
            os.close(fd)

    def _write(self, text: str) -> None:
        stamp = datetime.fromtimestamp(self.clock.now(), tz=UTC).isoformat(timespec="seconds")
        with open_private(self.path, "a", encoding="utf-8") as log:
            log.write(f"{stamp} {text}")

    def _finish(self, result: HookResult) -> HookResult:
        self.result = result
        self._write(f"{self.hook}: {result.summary}\n")
        return result

    def _last_line(self) -> str:
        try:
            with self.path.open("rb") as log:
                log.seek(self._offset)
                output = log.read(64 << 10).decode(errors="replace").strip()
        except OSError:
            return ""
        return output.splitlines()[-1] if output else ""

    def poll(self) -> HookResult | None:
        """The hook's result once it has ended (or been killed for its timeout); None while it
        runs."""
        if self.result is not None or self._popen is None:
            return self.result
        code = self._popen.poll()
        seconds = self.clock.monotonic() - self.started
        if code is None:
            if seconds < self.timeout:
                return None
            self.kill()
            return self._finish(HookResult(False, f"timed out after {self.timeout:g} s"))
        summary = f"exit {code} in {seconds:.1f} s"
        if code:
            summary += f": {self._last_line()[:200]}"
        return self._finish(HookResult(code == 0, summary))

    def kill(self) -> None:
        if self._popen is not None and self._popen.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._popen.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._popen.wait(timeout=5)


def copytruncate(path: Path, max_bytes: int, keep: int = 5) -> bool:
    """A log a running process appends to (``O_APPEND``) grew past ``max_bytes``: copy it
    aside (``path.1``, older ones shifted) and truncate it in place, so the writer's next line
    lands at the new end. Lines written between the copy and the truncate are lost — logrotate's
    ``copytruncate`` has the same window."""
    try:
        size = path.stat().st_size
    except OSError:
        return False
    if size <= max_bytes:
        return False
    for index in range(keep - 1, 0, -1):
        older = path.with_name(f"{path.name}.{index}")
        if older.exists():
            older.replace(path.with_name(f"{path.name}.{index + 1}"))
    with path.open("rb") as source, open_private(path.with_name(path.name + ".1"), "wb") as copy:
        shutil.copyfileobj(source, copy)
    with path.open("r+b") as handle:
        handle.truncate(0)
    return True


def rotate(path: Path, keep: int) -> None:
    """``path`` → ``path.1`` → … → ``path.keep`` (the oldest is dropped)."""
    if keep < 1:
        path.unlink(missing_ok=True)
        return
    for index in range(keep - 1, 0, -1):
        older = path.with_name(f"{path.name}.{index}")
        if older.exists():
            older.replace(path.with_name(f"{path.name}.{index + 1}"))
    if path.exists():
        path.replace(path.with_name(f"{path.name}.1"))


@dataclass(frozen=True)
class StopResult:
    how: str  # "exited" (drained and left on SIGTERM), "killed" (SIGKILL of the group), "gone"
    seconds: float
    returncode: int | None  # known only for tunerd's own child


class EngineProcess:
    """One engine process: spawned by this tunerd, or adopted from an earlier one."""

    def __init__(
        self,
        identity: Identity,
        log_path: Path,
        popen: subprocess.Popen[bytes] | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.identity = identity
        self.log_path = log_path
        self._popen = popen
        self._clock = clock

    @property
    def pid(self) -> int:
        return self.identity.pid

    @property
    def adopted(self) -> bool:
        return self._popen is None

    @classmethod
    def spawn(
        cls,
        argv: Sequence[str],
        log_path: str | os.PathLike[str],
        *,
        env: Mapping[str, str] | None = None,
        base_env: Mapping[str, str] | None = None,
        keep_logs: int = 5,
        cwd: str | os.PathLike[str] | None = None,
        clock: Clock = SYSTEM_CLOCK,
        secret_names: Collection[str] = frozenset(),
    ) -> EngineProcess:
        """Start ``argv`` with tunerd's environment minus its secrets (``TUNERD_*`` and
        ``secret_names``) plus ``env``, its output appended to ``log_path`` (0600)."""
        if not argv:
            raise ProcessError("the engine's command is empty")
        path = Path(log_path)
        private_dir(path.parent)
        rotate(path, keep_logs)
        environment = engine_environment(
            os.environ if base_env is None else base_env, env or {}, secret_names
        )
        fd = private_fd(path, os.O_WRONLY | os.O_APPEND)
        try:
            popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=fd,
                stderr=subprocess.STDOUT,
                env=environment,
                cwd=cwd,
                start_new_session=True,  # own session and group: outlives tunerd, killable as one
                close_fds=True,
            )
        except OSError as error:
            raise ProcessError(f"cannot start {argv[0]}: {error.strerror or error}") from None
        finally:
            os.close(fd)
        identity = _identity_after_exec(popen.pid, clock)
        if identity is None:  # exited before we could look: keep what we know
            identity = Identity(popen.pid, -1, tuple(argv))
        return cls(identity, path, popen, clock)

    @classmethod
    def adopt(
        cls, identity: Identity, log_path: str | os.PathLike[str], clock: Clock = SYSTEM_CLOCK
    ) -> EngineProcess | None:
        """The engine an earlier tunerd started, if that very process is still alive."""
        live = read_identity(identity.pid)
        if live is None or live.start_ticks != identity.start_ticks:
            return None
        return cls(live, Path(log_path), None, clock)

    # -- state -------------------------------------------------------------------------------
    def alive(self) -> bool:
        if self._popen is not None:
            return self._popen.poll() is None
        live = read_identity(self.pid)
        return live is not None and live.start_ticks == self.identity.start_ticks

    def log_settled(self) -> bool:
        """Nothing more will be written to the log: no process of the engine's group is left
        (an engine-core child can still be printing after the main process exited)."""
        try:
            os.killpg(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    @property
    def returncode(self) -> int | None:
        """The exit status (negative: killed by that signal); None while running or adopted."""
        return None if self._popen is None else self._popen.poll()

    def argv_now(self) -> tuple[str, ...] | None:
        """The argv the process reports now (None once it is gone)."""
        live = read_identity(self.pid)
        if live is None or live.start_ticks != self.identity.start_ticks:
            return None
        return live.argv

    def members(self) -> list[int]:
        return group_members(self.pid)

    def close(self) -> None:
        """Nothing to let go of: the engine outlives tunerd by design."""

    # -- stopping ----------------------------------------------------------------------------
    def terminate(self) -> None:
        """SIGTERM to the main process only: vLLM drains, then stops its engine core."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)

    def kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)

    def _wait(self, condition: Callable[[], bool], seconds: float) -> bool:
        deadline = self._clock.monotonic() + seconds
        while True:
            if condition():
                return True
            if self._clock.monotonic() >= deadline:
                return False
            self._clock.sleep(_POLL_S)

    def stop(self, timeout: float, group_timeout: float = 10.0) -> StopResult:
        """SIGTERM the main process; SIGKILL the group if it outlives ``timeout``; return once
        no process of the group is left (or ``group_timeout`` after the SIGKILL)."""
        started = self._clock.monotonic()
        if not self.alive() and not self.members():
            return StopResult("gone", 0.0, self.returncode)
        self.terminate()
        how = "exited"
        if not self._wait(lambda: not self.alive(), timeout):
            how = "killed"
            self.kill_group()
            self._wait(lambda: not self.alive(), group_timeout)
        if not self._wait(lambda: not self.members(), group_timeout if how == "killed" else 5.0):
            how = "killed"  # the main process left, a child of it did not: take the group down
            self.kill_group()
            if not self._wait(lambda: not self.members(), group_timeout):
                raise ProcessError(
                    f"engine group {self.pid} still has processes {self.members()} after SIGKILL"
                )
        return StopResult(how, self._clock.monotonic() - started, self.returncode)

    def wait_exit(self, timeout: float) -> bool:
        return self._wait(lambda: not self.alive(), timeout)

    # -- the log -------------------------------------------------------------------------------
    def rotate_log_if_large(self, max_bytes: int, keep: int = 5) -> bool:
        return copytruncate(self.log_path, max_bytes, keep)


@dataclass(frozen=True)
class Successor:
    """What replaced an engine whose main process is gone: the engine a person started in its
    place through the engine's manager (``systemctl restart``), or None — it died; ``pending``
    while the manager is still stopping or starting it."""

    engine: Any = None  # the runner's engine (EngineProcess, UnitEngine)
    pending: bool = False


class Started:
    """A start that is already done (a spawn): :meth:`poll` hands the engine over."""

    def __init__(self, engine: EngineProcess) -> None:
        self.engine = engine

    def poll(self) -> EngineProcess:
        return self.engine

    def detail(self) -> str:
        return f"spawned pid {self.engine.pid}"


class ProcessRunner:
    """How the saga starts and finds a supervised engine: tunerd's own child, found again by
    its identity, its argv or the port it listens on."""

    waits_for_room = True  # the old engine is gone before the spawn: wait for its memory
    stops_in_start = False  # tunerd stops the old engine itself (SIGTERM, then the group)

    def __init__(
        self,
        log_path: Path,
        env: Mapping[str, str],
        clock: Clock = SYSTEM_CLOCK,
        secret_names: Collection[str] = frozenset(),
    ) -> None:
        self.log_path = log_path
        self.env = env
        self.clock = clock
        #: the variables the config names as secrets, kept from the engine (a reload sets them)
        self.secret_names = frozenset(secret_names)

    def spawn(self, argv: Sequence[str]) -> EngineProcess:
        return EngineProcess.spawn(
            argv, self.log_path, env=self.env, clock=self.clock, secret_names=self.secret_names
        )

    def start(self, argv: Sequence[str]) -> Started:
        """Spawn now: the engine is there as soon as this returns."""
        return Started(self.spawn(argv))

    def adopt(self, identity: Identity) -> EngineProcess | None:
        return EngineProcess.adopt(identity, self.log_path, self.clock)

    def successor(self, engine: EngineProcess) -> Successor:
        """Nothing restarts tunerd's own child behind its back: a dead engine died."""
        return Successor()

    def find_new(self, argv: Sequence[str]) -> EngineProcess | None:
        identity = find_spawned(argv)
        return None if identity is None else EngineProcess(identity, self.log_path, None, self.clock)

    def listener(self, port: int) -> EngineProcess | None:
        identity = find_listener(port)
        return None if identity is None else EngineProcess.adopt(identity, self.log_path, self.clock)
