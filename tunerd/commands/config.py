"""``tunerd config check [--config F]``: validate the daemon's config (DESIGN §4.1); exit 0 / 2.

Also loads the policy files the config names, so a config that would not start is caught here.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from tunerd.commands import summary
from tunerd.commands.common import EXIT_BAD_INPUT, EXIT_OK, Parser, UsageError, examples
from tunerd.config import DEFAULT_CONFIG, Config, ConfigError, load_config
from tunerd.policy.schema import PolicyError, load_policy_files

__all__ = ["load_or_usage_error", "register"]


def register(subparsers: argparse._SubParsersAction[Parser]) -> None:
    parser = subparsers.add_parser("config", help=summary("config"))
    examples(
        parser,
        """\
examples:
  tunerd config check --config /etc/tunerd/tunerd.yaml
""",
    )
    commands = parser.add_subparsers(dest="config_command", metavar="COMMAND", required=True)
    check = commands.add_parser(
        "check",
        help="validate the config and the policies it names; exit 0 valid, 2 invalid",
        description="Every problem is printed as file:line: path: message; exit 0 valid, 2 invalid.",
    )
    check.add_argument("--config", default=DEFAULT_CONFIG, help=f"the config file (default {DEFAULT_CONFIG})")
    check.add_argument(
        "--json",
        action="store_true",
        help='one JSON object: {"ok", "config", "engines", "policies", "mode", "problems": [...]}',
    )
    check.set_defaults(handler=_check, prog=check.prog)
    examples(
        check,
        """\
examples:
  tunerd config check --config /etc/tunerd/tunerd.yaml
  tunerd config check --config tunerd.yaml --json

exit status: 0 valid, 2 invalid.
""",
    )


def load_or_usage_error(path: str) -> Config:
    """The config, or every problem on stderr and a usage error (exit 2)."""
    try:
        return load_config(path)
    except ConfigError as error:
        for problem in error.problems:
            print(problem, file=sys.stderr)
        raise UsageError(f"{path}: the config did not load") from None


def _check(args: argparse.Namespace) -> int:
    if args.json:
        return _check_json(args.config)
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


def _check_json(path: str) -> int:
    """``config check --json``: the verdict as one object on stdout, whatever it is."""
    report: dict[str, Any] = {"ok": False, "config": path, "engines": [], "policies": [], "mode": None}
    try:
        config = load_config(path)
        report.update(engines=[engine.name for engine in config.engines], mode=str(config.mode))
        report["policies"] = [policy.name for policy in load_policy_files(config.policy_files())]
    except (ConfigError, PolicyError) as error:
        report["problems"] = [str(problem) for problem in error.problems]
    else:
        report.update(ok=True, problems=[])
    print(json.dumps(report, indent=2))
    return EXIT_OK if report["ok"] else EXIT_BAD_INPUT
