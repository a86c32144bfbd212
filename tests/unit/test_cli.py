"""The entry point loads only the command asked for: `tunerd status` run every second by a
watch loop must not pay for the config schema, the policy engine and the daemon."""

from __future__ import annotations

import argparse
import subprocess
import sys

from tunerd.cli import build_parser
from tunerd.commands import COMMANDS

PROBE = """
import sys
from tunerd.cli import main
code = main(sys.argv[1:])
heavy = sorted(m for m in ("pydantic", "tunerd.config", "tunerd.policy.engine", "tunerd.daemon",
                           "tunerd.planner.bills") if m in sys.modules)
print("LOADED", ",".join(heavy), code)
"""


def test_status_loads_no_schema_no_policy_engine_no_daemon() -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, "status", "--json", "--socket", "/nonexistent/tunerd.sock"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    loaded = next(line for line in done.stdout.splitlines() if line.startswith("LOADED"))
    assert loaded == "LOADED  3", done.stdout + done.stderr  # nothing heavy; exit 3: no daemon there
    assert "no status socket at /nonexistent/tunerd.sock" in done.stderr


def test_help_lists_every_command_from_the_table() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tunerd", "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0
    for name in COMMANDS:
        assert f"    {name} " in done.stdout, name


def _parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    found: list[tuple[str, argparse.ArgumentParser]] = []

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    found.append((f"{path} {name}", sub))
                    walk(sub, f"{path} {name}")

    walk(build_parser(), "tunerd")
    return found


def test_every_help_teaches_with_examples_and_says_its_exit_status() -> None:
    """Issue 21: an example in every --help. A command that runs (it has a handler of its own)
    says its exit status too."""
    lacking = [path for path, parser in _parsers() if "examples:" not in parser.format_help()]
    assert not lacking, lacking
    leaves = [
        (path, parser)
        for path, parser in _parsers()
        if not any(isinstance(action, argparse._SubParsersAction) for action in parser._actions)
    ]
    silent = [path for path, parser in leaves if "exit status" not in parser.format_help().lower()]
    assert not silent, silent


def test_an_option_is_its_whole_name_and_the_command_says_so() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tunerd", "plan", "--model", "llama-3.1-8b", "--conc", "4"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "tunerd plan: error: unrecognized arguments: --conc 4 (see tunerd plan --help)" in done.stderr
