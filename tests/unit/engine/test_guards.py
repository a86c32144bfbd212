"""Guards: budget, settle, in-flight, hold/pin/pause, crash loops, backoff."""

from __future__ import annotations

import pytest

from tunerd.engine.guards import (
    EngineFacts,
    GuardConfig,
    backoff_seconds,
    budget,
    is_crash_loop,
    is_quiet,
    may_change,
    shared_gpu_refusal,
)

HOUR = 3600.0
CONFIG = GuardConfig(max_restarts=3, window=HOUR, settle=900)
SEED = {"gpu_memory_utilization": 0.92, "max_num_seqs": 8}


def test_a_quiet_engine_may_change() -> None:
    assert may_change(EngineFacts(restarts=[]), CONFIG, now=10_000) is None
    assert may_change(EngineFacts(restarts=[10_000 - 901]), CONFIG, now=10_000) is None


def test_one_change_per_settle_period() -> None:
    refusal = may_change(EngineFacts(restarts=[10_000 - 300]), CONFIG, now=10_000)
    assert refusal is not None
    assert "settling: 300 s" in refusal.reason
    assert not refusal.hold


def test_budget_counts_only_the_window_and_exhaustion_holds() -> None:
    now = 100_000.0
    restarts = [now - 2 * HOUR, now - 3000, now - 2000, now - 1000]
    assert budget(EngineFacts(restarts), CONFIG, now) == (3, 0)
    refusal = may_change(EngineFacts(restarts), CONFIG, now)
    assert refusal is not None
    assert refusal.hold
    assert "3 restarts in the last 3600 s" in refusal.reason
    skip = may_change(EngineFacts(restarts), GuardConfig(on_exhausted="skip"), now)
    assert skip is not None
    assert not skip.hold
    # the oldest restart in the window leaves it: budget back
    assert budget(EngineFacts(restarts), CONFIG, now + 601) == (2, 1)
    assert may_change(EngineFacts(restarts), CONFIG, now + 601) is None


@pytest.mark.parametrize(
    ("facts", "words"),
    [
        (EngineFacts([], in_flight=True), "in flight"),
        (EngineFacts([], pinned=True), "pinned"),
        (EngineFacts([], paused="argv changed by a person"), "argv changed by a person"),
        (EngineFacts([], held=True), "held"),
    ],
)
def test_states_that_refuse_any_change(facts: EngineFacts, words: str) -> None:
    refusal = may_change(facts, CONFIG, now=0)
    assert refusal is not None
    assert words in refusal.reason


def test_crash_loops() -> None:
    lower = {**SEED, "gpu_memory_utilization": 0.88}
    assert not is_crash_loop(SEED, [], None)  # a first crash: tune
    assert is_crash_loop(SEED, [SEED], None)  # the same settings crashed again
    assert not is_crash_loop(lower, [SEED], None)  # tunerd changed them in between
    assert is_crash_loop(SEED, [], rolled_back_to=SEED)  # the safe base crashed


def test_backoff_doubles_and_caps() -> None:
    assert [backoff_seconds(n, CONFIG) for n in range(8)] == [0, 30, 60, 120, 240, 480, 960, 1800]


def test_bad_config_is_refused() -> None:
    with pytest.raises(ValueError, match="max_restarts"):
        GuardConfig(max_restarts=0)
    with pytest.raises(ValueError, match="on_exhausted"):
        GuardConfig(on_exhausted="ignore")


def test_quiet_means_watched_the_whole_stretch_and_never_busier() -> None:
    idle = [(float(t), 0.0) for t in range(0, 130, 2)]  # every 2 s for 128 s
    assert is_quiet(idle, now=128.0, max_running=0, hold=120.0)
    assert not is_quiet(idle, now=128.0, max_running=0, hold=200.0)  # not watched that long
    busy_once = [(t, 3.0 if t == 100.0 else v) for t, v in idle]
    assert not is_quiet(busy_once, now=128.0, max_running=0, hold=120.0)
    assert is_quiet(busy_once, now=128.0, max_running=3, hold=120.0)
    assert is_quiet(busy_once, now=128.0, max_running=0, hold=20.0)  # the busy moment is older
    gap = [(t, None if t == 120.0 else v) for t, v in idle]
    assert not is_quiet(gap, now=128.0, max_running=0, hold=120.0)  # a missing reading is not quiet
    assert not is_quiet([], now=128.0, max_running=0, hold=1.0)


def test_engines_sharing_a_gpu_stay_within_its_limit() -> None:
    gpus = {"chat": [0], "embed": [0], "batch": [1]}
    others = {"embed": 0.45, "batch": 0.9}
    assert shared_gpu_refusal("chat", 0.5, gpus, others, 0.95) is None  # 0.95 exactly is fine
    assert shared_gpu_refusal("chat", 0.53, gpus, others, 0.95) == (
        "GPU 0 would be 0.98 booked (chat 0.53 beside embed 0.45; limit 0.95)"
    )
    assert shared_gpu_refusal("batch", 0.97, gpus, {"chat": 0.5, "embed": 0.45}, 0.95) is None  # alone on 1
    tensor_parallel = {"big": [0, 1], "small": [1]}
    assert "GPU 1 would be" in (shared_gpu_refusal("big", 0.8, tensor_parallel, {"small": 0.3}, 0.95) or "")


def test_restarts_in_the_future_count_as_now() -> None:
    """The wall clock stepped back an hour after three restarts: they lie "in the future" of
    ``now`` and still count — budget, settle period and all (a clock step never buys
    restarts)."""
    now = 100_000.0
    restarts = [now + HOUR - 60, now + HOUR - 30, now + HOUR - 10]
    assert budget(EngineFacts(restarts), CONFIG, now) == (3, 0)
    refusal = may_change(EngineFacts(restarts), CONFIG, now, settle=False)
    assert refusal is not None
    assert "restart budget spent: 3 restarts" in refusal.reason
    assert refusal.hold
    settling = may_change(EngineFacts(restarts[-1:]), CONFIG, now)
    assert settling is not None
    assert settling.reason.startswith("settling: 0 s since the last restart")


def test_a_reading_in_the_future_counts_as_now_for_quiet() -> None:
    """A busy reading stamped after ``now`` (the clock stepped back) is the newest reading: the
    engine is not quiet."""
    idle = [(float(t), 0.0) for t in range(0, 130, 2)]
    busy_later = [*idle, (500.0, 5.0)]
    assert not is_quiet(busy_later, now=128.0, max_running=0, hold=120.0)
    assert is_quiet([*idle, (500.0, 0.0)], now=128.0, max_running=0, hold=120.0)
