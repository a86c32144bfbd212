"""The saga's fast tier: every branch of the state machine on a box of fake engines and a
manual clock, real SQLite — a crash loop, a spent budget, a hold and its backoff, a rollback
that fails too, reconcile at each step — in milliseconds. The same stories with real
processes are tests/integration/test_saga.py."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.fakes.engines import OOM, FakeBox, settings_key
from tunerd.engine.guards import GuardConfig
from tunerd.engine.saga import FLOWS, EngineSpec, Supervisor
from tunerd.outcomes import CrashResponse, Outcome, SagaKind, SagaResult, Step
from tunerd.state import State, StateUnwritable

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


FINAL = ("succeeded", "failed", "rolled_back", "skipped")


def assert_every_start_is_accounted_for(state: State, engine: str = "main") -> None:
    """Every start of the engine (its generation counts them) is in the history record of
    the action it was made for, and that action has a final outcome — unless its saga is
    still in flight; no restart is left ``applied`` without one."""
    in_flight = {intent.action_id for intent in state.intents() if intent.engine == engine}
    starts = 0
    for action in state.history(engine, limit=10**6):
        if action["kind"] == "notify":
            continue
        starts += len(action["evidence"].get("starts", []))
        if action["id"] not in in_flight and action["outcome"] != "proposed":
            assert action["outcome"] in FINAL, action
    record = state.engine(engine)
    assert starts == (record.generation if record else 0), state.history(engine)


@pytest.fixture
def state(tmp_path: Path) -> Iterator[State]:
    opened = State.open(tmp_path / "state")
    yield opened
    assert_every_start_is_accounted_for(opened)  # after every test of the saga
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


# -- a state that refuses writes, tunerd killed between them (issue 16) ----------------------------

TABLES = ("versions", "engines", "actions", "intents")


class FullDisk:
    """The state's database made genuinely full: it may not grow (SQLite's own
    ``max_page_count``), its free pages are taken, and each write to tunerd's tables needs a
    fresh page (a temp trigger stores a page-sized row beside it) — so the very next write the
    saga makes gets SQLite's real SQLITE_FULL, whichever it is. :meth:`free` makes room."""

    def __init__(self, state: State, tables: tuple[str, ...] = TABLES, blob: int = 4000) -> None:
        self.db = state._db
        self.tables = tables
        self.blob = blob
        self.full = False
        self.db.execute("CREATE TABLE IF NOT EXISTS test_filler (x BLOB)")

    def fill(self, spare_pages: int = 0) -> None:
        for table in self.tables:
            for op in ("INSERT", "UPDATE", "DELETE"):
                self.db.execute(
                    f"CREATE TEMP TRIGGER IF NOT EXISTS test_full_{table}_{op} BEFORE {op} ON main.{table} "
                    f"BEGIN INSERT INTO test_filler VALUES (zeroblob({self.blob})); END"
                )
        pages = self.db.execute("PRAGMA page_count").fetchone()[0]
        self.db.execute(f"PRAGMA max_page_count = {pages}")
        while True:
            try:
                self.db.execute("INSERT INTO test_filler VALUES (zeroblob(256))")
            except sqlite3.OperationalError as error:
                if "full" not in str(error):
                    raise
                break
        if spare_pages:
            pages = self.db.execute("PRAGMA page_count").fetchone()[0]
            self.db.execute(f"PRAGMA max_page_count = {pages + spare_pages}")
        self.full = True

    def free(self) -> None:
        for table in self.tables:
            for op in ("INSERT", "UPDATE", "DELETE"):
                self.db.execute(f"DROP TRIGGER IF EXISTS temp.test_full_{table}_{op}")
        self.db.execute("PRAGMA max_page_count = 1073741823")
        self.full = False


