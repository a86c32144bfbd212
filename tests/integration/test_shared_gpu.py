"""Several simulated engines under one real daemon (real processes on loopback, real SQLite).

On one simulated GPU (``--sim-gpu-share``): each engine sees the other's memory, a raise that
would overbook the card is refused, and two restarts asked for in the same tick run one after
the other. On two GPUs: load on one engine tunes that engine only — policy states, guards and
history are per engine."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.integration.sim_daemon import free_port, sim_command, started, ticked
from tunerd.config import load_config
from tunerd.daemon import Daemon
from tunerd.sim.load import LoadOptions, run_load

pytestmark = pytest.mark.slow
ENGINES = ("chat", "embed")
UP = {"metric": "engine_up", "above": 0.5}


class Card:
    """The config of two engines sharing GPU 0 of one simulated H100, and what the daemon said."""

    def __init__(self, tmp_path: Path, policies: list[dict[str, Any]]) -> None:
        self.tmp_path = tmp_path
        self.ports = {name: free_port() for name in ENGINES}
        self.said: list[dict[str, Any]] = []
        share = tmp_path / "card.json"
        engines = []
        for name in ENGINES:
            command = sim_command(self.ports[name], "h100-80g", "--sim-gpu-share", str(share))
            engines.append(
                {
                    "name": name,
                    "command": command,
                    "url": self.url(name),
                    "gpus": [0],
                    "settings": {"gpu_memory_utilization": 0.45, "max_model_len": 16384, "max_num_seqs": 8},
                    "bounds": {"gpu_memory_utilization": [0.40, 0.60], "max_num_seqs": [4, 8]},
                    "drain": "30s",
                    "startup_timeout": "30s",
                    "probation": "1s",
                    "gpu_wait": "20s",
                }
            )
        policy_file = tmp_path / "policies.yaml"
        policy_file.write_text(yaml.safe_dump({"version": 1, "policies": policies}, sort_keys=False))
        config = tmp_path / "tunerd.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "engines": engines,
                    # the card as one engine's simulator reports it: both engines' processes
                    "gpu": {"source": "sim", "url": self.url("embed")},
                    "metrics": {"interval": "200ms"},
                    "mode": "act",
                    "policies": [str(policy_file)],
                    "guards": {"settle": "0s"},
                    "state_dir": str(tmp_path / "state"),
                }
            )
        )
        self.daemon = Daemon(
            load_config(config), say=lambda event, **fields: self.said.append({"event": event, **fields})
        )

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def history(self, name: str) -> list[dict[str, Any]]:
        return [h for h in self.daemon.state.history(limit=50) if h["engine"] == name]

    def close(self) -> None:
        pids = [record.pid for name in ENGINES if (record := self.daemon.state.engine(name)) and record.pid]
        self.daemon.close()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


@pytest.fixture
def card(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Card]:
    made = Card(tmp_path, request.param)
    try:
        started(made.daemon)
        yield made
    finally:
        made.close()


RAISE_CHAT = [
    {
        "name": "raise-chat",
        "engines": ["chat"],
        "when": UP,
        "then": [{"tune": {"gpu_memory_utilization": "+0.1"}}, {"restart": {"drain": "30s"}}],
        "cooldown": "1h",
    }
]
SHRINK_BOTH = [
    {
        "name": "shrink-both",
        "when": UP,
        "then": [{"tune": {"max_num_seqs": "step_down"}}, {"restart": {"drain": "30s"}}],
        "cooldown": "1h",
    }
]


@pytest.mark.parametrize("card", [RAISE_CHAT], indirect=True)
def test_each_engine_sees_the_other_and_an_overbooking_raise_is_refused(card: Card) -> None:
    gpu = httpx.get(card.url("embed") + "/sim/gpu", timeout=5).json()["gpus"][0]
    pids = {p["pid"] for p in gpu["processes"]}
    engines = {card.daemon.state.engine(name).pid for name in ENGINES}  # type: ignore[union-attr]
    assert engines <= pids  # one card: embed's simulator lists chat's process too
    chat_pid = card.daemon.state.engine("chat").pid  # type: ignore[union-attr]

    ticked(card.daemon)

    refused = card.history("chat")[0]
    assert (refused["kind"], refused["outcome"]) == ("tune", "skipped"), refused
    assert "GPU 0 would be 1 booked (chat 0.55 beside embed 0.45; limit 0.95)" in refused["reason"]
    assert card.daemon.state.engine("chat").pid == chat_pid  # type: ignore[union-attr]  # not restarted
    assert not [h for h in card.history("embed") if h["kind"] == "tune"]


@pytest.mark.parametrize("card", [SHRINK_BOTH], indirect=True)
def test_two_restarts_asked_for_at_once_never_overlap(card: Card) -> None:
    card.said.clear()  # the first starts said their steps too
    ticked(card.daemon)  # both engines' policy fires in this one tick: one restarts, one waits
    waiting = [loop.name for loop in card.daemon.engines if loop.waiting is not None]
    assert len(waiting) == 1
    ticked(card.daemon)  # the GPU is free again: the waiting plan goes ahead

    for name in ENGINES:
        tune = next(h for h in card.history(name) if h["kind"] == "tune")
        assert tune["outcome"] == "succeeded", (tune["outcome"], tune["reason"])
        assert tune["to_settings"]["max_num_seqs"] == 6
    # what the daemon said, in order: one engine's whole restart, then the other's
    steps = [(e["engine"], e["step"]) for e in card.said if e["event"] == "restart_step"]
    first = steps[0][0]
    firsts = [i for i, (engine, _) in enumerate(steps) if engine == first]
    seconds = [i for i, (engine, _) in enumerate(steps) if engine != first]
    assert firsts
    assert seconds
    assert max(firsts) < min(seconds), steps
    done = [e for e in card.said if e["event"] == "restart_finished"]
    assert [e["engine"] for e in done] == [first, next(n for n in ENGINES if n != first)]
    assert card.said.index(done[0]) < next(
        i for i, e in enumerate(card.said) if e["event"] == "restart_step" and e["engine"] != first
    )
    for name in ENGINES:
        assert httpx.get(card.url(name) + "/health", timeout=5).status_code == 200


def test_two_engines_on_two_gpus_keep_their_own_policy_states_guards_and_history(tmp_path: Path) -> None:
    """Each engine on its own simulated card (no --sim-gpu-share): load on one saturates its
    pool; only that engine's policy fires, only its guards and history move."""
    ports = {name: free_port() for name in ENGINES}
    settings = {
        "max_model_len": 16384,
        "max_num_seqs": 12,
        "max_num_batched_tokens": 8192,
        "kv_cache_memory_bytes": 6 << 30,
    }
    engines = [
        {
            "name": name,
            "command": sim_command(ports[name], "h100-80g"),
            "url": f"http://127.0.0.1:{ports[name]}",
            "gpus": [index],
            "settings": dict(settings),  # one dict each: a shared one is dumped as &id001/*id001
            "bounds": {"max_num_seqs": [4, 12]},
            "drain": "30s",
            "startup_timeout": "30s",
            "probation": "1s",
        }
        for index, name in enumerate(ENGINES)
    ]
    policy = {
        "name": "pool-saturated",
        "when": {
            "all": [
                {"metric": "kv_cache_usage", "above": 0.85},
                {"metric": "num_requests_waiting", "above": 0},
            ]
        },
        "then": [{"tune": {"max_num_seqs": "step_down"}}, {"restart": {"drain": "30s"}}],
        "cooldown": "1h",
    }
    policy_file = tmp_path / "policies.yaml"
    policy_file.write_text(yaml.safe_dump({"version": 1, "policies": [policy]}, sort_keys=False))
    config = tmp_path / "tunerd.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "engines": engines,
                "gpu": {"source": "none"},
                "metrics": {"interval": "200ms"},
                "mode": "act",
                "policies": [str(policy_file)],
                "guards": {"settle": "0s"},
                "state_dir": str(tmp_path / "state"),
                "listen": {"metrics": "127.0.0.1:0"},
            }
        )
    )
    daemon = Daemon(load_config(config), say=lambda *a, **k: None)
    try:
        started(daemon)
        options = LoadOptions(
            f"http://127.0.0.1:{ports['chat']}",
            concurrency=12,
            prompt_tokens=8_000,
            max_tokens=512,
            duration=60,
        )
        threading.Thread(target=run_load, args=(options,), daemon=True).start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(
            h["kind"] == "tune" for h in daemon.state.history(engine="chat")
        ):
            ticked(daemon)
            time.sleep(0.2)
        for _ in range(5):
            ticked(daemon)  # embed goes on being watched after chat's restart
        daemon.publish()
        status = {engine["name"]: engine for engine in (daemon.published or {})["engines"]}

        chat_tune = next(h for h in daemon.state.history(engine="chat") if h["kind"] == "tune")
        assert chat_tune["outcome"] == "succeeded", chat_tune
        assert status["chat"]["settings"]["max_num_seqs"] == 9
        assert status["chat"]["guards"]["restarts_in_window"] == 2  # the first start and the tune
        assert [h["kind"] for h in daemon.state.history(engine="embed")] == [
            "restart"
        ]  # its first start only
        assert status["embed"]["settings"]["max_num_seqs"] == 12
        assert status["embed"]["guards"]["restarts_in_window"] == 1
        states = {name: {p["name"]: p["state"] for p in status[name]["policies"]} for name in ENGINES}
        assert states["chat"]["pool-saturated"] == "cooldown"
        assert states["embed"]["pool-saturated"] == "inactive"
    finally:
        pids = [record.pid for name in ENGINES if (record := daemon.state.engine(name)) and record.pid]
        daemon.close()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
