"""``tunerd pin``, ``resume`` and ``rollback``: a person's word over the policies.

``pin`` freezes an engine's settings: no policy changes them until ``resume`` (crash restarts
of the same settings still happen). ``resume`` clears a pin, a hold (after a crash loop or a
spent restart budget) and a pause (after a person changed the engine's flags or rolled it
back). ``rollback`` undoes the last change that took: the running tunerd restarts the engine
with the settings it had before, through the same saga (drain, verify, roll back if *that*
fails), and tuning pauses so the policies do not redo the change at once. When the last change
was of the engine's gate (a policy's ``gate:`` action), its limits are set back live instead,
with no restart. All three write to
the state database, which the running daemon reads every tick, and are recorded in history;
then they wake the daemon through its status socket (``--socket``) so that it acts at once,
and say when no tunerd answered (it acts when it next runs). A person who may not read or
write the state (tunerd keeps it 0700/0600: its user's) is told so in one line.
"""

from __future__ import annotations

import argparse
import contextlib
import getpass
import json
import os
import pwd
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tunerd.clock import SYSTEM_CLOCK
from tunerd.commands import summary
from tunerd.commands.common import EXIT_OK, Parser, UsageError, examples
from tunerd.commands.history import add_state_arguments, state_dir_of
from tunerd.commands.status import add_socket_argument, socket_of, wake
from tunerd.engine.args import settings_to_args
from tunerd.state import DB_NAME, State, StateError

__all__ = ["register"]


_JSON_HELP = 'one JSON object: {"engine", "done", "said", "woken"} (woken: a running tunerd answered)'


def register(subparsers: argparse._SubParsersAction[Parser]) -> None:
    pin = subparsers.add_parser(
        "pin",
        help=summary("pin"),
        description="Freeze ENGINE's settings. Recorded in history with your reason.",
    )
    pin.add_argument("engine", metavar="ENGINE", help="the engine's name in the config")
    pin.add_argument("--reason", default="pinned by hand", help="why (shown in history)")
    add_state_arguments(pin)
    add_socket_argument(pin)
    pin.add_argument("--json", action="store_true", help=_JSON_HELP)
    pin.set_defaults(handler=_pin, prog=pin.prog)
    examples(
        pin,
        """\
examples:
  tunerd pin llama31-8b --reason "load test tonight: keep the settings"
  tunerd pin llama31-8b --json

exit status: 0 pinned (the running tunerd is woken to see it), 2 bad usage or no state.
""",
    )
    resume = subparsers.add_parser(
        "resume",
        help=summary("resume"),
        description="Clear ENGINE's pin, hold and pause. Recorded in history with your reason.",
    )
    resume.add_argument("engine", metavar="ENGINE", help="the engine's name in the config")
    resume.add_argument("--reason", default="resumed by hand", help="why (shown in history)")
    add_state_arguments(resume)
    add_socket_argument(resume)
    resume.add_argument("--json", action="store_true", help=_JSON_HELP)
    resume.set_defaults(handler=_resume, prog=resume.prog)
    examples(
        resume,
        """\
examples:
  tunerd resume llama31-8b --reason "root cause fixed: the notebook moved to GPU 1"
  tunerd resume llama31-8b --json

exit status: 0 resumed, 2 bad usage or no state.
""",
    )

    rollback = subparsers.add_parser(
        "rollback",
        help=summary("rollback"),
        description=(
            "Ask the running tunerd to restart ENGINE with the settings it had before its last "
            "change, through the restart saga, and pause tuning until `tunerd resume`. When the "
            "last change was of the engine's gate (a policy's gate: action), tunerd sets the "
            "gate's limits back instead, live, with no restart. If tunerd is not running, the "
            "rollback waits in the state database for the next `tunerd run`."
        ),
    )
    rollback.add_argument("engine", metavar="ENGINE", help="the engine's name in the config")
    rollback.add_argument("--reason", default="rolled back by hand", help="why (shown in history)")
    add_state_arguments(rollback)
    add_socket_argument(rollback)
    rollback.add_argument("--json", action="store_true", help=_JSON_HELP)
    rollback.set_defaults(handler=_rollback, prog=rollback.prog)
    examples(
        rollback,
        """\
examples:
  tunerd rollback llama31-8b --reason "the last tune made it worse"
  tunerd rollback llama31-8b --json

exit status: 0 asked (the running tunerd does it through the restart saga), 2 nothing to roll
back, bad usage or no state.
""",
    )


def _user() -> str:
    """The user this command runs as (by its uid: ``USER`` may still name whoever ran ``su``)."""
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return f"uid {os.geteuid()}"


def _cannot(what: str, state_dir: str | os.PathLike[str], why: object, *, denied: bool = True) -> UsageError:
    advice = " (run it as the user tunerd runs as, or as root)" if denied else ""
    return UsageError(f"cannot {what} the state in {state_dir}: {why}{advice}")


