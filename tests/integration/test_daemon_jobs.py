"""The daemon's jobs on the real APScheduler (tunerd.scheduler): ticks on one thread that
never overlap, sampling that keeps its schedule while a tick is blocked, a dead engine that
brings the tick forward, and a daemon that stops when its ticks keep failing.

The engine is never started (no ``start()``): a tick then reads nothing and changes nothing,
and the test slows or breaks the tick itself — as a restart of minutes or a bug would."""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.sim_daemon import BEFORE, CountingGpu, close_daemon, running, sim_daemon, started
from tunerd.config import load_config
from tunerd.daemon import Daemon

pytestmark = pytest.mark.slow


def _daemon(tmp_path: Path, said: list[dict[str, Any]], gpu: CountingGpu | None = None) -> Daemon:
    config = tmp_path / "tunerd.yaml"
    config.write_text(
        "engine:\n  name: main\n  command: [vllm, serve, /srv/llama]\n"
        "metrics: {interval: 100ms}\ngpu: {interval: 100ms}\n"
        f"policies: []\nstate_dir: {tmp_path / 'state'}\n"
    )
    return Daemon(
        load_config(config),
        gpu=gpu or CountingGpu(),
        say=lambda event, **fields: said.append({"event": event, **fields}),
    )


def test_a_slow_tick_is_never_overlapped_and_sampling_keeps_its_schedule(tmp_path: Path) -> None:
    said: list[dict[str, Any]] = []
    gpu = CountingGpu()
    daemon = _daemon(tmp_path, said, gpu)
    ticks: list[tuple[float, float, int]] = []
    skipped: list[int] = []
    tick = daemon.tick

    def slow_tick() -> None:  # a tick that restarts an engine: it holds the loop thread
        started = time.monotonic()
        tick()
        time.sleep(0.5)
        assert daemon.jobs is not None
        skipped.append(daemon.jobs.skipped["tick"])
        ticks.append((started, time.monotonic(), threading.get_ident()))

    daemon.tick = slow_tick  # type: ignore[method-assign]
    try:
        daemon.run(ticks=3)
    finally:
        daemon.close()
    assert len(ticks) == 3
    assert len({thread for _, _, thread in ticks}) == 1  # the loop's one thread
    assert ticks[0][2] != threading.get_ident()
    for (_, end, _), (start, _, _) in itertools.pairwise(ticks):
        assert start >= end  # never two at once
    assert skipped[-1] >= 3  # runs that fell due meanwhile were skipped, not stacked
    # every 100 ms, tick or no tick: 1.5 s of slow ticks saw a dozen readings or more
    during = [at for at in gpu.reads if ticks[0][0] <= at <= ticks[-1][1]]
    assert len(during) >= 10, during
    assert max(b - a for a, b in itertools.pairwise(during)) < 0.5


def test_ticks_that_keep_failing_stop_the_daemon_with_the_reason(tmp_path: Path) -> None:
    said: list[dict[str, Any]] = []
    daemon = _daemon(tmp_path, said)

    def broken_tick() -> None:
        raise RuntimeError("disk I/O error")

    daemon.tick = broken_tick  # type: ignore[method-assign]
    stop = threading.Event()
    timer = threading.Timer(20, stop.set)  # the test's own limit, never reached when it passes
    timer.start()
    try:
        daemon.run(stop)
    finally:
        timer.cancel()
        daemon.close()
    assert not stop.is_set() or daemon.failure is not None
    assert daemon.failure == "3 ticks in a row failed; last: RuntimeError: disk I/O error"
    failed = [e for e in said if e["event"] == "job_failed"]
    assert [e["job"] for e in failed] == ["tick"] * 3
    assert "broken_tick" in failed[0]["traceback"]
    assert said[-1] == {"event": "stopping", "reason": daemon.failure}


