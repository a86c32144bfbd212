"""What the real-engine stories share: a config for a supervised tiny vLLM, a ``tunerd run``
subprocess whose JSON lines are read as they come, and a load of distinct long prompts that
records every request's start, end and status."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.integration.cli import TUNERD
from tests.realvllm import ROOT, vllm_python
from tests.realvllm.tiny_model import _WORDS
from tunerd.state import State

REALVLLM = [
    pytest.mark.realvllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        vllm_python() is None, reason="no vLLM CPU build (make test installs it; or set TUNERD_VLLM_PYTHON)"
    ),
]
ENGINE = "tiny"
MODEL_NAME = "tiny-llama"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def shipped_policy(name: str, **changes: Any) -> dict[str, Any]:
    """One of the shipped default policies, with the durations a test can wait for."""
    shipped = yaml.safe_load((ROOT / "policies" / "default.yaml").read_text())
    policy = next(p for p in shipped["policies"] if p["name"] == name)
    return _replace(policy, changes)


def _replace(node: Any, changes: dict[str, Any]) -> Any:
    if isinstance(node, dict):
        return {key: changes.get(key, _replace(value, changes)) for key, value in node.items()}
    if isinstance(node, list):
        return [_replace(item, changes) for item in node]
    return node


def write_config(
    tmp_path: Path,
    *,
    python: str,
    model: Path,
    port: int,
    settings: dict[str, Any],
    bounds: dict[str, list[Any]],
    policies: list[dict[str, Any]],
    probation: str = "5s",
    gate: dict[str, Any] | None = None,
) -> Path:
    policy_file = tmp_path / "policies.yaml"
    policy_file.write_text(yaml.safe_dump({"version": 1, "policies": policies}, sort_keys=False))
    command = [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--served-model-name", MODEL_NAME, "--dtype", "bfloat16", "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    config = {
        "engine": {
            "name": ENGINE,
            "command": command,
            "env": {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
            "url": f"http://127.0.0.1:{port}",
            "settings": settings,
            "bounds": bounds,
            "drain": "30s",
            "startup_timeout": "240s",
            "probation": probation,
            **({"gate": gate} if gate is not None else {}),
        },
        "gpu": {"source": "none"},  # the CPU build has no GPU to read (DESIGN §7)
        "metrics": {"interval": "500ms"},
        "mode": "act",
        "policies": [str(policy_file)],
        "guards": {"max_restarts": 5, "window": "1h", "settle": "0s"},
        "state_dir": str(tmp_path / "state"),
    }
    path = tmp_path / "tunerd.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


class Tunerd:
    """``tunerd run --config`` as an operator starts it; its stdout/stderr JSON lines are kept."""

    def __init__(self, config: Path) -> None:
        self.config = config
        self.lines: list[str] = []
        self.process = subprocess.Popen(
            [*TUNERD, "run", "--config", str(config)],  # the console script, as an operator runs it
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        found = []
        for line in list(self.lines):
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    event = json.loads(line)
                    if name is None or event.get("event") == name:
                        found.append(event)
        return found

    def wait_event(
        self, name: str, timeout: float, where: Callable[[dict[str, Any]], bool] = lambda e: True
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            for event in self.events(name):
                if where(event):
                    return event
            if time.monotonic() >= deadline or self.process.poll() is not None:
                break
            time.sleep(0.2)
        raise AssertionError(f"no {name} event within {timeout:g} s; tunerd said:\n" + self.output())

    def output(self) -> str:
        return "\n".join(self.lines[-80:])

    def stop(self, timeout: float = 180) -> int:
        """SIGTERM, as systemd stops it; the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return code


