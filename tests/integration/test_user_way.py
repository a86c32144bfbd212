"""Acceptance, the user's way: docs/config.md's engine ``command`` is a console script
(``[vllm, serve, …]``); here the simulator's own console script from the virtual environment,
``tunerd sim serve …``, found on ``PATH`` — and tunerd itself started as its console script,
as systemd does. /proc then shows ``…/bin/python …/bin/tunerd sim serve …``, not the argv
in the config.

With no policy firing, in each mode, over ten simulated minutes: the engine tunerd started
first is the engine that still serves (same PID), nothing was restarted, nothing alerted, and
history holds the first start alone. tunerd stopped with SIGTERM and started again re-adopts
that very engine, silently."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.integration.cli import VENV_BIN, TunerdRun, run_tunerd
from tests.integration.sim_daemon import free_port
from tunerd.state import State, StateError

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]
SEED = {
    "gpu_memory_utilization": 0.92,
    "max_model_len": 32768,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 2048,
    "kv_cache_dtype": "fp8",
}
SIMULATED_MINUTES = 10
#: a console script, as docs/config.md writes `[vllm, serve, MODEL]`
COMMAND = [
    "tunerd", "sim", "serve", "--host", "127.0.0.1", "--time-scale", "50", "--sim-startup-seconds", "10",
    "--sim-model", "llama-3.1-8b", "--sim-weights", "awq", "--sim-gpu", "rtx4090",
]  # fmt: skip


def _config(tmp_path: Path, port: int, mode: str) -> Path:
    url = f"http://127.0.0.1:{port}"
    config = {
        "engines": [
            {
                "name": "llama31-8b",
                "control": "supervise",
                # a console script, as docs/config.md writes `[vllm, serve, MODEL]`
                "command": [*COMMAND, "--port", str(port)],
                "url": url,
                "settings": SEED,
                "bounds": {
                    "gpu_memory_utilization": [0.80, 0.95],
                    "max_num_seqs": [4, 16],
                    "max_num_batched_tokens": [512, 8192],
                },
                "drain": "30s",
                "startup_timeout": "60s",
            }
        ],
        "gpu": {"source": "sim", "url": url, "interval": "250ms"},
        "metrics": {"interval": "1s"},
        "clock": {"source": "sim", "url": url},
        "mode": mode,
        "policies": [str(ROOT / "policies" / "default.yaml")],  # the shipped policies
        "state_dir": str(tmp_path / "state"),
        "listen": {"metrics": "127.0.0.1:0", "status": str(tmp_path / "tunerd.sock")},
    }
    path = tmp_path / "tunerd.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _wait(what: str, condition: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, OSError, StateError):
            if condition():  # type: ignore[operator]
                return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _history(state_dir: Path) -> list[dict[str, object]]:
    state = State.open(state_dir, readonly=True)
    try:
        return state.history(limit=100)
    finally:
        state.close()


def _engine_pid(state_dir: Path) -> int | None:
    state = State.open(state_dir, readonly=True)
    try:
        record = state.engine("llama31-8b")
        return record.pid if record else None
    finally:
        state.close()


def _simulated_seconds(url: str) -> float:
    return float(httpx.get(url + "/sim/clock", timeout=2).json()["time"])


@pytest.mark.parametrize("mode", ["observe", "advise", "act"])
def test_a_console_script_engine_is_left_alone_when_no_policy_fires(tmp_path: Path, mode: str) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    state_dir = tmp_path / "state"
    config = _config(tmp_path, port, mode)
    env = {"PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    pid = None
    first = TunerdRun(config, env=env)
    try:
        # the database exists a moment before its first record: an empty history is "not yet"
        _wait(
            "the first start", lambda: [h["outcome"] for h in _history(state_dir)[-1:]] == ["succeeded"], 60
        )
        pid = _engine_pid(state_dir)
        assert pid is not None
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert argv[1].endswith(b"/bin/tunerd"), argv  # python runs the script: /proc is not the config
        _wait(
            f"{SIMULATED_MINUTES} simulated minutes",
            lambda: _simulated_seconds(url) >= SIMULATED_MINUTES * 60,
            60,
        )
        assert _engine_pid(state_dir) == pid
        assert Path(f"/proc/{pid}").exists()
        history = _history(state_dir)
        assert [(h["kind"], h["mode"], h["outcome"]) for h in history] == [("restart", mode, "succeeded")], (
            history
        )
        assert first.events("alert") == []
        assert first.stop() == 0

        second = TunerdRun(config, env=env)  # tunerd restarted: the engine served on
        try:
            reconciled = second.event("engine_reconciled")
            assert reconciled["outcome"] == f"adopted pid {pid}"
            since = _simulated_seconds(url)
            _wait("four more simulated minutes", lambda: _simulated_seconds(url) >= since + 240, 30)
            assert _engine_pid(state_dir) == pid
            assert len(_history(state_dir)) == 1
            assert second.events("alert") == []
        finally:
            assert second.stop() == 0
    finally:
        first.stop()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


FEWER_SEQS = {
    "version": 1,
    "policies": [
        {
            "name": "fewer-seqs",
            "description": "an idle engine: fewer sequences (a test policy that fires at once)",
            "when": {"metric": "num_requests_running", "below": 1},
            "then": [{"tune": {"max_num_seqs": "step_down"}}, {"restart": {"drain": "0s"}}],
            "cooldown": "1h",
        }
    ],
}


def _engines(port: int) -> set[int]:
    """The simulated engines serving ``port`` that lead their own session, as tunerd starts
    them (the console script shows as `python …/bin/tunerd sim serve … --port N`)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if b"serve" in argv and str(port).encode() in argv and int(stat[3]) == int(entry.name):
                found.add(int(entry.name))
    return found


