"""Policy evaluation: for/cooldown timing, missing samples, merging, modes; all without sleeping."""

from __future__ import annotations

import itertools

import pytest

from tunerd import detect
from tunerd.policy.engine import EngineContext, evaluate, matures_at, new_states
from tunerd.policy.schema import Policy, load_policy_file
from tunerd.store import Event, Store

SETTINGS = {"max_num_seqs": 8, "max_num_batched_tokens": 2048, "gpu_memory_utilization": 0.92}
BOUNDS = {
    "max_num_seqs": [4, 16],
    "max_num_batched_tokens": [512, 8192],
    "gpu_memory_utilization": [0.80, 0.95],
}


def _policies(text: str) -> list[Policy]:
    return list(load_policy_file("p.yaml", "version: 1\npolicies:\n" + text).policies)


def _context(mode: str = "act", **changes: object) -> EngineContext:
    return EngineContext(name="e", settings={**SETTINGS, **changes}, bounds=BOUNDS, mode=mode)


HOT = _policies("""
  - name: hot
    when: {metric: kv_cache_usage, above: 0.85, for: 1m}
    then: [{tune: {max_num_seqs: step_down}}, {restart: {drain: 10s}}]
    cooldown: 5m
""")


def _run(
    policies: list[Policy],
    values: list[float | None],
    interval: float = 10.0,
    context: EngineContext | None = None,
) -> list[tuple[float, dict[str, tuple[object, object]], str]]:
    store = Store(capacity=1000)
    states = new_states(policies)
    fired = []
    for index, value in enumerate(values):
        now = index * interval
        store.record("kv_cache_usage", "e", now, value)
        states, plan = evaluate(policies, states, store, context or _context(), now)
        if plan is not None:
            fired.append((now, plan.changes, plan.mode))
    return fired


def test_for_fires_after_the_hold_not_before() -> None:
    fired = _run(HOT, [0.5, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9])
    assert [time for time, _, _ in fired] == [70.0]  # true since 10 s, 1 m later


def test_a_missing_sample_neither_fires_nor_clears() -> None:
    """A None in the middle does not reset the hold; a None at the due time does not fire."""
    assert [t for t, _, _ in _run(HOT, [0.9, 0.9, None, 0.9, 0.9, 0.9, 0.9])] == [60.0]
    assert _run(HOT, [0.9, 0.9, 0.9, 0.9, 0.9, 0.9, None]) == []


def test_a_false_sample_resets_the_hold() -> None:
    assert [t for t, _, _ in _run(HOT, [0.9, 0.9, 0.9, 0.5, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9])] == [100.0]


def test_cooldown_then_for_counts_only_after_the_action() -> None:
    fired = _run(HOT, [0.9] * 60)
    times = [t for t, _, _ in fired]
    assert times[0] == 60.0
    assert all(b - a >= 300 for a, b in itertools.pairwise(times))


def test_states_pending_firing_cooldown() -> None:
    store = Store(capacity=100)
    states = new_states(HOT)
    seen = []
    for index, value in enumerate([0.5, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9]):
        store.record("kv_cache_usage", "e", index * 10.0, value)
        states, _ = evaluate(HOT, states, store, _context(), index * 10.0)
        seen.append(states["hot"].state)
    assert seen == [
        "inactive",
        "pending",
        "pending",
        "pending",
        "pending",
        "pending",
        "pending",
        "firing",
        "cooldown",
    ]


def test_mode_capped_by_the_global_mode() -> None:
    policies = _policies("""
  - name: hot
    when: {metric: kv_cache_usage, above: 0.85}
    then: [{tune: {max_num_seqs: step_down}}]
    mode: act
""")
    assert _run(policies, [0.9], context=_context(mode="advise"))[0][2] == "advise"
    observe = _policies("""
  - name: hot
    when: {metric: kv_cache_usage, above: 0.85}
    then: [{tune: {max_num_seqs: step_down}}]
    mode: observe
""")
    assert _run(observe, [0.9], context=_context(mode="act"))[0][2] == "observe"


def test_tunes_that_change_nothing_never_restart() -> None:
    store = Store(capacity=10)
    store.record("kv_cache_usage", "e", 0.0, 0.9)
    policies = _policies("""
  - name: hot
    when: {metric: kv_cache_usage, above: 0.85}
    then: [{tune: {max_num_seqs: step_down}}, {restart: {drain: 10s}}]
""")
    _, plan = evaluate(policies, new_states(policies), store, _context(max_num_seqs=4), 0.0)
    assert plan is not None
    assert plan.changes == {}
    assert plan.restart is None


def test_merge_order_crash_before_saturation_and_first_tune_wins() -> None:
    policies = _policies("""
  - name: saturated
    when: {metric: kv_cache_usage, above: 0.85}
    then: [{tune: {gpu_memory_utilization: 0.95}}, {restart: {drain: 60s}}]
  - name: oom
    when: {event: engine_crash, kind: cuda_oom}
    then: [{tune: {gpu_memory_utilization: -0.03}}, {restart: {drain: 0s}}]
""")
    store = Store(capacity=10)
    store.record("kv_cache_usage", "e", 0.0, 0.9)
    store.add_event(Event(0.0, "engine_crash", "e", data={"kind": "cuda_oom"}))
    _, plan = evaluate(policies, new_states(policies), store, _context(), 0.0)
    assert plan is not None
    assert plan.policies == ("oom", "saturated")
    assert plan.changes == {"gpu_memory_utilization": (0.92, 0.89)}
    assert plan.restart is not None
    assert plan.restart.drain == 0.0


