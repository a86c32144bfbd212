"""Real processes for the gate's tests: ``tunerd sim serve`` on loopback and ``tunerd gate``
in front of it, started as a user starts them (the console script, a config file)."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.cli import TUNERD
from tests.integration.sim_daemon import free_port

#: the seed's engine on the simulated RTX 4090 (DESIGN §6), time ×50
SEED_ENGINE = [
    "--sim-model", "llama-3.1-8b", "--sim-weights", "awq", "--sim-gpu", "rtx4090",
    "--gpu-memory-utilization", "0.92", "--max-model-len", "32768", "--max-num-seqs", "8",
    "--max-num-batched-tokens", "2048", "--kv-cache-dtype", "fp8",
]  # fmt: skip


@dataclass
class Process:
    """A background process whose output lines are kept as they come."""

    process: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    def events(self, name: str) -> list[dict[str, Any]]:
        found = []
        for line in list(self.lines):
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    event = json.loads(line)
                    if event.get("event") == name:
                        found.append(event)
        return found

    def wait_event(self, name: str, timeout: float = 30) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.events(name)
            if found:
                return found[-1]
            if self.process.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"no {name} event:\n" + "\n".join(self.lines[-40:]))

    def stop(self, timeout: float = 20) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def start_sim(port: int, *args: str, scale: str = "50") -> Process:
    command = [
        *TUNERD, "sim", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--time-scale", scale, "--sim-startup-seconds", "10", *args,
    ]  # fmt: skip
    return Process(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))


def start_gate(config: Path | str) -> Process:
    """``tunerd gate --config CONFIG``, as the unit runs it."""
    command = [*TUNERD, "gate", "--config", str(config)]
    return Process(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))


def wait_healthy(url: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.05)
    raise AssertionError(f"{url} never became healthy")


@dataclass
class GateWorld:
    """The simulator, and ``tunerd gate`` in front of it."""

    sim: Process | None
    gate: Process
    engine_url: str
    url: str
    control: Path
    config: Path
    engine_port: int

    def status(self) -> dict[str, Any]:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(self.control)), timeout=5) as client:
            data: dict[str, Any] = client.get("http://gate/status").json()["engines"]["main"]
            return data

    def control_post(self, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(self.control)), timeout=5) as client:
            return client.post(f"http://gate/engines/main/{path}", json=body or {})

    def engine_metric(self, name: str, **labels: str) -> float:
        """The sum of the engine's samples ``name`` with ``labels``."""
        return metric(httpx.get(f"{self.engine_url}/metrics", timeout=5).text, name, **labels)

    def gate_metric(self, name: str, **labels: str) -> float:
        return metric(httpx.get(f"{self.url}/gate/metrics", timeout=5).text, name, **labels)

    def restart_sim(self, *args: str) -> None:
        assert self.sim is not None
        self.sim.stop()
        self.sim = start_sim(self.engine_port, *args)


def gate_config(tmp_path: Path, engine_port: int, **gate: Any) -> tuple[Path, Path, int]:
    port = free_port()
    control = tmp_path / "gate.sock"
    config = {
        "state_dir": str(tmp_path / "state"),
        "engines": [
            {
                "name": "main",
                "url": f"http://127.0.0.1:{engine_port}",
                "command": ["vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct"],
                "gate": {"listen": f"127.0.0.1:{port}", "control": str(control), **gate},
            }
        ],
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path, control, port


@contextlib.contextmanager
def gate_world(
    tmp_path: Path, *sim_args: str, start_engine: bool = True, scale: str = "50", **gate: Any
) -> Iterator[GateWorld]:
    engine_port = free_port()
    sim = start_sim(engine_port, *sim_args, scale=scale) if start_engine else None
    config, control, port = gate_config(tmp_path, engine_port, **gate)
    engine_url = f"http://127.0.0.1:{engine_port}"
    if start_engine:
        wait_healthy(engine_url)
    process = start_gate(config)
    world = GateWorld(sim, process, engine_url, f"http://127.0.0.1:{port}", control, config, engine_port)
    try:
        process.wait_event("gate_control_listening")
        if start_engine:
            process.wait_event("gate_engine_up")
        yield world
    finally:
        world.gate.stop()
        if world.sim is not None:
            world.sim.stop()


def metric(page: str, name: str, **labels: str) -> float:
    return sum(
        sample.value
        for family in text_string_to_metric_families(page)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


def words(n: int) -> str:
    """A prompt of ``n`` tokens for the simulated model (one token per word)."""
    return " ".join(["the"] * n)
