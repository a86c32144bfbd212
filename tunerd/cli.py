"""The ``tunerd`` command line: parse, call the library, print. Exit 0 ok, 1 "no", 2 bad input.

Every error is one line on stderr naming the problem (``tunerd plan: error: ...``); machine
output is ``--json`` on stdout. Each subcommand lives in ``tunerd/commands/``; only the one
asked for is imported (:data:`tunerd.commands.COMMANDS` lists the rest for ``--help``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

from tunerd import __version__
from tunerd.commands import COMMANDS
from tunerd.commands.common import EXIT_BAD_INPUT, EXIT_NO_DAEMON, EXIT_OK, NoDaemon, Parser, UsageError
from tunerd.errors import InputError

__all__ = ["main"]


def _asked(argv: Sequence[str]) -> str | None:
    """The command named on the line (the first word that is not an option), if it is one."""
    first = next((arg for arg in argv if not arg.startswith("-")), None)
    return first if first in COMMANDS else None


def build_parser(argv: Sequence[str] | None = None) -> Parser:
    """The whole parser; with ``argv``, only the command it names is loaded (the others are
    listed, by name and help)."""
    asked = None if argv is None else _asked(argv)
    parser = Parser(
        prog="tunerd",
        description="Keep a vLLM inference box inside its GPU memory.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"tunerd {__version__}")
    subparsers = parser.add_subparsers(
        title="commands", dest="command", metavar="COMMAND", parser_class=Parser
    )
    loaded: set[str] = set()
    for name, (module, summary) in COMMANDS.items():
        if asked is not None and module != COMMANDS[asked][0]:
            subparsers.add_parser(name, help=summary)  # listed; never parsed (not asked for)
        elif module not in loaded:
            importlib.import_module(f"tunerd.commands.{module}").register(subparsers)
            loaded.add(module)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    args, extra = parser.parse_known_args(argv)
    if extra:  # said by the command's own parser, which knows its options (and its --help)
        own = getattr(args, "prog", None)
        message = f"unrecognized arguments: {' '.join(extra)}"
        if own:
            print(f"{own}: error: {message} (see {own} --help)", file=sys.stderr)
            return EXIT_BAD_INPUT
        parser.error(message)
    handler: Callable[[argparse.Namespace], int] | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return EXIT_BAD_INPUT
    prog = getattr(args, "prog", "tunerd")
    try:
        return handler(args)
    except NoDaemon as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return EXIT_NO_DAEMON
    except (UsageError, InputError) as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:  # `tunerd plan ... | head`
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
