"""The ``tunerd`` command line: parse, call the library, print. Exit 0 ok, 1 "no", 2 bad input.

Every error is one line on stderr naming the problem (``tunerd plan: error: ...``); machine
output is ``--json`` on stdout. Each subcommand lives in ``tunerd/commands/``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from tunerd import __version__
from tunerd.commands import config, demo, history, inspect, notify, pin, plan, policy, run, sim, status
from tunerd.commands.common import EXIT_BAD_INPUT, EXIT_OK, Parser, UsageError
from tunerd.planner.shapes import ShapeError
from tunerd.units import UnitError

__all__ = ["main"]


def build_parser() -> Parser:
    parser = Parser(
        prog="tunerd",
        description="Keep a vLLM inference box inside its GPU memory.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"tunerd {__version__}")
    subparsers = parser.add_subparsers(
        title="commands", dest="command", metavar="COMMAND", parser_class=Parser
    )
    plan.register(subparsers)
    inspect.register(subparsers)
    policy.register(subparsers)
    sim.register(subparsers)
    history.register(subparsers)
    run.register(subparsers)
    status.register(subparsers)
    config.register(subparsers)
    notify.register(subparsers)
    pin.register(subparsers)
    demo.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int] | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return EXIT_BAD_INPUT
    prog = getattr(args, "prog", "tunerd")
    try:
        return handler(args)
    except (UsageError, ShapeError, UnitError) as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:  # `tunerd plan ... | head`
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
