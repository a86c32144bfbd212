"""What the benchmarks share: a free port, the simulated engine's command, stopping the engine
tunerd left serving, and the figure each benchmark reports for `make bench`'s table.

A figure is one JSON line appended to the file named by ``TUNERD_BENCH_FIGURES`` (when set):
the DESIGN §8 bar it measures, the measured value as text, the target as text, and whether it
was met. ``bench/table.py`` prints them as one table.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
from pathlib import Path

from tunerd.state import State

ROOT = Path(__file__).parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def sim_command(port: int, time_scale: float, startup_seconds: float, *extra: str) -> list[str]:
    """`tunerd sim serve` as the daemon starts it: the seed's card, model and weights."""
    return [
        sys.executable, "-m", "tunerd", "sim", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--time-scale", f"{time_scale:g}", "--sim-startup-seconds", f"{startup_seconds:g}",
        "--sim-model", "llama-3.1-8b", "--sim-weights", "awq", "--sim-gpu", "rtx4090", *extra,
    ]  # fmt: skip


def kill_engine(state_dir: Path, engine: str = "main") -> None:
    """SIGKILL the process group of the engine tunerd left serving (tunerd stops, engines stay)."""
    with contextlib.suppress(Exception):
        state = State.open(state_dir)
        record = state.engine(engine)
        state.close()
        if record is not None and record.pid:
            os.killpg(record.pid, signal.SIGKILL)


def figure(bar: str, value: str, target: str, met: bool) -> None:
    """Report one DESIGN §8 figure (printed by the benchmark too; tabled by bench/table.py)."""
    print(f"  → {bar}: {value} (target {target}): {'met' if met else 'NOT met'}")
    path = os.environ.get("TUNERD_BENCH_FIGURES")
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps({"bar": bar, "value": value, "target": target, "met": met}) + "\n")