def wait_healthy(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise AssertionError(f"{url}/health did not answer 200 within {timeout:g} s")


def engine_record(state_dir: Path) -> Any:
    state = State.open(state_dir, readonly=True)
    try:
        return state.engine(ENGINE)
    finally:
        state.close()


def history(state_dir: Path) -> list[dict[str, Any]]:
    state = State.open(state_dir, readonly=True)
    try:
        return state.history(limit=1000)
    finally:
        state.close()


def kill_engine(state_dir: Path) -> None:
    """Teardown: the engines outlive tunerd by design, so the test ends them."""
    with contextlib.suppress(Exception):
        record = engine_record(state_dir)
        if record is not None and record.pid is not None:
            os.killpg(record.pid, signal.SIGKILL)


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


@dataclass(frozen=True)
class Request:
    started: float  # time.time()
    ended: float
    status: int | None  # None: no HTTP answer (refused while the engine was down)
    detail: str = ""  # the answer's first 200 characters, or the client's error
    finish_reason: str | None = None  # of a 200 answer: "length" (all tokens asked for), "abort"…
    tokens: int = 0  # completion tokens in a 200 answer
    first_token: float | None = None  # when its first token arrived (time.time()): it was in the engine
    asked: int = 0  # max_tokens asked for
    prompt_tokens: int = 0

    def whole(self, max_model_len: int) -> bool:
        """Answered with every token asked for (vLLM caps a request at ``max_model_len``)."""
        return self.status == 200 and self.tokens == min(self.asked, max_model_len - self.prompt_tokens)


class Load:
    """``workers`` clients, each sending one completion after another: a prompt of about
    ``words`` distinct random words (no shared prefix, so the pool really fills) and about
    ``max_tokens`` of output, streamed, so each record says when its first token came (then the
    engine had it) and how it finished. A refused connection (the engine restarting) is retried
    after a short pause, as real clients do; every attempt is recorded."""

    def __init__(
        self, url: str, *, workers: int, words: int, max_tokens: int, pause: float = 0.0, seed: int = 0
    ) -> None:
        self.url = url
        self.workers = workers
        self.words = words
        self.max_tokens = max_tokens
        self.pause = pause
        self.seed = seed
        self.requests: list[Request] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._work, args=(n,), daemon=True) for n in range(workers)]
        self.seen: list[str] = []
        self._watcher = threading.Thread(target=self._watch, daemon=True)

    def start(self) -> Load:
        for thread in self._threads:
            thread.start()
        self._watcher.start()
        return self

    def pool(self) -> str:
        """What the engine's /metrics said each second: kv usage, waiting, preemptions (for a
        failure message)."""
        return "\n".join(self.seen[-120:])

    def _watch(self) -> None:
        names = ("vllm:kv_cache_usage_perc{", "vllm:num_requests_waiting{", "vllm:num_preemptions_total{")
        with httpx.Client(timeout=10) as client:
            while not self._stop.wait(1.0):
                try:
                    text = client.get(self.url + "/metrics").text
                except httpx.HTTPError as error:
                    self.seen.append(f"{time.time():.1f} {type(error).__name__}")
                    continue
                values = [line.rsplit(" ", 1)[1] for line in text.splitlines() if line.startswith(names)]
                done = len(self.requests)
                self.seen.append(f"{time.time():.1f} usage/waiting/preempted {' '.join(values)}; {done} done")

    def stop(self, timeout: float = 300) -> list[Request]:
        """Send nothing new; wait for the requests in flight."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=timeout)
        return list(self.requests)

    def _work(self, worker: int) -> None:
        rng = random.Random(self.seed * 1000 + worker)
        with httpx.Client(timeout=httpx.Timeout(300, connect=5)) as client:
            while not self._stop.is_set():
                # lengths vary ±50 % and each client pauses a little, as real traffic does: the
                # clients drift apart instead of sending in waves (measured: without the pause,
                # requests capped at max_model_len finished together and the next wave began
                # together)
                self._stop.wait(rng.uniform(0, self.pause))
                words = rng.randint(self.words // 2, self.words * 3 // 2)
                prompt = " ".join(rng.choice(_WORDS) for _ in range(words))
                body = {
                    "model": MODEL_NAME,
                    "prompt": prompt,
                    "max_tokens": rng.randint(self.max_tokens // 2, self.max_tokens * 3 // 2),
                    "ignore_eos": True,
                    "temperature": 0,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                started = time.time()
                try:
                    request = self._stream(client, body, started)
                except httpx.HTTPError as error:
                    request = Request(started, time.time(), None, type(error).__name__)
                    self._stop.wait(0.5)
                self.requests.append(request)

    def _stream(self, client: httpx.Client, body: dict[str, Any], started: float) -> Request:
        """One streamed completion: when its first token came, how it finished, how many tokens."""
        with client.stream("POST", self.url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return Request(started, time.time(), response.status_code, response.read().decode()[:200])
            first: float | None = None
            reason: str | None = None
            tokens = prompt_tokens = 0
            detail = ""
            try:
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: ") :])
                    if "error" in chunk:
                        detail = json.dumps(chunk["error"])[:200]
                        continue
                    for choice in chunk.get("choices", []):
                        if choice.get("text"):
                            first = first or time.time()
                            tokens += 1  # one token a chunk, until the usage says
                        reason = choice.get("finish_reason") or reason
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                        prompt_tokens = chunk["usage"]["prompt_tokens"]
            except httpx.HTTPError as error:  # the answer broke off: keep what came
                detail = f"{type(error).__name__} after {tokens} tokens"
            return Request(
                started, time.time(), 200, detail, reason, tokens, first, body["max_tokens"], prompt_tokens
            )
