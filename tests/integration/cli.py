"""Run the `tunerd` command as a user does, in a child process."""

from __future__ import annotations

import os
import subprocess
import sys

__all__ = ["run_tunerd"]


def run_tunerd(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """``tunerd ARGS…`` with this interpreter; its output captured, its exit status not checked."""
    return subprocess.run(
        [sys.executable, "-m", "tunerd", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, **(env or {})},
    )
