"""The saga's fast tier: every branch of the state machine on a box of fake engines and a
manual clock, real SQLite — a crash loop, a spent budget, a hold and its backoff, a rollback
that fails too, reconcile at each step — in milliseconds. The same stories with real
processes are tests/integration/test_saga.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakes.engines import OOM, FakeBox, settings_key
from tunerd.engine.guards import GuardConfig
from tunerd.engine.saga import FLOWS, EngineSpec, Supervisor
from tunerd.outcomes import CrashResponse, Outcome, SagaKind, SagaResult, Step
from tunerd.state import State

SEED = {"gpu_memory_utilization": 0.92, "max_model_len": 32768, "max_num_seqs": 8}
FEWER = {**SEED, "max_num_seqs": 6}
TOO_LONG = (
    "ValueError: To serve at least one request with the model's max seq len (131072), (16.00 GiB "
    "KV cache is needed, which is larger than the available KV cache memory (0.25 GiB). Based on "
    "the available memory, the estimated maximum model length is 2048."
)


@pytest.fixture
def box(tmp_path: Path) -> FakeBox:
    return FakeBox(tmp_path / "engines" / "main.log")


@pytest.fixture
def state(tmp_path: Path) -> Iterator[State]:
    opened = State.open(tmp_path / "state")
    yield opened
    opened.close()


def _supervisor(box: FakeBox, state: State, **guards: object) -> Supervisor:
    spec = EngineSpec(
        name="main",
        command=("vllm", "serve", "/srv/models/llama"),
        url="http://127.0.0.1:8000",
        log_path=box.log_path,
        drain_seconds=5,
        startup_timeout=60,
        probation_seconds=30,
        gpu_wait_seconds=10,
    )
    return Supervisor(
        spec,
        state,
        box.clock,
        guards=GuardConfig(**{"settle": 0, **guards}),  # type: ignore[arg-type]
        client=box.client,  # type: ignore[arg-type]
        runner=box.runner,
    )


def _drive(supervisor: Supervisor, seconds: float = 1.0, looks: int = 500) -> SagaResult:
    """Advance the saga in flight as the daemon's job does, the clock moving between looks."""
    for _ in range(looks):
        result = supervisor.advance()
        if result is not None:
            return result
        supervisor.clock.sleep(seconds)
    raise AssertionError(f"the saga did not end: {supervisor.progress()}")


def _started(box: FakeBox, state: State, **guards: object) -> Supervisor:
    supervisor = _supervisor(box, state, **guards)
    assert supervisor.begin_first_start(SEED) is None
    result = _drive(supervisor)
    assert (result.kind, result.outcome) == (SagaKind.FIRST_START, Outcome.SUCCEEDED)
    return supervisor


def test_a_first_start_is_verified_and_becomes_last_known_good(box: FakeBox, state: State) -> None:
    supervisor = _supervisor(box, state)
    supervisor.begin_first_start(SEED)
    progress = supervisor.progress()
    assert progress is not None
    assert (progress.kind, progress.step) == (SagaKind.FIRST_START, Step.STARTING)
    result = _drive(supervisor)
    assert result.version is not None
    record = state.engine("main")
    assert record is not None
    assert record.running == record.last_known_good == result.version
    assert record.spawned_argv == [*supervisor.spec.argv(SEED)]
    assert state.intents() == []
    assert [(h["kind"], h["outcome"]) for h in state.history()] == [("restart", "succeeded")]


