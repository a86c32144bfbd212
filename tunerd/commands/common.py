"""What every subcommand shares: exit codes, one-line errors, argument types."""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

from tunerd.units import UnitError, parse_size, parse_token_count

__all__ = [
    "EXIT_BAD_INPUT",
    "EXIT_NO",
    "EXIT_NO_DAEMON",
    "EXIT_OK",
    "NoDaemon",
    "Parser",
    "UsageError",
    "examples",
    "positive_float",
    "positive_int",
    "size",
    "token_count",
    "utilization",
]

EXIT_OK = 0
EXIT_NO = 1
EXIT_BAD_INPUT = 2
#: a command that talks to a running daemon (or gate) found none answering: not bad input,
#: so that a script can tell "tunerd is down" from "I typed it wrong"
EXIT_NO_DAEMON = 3


class UsageError(Exception):
    """Bad input detected after parsing; reported as one line, exit 2."""


class NoDaemon(UsageError):
    """No daemon answered where the command looked for one; reported as one line, exit 3."""


class Parser(argparse.ArgumentParser):
    """argparse, but an error is one line (``PROG: error: MESSAGE``) and exit 2, and an option
    is its whole name: ``--conc`` is not ``--concurrency`` (a script that abbreviates breaks
    the day a second option starts the same way)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def examples(parser: argparse.ArgumentParser, text: str) -> None:
    """``text`` (examples, then the exit status) under the parser's ``--help``, as written."""
    parser.epilog = text
    parser.formatter_class = argparse.RawDescriptionHelpFormatter


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got '{text}'") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive whole number, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got '{text}'") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def token_count(text: str) -> int:
    try:
        return parse_token_count(text)
    except UnitError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def size(text: str) -> int:
    """A memory size a person types, with its unit: ``24GiB``, ``23.5GiB``, ``512MiB``. A bare
    number is refused — ``--gpu-mem 24`` meant 24 GiB, not 24 bytes."""
    if text.strip().replace(".", "", 1).isdigit():
        raise argparse.ArgumentTypeError(
            f"invalid size '{text}': give a unit, e.g. '{text.strip()}GiB' (a bare number would be bytes)"
        )
    try:
        value = parse_size(text)
    except UnitError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"invalid size '{text}': must be more than zero")
    return value


def utilization(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction such as 0.92, got '{text}'") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value
