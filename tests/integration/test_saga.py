"""The restart saga against the simulator as a real process: a restart that passes, one that
cannot start and is rolled back, and tunerd killed with SIGKILL at every step of a restart."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tunerd.engine.args import settings_from_argv
from tunerd.engine.guards import GuardConfig
from tunerd.engine.process import read_identity
from tunerd.engine.saga import CrashHandled, EngineSpec, Supervisor
from tunerd.outcomes import CrashResponse, Outcome, SagaKind, SagaResult
from tunerd.state import State

pytestmark = pytest.mark.slow

NO_SETTLE = GuardConfig(settle=0)  # the tests restart right after a start
SEED_SETTINGS = {
    "gpu_memory_utilization": 0.92,
    "max_model_len": 32768,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 2048,
    "kv_cache_dtype": "fp8",
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _spec(tmp_path: Path, port: int) -> EngineSpec:
    command = (
        sys.executable, "-m", "tunerd", "sim", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--time-scale", "50", "--sim-startup-seconds", "10",
        "--sim-model", "llama-3.1-8b", "--sim-weights", "awq", "--sim-gpu", "rtx4090",
    )  # fmt: skip
    return EngineSpec(
        name="main",
        command=command,
        url=f"http://127.0.0.1:{port}",
        log_path=tmp_path / "engines" / "main.log",
        drain_seconds=30,
        startup_timeout=30,
        probation_seconds=1.0,
    )


@pytest.fixture
def world(tmp_path: Path) -> Iterator[tuple[EngineSpec, State]]:
    spec = _spec(tmp_path, _free_port())
    state = State.open(tmp_path / "state")
    yield spec, state
    record = state.engine("main")
    if record is not None and record.pid is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(record.pid, signal.SIGKILL)
    state.close()


def _serving_settings(spec: EngineSpec, state: State) -> dict[str, object]:
    """What the live engine was started with, read from its own argv."""
    record = state.engine(spec.name)
    assert record is not None
    assert record.pid is not None
    live = read_identity(record.pid)
    assert live is not None, "the recorded engine is not running"
    assert live.start_ticks == record.pid_start
    assert httpx.get(spec.url + "/health", timeout=5).status_code == 200
    return settings_from_argv(live.argv)


def test_restart_with_new_settings_is_verified_and_promoted(world: tuple[EngineSpec, State]) -> None:
    spec, state = world
    supervisor = Supervisor(spec, state, guards=NO_SETTLE)
    first = supervisor.start_initial(SEED_SETTINGS)
    assert first.outcome == "succeeded"
    safer = {**SEED_SETTINGS, "max_num_seqs": 4}
    result = supervisor.restart(safer, reason="pool saturated", policy="pool-saturated")
    assert result.outcome == "succeeded", result.reason
    assert _serving_settings(spec, state) == safer
    record = state.engine("main")
    assert record is not None
    assert record.last_known_good == result.version == record.running
    assert record.generation == 2
    assert state.version(result.version).startup_seconds is not None
    assert state.intents() == []
    tune = state.history()[0]
    assert (tune["kind"], tune["outcome"], tune["policy"]) == ("tune", "succeeded", "pool-saturated")
    assert tune["from_settings"]["max_num_seqs"] == 8
    assert tune["to_settings"]["max_num_seqs"] == 4
    assert "non-default args" in spec.log_path.read_text()  # the new engine's own log


def test_settings_that_cannot_start_are_rolled_back(world: tuple[EngineSpec, State]) -> None:
    spec, state = world
    supervisor = Supervisor(spec, state, guards=NO_SETTLE)
    assert supervisor.start_initial(SEED_SETTINGS).outcome == "succeeded"
    good = state.engine("main")
    assert good is not None
    # 128K tokens of 16-bit KV do not fit in half a 4090: vLLM refuses to start.
    doomed = {
        **SEED_SETTINGS,
        "gpu_memory_utilization": 0.5,
        "max_model_len": 131072,
        "kv_cache_dtype": "auto",
    }
    result = supervisor.restart(doomed, reason="test")
    assert result.outcome == "rolled_back"
    assert "max_model_len_exceeds_kv" in result.reason
    assert "estimated maximum model length" in result.reason
    assert _serving_settings(spec, state) == SEED_SETTINGS
    record = state.engine("main")
    assert record is not None
    assert record.running == record.last_known_good == good.last_known_good
    failed = state.failed_values("main", since=0)
    assert failed["max_model_len"] == [131072]
    assert state.history()[0]["outcome"] == "rolled_back"
    assert state.intents() == []


def test_a_start_waits_for_the_gpu_memory_its_settings_need(world: tuple[EngineSpec, State]) -> None:
    """The GPU reading is the one fake here (no GPU): it reports the old engine's memory held
    for two more looks, then free; the start waits for it. Memory that never frees fails the
    start with the reason, and nothing is spawned."""
    spec, state = world
    looks: list[dict[str, object]] = []

    def room(settings: dict[str, object]) -> str | None:
        looks.append(settings)
        return "GPU 0: 2.52 GiB free, 21.64 GiB needed" if len(looks) <= 2 else None

    supervisor = Supervisor(spec, state, guards=NO_SETTLE, room=room)
    assert supervisor.start_initial(SEED_SETTINGS).outcome == "succeeded"
    assert looks == [SEED_SETTINGS] * 3
    pid = state.engine("main").pid
    os.killpg(pid, signal.SIGKILL)
    stuck = Supervisor(
        EngineSpec(**{**spec.__dict__, "gpu_wait_seconds": 1.0}),
        state,
        guards=NO_SETTLE,
        room=lambda settings: "GPU 0: a neighbour holds 20 GiB",
    )
    failed = stuck.start_initial(SEED_SETTINGS)
    assert failed.outcome == "failed"
    assert (
        failed.reason
        == "first start failed: GPU memory still short after 1 s: GPU 0: a neighbour holds 20 GiB"
    )
    assert stuck.process is None


# An engine whose main process exits at once while a child of it prints the failure a moment
# later — as vLLM's engine-core process can, and as the journal copy of systemd mode lags. The
# text is vLLM 0.33's (shared/reference/vllm-facts.md).
LATE_FAILURE = (
    "(sleep 0.4; echo \"ValueError: To serve at least one request with the model's max seq len "
    "(131072), (16.00 GiB KV cache is needed, which is larger than the available KV cache memory "
    '(0.25 GiB). Based on the available memory, the estimated maximum model length is 2048.") & exit 1'
)


def test_a_start_failure_is_diagnosed_from_lines_written_after_the_main_process_exited(
    world: tuple[EngineSpec, State],
) -> None:
    spec, state = world
    late = EngineSpec(**{**spec.__dict__, "command": ("sh", "-c", LATE_FAILURE)})
    failed = Supervisor(late, state, guards=NO_SETTLE).start_initial(SEED_SETTINGS)
    assert failed.outcome == "failed"
    assert "max_model_len_exceeds_kv" in failed.reason, failed.reason
    assert "estimated maximum model length is 2048" in failed.reason


HOOK = """
import os, sys, urllib.request
try:
    health = urllib.request.urlopen(os.environ["TUNERD_ENGINE_URL"] + "/health", timeout=5).status
