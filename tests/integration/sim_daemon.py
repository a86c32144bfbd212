"""A real daemon over one simulated engine (real processes on loopback, real SQLite), for the
integration tests that drive the daemon in-process."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

from tunerd.clock import Clock
from tunerd.config import load_config
from tunerd.daemon import Daemon
from tunerd.gpu import OK, GpuReading
from tunerd.sources.gpu import GpuSource, NoGpuSource
from tunerd.state import State

BEFORE = {"gpu_memory_utilization": 0.92, "max_model_len": 32768, "max_num_seqs": 8}


class CountingGpu:
    """A GPU source that answers at once with no GPU and records when it was read: what the
    tests that measure the sampling schedule watch."""

    name = "counting"

    def __init__(self) -> None:
        self.reads: list[float] = []

    def sample(self) -> GpuReading:
        self.reads.append(time.monotonic())
        return GpuReading(source=self.name, status=OK)

    def close(self) -> None:
        pass


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def sim_command(port: int, gpu: str = "rtx4090", *extra: str) -> list[str]:
    """`tunerd sim serve` for the seed's model (Llama 3.1 8B AWQ) on ``gpu``, time ×50, a 10 s
    start-up (0.2 s of wall time)."""
    return [
        sys.executable, "-m", "tunerd", "sim", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--time-scale", "50", "--sim-startup-seconds", "10",
        "--sim-model", "llama-3.1-8b", "--sim-weights", "awq", "--sim-gpu", gpu, *extra,
    ]  # fmt: skip


def sim_daemon(
    tmp_path: Path,
    port: int | None = None,
    settings: dict[str, object] = BEFORE,
    policies: tuple[str, ...] = (),
    guards: dict[str, object] | None = None,
    *,
    top: dict[str, object] | None = None,
    said: list[dict[str, Any]] | None = None,
    gpu: GpuSource | None = None,
    clock: Clock | None = None,
    **engine: object,
) -> Daemon:
    """A daemon (mode act, settle 0) over one simulated engine on ``port``, built from a real
    config file; ``policies`` are policy files, ``top`` adds top-level fields (clock, metrics…),
    ``engine`` fields to the engine's block (hooks, bounds…). ``said`` gets what the daemon
    says, each event with the monotonic time it was said at."""
    port = port or free_port()
    command = sim_command(port)
    config = tmp_path / "tunerd.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "engine": {
                    "name": "main",
                    "command": command,
                    "url": f"http://127.0.0.1:{port}",
                    "settings": settings,
                    "drain": "30s",
                    "startup_timeout": "30s",
                    "probation": "1s",
                    **engine,
                },
                "mode": "act",
                "policies": list(policies),
                "guards": {"settle": "0s", **(guards or {})},
                "state_dir": str(tmp_path / "state"),
                "listen": {"metrics": "127.0.0.1:0"},  # any free port: never the operator's 9464
                **(top or {}),
            }
        )
    )

    def say(event: str, **fields: Any) -> None:
        if said is not None:
            said.append({"event": event, **fields, "at": time.monotonic()})

    return Daemon(load_config(config), gpu=gpu or NoGpuSource(), say=say, clock=clock)


def sim_config(tmp_path: Path, **top: object) -> tuple[Path, str]:
    """A config file for `tunerd run` over one simulated engine on an RTX 4090 (its GPU read
    from the simulator), mode advise, no policies unless ``top`` says; (path, engine URL)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = sim_command(port)
    config = {
        "engine": {
            "name": "main",
            "command": command,
            "url": url,
            "settings": BEFORE,
            "startup_timeout": "30s",
            "probation": "1s",
        },
        "gpu": {"source": "sim", "url": url, "interval": "250ms"},
        "metrics": {"interval": "2s"},
        "mode": "advise",
        "policies": [],
        "state_dir": str(tmp_path / "state"),
        "listen": {"metrics": "127.0.0.1:0"},
        **top,
    }
    path = tmp_path / "tunerd.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, url


def kill_recorded_engine(state_dir: Path, engine: str = "main") -> None:
    """End the engine a finished test left running (engines outlive tunerd by design)."""
    state = State.open(state_dir)
    record = state.engine(engine)
    state.close()
    if record is not None and record.pid:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(record.pid, signal.SIGKILL)


def settle(daemon: Daemon, timeout: float = 60) -> Daemon:
    """Advance the daemon's restarts in flight until none is left, as its ``sagas`` job does
    (for the tests that drive the daemon without its jobs)."""
    deadline = time.monotonic() + timeout
    while daemon.in_flight():
        assert time.monotonic() < deadline, f"restarts still in flight: {daemon.in_flight()}"
        daemon.advance_sagas()
        time.sleep(0.05)
    return daemon


def started(daemon: Daemon, timeout: float = 60) -> Daemon:
    """``daemon.start()`` and its engines' starts carried out."""
    daemon.start()
    return settle(daemon, timeout)


def ticked(daemon: Daemon, timeout: float = 60) -> Daemon:
    """One tick and the restart it began carried out."""
    daemon.tick()
    return settle(daemon, timeout)


def close_daemon(daemon: Daemon, kill: bool) -> None:
    """Close the daemon; with ``kill``, end its engine too (engines outlive tunerd by design)."""
    record = daemon.state.engine("main")
    daemon.close()
    if kill and record is not None and record.pid:
        with contextlib.suppress(ProcessLookupError):  # it may have died on its own
            os.killpg(record.pid, signal.SIGKILL)


@contextlib.contextmanager
def running(daemon: Daemon, prepare: Callable[[], object] | None = None) -> Iterator[Daemon]:
    """The daemon as `tunerd run` runs it: started (its engines' starts carried out), ``prepare``
    done (on this thread, before any job runs), then its jobs on a thread until the block ends,
    the first tick awaited (at most 10 s); then stopped, closed, and its engine killed."""
    stop = threading.Event()
    runner = threading.Thread(target=daemon.run, args=(stop,))
    try:
        started(daemon)
        if prepare is not None:
            prepare()
        runner.start()
        deadline = time.monotonic() + 10
        while daemon.ticks < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        yield daemon
    finally:
        stop.set()
        if runner.is_alive():
            runner.join(60)
        close_daemon(daemon, kill=True)