def test_a_dead_engine_brings_the_tick_forward(tmp_path: Path) -> None:
    """A simulated engine killed between two ticks 30 s apart is seen dead, and restarted,
    within a GPU sampling period (the look for a dead engine follows each reading) — not at the
    next tick."""
    said: list[dict[str, Any]] = []
    daemon = sim_daemon(tmp_path, top={"metrics": {"interval": "30s"}}, said=said, gpu=CountingGpu())
    with running(daemon):
        assert daemon.ticks == 1
        killed_at = time.monotonic()
        os.killpg(daemon.engines[0].supervisor.process.pid, signal.SIGKILL)  # type: ignore[union-attr]
        deadline = killed_at + 15

        def after(event: str) -> list[dict[str, Any]]:
            return [e for e in said if e["event"] == event and e["at"] >= killed_at]

        while not after("restart_finished") and time.monotonic() < deadline:
            time.sleep(0.05)
        crash = next(e for e in said if e["event"] == "engine_crash")
        assert crash["at"] - killed_at < 2.0  # sampled every 0.25 s; the tick is 30 s
        recovered = next(e for e in said if e["event"] == "engine_recovered")
        assert recovered["response"] == "restarting", recovered
        assert recovered["outcome"] == "restarting after unknown with the same settings"
        [finished] = after("restart_finished")
        assert (finished["kind"], finished["outcome"]) == ("recover", "succeeded"), finished
        assert finished["at"] - killed_at < 10.0  # advanced by the sagas job, not the 30 s tick
        assert daemon.jobs is not None
        deadline = time.monotonic() + 2
        while daemon.jobs.has("sagas") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not daemon.jobs.has("sagas")  # nothing in flight: the idle daemon does not wake for it


def test_a_reload_that_changes_the_interval_reschedules_the_tick_and_resizes_the_store(
    tmp_path: Path,
) -> None:
    said: list[dict[str, Any]] = []
    daemon = _daemon(tmp_path, said)  # ticks every 100 ms
    config = tmp_path / "tunerd.yaml"
    stop = threading.Event()
    runner = threading.Thread(target=daemon.run, args=(stop,))
    runner.start()
    try:
        time.sleep(0.5)
        assert daemon.ticks >= 3
        config.write_text(config.read_text().replace("metrics: {interval: 100ms}", "metrics: {interval: 1s}"))
        daemon.reload_requested.set()  # what SIGHUP does
        deadline = time.monotonic() + 5
        while not any(e["event"] == "reloaded" for e in said) and time.monotonic() < deadline:
            time.sleep(0.02)
        before = daemon.ticks
        time.sleep(2.0)
        assert daemon.ticks - before <= 3  # one a second now, not ten
        assert daemon.store.capacity == 6 * 3600 + 1
    finally:
        stop.set()
        runner.join(10)
        daemon.close()


def test_the_engines_warnings_and_errors_are_passed_into_tunerds_log(tmp_path: Path) -> None:
    """A first start vLLM refuses (128K tokens do not fit half a 4090): its ERROR lines reach
    tunerd's log with ``source: engine``; its INFO lines stay in the engine's own log."""
    said: list[dict[str, Any]] = []
    refused = {**BEFORE, "gpu_memory_utilization": 0.5, "max_model_len": 131072}
    daemon = sim_daemon(tmp_path, settings=refused, said=said, gpu=CountingGpu())
    try:
        started(daemon)
    finally:
        close_daemon(daemon, kill=True)
    passed = [e for e in said if e["event"] == "engine_log"]
    assert {(e["source"], e["engine"]) for e in passed} == {("engine", "main")}
    errors = [e["line"] for e in passed if e["engine_level"] == "error"]
    assert any("estimated maximum model length" in line for line in errors), passed
    assert not [e for e in passed if e["engine_level"] == "info"]
    log = (tmp_path / "state" / "engines" / "main.log").read_text()
    assert ") INFO " in log


def test_a_for_that_completes_between_ticks_is_acted_on_then(tmp_path: Path) -> None:
    """DESIGN §8: detection within `for` + one sampling interval. A condition first seen at a
    tick, with `for: 1s` and ticks 4 s apart, fires 1 s later — not at the next tick (found by
    bench/bench_detect.py, which measured `for` + two intervals' worth before)."""
    policy = tmp_path / "policies.yaml"
    policy.write_text(
        "version: 1\npolicies:\n  - name: always\n    description: a test policy that always holds\n"
        "    when: {metric: kv_cache_usage, below: 2, for: 1s}\n    then: [{notify: {severity: info}}]\n"
        "    cooldown: 1h\n"
    )
    said: list[dict[str, Any]] = []
    daemon = sim_daemon(
        tmp_path, policies=(str(policy),), top={"metrics": {"interval": "4s"}}, said=said, gpu=CountingGpu()
    )
    with running(daemon):
        first_tick = time.monotonic()
        while not any(e["event"] == "alert" for e in said) and time.monotonic() < first_tick + 10:
            time.sleep(0.05)
        alert = next(e for e in said if e["event"] == "alert")
        assert alert["policy"] == "always"
        assert 0.8 < alert["at"] - first_tick < 2.5  # 1 s after the first tick; the next is at 4 s
