"""The daemon's alerts reach the chat sinks (a real daemon over the simulator, a local receiver
playing the service): a firing policy's alert, its resolve when the condition clears, and a
sink that hangs for 30 s while the GPU sampling and the ticks keep their schedule."""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.notify_receiver import Answer, receiver
from tests.integration.sim_daemon import (
    CountingGpu,
    close_daemon,
    free_port,
    running,
    sim_command,
    sim_daemon,
    started,
    ticked,
)

pytestmark = pytest.mark.slow

UP = {
    "name": "engine-is-up",
    "when": {"metric": "engine_up", "above": 0.5},
    "then": [{"notify": {"severity": "warning"}}],
}


def _policies(tmp_path: Path, *policies: dict[str, Any]) -> str:
    path = tmp_path / "policies.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "policies": list(policies)}, sort_keys=False))
    return str(path)


def test_an_alert_goes_out_and_its_resolve_follows_when_the_condition_clears(tmp_path: Path) -> None:
    with receiver("slack") as slack:
        said: list[dict[str, Any]] = []
        daemon = sim_daemon(
            tmp_path,
            policies=(_policies(tmp_path, {**UP, "cooldown": "1h"}),),
            top={"mode": "observe", "notify": [{"name": "chat", "kind": "slack", "url": slack.url}]},
            said=said,
        )
        try:
            started(daemon)
            daemon._start_sampling()  # the dispatcher's lanes start with the jobs
            ticked(daemon)
            [firing] = slack.wait_for(1)
            assert firing.json()["text"].startswith("tunerd warning: engine-is-up on main")
            pid = daemon.engines[0].supervisor.process.pid  # type: ignore[union-attr]
            os.killpg(pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while daemon.engines[0].supervisor.process.alive() and time.monotonic() < deadline:  # type: ignore[union-attr]
                time.sleep(0.05)
            ticked(daemon)  # engine_up 0: the condition no longer holds
            got = slack.wait_for(2)
            notes = [h for h in daemon.state.history(limit=50) if h["kind"] == "notify"]
        finally:
            close_daemon(daemon, kill=True)
    assert len(got) == 2
    assert got[1].json()["text"].startswith("tunerd resolved: engine-is-up on main")
    assert [(h["outcome"], h["reason"].split(":")[0]) for h in reversed(notes)] == [
        ("applied", "warning firing"),
        ("applied", "warning resolved"),
    ]
    assert all("(sent to chat)" in h["reason"] for h in notes)
    alerts = [e for e in said if e["event"] == "alert"]
    assert [(e["status"], e["sinks"]) for e in alerts] == [("firing", ["chat"]), ("resolved", ["chat"])]


def test_a_sink_hanging_for_30_s_does_not_move_the_sampling_or_the_ticks(tmp_path: Path) -> None:
    """Every tick fires a policy that alerts a webhook whose every answer takes 30 s."""
    with receiver("webhook") as hanging:
        hanging.answer(*[Answer(200, b"{}", delay=30.0)] * 50)
        gpu = CountingGpu()
        daemon = sim_daemon(
            tmp_path,
            policies=(_policies(tmp_path, UP),),
            top={
                "mode": "observe",
                "metrics": {"interval": "250ms"},
                "notify": [{"name": "stuck", "kind": "webhook", "url": hanging.url}],
            },
            gpu=gpu,
        )
        stop = threading.Event()
        runner = threading.Thread(target=daemon.run, args=(stop,))
        try:
            started(daemon)
            runner.start()
            hanging.wait_for(1)  # the lane is now stuck in a send of 30 s
            since, ticks = time.monotonic(), daemon.ticks
            time.sleep(4.0)
            reads = [at for at in gpu.reads if at >= since]
            tick_count = daemon.ticks - ticks
        finally:
            stop.set()
            runner.join(30)
            hanging.release.set()
            notes = [h for h in daemon.state.history(limit=200) if h["kind"] == "notify"]
            close_daemon(daemon, kill=True)
    gaps = [b - a for a, b in itertools.pairwise(reads)]
    assert len(reads) >= 14, reads  # 4 s at 4 Hz
    assert max(gaps) < 0.6, gaps
    assert tick_count >= 12  # 4 s at 4 Hz: the alerts of every tick were handed over, not waited on
    assert len(notes) >= tick_count
    assert all(h["outcome"] == "applied" and "sent to stuck" in h["reason"] for h in notes)


def test_a_crash_loop_pages_every_sink_once(tmp_path: Path) -> None:
    """The engine leaks ~1 GiB a wall second: each start dies of a CUDA OOM, the second crash of
    the same settings is a loop, the engine is held — and a critical alert goes out."""
    port = free_port()
    with receiver("slack") as slack:
        daemon = sim_daemon(
            tmp_path,
            port,
            command=[*sim_command(port), "--sim-drift", "100GiB/h"],
            top={
                "metrics": {"interval": "200ms"},
                "notify": [{"name": "chat", "kind": "slack", "url": slack.url}],
            },
        )
        with running(daemon):
            deadline = time.monotonic() + 60
            while not any("held" in g.json()["text"] for g in slack.got) and time.monotonic() < deadline:
                time.sleep(0.1)
        texts = [g.json()["text"] for g in slack.got]
    held = [text for text in texts if "held" in text]
    assert len(held) == 1, texts
    assert held[0].startswith("tunerd CRITICAL: main held: tuning stopped: crash loop after cuda_oom")