def _look(supervisor: Supervisor) -> object:
    """One look of the daemon's loop at the engine: the saga in flight advances, else a dead
    engine is checked. A write the state refused at the check is the tick's: it is tried
    again at the next one (the daemon's part, tested in tests/integration/test_faults.py)."""
    if supervisor.in_flight():
        return supervisor.advance()
    try:
        return supervisor.check()
    except StateUnwritable as refused:
        return refused


def _serving_what_the_state_says(box: FakeBox, state: State, supervisor: Supervisor) -> None:
    [engine] = box.live()
    record = state.engine("main")
    assert record is not None
    assert (record.pid, record.pid_start) == (engine.pid, engine.identity.start_ticks)
    assert engine.settings == supervisor.running_settings()
    assert state.intents() == []


def _events(scenario: Callable[[FakeBox, State, Supervisor], None], path: Path) -> list[str]:
    """The steps ``scenario`` says (on_step), in order, on a state with room."""
    box, state = FakeBox(path / "engines" / "main.log"), State.open(path / "state")
    said: list[str] = []
    supervisor = _started(box, state)
    supervisor.on_step = said.append
    scenario(box, state, supervisor)
    for _ in range(200):
        if _look(supervisor) is not None and not supervisor.in_flight():
            break
        box.clock.advance(1)
    state.close()
    return said


def _crash(box: FakeBox, state: State, supervisor: Supervisor) -> None:
    box.engines[supervisor.process.pid].exit_code = 1  # type: ignore[union-attr]
    box.log_path.open("a").write(OOM + "\n")


def _doomed_restart(box: FakeBox, state: State, supervisor: Supervisor) -> None:
    doomed = {**SEED, "max_model_len": 131072}
    box.fails[settings_key(doomed)] = TOO_LONG
    assert supervisor.begin_restart(doomed, reason="test") is None


@pytest.mark.parametrize(
    ("scenario", "kind"), [(_crash, SagaKind.RECOVER), (_doomed_restart, SagaKind.ROLLBACK)]
)
def test_a_disk_full_at_each_write_of_a_saga_leaves_it_stuck_then_it_goes_on_by_itself(
    tmp_path: Path, scenario: Callable[[FakeBox, State, Supervisor], None], kind: SagaKind
) -> None:
    """The disk fills at each point of a crash restart and of a rollback — before it begins,
    after each step is written, right after the spawn — so each of its writes is refused in
    turn (SQLite's real SQLITE_FULL). Before the fix the refusal escaped advance() (the
    daemon's job failed at each look) or left the connection inside a transaction; now the
    step is *stuck*: advance() returns, the progress says why, it is tried again with backoff,
    and once there is room it goes on by itself: the engine serves what the state records and
    every action has its final outcome."""
    events = _events(scenario, tmp_path / "dry")
    assert len(events) >= 4, events
    for point in range(len(events) + 1):  # 0: before the saga begins
        where = tmp_path / f"at-{point}"
        box, state = FakeBox(where / "engines" / "main.log"), State.open(where / "state")
        supervisor = _started(box, state)
        disk = FullDisk(state)
        said: list[str] = []

        def on_step(step: str, said: list[str] = said, disk: FullDisk = disk, point: int = point) -> None:
            said.append(step)
            if len(said) == point:
                disk.fill()

        supervisor.on_step = on_step
        if point == 0:
            disk.fill()
        refused = []
        begun = False
        for _ in range(40):  # 40 s full: every look returns, none raises
            if not begun:  # a restart the state refused to begin is asked again (the tick's plan)
                try:
                    scenario(box, state, supervisor)
                    begun = True
                except StateUnwritable as error:
                    refused.append(str(error))
            seen = _look(supervisor)
            if isinstance(seen, StateUnwritable):
                refused.append(str(seen))
            if supervisor.trouble is not None:
                trouble = supervisor.trouble
                refused.append(trouble.error)
                assert trouble.unwritable
                progress = supervisor.progress()
                assert progress is not None
                assert "database or disk is full" in progress.detail
            box.clock.advance(1)
        assert disk.full, (point, said)
        assert refused, f"nothing was refused when full after {said}"
        assert all("database or disk is full" in text for text in refused)
        if supervisor.trouble is not None:
            assert supervisor.trouble.attempts < 15  # backed off: not a try at each look
        disk.free()
        if not begun:
            scenario(box, state, supervisor)
        ended = None
        for _ in range(300):
            seen = _look(supervisor)
            if isinstance(seen, SagaResult) and seen.kind is kind:
                ended = seen
            if ended is not None and not supervisor.in_flight():
                break
            box.clock.advance(1)
        assert ended is not None, (point, said, supervisor.progress())
        assert supervisor.trouble is None
        _serving_what_the_state_says(box, state, supervisor)
        assert_every_start_is_accounted_for(state)
        state.close()


