"""Bugs found in review of the policy system; each test failed before its fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from tunerd.policy.engine import EngineContext, NotifyRequest, evaluate, new_states
from tunerd.policy.schema import PolicyError, load_policy_file
from tunerd.policy.testrun import run_test_file
from tunerd.store import Event, Store
from tunerd.tune import apply_tune

POLICY = "version: 1\npolicies:\n  - name: p\n    when: {when}\n    then: [{then}]\n"


def _load(text: str) -> list[str]:
    try:
        load_policy_file("p.yaml", text)
    except PolicyError as error:
        return error.problems
    return []


def test_yaml_anchors_and_merge_keys_are_refused_and_empty_values_load() -> None:
    """Anchors, aliases and merge keys are refused (issue 16: nested aliases are a bomb), at
    the line of the first; a file without them and with empty values loads."""
    text = (
        "version: 1\n"
        "base: &base {metric: kv_cache_usage, above: 0.9}\n"
        "policies:\n  - name: p\n    description:\n    when:\n      <<: *base\n    then:\n      - notify:\n"
    )
    assert _load(text) == [
        "p.yaml:2: YAML anchors and aliases (&x, *x) are not accepted: write the values out"
    ]
    merged = text.replace("&base ", "").replace("*base", "{metric: kv_cache_usage, above: 0.9}")
    assert _load(merged) == ["p.yaml:7: YAML merge keys (<<) are not accepted: write the values out"]
    written_out = merged.replace("base: {metric: kv_cache_usage, above: 0.9}\n", "").replace(
        "<<: {metric: kv_cache_usage, above: 0.9}", "{metric: kv_cache_usage, above: 0.9}"
    )
    assert _load(written_out) == []


@pytest.mark.parametrize(
    ("when", "then", "fragment"),
    [
        ("{metric: [a], above: 1}", "{hold: true}", "unknown signal"),
        ("{metric: kv_cache_usage, above: " + "9" * 400 + "}", "{hold: true}", "number out of range"),
        ("{metric: kv_cache_usage, above: 0.5, for: .nan}", "{hold: true}", "invalid duration"),
        ("{metric: kv_cache_usage, above: 0.5}", "{tune: {max_num_seqs: '-inf'}}", "finite"),
        ("{metric: kv_cache_usage, above: 0.5}", "{tune: {enforce_eager: '+1'}}", "takes no delta"),
        ("{metric: kv_cache_usage, above: 0.5}", "{tune: {enforce_eager: halve}}", "cannot be halved"),
    ],
)
def test_bad_values_are_problems_not_tracebacks(when: str, then: str, fragment: str) -> None:
    errors = _load(POLICY.format(when=when, then=then))
    assert any(fragment in error for error in errors), errors


def test_deep_nesting_is_a_problem() -> None:
    when = "{not: " * 400 + "{metric: kv_cache_usage, above: 0.5}" + "}" * 400
    errors = _load(POLICY.format(when=when, then="{hold: true}"))
    assert errors
    assert "too deep" in errors[0]


def test_version_true_refused() -> None:
    assert _load("version: true\npolicies: []\n")


@pytest.mark.parametrize(
    "body",
    [
        "interval: [1]\ntests: [{name: a}]",
        "interval: 0s\ntests: [{name: a, events: [{at: 1m, engine_crash: {}}]}]",
        "tests: [{name: a, expect: [{at: banana}]}]",
        "tests: [{name: a, series: abc}]",
        "tests: [{name: a, series: {kv_cache_usage: [1, 2]}}]",
        "tests: [{name: a, events: [{at: 1m, engine_crash: cuda_oom}]}]",
        "tests: [{name: a, expect: [{at: 1m, tune: [a]}]}]",
        "engine: {settings: [1]}\ntests: [{name: a}]",
        "engine: {bounds: {max_num_seqs: 5}}\ntests: [{name: a}]",
        "tests: [{name: a, series: {kv_cache_usage: '1x999999999'}}]",
    ],
)
def test_malformed_test_files_exit_2_not_traceback(tmp_path: Path, body: str) -> None:
    (tmp_path / "p.yaml").write_text(
        POLICY.format(when="{metric: kv_cache_usage, above: 0.5}", then="{hold: true}")
    )
    (tmp_path / "t.yaml").write_text(f"policies: [p.yaml]\n{body}\n")
    with pytest.raises(PolicyError):
        run_test_file(tmp_path / "t.yaml")


def test_event_after_the_last_sample_is_evaluated(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text(
        POLICY.format(when="{event: engine_crash}", then="{notify: {severity: critical}}")
    )
    (tmp_path / "t.yaml").write_text(
        "policies: [p.yaml]\ninterval: 5s\ntests:\n  - name: a\n    events: [{at: 62s, engine_crash: {kind: cuda_oom}}]\n"
        "    expect: [{at: 65s, notify: {severity: critical}}]\n"
    )
    assert all(outcome.passed for outcome in run_test_file(tmp_path / "t.yaml"))


def test_merged_first_of_tunes_one_knob() -> None:
    policies = list(
        load_policy_file(
            "p.yaml",
            """version: 1
