"""A policy's ``gate:`` action: the limits' steps (tunerd.gate.tuning), the policy language's
check of it, and the plan it makes (pure; no gate runs here)."""

from __future__ import annotations

import pytest

from tunerd.gate.tuning import apply_gate, fit_fraction, gate_problem
from tunerd.policy.engine import EngineContext, evaluate, new_states
from tunerd.policy.schema import PolicyError, load_policy_file
from tunerd.store import Store

LIMITS = {"target_fraction": 0.9, "long_threshold": 16384, "long_lane": 1, "max_concurrency": 0}
SEED = {"max_num_seqs": 8, "gpu_memory_utilization": 0.92}


@pytest.mark.parametrize(
    ("knob", "operation", "current", "after"),
    [
        ("target_fraction", "step_down", 0.9, 0.85),  # two-decimal arithmetic: never 0.8500000000000001
        ("target_fraction", "step_down", 0.52, 0.5),
        ("target_fraction", "step_down", 0.5, 0.5),  # the floor
        ("target_fraction", "step_up", 0.98, 1.0),
        ("target_fraction", 0.7, 0.9, 0.7),
        ("long_threshold", "step_down", 16384, 8192),
        ("long_threshold", "step_down", 1500, 1024),
        ("long_threshold", "step_up", 8192, 16384),
        ("long_lane", "step_down", 1, 1),
        ("long_lane", "step_up", 1, 2),
        ("max_concurrency", "step_down", 0, 6),  # from unbounded: the engine's max_num_seqs 8, notched
        ("max_concurrency", "step_down", 6, 4),
        ("max_concurrency", "step_down", 1, 1),
        ("max_concurrency", "step_up", 4, 5),
        ("max_concurrency", "step_up", 0, 0),  # already unbounded
    ],
)
def test_each_limit_steps_as_documented(knob: str, operation: object, current: object, after: object) -> None:
    result = apply_gate(knob, operation, current, SEED)
    assert result.after == after
    assert result.changed is (after != current)


def test_a_step_from_an_unknown_value_changes_nothing_and_says_why() -> None:
    result = apply_gate("target_fraction", "step_down", None, SEED)
    assert not result.changed
    assert "not known" in result.reason
    assert apply_gate("max_concurrency", "step_down", 0, {}).after == 192  # vLLM's 256, notched


@pytest.mark.parametrize(
    ("knob", "operation", "says"),
    [
        ("target_fraction", 1.5, "in (0, 1]"),
        ("target_fraction", True, "in (0, 1]"),
        ("long_threshold", 0.5, "whole numbers"),
        ("long_lane", 0, "from 1"),
        ("max_concurrency", "halve", "step_down, step_up or fit"),
        ("long_lane", "fit", "target_fraction only"),
        ("queue", 3, "not a gate limit"),
    ],
)
def test_bad_gate_values_are_refused(knob: str, operation: object, says: str) -> None:
    problem = gate_problem(knob, operation)
    assert problem is not None
    assert says in problem
    assert gate_problem("max_concurrency", 0) is None


def test_the_policy_language_checks_a_gate_action_where_it_is_written() -> None:
    text = """version: 1
policies:
  - name: tighten
    when: {metric: kv_cache_usage, above: 0.85}
    then:
      - gate: {target_fraction: 1.7, lanes: 2}
"""
    with pytest.raises(PolicyError) as error:
        load_policy_file("p.yaml", text)
    said = str(error.value)
    assert (
        "p.yaml:6: policy 'tighten': then[0].gate.target_fraction: target_fraction must be in (0, 1]" in said
    )
    assert "then[0].gate.lanes: 'lanes' is not a gate limit" in said


POLICY = list(
    load_policy_file(
        "p.yaml",
        """version: 1
policies:
  - name: tighten
    when: {metric: kv_cache_usage, above: 0.85}
    then: [{gate: {target_fraction: step_down, max_concurrency: step_down}}]
""",
    ).policies
)


def _plan(gate: dict[str, object] | None):  # type: ignore[no-untyped-def]
    store = Store(capacity=10)
    store.record("kv_cache_usage", "e", 0.0, 0.9)
    context = EngineContext(name="e", settings=SEED, mode="act", gate=gate)  # type: ignore[arg-type]
    return evaluate(POLICY, new_states(POLICY), store, context, 0.0)[1]