def test_status_answers_through_a_restart_and_sigterm_leaves_it_to_the_next_tunerd(tmp_path: Path) -> None:
    """A restart that a policy asks for reaches probation (20 s). Meanwhile `tunerd status
    --json` answers within a second, every second, with the step and its deadline. SIGTERM
    then: STOPPING=1, tunerd gone within 10 s, no engine spawned after it, the restart left in
    the state; the next tunerd finishes it — the same engine, promoted."""
    port = free_port()
    state_dir, sock = tmp_path / "state", tmp_path / "tunerd.sock"
    policies = tmp_path / "policies.yaml"
    policies.write_text(yaml.safe_dump(FEWER_SEQS))
    config = _config(tmp_path, port, "act")
    data = yaml.safe_load(config.read_text())
    data["policies"] = [str(policies)]
    data["clock"] = {"source": "system"}
    data["engines"][0]["probation"] = "20s"
    data["guards"] = {"settle": "0s"}  # the policy fires right after the first start
    config.write_text(yaml.safe_dump(data))
    notify = tmp_path / "notify"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(notify))
    env = {"PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}", "NOTIFY_SOCKET": str(notify)}
    first = TunerdRun(config, env=env)
    try:

        def status(answering: bool = True) -> dict[str, object]:
            done = run_tunerd("status", "--json", "--socket", str(sock), timeout=10)
            if not answering and done.returncode != 0:
                return {}  # not serving its socket yet
            assert done.returncode == 0, done.stderr
            engine: dict[str, object] = json.loads(done.stdout)["engines"][0]
            return engine

        def in_probation() -> bool:
            restart = status(answering=False).get("restart")
            return isinstance(restart, dict) and restart.get("step") == "probation"

        _wait("probation", in_probation, 90)
        answers = []
        for _ in range(5):
            asked = time.monotonic()
            engine = status()
            answers.append(time.monotonic() - asked)
            restart = engine["restart"]
            assert isinstance(restart, dict)
            assert (engine["state"], restart["kind"], restart["step"]) == (
                "restarting",
                "restart",
                "probation",
            )
            assert restart["deadline"] > time.time()
            time.sleep(max(0.0, 1.0 - (time.monotonic() - asked)))
        assert max(answers) < 1.0, answers
        serving = _engines(port)
        assert len(serving) == 1

        asked = time.monotonic()
        first.process.send_signal(signal.SIGTERM)
        assert first.process.wait(timeout=15) == 0
        assert time.monotonic() - asked <= 10
        said = []
        listener.settimeout(0.5)
        with contextlib.suppress(TimeoutError):
            while True:
                said.append(listener.recv(4096).decode())
        assert any(message.startswith("STOPPING=1") for message in said), said
        time.sleep(2)
        assert _engines(port) == serving  # nothing spawned after SIGTERM; the new engine serves on
        state = State.open(state_dir, readonly=True)
        try:
            [intent] = state.intents()
        finally:
            state.close()
        assert (intent.kind, intent.step) == ("restart", "probation")
    finally:
        first.stop()

    second = TunerdRun(config, env=env)
    try:
        _wait(
            "the restart finished",
            lambda: [h["outcome"] for h in _history(state_dir)[:1]] == ["succeeded"],
            60,
        )
        tune = next(h for h in _history(state_dir) if h["kind"] == "tune")
        assert tune["outcome"] == "succeeded"
        assert tune["to_settings"]["max_num_seqs"] == 6  # type: ignore[index]
        assert {_engine_pid(state_dir)} == serving  # the engine in probation, promoted: not respawned
        assert (
            "resuming an interrupted restart from 'probation'" in second.event("engine_reconciled")["outcome"]
        )
    finally:
        second.stop()
        for pid in serving | _engines(port):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        listener.close()