except OSError:
    health = "down"
with open(sys.argv[1], "a") as out:
    out.write(f"{os.environ['TUNERD_HOOK']} {os.environ['TUNERD_ENGINE']} {health}\\n")
print("hook ran")
sys.exit(int(sys.argv[2]))
"""


def _with_hooks(spec: EngineSpec, record: Path, pre_stop_exit: int = 0) -> EngineSpec:
    hooks = {
        "pre_stop": (sys.executable, "-c", HOOK, str(record), str(pre_stop_exit)),
        "post_start": (sys.executable, "-c", HOOK, str(record), "0"),
    }
    return EngineSpec(**{**spec.__dict__, "hooks": hooks})


def test_hooks_run_in_order_around_a_restart(world: tuple[EngineSpec, State], tmp_path: Path) -> None:
    """post_start once the engine is verified, pre_stop while the old one still serves."""
    spec, state = world
    record = tmp_path / "hooks.txt"
    supervisor = Supervisor(_with_hooks(spec, record), state, guards=NO_SETTLE)
    assert supervisor.start_initial(SEED_SETTINGS).outcome == "succeeded"
    result = supervisor.restart({**SEED_SETTINGS, "max_num_seqs": 4}, reason="test")
    assert result.outcome == "succeeded", result.reason
    assert record.read_text().splitlines() == [
        "post_start main 200",
        "pre_stop main 200",
        "post_start main 200",
    ]
    log = (spec.log_path.parent / "main.hooks.log").read_text()
    assert log.count("pre_stop: exit 0 in") == 1
    assert log.splitlines().count("hook ran") == 3  # the hooks' own output is kept


def test_a_failing_pre_stop_aborts_the_restart(world: tuple[EngineSpec, State], tmp_path: Path) -> None:
    """The load balancer refused to take the engine out: nothing is stopped, the restart fails
    with the hook's own words, and the old engine serves on."""
    spec, state = world
    supervisor = Supervisor(
        _with_hooks(spec, tmp_path / "hooks.txt", pre_stop_exit=3), state, guards=NO_SETTLE
    )
    assert supervisor.start_initial(SEED_SETTINGS).outcome == "succeeded"
    before = state.engine("main")
    result = supervisor.restart({**SEED_SETTINGS, "max_num_seqs": 4}, reason="test")
    assert result.outcome == "failed"
    assert result.reason.startswith("pre_stop hook failed (exit 3 in ")
    assert result.reason.endswith(": hook ran): the old engine still serves")
    after = state.engine("main")
    assert (after.pid, after.running) == (before.pid, before.running)
    assert _serving_settings(spec, state) == SEED_SETTINGS
    assert state.intents() == []
    assert state.history()[0]["outcome"] == "failed"


