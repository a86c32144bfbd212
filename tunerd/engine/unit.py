"""systemd mode's engine: a unit tunerd restarts but does not own (DESIGN §4.9).

The engine's unit ends its ``ExecStart`` in ``$TUNERD_ARGS`` and reads
``EnvironmentFile=-STATE_DIR/engines/NAME.env``; tunerd writes that file atomically (a temporary
file in the same folder, fsync, rename) with the flags for the new settings, then runs
``systemctl restart UNIT`` — one call, an argv list, no shell, no drop-in, no
``daemon-reload``. systemd then stops the old engine as the unit says (``KillMode=mixed``:
SIGTERM to the main process, so vLLM drains; SIGKILL to the rest after ``TimeoutStopSec``) and
starts the new one. ``systemctl restart`` returns once the new main process runs.

What tunerd reads back:

- ``systemctl show UNIT -p …``: ``MainPID``, ``ActiveState``, ``ExecMainCode`` and
  ``ExecMainStatus`` (how the last main process ended) and ``InvocationID`` (systemd ≥ 232 gives
  each start its own);
- the engine's output from ``journalctl -u UNIT _SYSTEMD_INVOCATION_ID=ID -f -o cat``, copied
  into ``STATE_DIR/engines/NAME.log`` (rotated per start) so the same log diagnosis reads it as
  in supervise mode. The invocation match keeps the old engine's last lines out of the new
  engine's log.

Whether the engine lives is read from ``/proc`` (its main PID and that PID's start time), as in
supervise mode — cheap enough to poll; ``systemctl show`` is asked only for the exit status.
The stop is part of the restart, so :meth:`UnitEngine.stop` does nothing but wait for a main
process that is already going; tunerd never stops a unit on its own.

Linux only, like supervise mode.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import re
import shlex
import signal
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from tunerd.clock import SYSTEM_CLOCK, Clock
from tunerd.engine.process import Identity, ProcessError, StopResult, Successor, read_identity, rotate
from tunerd.paths import private_dir, private_fd

__all__ = [
    "SystemdRunner",
    "UnitEngine",
    "UnitStart",
    "env_file_text",
    "parse_show",
    "parse_timespan",
    "unit_problems",
]

_UNIT_SHOW = ("LoadState", "KillMode", "Restart", "TimeoutStopUSec")
_TIMESPAN = re.compile(r"(\d+(?:\.\d+)?)\s*(us|ms|s|min|h|d|w)?")
_UNIT_SECONDS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_SHOW = ("MainPID", "ActiveState", "SubState", "ExecMainCode", "ExecMainStatus", "InvocationID", "Job")
#: systemd is between a stop and a start: what the unit runs next is not decided yet
_MOVING = ("activating", "deactivating", "reloading")
_CALL_TIMEOUT_S = 30.0
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# systemd's CLD_* codes in ExecMainCode: how the main process ended
_EXITED, _KILLED, _DUMPED = 1, 2, 3


def env_file_text(flags: Sequence[str]) -> str:
    """The environment file for ``flags``: one ``TUNERD_ARGS="…"`` line. systemd splits an
    unbraced ``$TUNERD_ARGS`` in ``ExecStart`` at whitespace, so no flag value may hold any, nor
    a quote or backslash (the allowlisted tunables never do)."""
    for flag in flags:
        if not flag or any(char.isspace() or char in "\"'\\$" for char in flag):
            raise ProcessError(f"cannot pass {flag!r} through $TUNERD_ARGS (whitespace, quotes or $)")
    header = "# written by tunerd: the flags for this engine's unit ($TUNERD_ARGS)\n"
    return header + f'TUNERD_ARGS="{" ".join(flags)}"\n'


def parse_show(text: str) -> dict[str, str]:
    """``systemctl show``'s ``Key=Value`` lines as a mapping."""
    found = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            found[key.strip()] = value.strip()
    return found


def parse_timespan(text: str) -> float | None:
    """Seconds in a time span as ``systemctl show`` prints it (``1min 30s``, ``2.500000s``,
    ``infinity``); None if it is not one."""
    text = text.strip()
    if text == "infinity":
        return math.inf
    parts = _TIMESPAN.findall(text)
    if not parts or _TIMESPAN.sub("", text).strip():
        return None
    return sum(float(number) * _UNIT_SECONDS[unit or "s"] for number, unit in parts)


