"""``tunerd policy check`` and ``tunerd policy test``: policies reviewed and tested like code."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from tunerd.commands import summary
from tunerd.commands.common import EXIT_BAD_INPUT, EXIT_NO, EXIT_OK, Parser, examples
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
    check.add_argument(
        "--json",
        action="store_true",
        help='one JSON object: {"ok", "files": [{"file", "ok", "policies": [names], "problems": [...]}]}',
    )
    check.set_defaults(handler=_check, prog=check.prog)
    examples(
        check,
        """\
examples:
  tunerd policy check /etc/tunerd/policies/*.yaml
  tunerd policy check policies/default.yaml --json

exit status: 0 valid, 2 invalid (each problem as FILE:LINE: path: message).
""",
    )
    test = commands.add_parser("test", help="run policy tests; exit 0 pass, 1 fail, 2 bad file")
    test.add_argument("files", nargs="+", metavar="FILE")
    test.add_argument(
        "--json",
        action="store_true",
        help='one JSON object: {"ok", "tests": [{"file", "name", "passed", "failures", "happened"}], '
        '"problems": [...]}',
    )
    test.set_defaults(handler=_test, prog=test.prog)
    examples(
        test,
        """\
examples:
  tunerd policy test policies/tests/*.yaml
  tunerd policy test incidents/oom_test.yaml --json

exit status: 0 every test passed, 1 one failed, 2 a bad file.
""",
    )


def _check(args: argparse.Namespace) -> int:
    status = EXIT_OK
    names: dict[str, str] = {}
    report: list[dict[str, Any]] = []
    for path in args.files:
        entry: dict[str, Any] = {"file": path, "ok": True, "policies": [], "problems": []}
        report.append(entry)
        try:
            loaded = load_policy_file(path)
        except PolicyError as error:
            entry.update(ok=False, problems=[str(problem) for problem in error.problems])
            status = EXIT_BAD_INPUT
            continue
        for policy in loaded.policies:
            entry["policies"].append(policy.name)
            if policy.name in names:
                entry["ok"] = False
                entry["problems"].append(
                    f"{path}: policy '{policy.name}': name already used in {names[policy.name]}"
                )
                status = EXIT_BAD_INPUT
            names.setdefault(policy.name, path)
    if args.json:
        print(json.dumps({"ok": status == EXIT_OK, "files": report}, indent=2))
        return status
    for entry in report:
        for problem in entry["problems"]:
            print(problem, file=sys.stderr)
        if entry["ok"]:
            count = len(entry["policies"])
            print(f"{entry['file']}: ok ({count} {'policy' if count == 1 else 'policies'})")
    return status


def _test(args: argparse.Namespace) -> int:
    status = EXIT_OK
    tests: list[dict[str, Any]] = []
    for path in args.files:
        try:
            outcomes = run_test_file(path)
        except PolicyError as error:
            problems = [str(problem) for problem in error.problems]
            if args.json:
                print(json.dumps({"ok": False, "tests": tests, "problems": problems}, indent=2))
            else:
                _print_tests(tests)  # what the files before it said
                for problem in problems:
                    print(problem, file=sys.stderr)
            return EXIT_BAD_INPUT
        for outcome in outcomes:
            if not outcome.passed:
                status = EXIT_NO
            tests.append(
                {
                    "file": path,
                    "name": outcome.name,
                    "passed": outcome.passed,
                    "failures": list(outcome.failures),
                    "happened": [] if outcome.passed else describe_plans(outcome.plans),
                }
            )
    if args.json:
        print(json.dumps({"ok": status == EXIT_OK, "tests": tests, "problems": []}, indent=2))
        return status
    _print_tests(tests)
    return status


def _print_tests(tests: list[dict[str, Any]]) -> None:
    for test in tests:
        if test["passed"]:
            print(f"PASS {test['file']}: {test['name']}")
            continue
        print(f"FAIL {test['file']}: {test['name']}")
        for failure in test["failures"]:
            print(f"  {failure}")
        print("  what happened:")
        for line in test["happened"]:
            print(f"    {line}")