DRIVER = """
import json, os, signal, sys
from pathlib import Path
from tunerd.engine.guards import GuardConfig
from tunerd.engine.saga import CrashHandled, EngineSpec, Supervisor
from tunerd.outcomes import CrashResponse, Outcome, SagaKind, SagaResult
from tunerd.state import State
spec_json, state_dir, die_at, settings = sys.argv[1:5]
raw = json.loads(spec_json)
spec = EngineSpec(**{**raw, "command": tuple(raw["command"]), "log_path": Path(raw["log_path"])})
def on_step(step):
    if step == die_at:
        os.kill(os.getpid(), signal.SIGKILL)
Supervisor(spec, State.open(state_dir), on_step=on_step, guards=GuardConfig(settle=0)).restart(json.loads(settings), reason="fault test")
print("restart finished without dying", flush=True)
"""

STEPS_TO_DIE_AT = ["intent", "stopping", "starting", "spawned", "verifying", "probation"]


@pytest.mark.parametrize("die_at", STEPS_TO_DIE_AT)
def test_tunerd_killed_at_each_step_of_a_restart(
    world: tuple[EngineSpec, State], tmp_path: Path, die_at: str
) -> None:
    spec, state = world
    assert Supervisor(spec, state, guards=NO_SETTLE).start_initial(SEED_SETTINGS).outcome == "succeeded"
    safer = {**SEED_SETTINGS, "max_num_seqs": 4}
    spec_json = json.dumps(
        {
            **{
                k: getattr(spec, k)
                for k in ("name", "url", "drain_seconds", "startup_timeout", "probation_seconds")
            },
            "command": list(spec.command),
            "log_path": str(spec.log_path),
            "env": dict(spec.env),
        }
    )
    killed = subprocess.run(
        [sys.executable, "-c", DRIVER, spec_json, str(tmp_path / "state"), die_at, json.dumps(safer)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    [intent] = state.intents()  # the kill left a restart in flight

    next_tunerd = Supervisor(spec, state, guards=NO_SETTLE)
    outcome = next_tunerd.reconcile()
    if next_tunerd.in_flight():
        outcome = next_tunerd.run_to_end()

    assert state.intents() == []
    history = state.history()
    assert [h["kind"] for h in history] == ["tune", "restart"]  # nothing lost, nothing doubled
    tune = history[0]
    record = state.engine("main")
    assert record is not None
    if die_at == "intent":  # the old engine was never touched: the restart is cancelled
        assert tune["outcome"] == "skipped", outcome
        assert _serving_settings(spec, state) == SEED_SETTINGS
        assert record.running == record.last_known_good == intent.from_version
    else:  # the old engine was stopped or stopping: the restart is finished
        assert tune["outcome"] == "succeeded", outcome
        assert _serving_settings(spec, state) == safer
        assert record.running == record.last_known_good == intent.to_version


def _until(supervisor: Supervisor, seconds: float, done: Callable[[list[object]], bool]) -> list[object]:
    """What the supervisor did, look after look, as the daemon's loop asks it: a dead engine's
    ``check`` and the restart in flight's ``advance``; until ``done`` or ``seconds``."""
    seen: list[object] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not done(seen):
        if supervisor.in_flight():
            if (result := supervisor.advance()) is not None:
                seen.append(result)
        elif (handled := supervisor.check()) is not None and handled.response is not CrashResponse.WAITING:
            seen.append(handled)
        time.sleep(0.05)
    return seen


def test_a_crash_loop_holds_the_engine_without_a_restart_storm(tmp_path: Path) -> None:
    port = _free_port()
    base = _spec(tmp_path, port)
    # The engine leaks ~1 GiB a wall second: every start of these settings dies of a CUDA OOM.
    spec = EngineSpec(**{**base.__dict__, "command": (*base.command, "--sim-drift", "100GiB/h")})
    state = State.open(tmp_path / "state")
    guards = GuardConfig(settle=0, max_restarts=10, backoff_base=60)
    paged: list[str] = []
    supervisor = Supervisor(spec, state, guards=guards, on_held=paged.append)
    try:
        assert supervisor.start_initial(SEED_SETTINGS).outcome == "succeeded"

        def held(seen: list[object]) -> bool:
            return bool(seen) and getattr(seen[-1], "response", None) is CrashResponse.HELD

        seen = _until(supervisor, 60, held)
        first, restarted = seen[0], seen[1]
        assert isinstance(first, CrashHandled)
        assert first.response is CrashResponse.RESTARTING  # a first crash: the same settings again
        assert first.reason == "restarting after cuda_oom with the same settings"
        assert isinstance(restarted, SagaResult)
        assert (restarted.kind, restarted.outcome, restarted.crash) == (
            SagaKind.RECOVER,
            Outcome.SUCCEEDED,
            "cuda_oom",
        )
        assert restarted.text() == "restarted after cuda_oom with the same settings"
        assert seen[-1].reason.startswith("held (crash loop)")  # the same settings crashed again
        [page] = paged  # the daemon turns it into a critical alert
        assert page.startswith("crash loop after cuda_oom (")
        assert page.endswith("): tuning stopped")
        record = state.engine("main")
        assert record is not None
        assert record.held
        kinds = [(h["kind"], h["outcome"]) for h in state.history()]
        assert kinds[:3] == [("hold", "succeeded"), ("restart", "skipped"), ("restart", "succeeded")]
        assert "CUDA out of memory" in state.history()[1]["reason"]
        assert state.history()[1]["evidence"]["crash"]["kind"] == "cuda_oom"
        # Held: backoff (60 s) before last-known-good is tried again; no storm meanwhile.
        for _ in range(20):
            handled = supervisor.check()
            assert handled is not None
            assert handled.response is CrashResponse.WAITING
            assert not supervisor.in_flight()
            time.sleep(0.05)
        assert len(state.history()) == len(kinds)
        # and tuning is refused while held
        refused = supervisor.restart({**SEED_SETTINGS, "max_num_seqs": 4}, reason="pool saturated")
        assert refused.outcome == "skipped"
        assert "held" in refused.reason
        assert len(paged) == 1  # paged once, when the hold began
    finally:
        record = state.engine("main")
        if record is not None and record.pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(record.pid, signal.SIGKILL)
        state.close()


def test_a_pinned_engine_that_crashes_restarts_with_its_own_settings(tmp_path: Path) -> None:
    """Regression: a crash of a pinned engine with tuned settings on offer left it down (the
    tune was refused as pinned, and nothing restarted the old settings)."""
    port = _free_port()
    base = _spec(tmp_path, port)
    spec = EngineSpec(**{**base.__dict__, "command": (*base.command, "--sim-drift", "100GiB/h")})
    state = State.open(tmp_path / "state")
    supervisor = Supervisor(spec, state, guards=GuardConfig(settle=0, max_restarts=10))
    try:
        assert supervisor.start_initial(SEED_SETTINGS).outcome == "succeeded"
        state.set_flags("main", pinned=True)
        lower = {**SEED_SETTINGS, "gpu_memory_utilization": 0.89}
        handled = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and handled is None:
            handled = supervisor.check(lower, reason="oom: gpu_memory_utilization 0.92 → 0.89", policy="oom")
            time.sleep(0.1)
        assert handled is not None
        assert handled.response is CrashResponse.RESTARTING
        assert supervisor.run_to_end().outcome == "succeeded"
        assert supervisor.running_settings() == SEED_SETTINGS
        assert [h["kind"] for h in state.history()] == ["restart", "restart"]  # no tune, not even skipped
    finally:
        record = state.engine("main")
        if record is not None and record.pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(record.pid, signal.SIGKILL)
        state.close()
