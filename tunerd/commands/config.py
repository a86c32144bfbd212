"""``tunerd config check [--config F]``: validate the daemon's config (DESIGN §4.1); exit 0 / 2.

Also loads the policy files the config names, so a config that would not start is caught here.
"""

from __future__ import annotations

import argparse
import sys

from tunerd.commands import summary
from tunerd.commands.common import EXIT_OK, Parser, UsageError
from tunerd.config import DEFAULT_CONFIG, Config, ConfigError, load_config
from tunerd.policy.schema import PolicyError, load_policy_files

__all__ = ["load_or_usage_error", "register"]


def register(subparsers: argparse._SubParsersAction[Parser]) -> None:
    parser = subparsers.add_parser("config", help=summary("config"))
    commands = parser.add_subparsers(dest="config_command", metavar="COMMAND", required=True)
    check = commands.add_parser(
        "check",
        help="validate the config and the policies it names; exit 0 valid, 2 invalid",
        description="Every problem is printed as file:line: path: message; exit 0 valid, 2 invalid.",
    )
    check.add_argument("--config", default=DEFAULT_CONFIG, help=f"the config file (default {DEFAULT_CONFIG})")
    check.set_defaults(handler=_check, prog=check.prog)


def load_or_usage_error(path: str) -> Config:
    """The config, or every problem on stderr and a usage error (exit 2)."""
    try:
        return load_config(path)
    except ConfigError as error:
        for problem in error.problems:
            print(problem, file=sys.stderr)
        raise UsageError(f"{path}: the config did not load") from None


def _check(args: argparse.Namespace) -> int:
    config = load_or_usage_error(args.config)
    try:
        policies = load_policy_files(config.policy_files())
    except PolicyError as error:
        for problem in error.problems:
            print(problem, file=sys.stderr)
        raise UsageError(f"{args.config}: the policies it names did not load") from None
    engines = ", ".join(engine.name for engine in config.engines)
    print(f"{args.config}: ok (engines: {engines}; {len(policies)} policies; mode {config.mode})")
    return EXIT_OK
