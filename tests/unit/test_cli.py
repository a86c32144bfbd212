"""The entry point loads only the command asked for: `tunerd status` run every second by a
watch loop must not pay for the config schema, the policy engine and the daemon."""

from __future__ import annotations

import subprocess
import sys

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
    assert loaded == "LOADED  2", done.stdout + done.stderr  # nothing heavy; exit 2: no daemon there
    assert "no status socket at /nonexistent/tunerd.sock" in done.stderr


def test_help_lists_every_command_from_the_table() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tunerd", "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0
    for name in COMMANDS:
        assert f"    {name} " in done.stdout, name