def _open(args: argparse.Namespace) -> State:
    state_dir = Path(state_dir_of(args))
    database = state_dir / DB_NAME
    try:
        exists = database.exists()
    except OSError as error:  # a state folder only tunerd's user may enter
        raise _cannot("read", state_dir, f"{(error.strerror or str(error)).lower()} for {_user()}") from None
    writable = os.access(database, os.R_OK | os.W_OK) and os.access(state_dir, os.W_OK | os.X_OK)
    if not exists:
        raise UsageError(f"no state in {state_dir}: tunerd has not run there yet")
    if not writable:  # SQLite writes beside the database too (-wal, -shm)
        raise _cannot("change", state_dir, f"permission denied for {_user()}")
    try:
        state = State.open(state_dir, readonly=True)
    except StateError as error:  # e.g. a database tunerd has created but not filled yet
        raise _cannot("read", state_dir, error, denied=False) from None
    known = state.engine(args.engine) is not None
    state.close()
    if not known:
        raise UsageError(f"no engine '{args.engine}' in {state_dir} (see `tunerd history`)")
    try:
        return State.open(state_dir)
    except StateError as error:
        raise _cannot("change", state_dir, error, denied=False) from None


@contextlib.contextmanager
def _writing(state_dir: str | os.PathLike[str]) -> Iterator[None]:
    """A write the database refuses (read-only, locked, a full disk) is one line, not a
    traceback."""
    try:
        yield
    except (sqlite3.Error, StateError) as error:
        raise _cannot("change", state_dir, error, denied=False) from None


@contextlib.contextmanager
def _changing(args: argparse.Namespace, kind: str) -> Iterator[State]:
    """The state to change; the person's ``kind`` action is recorded with their reason."""
    state = _open(args)
    try:
        with _writing(state_dir_of(args)):
            yield state
            state.record_action(
                engine=args.engine,
                kind=kind,
                mode="act",
                outcome="succeeded",
                reason=args.reason,
                now=SYSTEM_CLOCK.now(),
            )
    finally:
        state.close()


def _pin(args: argparse.Namespace) -> int:
    with _changing(args, "pin") as state:
        state.set_flags(args.engine, pinned=True)
    return _said(
        args, "pinned", f"{args.engine}: pinned; `tunerd resume {args.engine}` lets tunerd tune it again"
    )


def _resume(args: argparse.Namespace) -> int:
    with _changing(args, "resume") as state:
        state.set_flags(args.engine, pinned=False, held=False, paused=None)
    return _said(args, "resumed", f"{args.engine}: resumed; policies may tune it again")


def _who() -> str:
    """Who asked (shown in history); a container may have no name for its user."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return f"uid {os.getuid()}"


def _rollback(args: argparse.Namespace) -> int:
    state = _open(args)
    try:
        with _writing(state_dir_of(args)):
            change = state.last_change(args.engine)
            gate_change = state.last_change(args.engine, kinds=("gate",))
            if gate_change is not None and (change is None or gate_change["id"] > change["id"]):
                said = _ask_gate_rollback(state, args, gate_change)
            elif change is None:
                raise UsageError(
                    f"{args.engine}: nothing to roll back (no settings or gate change has taken yet)"
                )
            else:
                said = _ask_settings_rollback(state, args, change)
            state.set_flags(args.engine, paused=f"rolled back by a person: {args.reason}")
    finally:
        state.close()
    return _said(args, "rollback asked", f"{said}; tuning paused until `tunerd resume {args.engine}`")


def _ask(
    state: State,
    args: argparse.Namespace,
    *,
    kind: str,
    change: dict[str, Any],
    current: dict[str, Any],
    target: dict[str, Any],
) -> None:
    """A person's rollback of ``change``, recorded as asked for: the running tunerd carries
    out the newest of each ``kind`` (``rollback``: settings; ``gate``: the gate's limits)."""
    state.record_action(
        engine=args.engine,
        kind=kind,
        mode="act",
        outcome="proposed",
        reason=f"{args.reason} (undoes #{change['id']})",
        now=SYSTEM_CLOCK.now(),
        from_settings=current,
        to_settings=target,
        evidence={"asked_by": _who(), "undoes": change["id"]},
    )


def _ask_settings_rollback(state: State, args: argparse.Namespace, change: dict[str, Any]) -> str:
    record = state.engine(args.engine)
    if record is None or record.running is None:
        raise UsageError(f"{args.engine}: not running under tunerd")
    running = state.version(record.running).settings
    target = change["from_settings"]
    if target == running:
        raise UsageError(f"{args.engine}: already running the settings before its last change")
    _ask(state, args, kind="rollback", change=change, current=running, target=target)
    return (
        f"{args.engine}: rollback of #{change['id']} asked; the running tunerd restarts it with "
        f"{' '.join(settings_to_args(target))}"
    )


def _ask_gate_rollback(state: State, args: argparse.Namespace, change: dict[str, Any]) -> str:
    """The last change was of the gate's limits: ask for those before it (live, no restart)."""
    target, current = change["from_settings"], change["to_settings"]
    _ask(state, args, kind="gate", change=change, current=current, target=target)
    words = ", ".join(f"{knob} {current.get(knob)} → {value}" for knob, value in target.items())
    return (
        f"{args.engine}: rollback of gate change #{change['id']} asked; the running tunerd sets the "
        f"gate's {words} live (no restart)"
    )


def _said(args: argparse.Namespace, done: str, text: str) -> int:
    """What was done, as a line (and a note when no tunerd answered the wake) or as JSON."""
    path = socket_of(args)
    woken = wake(path)
    if args.json:
        print(json.dumps({"engine": args.engine, "done": done, "said": text, "woken": woken}))
        return EXIT_OK
    print(text)
    if not woken:
        print(f"(no tunerd answered on {path}: it acts on this when it next runs)")
    return EXIT_OK