def test_first_of_takes_the_first_alternative_that_moves() -> None:
    policies = _policies("""
  - name: oom
    when: {event: engine_crash}
    then:
      - first_of:
          - tune: {gpu_memory_utilization: -0.03}
          - tune: {max_num_batched_tokens: halve}
""")
    store = Store(capacity=10)
    store.add_event(Event(0.0, "engine_crash", "e", data={"kind": "cuda_oom"}))
    _, plan = evaluate(policies, new_states(policies), store, _context(gpu_memory_utilization=0.80), 0.0)
    assert plan is not None
    assert plan.changes == {"max_num_batched_tokens": (2048, 1024)}


def test_a_broken_policy_reports_health_and_others_run(monkeypatch: pytest.MonkeyPatch) -> None:
    policies = _policies("""
  - name: broken
    when: {signal: over_budget}
    then: [{hold: true}]
  - name: hot
    when: {metric: kv_cache_usage, above: 0.85}
    then: [{tune: {max_num_seqs: step_down}}]
""")

    def explode(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("detector failed")

    monkeypatch.setattr(detect, "over_budget", explode)
    store = Store(capacity=10)
    store.record("kv_cache_usage", "e", 0.0, 0.9)
    states, plan = evaluate(policies, new_states(policies), store, _context(), 0.0)
    assert states["broken"].health == "error"
    assert states["broken"].last_error == "RuntimeError: detector failed"
    assert plan is not None
    assert plan.policies == ("hot",)


def test_same_inputs_same_plan() -> None:
    assert _run(HOT, [0.9] * 30) == _run(HOT, [0.9] * 30)


def test_matures_at_says_when_a_for_will_have_held_long_enough() -> None:
    """The daemon ticks again then, instead of waiting for its next tick (DESIGN §8)."""
    both = _policies("""
  - name: hot
    when: {metric: kv_cache_usage, above: 0.85, for: 1m}
    then: [{notify: {severity: info}}]
  - name: busy
    when:
      all:
        - {metric: num_requests_running, above: 2, for: 30s}
        - not: {metric: kv_cache_usage, below: 0.1, for: 5m}
    then: [{notify: {severity: info}}]
""")
    store = Store(capacity=100)
    states = new_states(both)
    assert matures_at(both, states, 0.0) is None  # nothing counting
    store.record("kv_cache_usage", "e", 100.0, 0.9)
    store.record("num_requests_running", "e", 100.0, 1)
    states, plan = evaluate(both, states, store, _context(), 100.0)
    assert plan is None
    assert matures_at(both, states, 100.0) == 160.0  # hot: seen at 100, for 1m
    store.record("kv_cache_usage", "e", 110.0, 0.9)
    store.record("num_requests_running", "e", 110.0, 3)
    states, _ = evaluate(both, states, store, _context(), 110.0)
    assert matures_at(both, states, 110.0) == 140.0  # busy's 30 s from 110 comes first
    assert matures_at(both, states, 150.0) == 160.0  # past ones are not due again
    states, plan = evaluate(both, states, store, _context(), 160.0)
    assert plan is not None
    assert "hot" in plan.policies


FITTING = _policies("""
  - name: oom
    when: {event: engine_crash, kind: cuda_oom}
    then:
      - first_of:
          - tune: {gpu_memory_utilization: fit}
          - tune: {gpu_memory_utilization: -0.03}
          - tune: {max_num_batched_tokens: halve}
      - restart: {drain: 0s}
  - name: underused
    when: {metric: kv_cache_usage, below: 0.4}
    then: [{tune: {gpu_memory_utilization: fit}}, {restart: {drain: 0s}}]
""")


def _fit_plan(
    fit: tuple[object, str, object] | None, *, crash: bool
) -> tuple[dict[str, tuple[object, object]], tuple[str, ...]]:
    store = Store(capacity=100)
    if crash:
        store.add_event(Event(1.0, "engine_crash", "e", data={"kind": "cuda_oom"}))
    else:
        store.record("kv_cache_usage", "e", 1.0, 0.1)
    fits = {} if fit is None else {"gpu_memory_utilization": fit}
    context = EngineContext(name="e", settings=SETTINGS, bounds=BOUNDS, mode="act", fits=fits)  # type: ignore[arg-type]
    _, plan = evaluate(FITTING, new_states(FITTING), store, context, 2.0)
    assert plan is not None
    return plan.changes, plan.reasons


def test_a_computed_fit_is_the_first_ofs_answer() -> None:
    changes, reasons = _fit_plan((0.874, "the observed peak", {"kv_cache_tokens": 100}), crash=True)
    assert changes == {"gpu_memory_utilization": (0.92, 0.874)}
    assert "fit: the observed peak" in reasons[0]


def test_without_calibration_the_notches_take_over() -> None:
    assert _fit_plan(None, crash=True)[0] == {"gpu_memory_utilization": (0.92, 0.89)}


def test_a_fit_that_says_the_engine_is_fine_stops_the_notches() -> None:
    """Calibrated and already within its fit: the crash policy changes nothing rather than
    taking a notch on top (and so asks for no restart)."""
    changes, reasons = _fit_plan((0.93, "room to spare", None), crash=True)
    assert changes == {}
    assert any("within its fit" in reason for reason in reasons)


def test_a_fit_goes_up_only_outside_crash_and_memory_policies_and_past_the_hysteresis() -> None:
    assert _fit_plan((0.95, "room", None), crash=False)[0] == {"gpu_memory_utilization": (0.92, 0.95)}
    assert _fit_plan((0.93, "a little room", None), crash=False)[0] == {}  # under 0.02: not worth it