def test_a_restart_walks_every_step_and_never_waits_inside_one(box: FakeBox, state: State) -> None:
    """Each advance returns at once; the drain and probation pass on the clock, looked at."""
    supervisor = _started(box, state)
    old = supervisor.process
    assert old is not None
    assert supervisor.begin_restart(FEWER, reason="pool saturated", policy="kv") is None
    seen: list[tuple[Step, str]] = []
    result = None
    for _ in range(200):
        before = box.clock.monotonic()
        result = supervisor.advance()
        assert box.clock.monotonic() == before  # nothing slept inside
        if result is not None:
            break
        progress = supervisor.progress()
        assert progress is not None
        if not seen or seen[-1][0] != progress.step:
            seen.append((progress.step, progress.detail))
        box.clock.advance(1.0)
    assert result is not None
    assert (result.kind, result.outcome) == (SagaKind.RESTART, Outcome.SUCCEEDED), result
    assert [step for step, _ in seen] == [Step.STOPPING, Step.PROBATION]  # the rest took no waiting
    assert seen[0][1] == f"draining pid {old.pid} (SIGTERM sent)"
    assert old.exit_code == 0  # it drained and left on SIGTERM
    assert box.spawned == [SEED, FEWER]
    assert supervisor.running_settings() == FEWER
    record = state.engine("main")
    assert record is not None
    assert record.last_known_good == result.version


def test_settings_that_cannot_start_roll_back_and_page(box: FakeBox, state: State) -> None:
    supervisor = _started(box, state)
    doomed = {**SEED, "max_model_len": 131072}
    box.fails[settings_key(doomed)] = TOO_LONG
    supervisor.begin_restart(doomed, reason="test")
    result = _drive(supervisor)
    assert (result.kind, result.outcome) == (SagaKind.ROLLBACK, Outcome.ROLLED_BACK)
    assert result.pages
    assert "estimated maximum model length is 2048" in result.reason
    assert supervisor.running_settings() == SEED
    assert state.failed_values("main", since=0) == {"max_model_len": [131072]}
    assert box.spawned == [SEED, doomed, SEED]


def test_a_rollback_that_fails_too_holds_the_engine(box: FakeBox, state: State) -> None:
    supervisor = _started(box, state)
    doomed = {**SEED, "max_model_len": 131072}
    box.fails[settings_key(doomed)] = TOO_LONG
    box.fails[settings_key(SEED)] = TOO_LONG  # the box changed: last-known-good no longer starts
    supervisor.begin_restart(doomed, reason="test")
    result = _drive(supervisor)
    assert (result.kind, result.outcome, result.version) == (SagaKind.ROLLBACK, Outcome.FAILED, None)
    assert "and last-known-good failed too" in result.reason
    record = state.engine("main")
    assert record is not None
    assert record.held


def test_a_crash_in_probation_rolls_back(box: FakeBox, state: State) -> None:
    supervisor = _started(box, state)
    supervisor.begin_restart(FEWER, reason="test")
    box.crash_after = 10.0  # the new settings leak: dead 10 s in, inside the 30 s probation
    result = _drive(supervisor)
    assert (result.kind, result.outcome) == (SagaKind.ROLLBACK, Outcome.ROLLED_BACK)
    assert "crashed in probation (cuda_oom)" in result.reason


def test_an_engine_that_outlives_its_drain_is_killed_with_its_group(box: FakeBox, state: State) -> None:
    supervisor = _started(box, state)
    box.drain_seconds = 10_000.0  # it never finishes draining
    old = supervisor.process
    assert old is not None
    supervisor.begin_restart(FEWER, reason="test")
    result = _drive(supervisor)
    assert result.outcome is Outcome.SUCCEEDED
    assert old.exit_code == -9  # SIGKILL after drain (5 s) + 30 s


def test_a_crash_loop_holds_then_backs_off_without_a_storm(box: FakeBox, state: State) -> None:
    paged: list[str] = []
    supervisor = _started(box, state, max_restarts=10, backoff_base=60)
    supervisor.on_held = paged.append
    box.crash_after = 5.0  # every start of these settings dies 5 s in
    box.clock.advance(6)
    handled = supervisor.check()
    assert handled is not None
    assert handled.response is CrashResponse.RESTARTING  # the first crash: the same settings
    assert _drive(supervisor).crash == "cuda_oom"
    box.clock.advance(6)
    held = supervisor.check()
    assert held is not None
    assert held.response is CrashResponse.HELD
    assert held.reason.startswith("held (crash loop)")
    assert len(paged) == 1
    spawned = len(box.spawned)
    for _ in range(59):  # the backoff: 60 s of looks, nothing started
        box.clock.advance(1)
        waiting = supervisor.check()
        assert waiting is not None
        assert waiting.response is CrashResponse.WAITING
    assert len(box.spawned) == spawned
    box.clock.advance(2)
    retry = supervisor.check()
    assert retry is not None
    assert retry.response is CrashResponse.RESTARTING  # last-known-good again, still held
    assert _drive(supervisor).reason == "last-known-good restarted (still held)"
    record = state.engine("main")
    assert record is not None
    assert record.held
    refused = supervisor.begin_restart(FEWER, reason="pool saturated")
    assert refused is not None
    assert refused.outcome is Outcome.SKIPPED
    assert "held" in refused.reason