def test_a_fired_gate_action_plans_live_changes_and_no_restart() -> None:
    plan = _plan(LIMITS)
    assert plan is not None
    assert plan.gate_changes == {"target_fraction": (0.9, 0.85), "max_concurrency": (0, 6)}
    assert plan.changes == {}  # no engine flag moves
    assert plan.restart is None
    assert "tighten: gate target_fraction 0.9 → 0.85" in plan.reasons


def test_without_a_gate_the_action_does_not_apply_and_a_silent_gate_is_said() -> None:
    assert _plan(None) is None  # a policy that only retunes a gate: no plan, no alert, no reason
    silent = _plan({})
    assert silent is not None
    assert silent.gate_changes == {}
    assert any("not known" in reason for reason in silent.reasons)


@pytest.mark.parametrize(
    ("in_flight", "pool", "usage", "fitted"),
    [
        # the gate's clients only: answers stop early, the pool holds less than was admitted
        (90_000, 100_000, 0.60, 1.0),  # 0.85 / (0.60 / 0.90) = 1.275: up to the ceiling of 1.0
        (90_000, 100_000, 0.80, 0.95),  # 0.85 / (0.80 / 0.90) = 0.956…: whole hundredths, down
        # clients that bypass the gate: the pool holds more than the gate admitted
        (90_000, 100_000, 0.95, 0.80),  # 0.85 / (0.95 / 0.90) = 0.805…
        (30_000, 100_000, 0.99, 0.50),  # 0.85 / 3.3 = 0.257…: not below the step floor
    ],
)
def test_fit_puts_the_pools_usage_at_the_ceiling(
    in_flight: int, pool: int, usage: float, fitted: float
) -> None:
    value, why = fit_fraction(in_flight, pool, usage)
    assert value == fitted
    assert f"{usage:.0%} used" in why
    result = apply_gate("target_fraction", "fit", 0.9, SEED, (value, why))
    assert result.after == fitted
    assert result.reason.startswith(
        "gate target_fraction 0.9 → " if fitted != 0.9 else "gate target_fraction stays"
    )


@pytest.mark.parametrize(
    ("in_flight", "pool", "usage", "says"),
    [
        (0, 100_000, 0.9, "nothing admitted"),
        (None, 100_000, 0.9, "nothing admitted"),
        (50_000, None, 0.9, "no reading"),
        (50_000, 100_000, None, "no reading"),
        (50_000, 100_000, 0.0, "no reading"),
        (50_000, 100_000, float("nan"), "no reading"),
    ],
)
def test_fit_without_a_ratio_to_go_by_changes_nothing_and_says_why(
    in_flight: int | None, pool: int | None, usage: float | None, says: str
) -> None:
    value, why = fit_fraction(in_flight, pool, usage)
    assert value is None
    assert says in why
    result = apply_gate("target_fraction", "fit", 0.9, SEED, (value, why))
    assert not result.changed
    assert says in result.reason


def test_a_fit_gate_action_plans_the_computed_fraction_from_the_context() -> None:
    policies = list(
        load_policy_file(
            "fit.yaml",
            "version: 1\npolicies:\n  - name: fit\n    when: {metric: kv_cache_usage, above: 0.85}\n"
            "    then: [{gate: {target_fraction: fit}}]\n",
        ).policies
    )
    store = Store(capacity=10)
    store.record("kv_cache_usage", "e", 0.0, 0.95)
    fitted = fit_fraction(90_000, 100_000, 0.95)
    context = EngineContext(
        name="e",
        settings=SEED,
        mode="act",  # type: ignore[arg-type]
        gate=LIMITS,
        gate_fits={"target_fraction": fitted},
    )
    plan = evaluate(policies, new_states(policies), store, context, 0.0)[1]
    assert plan is not None
    assert plan.gate_changes == {"target_fraction": (0.9, 0.8)}
    assert any("gate target_fraction 0.9 → 0.8 (fit: the pool 95% used" in reason for reason in plan.reasons)