def test_a_crash_restart_is_recorded_with_its_intent_or_not_at_all(box: FakeBox, state: State) -> None:
    """check() recorded the crash restart's action, then wrote its intent apart: tunerd
    stopping between the two (kill -9; here SQLite refusing the intent for want of room) left
    an `applied` action no tunerd would ever end — counted against the restart budget for
    good. Now the two are one write: the next tunerd finds either both or neither."""
    supervisor = _started(box, state, max_restarts=10)
    _crash(box, state, supervisor)
    disk = FullDisk(state, tables=("intents",), blob=200_000)  # the intent needs 50 pages…
    disk.fill(spare_pages=8)  # … the action a few
    with pytest.raises((StateUnwritable, sqlite3.OperationalError)):
        supervisor.check()
    disk.free()
    following = _supervisor(box, state, max_restarts=10)  # tunerd is gone; the next one
    following.reconcile()
    result = _drive(following)
    assert (result.kind, result.outcome) == (SagaKind.RECOVER, Outcome.SUCCEEDED)
    assert [(h["kind"], h["outcome"]) for h in state.history()] == [
        ("restart", "succeeded"),
        ("restart", "succeeded"),
    ]
    assert len(state.restart_times("main", 0)) == 2  # the first start and this one


def test_the_next_tunerd_ends_a_restart_an_older_tunerd_left_applied_without_an_intent(
    box: FakeBox, state: State
) -> None:
    supervisor = _started(box, state)
    orphan = state.record_action(
        engine="main",
        kind="restart",
        mode="act",
        outcome="applied",
        reason="engine crashed",
        now=box.clock.now(),
    )
    assert _supervisor(box, state).reconcile().what == "adopted"
    record = state.action(orphan)
    assert record is not None
    assert record["outcome"] == "skipped"
    assert "no intent" in record["reason"]
    assert len(state.restart_times("main", 0)) == 1  # it no longer counts against the budget
    assert supervisor.running_settings() == SEED


def test_every_start_is_in_the_history_record_of_its_action_when_the_next_tunerd_makes_it(
    box: FakeBox, state: State
) -> None:
    """A rollback killed at `starting`: the next tunerd starts last-known-good. Each start —
    the first, the doomed settings', the rollback's that the next tunerd made — is in the
    history record of its action; before, the generation counted 3 starts and history
    said nothing of two."""
    supervisor = _started(box, state)
    supervisor.room = lambda settings: "GPU 0: 1 GiB free" if settings == SEED else None  # the rollback waits
    _doomed_restart(box, state, supervisor)
    for _ in range(50):
        progress = supervisor.progress()
        assert progress is not None
        if progress.kind is SagaKind.ROLLBACK and progress.step is Step.STARTING:
            break
        supervisor.advance()
        box.clock.advance(1)
    following = _supervisor(box, state)
    assert following.reconcile().what == "resumed"
    result = _drive(following)
    assert (result.kind, result.outcome) == (SagaKind.ROLLBACK, Outcome.ROLLED_BACK)
    tune = state.history()[0]
    starts = tune["evidence"]["starts"]
    assert [start["generation"] for start in starts] == [2, 3]
    assert [start["how"] for start in starts] == ["spawned", "spawned"]
    assert starts[-1]["pid"] == following.process.pid  # type: ignore[union-attr]
    assert state.engine("main").generation == 3  # type: ignore[union-attr]