def unit_problems(unit: str, shown: dict[str, str], drain: float) -> list[str]:
    """What in the unit would undo tunerd's restarts (DESIGN §4.9), from ``systemctl show``."""
    if shown.get("LoadState", "loaded") != "loaded":
        return [
            f"{unit}: LoadState={shown.get('LoadState')}: systemd has no such unit (systemctl cat {unit})"
        ]
    problems = []
    if shown.get("KillMode", "mixed") != "mixed":
        problems.append(
            f"{unit}: KillMode={shown['KillMode']} signals vLLM's engine core directly and aborts the "
            "drain; set KillMode=mixed"
        )
    if shown.get("Restart", "no") != "no":
        problems.append(
            f"{unit}: Restart={shown['Restart']} lets systemd restart the engine behind tunerd's guards; "
            "set Restart=no"
        )
    stop = parse_timespan(shown.get("TimeoutStopUSec", "infinity"))
    if stop is not None and stop < drain + 30:
        problems.append(
            f"{unit}: TimeoutStopSec={stop:g}s is shorter than the drain ({drain:g}s) + 30s: systemd "
            "would kill requests vLLM is still finishing"
        )
    return problems


_PRCTL = ctypes.CDLL(None, use_errno=True).prctl  # resolved here, not in the forked child


def _die_with_parent() -> None:
    """In the journal follower, between fork and exec: end it when tunerd dies, however tunerd
    dies (``KillMode=process`` would leave it running, one more each time). One system call
    through a function resolved before the fork: nothing that takes a lock."""
    _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)


