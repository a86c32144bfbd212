"""``tunerd policy check`` and ``tunerd policy test``: policies reviewed and tested like code."""

from __future__ import annotations

import argparse
import sys

from tunerd.commands import summary
from tunerd.commands.common import EXIT_BAD_INPUT, EXIT_NO, EXIT_OK, Parser
from tunerd.policy.schema import PolicyError, load_policy_file
from tunerd.policy.testrun import describe_plans, run_test_file

__all__ = ["register"]

_EPILOG = """\
examples:
  tunerd policy check policies/*.yaml
  tunerd policy test tests/policies/*_test.yaml

exit status: check — 0 valid, 2 invalid; test — 0 all pass, 1 any fail, 2 a bad file.
Every problem is printed as FILE:LINE: policy 'NAME': FIELD.PATH: what is wrong.
"""


def register(subparsers: argparse._SubParsersAction[Parser]) -> None:
    parser = subparsers.add_parser(
        "policy",
        help=summary("policy"),
        description="Validate policy files (DESIGN §4.5) or run policy tests (§4.6).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(handler=lambda _args: parser.error("say check or test"), prog=parser.prog)
    commands = parser.add_subparsers(title="what", dest="policy_command", metavar="WHAT", parser_class=Parser)
    check = commands.add_parser("check", help="validate policy files; exit 0 valid, 2 invalid")
    check.add_argument("files", nargs="+", metavar="FILE")
    check.set_defaults(handler=_check, prog=check.prog)
    test = commands.add_parser("test", help="run policy tests; exit 0 pass, 1 fail, 2 bad file")
    test.add_argument("files", nargs="+", metavar="FILE")
    test.set_defaults(handler=_test, prog=test.prog)


def _check(args: argparse.Namespace) -> int:
    status = EXIT_OK
    names: dict[str, str] = {}
    for path in args.files:
        try:
            loaded = load_policy_file(path)
        except PolicyError as error:
            for problem in error.problems:
                print(problem, file=sys.stderr)
            status = EXIT_BAD_INPUT
            continue
        for policy in loaded.policies:
            if policy.name in names:
                print(
                    f"{path}: policy '{policy.name}': name already used in {names[policy.name]}",
                    file=sys.stderr,
                )
                status = EXIT_BAD_INPUT
            names.setdefault(policy.name, path)
        print(f"{path}: ok ({len(loaded.policies)} {'policy' if len(loaded.policies) == 1 else 'policies'})")
    return status


def _test(args: argparse.Namespace) -> int:
    status = EXIT_OK
    for path in args.files:
        try:
            outcomes = run_test_file(path)
        except PolicyError as error:
            for problem in error.problems:
                print(problem, file=sys.stderr)
            return EXIT_BAD_INPUT
        for outcome in outcomes:
            if outcome.passed:
                print(f"PASS {path}: {outcome.name}")
                continue
            status = EXIT_NO
            print(f"FAIL {path}: {outcome.name}")
            for failure in outcome.failures:
                print(f"  {failure}")
            print("  what happened:")
            for line in describe_plans(outcome.plans):
                print(f"    {line}")
    return status