policies:
  - name: oom
    when: {event: engine_crash}
    then: [{first_of: [{tune: {gpu_memory_utilization: -0.03}}, {tune: {max_num_batched_tokens: halve}}]}]
  - name: ratchet
    when: {event: engine_crash}
    then: [{first_of: [{tune: {gpu_memory_utilization: -0.03}}, {tune: {max_num_batched_tokens: halve}}]}]
""",
        ).policies
    )
    store = Store(capacity=10)
    store.add_event(Event(0.0, "engine_crash", "e", data={"kind": "cuda_oom"}))
    context = EngineContext(
        "e",
        {"gpu_memory_utilization": 0.92, "max_num_batched_tokens": 2048},
        bounds={"gpu_memory_utilization": [0.8, 0.95], "max_num_batched_tokens": [512, 8192]},
        mode="act",
    )
    _, plan = evaluate(policies, new_states(policies), store, context, 0.0)
    assert plan is not None
    assert plan.changes == {"gpu_memory_utilization": (0.92, 0.89)}


def test_an_advise_policy_does_not_hold_back_an_act_policy() -> None:
    policies = list(
        load_policy_file(
            "p.yaml",
            """version: 1
policies:
  - name: act
    when: {event: engine_crash}
    then: [{tune: {gpu_memory_utilization: -0.03}}, {restart: {drain: 0s}}]
  - name: careful
    when: {event: engine_crash}
    then: [{tune: {max_num_seqs: step_up}}, {notify: {severity: info}}]
    mode: advise
""",
        ).policies
    )
    store = Store(capacity=10)
    store.add_event(Event(0.0, "engine_crash", "e", data={}))
    context = EngineContext(
        "e",
        {"gpu_memory_utilization": 0.92, "max_num_seqs": 8},
        bounds={"gpu_memory_utilization": [0.8, 0.95], "max_num_seqs": [4, 16]},
        mode="act",
    )
    _, plan = evaluate(policies, new_states(policies), store, context, 0.0)
    assert plan is not None
    assert plan.mode == "act"
    assert plan.changes == {"gpu_memory_utilization": (0.92, 0.89)}
    assert any("proposed only" in reason for reason in plan.reasons)
    assert NotifyRequest("careful", "info", None) in plan.notify


def test_tunes_clamp_before_validating_and_never_step_the_wrong_way() -> None:
    assert apply_tune("max_num_seqs", -8, 8, [4, 16]).after == 4
    assert apply_tune("gpu_memory_utilization", "double", 0.6, [0.5, 0.95]).after == 0.95
    assert apply_tune("max_num_seqs", "step_up", 32, [4, 16]).after == 32
    assert apply_tune("max_num_seqs", "step_down", 2, [4, 16]).after == 2
