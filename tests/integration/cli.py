"""Run the `tunerd` command as a user does, in a child process."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["TUNERD", "VENV_BIN", "TunerdRun", "run_tunerd"]

#: the virtual environment's scripts: where pip put the ``tunerd`` console script (and where the
#: acceptance tests find other console scripts, such as the simulator's)
VENV_BIN = Path(sys.executable).parent
#: ``tunerd`` as a user runs it: the console script pip installed (``python -m tunerd`` only
#: when the suite runs from an interpreter without one)
TUNERD = [str(VENV_BIN / "tunerd")] if (VENV_BIN / "tunerd").exists() else [sys.executable, "-m", "tunerd"]


def _kept(name: str) -> Path | None:
    """Where a copy of a command's output goes for the session's secret search (conftest)."""
    folder = os.environ.get("TUNERD_TEST_OUTPUT")
    return Path(folder) / f"{name}-{os.getpid()}-{time.monotonic_ns()}.log" if folder else None


def run_tunerd(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """``tunerd ARGS…`` with this interpreter; its output captured, its exit status not checked."""
    done = subprocess.run(
        [*TUNERD, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, **(env or {})},
    )
    if (kept := _kept(args[0] if args else "tunerd")) is not None:
        kept.write_text(f"$ tunerd {' '.join(args)}\n{done.stdout}\n{done.stderr}")
    return done


class TunerdRun:
    """``tunerd run --config CONFIG`` in the background; its JSON log lines kept as they come."""

    def __init__(self, config: Path, env: dict[str, str] | None = None) -> None:
        self.lines: list[str] = []
        self.process = subprocess.Popen(
            [*TUNERD, "run", "--config", str(config)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **(env or {})},
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        kept = _kept("run")
        with kept.open("a") if kept is not None else contextlib.nullcontext() as copy:
            for line in self.process.stdout:
                self.lines.append(line.rstrip("\n"))
                if copy is not None:
                    copy.write(line)

    def events(self, name: str) -> list[dict[str, Any]]:
        found = []
        for line in list(self.lines):
            if line.startswith("{"):
                event = json.loads(line)
                if event.get("event") == name:
                    found.append(dict(event))
        return found

    def event(self, name: str, timeout: float = 30) -> dict[str, Any]:
        """The first ``name`` event, waiting for it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if found := self.events(name):
                return found[0]
            if self.process.poll() is not None and not self.events(name):
                break
            time.sleep(0.1)
        raise AssertionError(f"no {name} event; tunerd said:\n" + "\n".join(self.lines[-30:]))

    def stop(self, timeout: float = 30) -> int:
        if self.process.poll() is None:
            self.process.terminate()
        return self.process.wait(timeout=timeout)