class SystemdRunner:
    """Restarts and reads one unit with ``systemctl`` and ``journalctl`` from ``PATH``."""

    waits_for_room = False  # the old engine still holds its memory until systemd stops it
    stops_in_start = True  # `systemctl restart` stops the old engine as the unit says, then starts

    def __init__(
        self,
        unit: str,
        env_path: Path,
        log_path: Path,
        clock: Clock = SYSTEM_CLOCK,
        *,
        restart_timeout: float = 300.0,
    ) -> None:
        #: how long ``systemctl restart`` may take: it returns only once the old engine has
        #: drained and stopped (``TimeoutStopSec``) and the new one was started
        self.restart_timeout = restart_timeout
        self.unit = unit
        self.env_path = env_path
        self.log_path = log_path
        self.clock = clock

    # -- systemctl ----------------------------------------------------------------------------
    def _systemctl(self, *args: str, timeout: float = _CALL_TIMEOUT_S) -> str:
        argv = ["systemctl", *args]
        try:
            done = subprocess.run(
                argv,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
                stdin=subprocess.DEVNULL,
            )
        except (OSError, subprocess.TimeoutExpired) as error:
            raise ProcessError(f"{shlex.join(argv)}: {error}") from None
        if done.returncode != 0:
            said = (done.stderr or done.stdout).strip().splitlines()
            raise ProcessError(
                f"{shlex.join(argv)} exited {done.returncode}: {said[-1] if said else 'no output'}"
            )
        return done.stdout

    def show(self, properties: Sequence[str] = _SHOW) -> dict[str, str]:
        args = [arg for prop in properties for arg in ("-p", prop)]
        return parse_show(self._systemctl("show", self.unit, *args))

    def problems(self, drain: float) -> list[str]:
        """The unit's settings that would undo tunerd's restarts (empty: none)."""
        try:
            return unit_problems(self.unit, self.show(_UNIT_SHOW), drain)
        except ProcessError as error:
            return [str(error)]

    def env_flags(self) -> tuple[str, ...] | None:
        """The flags the environment file holds now (None without one)."""
        try:
            text = self.env_path.read_text()
        except OSError:
            return None
        for line in text.splitlines():
            if line.startswith("TUNERD_ARGS="):
                return tuple(line.removeprefix("TUNERD_ARGS=").strip('"').split())
        return None

    def write_env(self, flags: Sequence[str]) -> None:
        """Replace the environment file atomically: a reader sees the old file or the new one."""
        text = env_file_text(flags)
        private_dir(self.env_path.parent)
        fd, temporary = tempfile.mkstemp(prefix=f".{self.env_path.name}.", dir=self.env_path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(text)
                handle.flush()
                os.fsync(handle.fileno())
            os.chmod(temporary, 0o644)
            os.replace(temporary, self.env_path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
        directory = os.open(self.env_path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)

    # -- what the supervisor asks -----------------------------------------------------------------
    def spawn(self, flags: Sequence[str]) -> UnitEngine:
        """Write the flags, ``systemctl restart`` the unit (systemd stops the old engine first),
        and follow the new engine's output — waiting for all of it (scripts and tests; the
        saga uses :meth:`start`)."""
        self.write_env(flags)
        self._systemctl("restart", self.unit, timeout=self.restart_timeout)
        return self.started()

    def start(self, flags: Sequence[str]) -> UnitStart:
        """Write the flags and begin ``systemctl restart`` without waiting for it: systemd
        drains and stops the old engine (``TimeoutStopSec``) and starts the new one, for
        minutes; :meth:`UnitStart.poll` looks whether it is done."""
        self.write_env(flags)
        return UnitStart(self, self.clock)

    def started(self) -> UnitEngine:
        """The engine the unit runs after a restart: its main process, its journal followed.
        One that has already died (vLLM refusing its flags can exit before this looks) is
        still handed over — a run whose process is gone — so that the saga reads why from that
        invocation's journal, as it does for one that dies a moment later."""
        main = self._main()
        if main is not None:
            return self._engine(*main)
        shown = self.show()
        invocation = shown.get("InvocationID", "")
        if not invocation:
            raise ProcessError(
                f"{self.unit} did not start after systemctl restart "
                f"(ActiveState={shown.get('ActiveState')}, ExecMainStatus={shown.get('ExecMainStatus')})"
            )
        return self._engine(Identity(0, -1, self.env_flags() or ()), invocation)

    def _main(self) -> tuple[Identity, str] | None:
        """The unit's running main process and its invocation, or None."""
        shown = self.show()
        pid = int(shown.get("MainPID") or 0)
        live = read_identity(pid) if pid else None
        if live is None:
            return None
        # its argv, as tunerd compares them: the flags it was given (the rest is the unit's)
        return Identity(live.pid, live.start_ticks, self.env_flags() or ()), shown.get("InvocationID", "")

    def _engine(self, identity: Identity, invocation: str) -> UnitEngine:
        rotate(self.log_path, 5)  # the copy of this run's journal starts a fresh log
        return UnitEngine(self, identity, invocation, self.clock)

    def adopt(self, identity: Identity) -> UnitEngine | None:
        """The unit's engine, if it is still the very process ``identity`` names."""
        main = self._main()
        if main is None or (main[0].pid, main[0].start_ticks) != (identity.pid, identity.start_ticks):
            return None
        return self._engine(*main)

    def listener(self, port: int) -> UnitEngine | None:
        """Whatever the unit runs now: after a ``systemctl restart`` by a person, the engine the
        recorded PID named is gone and this one serves."""
        main = self._main()
        return None if main is None else self._engine(*main)

    def successor(self, engine: UnitEngine) -> Successor:
        """The recorded main process is gone: what took its place. A person's ``systemctl
        restart`` shows as a new ``InvocationID`` with a live main process — a restart, not a
        crash; while a job runs on the unit (``Job``) or it is activating or deactivating, it is
        too early to say; otherwise the engine died (a crash)."""
        try:
            shown = self.show()
        except ProcessError:
            return Successor(None, pending=True)  # systemctl did not answer: look again
        if shown.get("Job", "").strip() not in ("", "0") or shown.get("ActiveState") in _MOVING:
            return Successor(None, pending=True)
        invocation = shown.get("InvocationID", "")
        if invocation and invocation != engine.invocation:
            main = self._main()
            if main is not None and main[1] == invocation:
                return Successor(self._engine(*main))
        return Successor(None)

    def find_new(self, flags: Sequence[str]) -> UnitEngine | None:
        """After an interrupted restart: the unit's running engine was started with ``flags``
        (its own argv ends in them — the environment file alone may have been written before
        tunerd died, with the old engine still running)."""
        main = self._main()
        if main is None or self.env_flags() != tuple(flags):
            return None
        live = read_identity(main[0].pid)
        if live is None or not flags or live.argv[-len(flags) :] != tuple(flags):
            return None
        return self._engine(*main)


class UnitStart:
    """``systemctl restart UNIT`` running as a child of tunerd; :meth:`poll` answers None until
    it has returned, then the new engine (or :class:`ProcessError`: it failed, or outlasted the
    runner's ``restart_timeout``)."""

    def __init__(self, runner: SystemdRunner, clock: Clock) -> None:
        self.runner = runner
        self.clock = clock
        self.started = clock.monotonic()
        self.argv = ["systemctl", "restart", runner.unit]
        try:
            self._popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        except OSError as error:
            raise ProcessError(f"{shlex.join(self.argv)}: {error}") from None

    def detail(self) -> str:
        return f"{shlex.join(self.argv)} running for {self.clock.monotonic() - self.started:.0f} s"

    def poll(self) -> UnitEngine | None:
        code = self._popen.poll()
        if code is None:
            if self.clock.monotonic() - self.started < self.runner.restart_timeout:
                return None
            self._popen.kill()
            self._popen.communicate()
            raise ProcessError(
                f"{shlex.join(self.argv)} did not return within {self.runner.restart_timeout:g} s"
            )
        out, err = self._popen.communicate()
        if code != 0:
            said = (err or out).strip().splitlines()
            raise ProcessError(f"{shlex.join(self.argv)} exited {code}: {said[-1] if said else 'no output'}")
        return self.runner.started()


class UnitEngine:
    """One run of the unit's main process (one ``InvocationID``)."""

    def __init__(self, runner: SystemdRunner, identity: Identity, invocation: str, clock: Clock) -> None:
        self.runner = runner
        self.identity = identity
        self.invocation = invocation
        self.log_path = runner.log_path
        self._clock = clock
        self._returncode: int | None = None
        self._follower = self._follow()

    @property
    def pid(self) -> int:
        return self.identity.pid

    def _follow(self) -> subprocess.Popen[bytes] | None:
        # --no-tail: the whole run from its first line, not the last ten (an engine adopted
        # after tunerd restarted still has its start-up figures in the log)
        argv = ["journalctl", "-u", self.runner.unit, "-f", "--no-tail", "-o", "cat", "--no-pager"]
        if self.invocation:
            argv.append(f"_SYSTEMD_INVOCATION_ID={self.invocation}")
        private_dir(self.log_path.parent)
        fd = private_fd(self.log_path, os.O_WRONLY | os.O_APPEND)  # 0600, like supervise mode's
        try:
            return subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=fd,
                stderr=subprocess.DEVNULL,
                preexec_fn=_die_with_parent,  # noqa: PLW1509 - one prctl, see _die_with_parent
            )
        except OSError:
            return None  # no journal to read: the saga still verifies by /health, without the log
        finally:
            os.close(fd)

    def close(self) -> None:
        """Stop copying the journal (the engine itself is systemd's)."""
        if self._follower is not None and self._follower.poll() is None:
            self._follower.send_signal(signal.SIGTERM)
            try:
                self._follower.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._follower.kill()
                self._follower.wait(timeout=5)
        self._follower = None

    def log_settled(self) -> bool:
        """Never known: the journal copy lags the engine by journald and ``journalctl -f``."""
        return False

    def alive(self) -> bool:
        live = read_identity(self.pid)
        return live is not None and live.start_ticks == self.identity.start_ticks

    @property
    def returncode(self) -> int | None:
        """How the main process ended, from systemd (negative: killed by that signal); None
        while it runs."""
        if self._returncode is None and not self.alive():
            with contextlib.suppress(ProcessError):
                shown = self.runner.show()
                code, status = int(shown.get("ExecMainCode") or 0), int(shown.get("ExecMainStatus") or 0)
                # ExecMainCode 0: systemd has not reaped it yet — ask again next time
                if shown.get("InvocationID", self.invocation) == self.invocation and code:
                    self._returncode = -status if code in (_KILLED, _DUMPED) else status
        return self._returncode

    def stop(self, timeout: float) -> StopResult:
        """Nothing to do now: ``systemctl restart`` stops the engine as the unit says (drain,
        then SIGKILL after ``TimeoutStopSec``). Stops the journal copy."""
        self.close()
        return StopResult("deferred", 0.0, None)

    # systemd stops the unit's processes itself: tunerd never signals them
    def terminate(self) -> None:
        """Nothing: the stop is part of ``systemctl restart``."""

    def kill_group(self) -> None:
        """Nothing: ``KillMode=mixed`` and ``TimeoutStopSec`` are systemd's."""

    def members(self) -> list[int]:
        return []