def test_a_spent_budget_holds_or_skips_as_configured(box: FakeBox, state: State) -> None:
    supervisor = _started(box, state, max_restarts=2)
    supervisor.begin_restart(FEWER, reason="one")
    _drive(supervisor)  # the first start and this: 2 in the window
    refused = supervisor.begin_restart(SEED, reason="two")
    assert refused is not None
    assert refused.outcome is Outcome.SKIPPED
    assert refused.reason.startswith("restart budget spent: 2 restarts in the last 3600 s")
    record = state.engine("main")
    assert record is not None
    assert record.held
    box.clock.advance(3601)  # the window has passed, but a hold waits for a person
    assert supervisor.begin_restart(SEED, reason="three") is not None


def test_a_spent_budget_with_on_exhausted_skip_does_not_hold(box: FakeBox, state: State) -> None:
    supervisor = _started(box, state, max_restarts=2, on_exhausted="skip")
    supervisor.begin_restart(FEWER, reason="one")
    _drive(supervisor)
    refused = supervisor.begin_restart(SEED, reason="two")
    assert refused is not None
    assert refused.outcome is Outcome.SKIPPED
    record = state.engine("main")
    assert record is not None
    assert not record.held


def test_nothing_is_spawned_once_tunerd_is_stopping(box: FakeBox, state: State) -> None:
    supervisor = _started(box, state)
    stopping = False
    supervisor.stopping = lambda: stopping
    supervisor.begin_restart(FEWER, reason="test")
    for _ in range(2):  # SIGTERM sent; the old engine drains (5 s)
        supervisor.advance()
        box.clock.advance(1)
    stopping = True  # SIGTERM to tunerd meanwhile
    for _ in range(20):
        assert supervisor.advance() is None
        box.clock.advance(1)
    progress = supervisor.progress()
    assert progress is not None
    assert progress.step is Step.STARTING
    assert progress.detail == "tunerd is stopping: nothing is spawned"
    assert box.live() == []
    assert box.spawned == [SEED]


def test_a_start_waits_for_gpu_memory_and_fails_with_its_reason(box: FakeBox, state: State) -> None:
    supervisor = _supervisor(box, state)
    supervisor.room = lambda settings: "GPU 0: 2.52 GiB free, 21.64 GiB needed"
    supervisor.begin_first_start(SEED)
    supervisor.advance()
    progress = supervisor.progress()
    assert progress is not None
    assert progress.detail == "waiting for GPU memory: GPU 0: 2.52 GiB free, 21.64 GiB needed"
    assert progress.deadline == pytest.approx(box.clock.now() + 10)
    result = _drive(supervisor)
    assert result.outcome is Outcome.FAILED
    assert (
        result.reason
        == "first start failed: GPU memory still short after 10 s: GPU 0: 2.52 GiB free, 21.64 GiB needed"
    )
    assert box.spawned == []


