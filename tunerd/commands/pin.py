"""``tunerd pin ENGINE`` and ``tunerd resume ENGINE``: a person's word over the policies.

``pin`` freezes an engine's settings: no policy changes them until ``resume`` (crash restarts
of the same settings still happen). ``resume`` clears a pin, a hold (after a crash loop or a
spent restart budget) and a pause (after a person changed the engine's flags). Both write to
the state database, which the running daemon reads every tick, and are recorded in history.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

from tunerd.clock import SYSTEM_CLOCK
from tunerd.commands.common import EXIT_OK, Parser, UsageError
from tunerd.commands.history import add_state_arguments, state_dir_of
from tunerd.state import State, StateError

__all__ = ["register"]


def register(subparsers: argparse._SubParsersAction[Parser]) -> None:
    pin = subparsers.add_parser(
        "pin",
        help="freeze an engine's settings: no policy changes them until `tunerd resume`",
        description="Freeze ENGINE's settings. Recorded in history with your reason.",
    )
    pin.add_argument("engine", metavar="ENGINE", help="the engine's name in the config")
    pin.add_argument("--reason", default="pinned by hand", help="why (shown in history)")
    add_state_arguments(pin)
    pin.set_defaults(handler=_pin, prog=pin.prog)
    resume = subparsers.add_parser(
        "resume",
        help="let tunerd tune an engine again (clears pin, hold and pause)",
        description="Clear ENGINE's pin, hold and pause. Recorded in history with your reason.",
    )
    resume.add_argument("engine", metavar="ENGINE", help="the engine's name in the config")
    resume.add_argument("--reason", default="resumed by hand", help="why (shown in history)")
    add_state_arguments(resume)
    resume.set_defaults(handler=_resume, prog=resume.prog)


def _open(args: argparse.Namespace) -> State:
    state_dir = state_dir_of(args)
    try:
        state = State.open(state_dir, readonly=True)
    except StateError:
        raise UsageError(f"no state in {state_dir}: tunerd has not run there yet") from None
    known = state.engine(args.engine) is not None
    state.close()
    if not known:
        raise UsageError(f"no engine '{args.engine}' in {state_dir} (see `tunerd history`)")
    return State.open(state_dir)


@contextlib.contextmanager
def _changing(args: argparse.Namespace, kind: str) -> Iterator[State]:
    """The state to change; the person's ``kind`` action is recorded with their reason."""
    state = _open(args)
    try:
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
    print(f"{args.engine}: pinned; `tunerd resume {args.engine}` lets tunerd tune it again")
    return EXIT_OK


def _resume(args: argparse.Namespace) -> int:
    with _changing(args, "resume") as state:
        state.set_flags(args.engine, pinned=False, held=False, paused=None)
    print(f"{args.engine}: resumed; policies may tune it again")
    return EXIT_OK
