"""The policy language's loader: every broken file is refused with file:line, policy and field."""

from __future__ import annotations

from pathlib import Path

import pytest

from tunerd.policy.schema import AllOf, MetricCondition, PolicyError, load_policy_file

GOOD = """\
version: 1
policies:
  - name: kv-pool-saturated
    when:
      all:
        - metric: kv_cache_usage
          above: 0.85
          for: 10m
        - any:
            - metric: num_requests_waiting_capacity
              above: 0
            - metric: num_preemptions_total
              rate_above: 0
    then:
      - tune: {max_num_seqs: step_down}
      - restart: {drain: 60s}
      - notify: {severity: warning}
    cooldown: 30m
"""


def _errors(text: str) -> list[str]:
    with pytest.raises(PolicyError) as caught:
        load_policy_file("p.yaml", text)
    return caught.value.problems


def test_load_design_example() -> None:
    loaded = load_policy_file("p.yaml", GOOD)
    policy = loaded.policies[0]
    assert isinstance(policy.when, AllOf)
    first = policy.when.all[0]
    assert isinstance(first, MetricCondition)
    assert (first.metric, first.above, first.for_) == ("kv_cache_usage", 0.85, 600.0)
    assert policy.cooldown == 1800.0


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        (
            "for: 10m",
            "for: banana",
            "p.yaml:8: policy 'kv-pool-saturated': when.all[0].for: invalid duration 'banana'",
        ),
        (
            "metric: kv_cache_usage",
            "metric: kv_cache_usge",
            "p.yaml:6: policy 'kv-pool-saturated': when.all[0].metric: unknown signal 'kv_cache_usge'",
        ),
        (
            "above: 0.85",
            'above: "0.85"',
            "p.yaml:7: policy 'kv-pool-saturated': when.all[0].above: expected a number, got '0.85'",
        ),
        (
            "cooldown: 30m",
            "cooldown: 30m\n    colour: red",
            "p.yaml:19: policy 'kv-pool-saturated': colour: unknown field",
        ),
        (
            "max_num_seqs: step_down",
            "swap_space: step_down",
            "p.yaml:15: policy 'kv-pool-saturated': then[0].tune.swap_space: 'swap_space' is not a tunable flag",
        ),
        (
            "drain: 60s",
            "drain: [60s]",
            "p.yaml:16: policy 'kv-pool-saturated': then[1].restart.drain: invalid duration",
        ),
        (
            "severity: warning",
            "severity: loud",
            "p.yaml:17: policy 'kv-pool-saturated': then[2].notify.severity:",
        ),
        ("version: 1", "version: 2", "p.yaml:1: version: expected 'version: 1', got 2"),
        (
            "rate_above: 0",
            "rate_above: 0\n              above: 1",
            "p.yaml:12: policy 'kv-pool-saturated': when.all[1].any[1]: give exactly one of above",
        ),
    ],
)
def test_broken_field_named_with_file_line_policy(old: str, new: str, expected: str) -> None:
    errors = _errors(GOOD.replace(old, new))
    assert any(error.startswith(expected) for error in errors), errors


def test_yaml_syntax_error_located() -> None:
    errors = _errors(GOOD.replace("above: 0.85", "above: [0.85"))
    assert errors[0].startswith("p.yaml:8: YAML syntax error")


def test_duplicate_policy_names_refused() -> None:
    text = GOOD + GOOD.split("policies:\n", 1)[1]
    errors = _errors(text)
    assert errors == [
        "p.yaml:19: policy 'kv-pool-saturated': name: duplicate policy name (first at policies[0])"
    ]


def test_duplicate_keys_refused() -> None:
    errors = _errors(GOOD.replace("cooldown: 30m", "cooldown: 30m\n    cooldown: 1h"))
    assert errors == ["p.yaml:19: policies[0].cooldown: duplicate key 'cooldown'"]


def test_every_error_of_a_file_reported() -> None:
    text = GOOD.replace("for: 10m", "for: banana").replace(
        "metric: num_requests_waiting_capacity", "metric: nope"
    )
    assert len(_errors(text)) == 2


@pytest.mark.parametrize(
    ("when", "message"),
    [
        ("{event: engine_crash, kind: cuda_boom}", "unknown crash kind 'cuda_boom'"),
        ("{no_event: engine_crash}", "for: required field is missing"),
        ("{signal: pool_saturated}", "signal: Input should be"),
        ("{metric: kv_cache_usage, above: 0.9, sideways: 1}", "sideways: unknown field"),
        ("{wat: 1}", "expected exactly one of metric, signal, event, no_event, all, any, not"),
        ("{all: []}", "all: expected a non-empty list of conditions"),
    ],
)
def test_condition_errors(when: str, message: str) -> None:
    text = f"version: 1\npolicies:\n  - name: p\n    when: {when}\n    then: [{{hold: true}}]\n"
    errors = _errors(text)
    assert any(message in error for error in errors), errors


def test_shipped_policies_load() -> None:
    root = Path(__file__).parents[3] / "policies"
    for path in [root / "default.yaml", *sorted((root / "examples").glob("*.yaml"))]:
        assert load_policy_file(path).policies