@pytest.mark.parametrize("step", list(FLOWS[SagaKind.RESTART]))
def test_the_next_tunerd_finishes_or_undoes_a_restart_left_at_each_step(
    box: FakeBox, state: State, step: Step
) -> None:
    """A tunerd that stops (SIGTERM, kill -9) leaves the intent at ``step``; the next one's
    reconcile picks it up from there."""
    supervisor = _started(box, state)
    box.startup_seconds = 5.0  # the new engine takes a moment: verifying waits
    looks = 0

    def short(settings: object) -> str | None:  # the old engine's memory: two looks to free
        nonlocal looks
        looks += 1
        return "GPU 0: 2.52 GiB free" if looks <= 2 else None

    supervisor.room = short
    supervisor.begin_restart(FEWER, reason="test")
    for _ in range(200):
        progress = supervisor.progress()
        assert progress is not None
        if progress.step is step:
            break
        supervisor.advance()
        box.clock.advance(1)
    # tunerd is gone; a new one over the same state and box
    following = _supervisor(box, state)
    done = following.reconcile()
    if step is Step.INTENT:
        assert done.what == "cancelled"
        assert state.history()[0]["outcome"] == "skipped"
        assert following.running_settings() == SEED
        return
    assert done.what == "resumed"
    result = _drive(following)
    assert (result.kind, result.outcome) == (SagaKind.RESTART, Outcome.SUCCEEDED), result
    assert following.running_settings() == FEWER
    assert len(box.live()) == 1  # one engine: the new one, never two
    assert [h["kind"] for h in state.history()] == ["tune", "restart"]


def test_reconcile_adopts_a_serving_engine_and_starts_a_down_one(box: FakeBox, state: State) -> None:
    supervisor = _started(box, state)
    pid = supervisor.process.pid  # type: ignore[union-attr]
    following = _supervisor(box, state)
    assert following.reconcile().text == f"adopted pid {pid}"
    box.engines[pid].kill_group()  # the box rebooted, say
    after = _supervisor(box, state)
    done = after.reconcile()
    assert done.what == "recovering"
    result = _drive(after)
    assert (result.kind, result.outcome) == (SagaKind.RECOVER, Outcome.SUCCEEDED)
    assert after.running_settings() == SEED


def test_an_engine_dead_in_verification_after_a_restart_rolls_back(box: FakeBox, state: State) -> None:
    supervisor = _started(box, state)
    supervisor.begin_restart(FEWER, reason="test")
    for _ in range(100):
        progress = supervisor.progress()
        if progress is not None and progress.step is Step.PROBATION:
            break
        supervisor.advance()
        box.clock.advance(1)
    assert supervisor.process is not None
    supervisor.process.kill_group()  # it died while tunerd was down
    following = _supervisor(box, state)
    following.reconcile()
    result = _drive(following)
    assert (result.kind, result.outcome) == (SagaKind.ROLLBACK, Outcome.ROLLED_BACK)
    assert following.running_settings() == SEED


def test_a_crash_with_tuned_settings_restarts_with_them(box: FakeBox, state: State) -> None:
    supervisor = _started(box, state)
    box.engines[supervisor.process.pid].exit_code = 1  # type: ignore[union-attr]
    box.log_path.open("a").write(OOM + "\n")
    lower = {**SEED, "gpu_memory_utilization": 0.89}
    handled = supervisor.check(lower, reason="oom: 0.92 → 0.89", policy="oom")
    assert handled is not None
    assert handled.response is CrashResponse.TUNING
    result = _drive(supervisor)
    assert (result.kind, result.outcome, result.crash) == (SagaKind.RESTART, Outcome.SUCCEEDED, "cuda_oom")
    assert supervisor.running_settings() == lower


# -- found in review: each failed before its fix ----------------------------------------------------


def test_a_start_that_fails_before_its_spawn_leaves_a_down_engine_that_is_retried(
    box: FakeBox, state: State
) -> None:
    """A crash restart whose start never spawned (the GPU memory never came) left no process
    behind, so nothing looked at the engine again: down for good. Now it is a down engine:
    check() treats it as dead — a loop holds it, backoff retries last-known-good."""
    supervisor = _started(box, state, max_restarts=10, backoff_base=60)
    supervisor.gpu_free = False  # type: ignore[attr-defined]
    supervisor.room = lambda settings: None if getattr(supervisor, "gpu_free", True) else "GPU 0: 1 GiB free"
    box.engines[supervisor.process.pid].kill_group()  # type: ignore[union-attr]
    first = supervisor.check()
    assert first is not None
    assert first.response is CrashResponse.RESTARTING
    failed = _drive(supervisor)
    assert (failed.kind, failed.outcome, failed.version) == (SagaKind.RECOVER, Outcome.FAILED, None)
    assert "GPU memory still short" in failed.reason
    assert supervisor.process is None
    crash = supervisor.crashed()
    assert crash is not None
    assert crash["message"].startswith("the engine is not running: GPU memory still short")
    held = supervisor.check()
    assert held is not None
    assert held.response is CrashResponse.HELD  # the same settings failed again: a loop
    supervisor.gpu_free = True  # type: ignore[attr-defined]
    box.clock.advance(61)
    retry = supervisor.check()
    assert retry is not None
    assert retry.response is CrashResponse.RESTARTING
    assert _drive(supervisor).outcome is Outcome.SUCCEEDED
    assert len(box.live()) == 1


