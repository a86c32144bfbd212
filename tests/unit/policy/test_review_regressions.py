"""Bugs found in review of the policy system; each test failed before its fix."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tunerd.policy.engine import EngineContext, NotifyRequest, evaluate, new_states
from tunerd.policy.schema import PolicyError, load_policy_file
from tunerd.policy.testrun import load_test_file, run_test_file, run_tests
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


# -- issue 16 -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("when", "then", "problem"),
    [
        (
            "{metric: kv_cache_usage, above: 0.5, for: 31d}",
            "{hold: true}",
            "when.for: duration '31d' is longer than 30 days",
        ),
        (
            "{metric: kv_cache_usage, above: 0.5, for: 1.0e+30}",
            "{hold: true}",
            "when.for: duration 1e+30 is longer than 30 days",
        ),
        (
            "{metric: num_preemptions_total, rate_above: 0, window: 0s}",
            "{hold: true}",
            "when.window: duration '0s' must be more than zero",
        ),
        (
            "{signal: neighbour_growth, by: 1GiB, window: 0}",
            "{hold: true}",
            "when.window: duration 0 must be more than zero",
        ),
        (
            "{event: engine_crash, within: 0s}",
            "{hold: true}",
            "when.within: duration '0s' must be more than zero",
        ),
        (
            "{no_event: engine_crash, for: 0s}",
            "{hold: true}",
            "when.for: duration '0s' must be more than zero",
        ),
        (
            "{event: engine_crash, at_least: true}",
            "{hold: true}",
            "when.at_least: Input should be a valid integer",
        ),
        (
            "{event: engine_crash, at_least: '3'}",
            "{hold: true}",
            "when.at_least: Input should be a valid integer",
        ),
        (
            "{event: engine_crash}",
            "{restart: {drain: 99999d}}",
            "then[0].restart.drain: duration '99999d' is longer than 30 days",
        ),
        (
            "{event: engine_crash}",
            "{tune: {max_num_seqs: 1.0e+30}}",
            "then[0].tune.max_num_seqs: max_num_seqs must be at most 1,048,576",
        ),
    ],
)
def test_values_no_policy_can_mean_are_refused(when: str, then: str, problem: str) -> None:
    errors = _load(POLICY.format(when=when, then=then))
    assert any(
        error.startswith(f"p.yaml:4: policy 'p': {problem}") or problem in error for error in errors
    ), errors


# 400 bytes that PyYAML expanded into 9**9 strings: 20 s and 1.1 GB in `policy check`.
BOMB = "version: 1\npolicies: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{b}: &{b} [*{a}, *{a}, *{a}, *{a}, *{a}, *{a}, *{a}, *{a}, *{a}]\n"
    for a, b in zip("abcdefgh", "bcdefghi", strict=True)
)


def test_an_alias_bomb_is_refused_at_once() -> None:
    assert len(BOMB) <= 450
    started = time.monotonic()
    errors = _load(BOMB)
    assert time.monotonic() - started < 5  # loose: expanding it took 20 s
    assert errors == ["p.yaml:2: YAML anchors and aliases (&x, *x) are not accepted: write the values out"]


def test_an_alias_bomb_in_a_policy_test_file_is_refused_at_once(tmp_path: Path) -> None:
    (tmp_path / "t.yaml").write_text(BOMB.replace("version: 1\npolicies:", "policies: [p.yaml]\ntests:"))
    with pytest.raises(PolicyError) as caught:
        run_test_file(tmp_path / "t.yaml")
    assert caught.value.problems == [
        f"{tmp_path / 't.yaml'}:2: YAML anchors and aliases (&x, *x) are not accepted: write the values out"
    ]


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (
            "engine: {bounds: {max_num_seqs: [16, 4]}}\ntests: [{name: a}]",
            "t.yaml:2: engine.bounds.max_num_seqs: max_num_seqs bounds are [low, high], got [16, 4]: the low one first",
        ),
        (
            "engine: {settings: {max_num_seqs: 1.0e+30}}\ntests: [{name: a}]",
            "t.yaml:2: engine.settings.max_num_seqs: max_num_seqs must be at most 1,048,576",
        ),
        (
            "interval: 1ms\ntests: [{name: a, events: [{at: 20m, engine_crash: {}}]}]",
            "t.yaml:3: tests[0]: runs for more than 1,000,000 evaluations: use a longer interval",
        ),
        (
            "tests: [{name: a, events: [{at: 31d, engine_crash: {}}]}]",
            "t.yaml:2: test 'a': events[0].at: duration '31d' is longer than 30 days",
        ),
        (
            "tests: [{name: a, expect: [{at: 0s, notify: {severity: [x]}}]}]",
            "t.yaml:2: test 'a': expect[0].notify: expected true or {severity: info | warning | critical}",
        ),
        (
            "engine: {mode: [act]}\ntests: [{name: a}]",
            "t.yaml:2: engine.mode: expected one of observe, advise, act",
        ),
    ],
)
def test_what_a_policy_test_would_trip_on_is_a_located_problem(
    tmp_path: Path, body: str, problem: str
) -> None:
    (tmp_path / "p.yaml").write_text(
        POLICY.format(when="{metric: kv_cache_usage, above: 0.5}", then="{notify: {severity: info}}")
    )
    (tmp_path / "t.yaml").write_text(f"policies: [p.yaml]\n{body}\n")
    with pytest.raises(PolicyError) as caught:
        run_test_file(tmp_path / "t.yaml")
    assert f"{tmp_path / problem}" in caught.value.problems or any(
        error.startswith(str(tmp_path / problem)) for error in caught.value.problems
    ), caught.value.problems


def test_a_test_file_is_checked_from_its_text_with_its_policies_beside_it(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text(POLICY.format(when="{event: engine_crash}", then="{hold: true}"))
    loaded = load_test_file(
        tmp_path / "t.yaml",
        "policies: [p.yaml]\ninterval: 10s\ntests: [{name: a, events: [{at: 1m, engine_crash: {}}], expect: [{at: 1m, hold: true}]}]\n",
    )
    assert ([policy.name for policy in loaded.policies], loaded.interval) == (["p"], 10.0)
    [outcome] = run_tests(loaded)
    assert outcome.passed, outcome.failures