def test_a_spawned_engine_whose_record_is_refused_is_taken_once_not_at_each_retry(
    box: FakeBox, state: State
) -> None:
    """systemd mode's launch builds a new engine — a `journalctl -f` copy of its journal and a
    rotated log — each time it is polled after `systemctl restart` returned. A retry of the
    refused record polled it again: one more follower per retry. Now the step keeps what its
    launch gave, and records that."""
    supervisor = _started(box, state)
    handed: list[object] = []
    spawn = box.runner.start

    class Launch:
        def __init__(self, argv: object) -> None:
            self.started = spawn(argv)  # type: ignore[arg-type]

        def poll(self) -> object:
            handed.append(self.started.engine)  # each poll hands out an engine (a new follower)
            return self.started.engine

        def detail(self) -> str:
            return "systemctl restart"

    box.runner.start = Launch  # type: ignore[method-assign, assignment]
    disk = FullDisk(state)
    supervisor.on_step = lambda step: disk.fill() if step == "spawned" else None
    supervisor.begin_restart(FEWER, reason="test")
    for _ in range(30):
        assert supervisor.advance() is None
        box.clock.advance(1)
    assert supervisor.trouble is not None
    assert "recording the new engine" in supervisor.trouble.what
    disk.free()
    result = _drive(supervisor)
    assert result.outcome is Outcome.SUCCEEDED
    assert len(handed) == 1


def test_a_pre_stop_failure_whose_end_is_refused_is_still_the_end(box: FakeBox, state: State) -> None:
    """The pre_stop hook failed (the load balancer kept the engine): the restart ends there,
    nothing stopped. When the state refused that end, the retry found the hook done and went
    on to stop the engine it had refused to take out. Now the end is kept and written."""
    supervisor = _started(box, state)
    old = supervisor.process
    assert old is not None
    spec = supervisor.spec
    supervisor.spec = EngineSpec(**{**spec.__dict__, "hooks": {"pre_stop": ("sh", "-c", "exit 3")}})
    disk = FullDisk(state)
    supervisor.on_step = lambda step: disk.fill() if step.startswith("pre_stop") else None
    supervisor.begin_restart(FEWER, reason="test")
    for _ in range(200):  # the hook runs (a real process) and fails; its end is refused
        assert supervisor.advance() is None
        if supervisor.trouble is not None:
            break
        time.sleep(0.01)  # real time: the hook is a real process
    for _ in range(20):
        assert supervisor.advance() is None
        box.clock.advance(1)
    assert supervisor.trouble is not None
    assert "ending the saga (failed)" in supervisor.trouble.what
    disk.free()
    result = _drive(supervisor)
    assert result.outcome is Outcome.FAILED
    assert result.reason.startswith("pre_stop hook failed (exit 3")
    assert old.alive()  # never stopped
    assert box.spawned == [SEED]


def test_a_held_engines_backoff_is_counted_on_the_monotonic_clock(box: FakeBox, state: State) -> None:
    """The wall clock stepped back an hour (NTP, a VM resumed): the held engine's retry was
    due on the wall clock, so it stayed down an hour longer."""
    supervisor = _started(box, state, max_restarts=10, backoff_base=60)
    box.crash_after = 5.0
    box.clock.advance(6)
    assert supervisor.check() is not None  # the first crash: the same settings again
    _drive(supervisor)
    box.clock.advance(6)
    held = supervisor.check()
    assert held is not None
    assert held.response is CrashResponse.HELD
    box.clock._now -= 3600  # the wall clock steps back; monotonic time goes on
    box.clock.advance(61)
    retry = supervisor.check()
    assert retry is not None
    assert retry.response is CrashResponse.RESTARTING
    _drive(supervisor)