def test_a_restart_after_a_crash_skips_pre_stop_and_begins_at_stopping(box: FakeBox, state: State) -> None:
    """A pre_stop hook run against a dead engine could fail and keep it down; after a crash
    the restart begins where there is something to do."""
    supervisor = _started(box, state)
    box.engines[supervisor.process.pid].exit_code = 1  # type: ignore[union-attr]
    handled = supervisor.check({**SEED, "gpu_memory_utilization": 0.89}, reason="oom")
    assert handled is not None
    assert handled.response is CrashResponse.TUNING
    progress = supervisor.progress()
    assert progress is not None
    assert progress.step is Step.STOPPING


def test_resume_at_starting_adopts_the_new_engine_it_had_recorded(box: FakeBox, state: State) -> None:
    """Killed after the new engine was spawned and recorded but before the step moved on: the
    next tunerd verifies that engine — it neither stops it nor spawns a second."""
    supervisor = _started(box, state)
    room = "GPU 0: 1 GiB free"
    supervisor.room = lambda settings: room  # the start waits at `starting`
    supervisor.begin_restart(FEWER, reason="test")
    while (progress := supervisor.progress()) is not None and progress.step is not Step.STARTING:
        supervisor.advance()
        box.clock.advance(1)
    room = None  # type: ignore[assignment]
    supervisor.advance()  # spawns and records the new engine, then moves on
    state.advance_intent("main", "starting", box.clock.now())  # …as if the kill came before the move
    new_pid = state.engine("main").pid  # type: ignore[union-attr]
    box.engines[new_pid].identity = box.engines[new_pid].identity.__class__(
        new_pid,
        new_pid * 10,
        ("something", "else"),  # /proc no longer shows the argv it spawned
    )
    following = _supervisor(box, state)
    assert following.reconcile().what == "resumed"
    assert following.progress().step is Step.VERIFYING  # type: ignore[union-attr]
    result = _drive(following)
    assert result.outcome is Outcome.SUCCEEDED
    assert [e.pid for e in box.live()] == [new_pid]
    assert len(box.spawned) == 2  # the first start and this restart's one


def test_an_interrupted_first_start_whose_engine_died_reports_its_end(box: FakeBox, state: State) -> None:
    supervisor = _supervisor(box, state)
    box.startup_seconds = 30.0
    supervisor.begin_first_start(SEED)
    supervisor.advance()  # spawned; verifying
    box.engines[supervisor.process.pid].kill_group()  # type: ignore[union-attr]
    done = _supervisor(box, state).reconcile()
    assert done.result is not None  # the daemon pages for it
    assert (done.result.kind, done.result.outcome) == (SagaKind.FIRST_START, Outcome.FAILED)


def test_an_unexpected_error_in_a_step_fails_the_step_not_the_loop(box: FakeBox, state: State) -> None:
    supervisor = _started(box, state)

    def broken(argv: object) -> object:
        raise RuntimeError("the runner broke")

    box.runner.start = broken  # type: ignore[method-assign, assignment]
    supervisor.begin_restart(FEWER, reason="test")
    result = _drive(supervisor)  # never raises
    assert result.kind is SagaKind.ROLLBACK
    assert result.outcome is Outcome.FAILED
    assert "starting failed: RuntimeError: the runner broke" in result.reason
