"""``tunerd policy test``: run policies over series written in promtool's notation (DESIGN §4.6).

A test file names the policy files (relative to itself), an engine (settings, bounds, ladders,
mode), an ``interval`` and tests. Each test gives ``series`` per signal (``'0.5x11 0.9x132'``:
``axN`` is N+1 samples of a, ``a+bxN`` grows by b, ``_`` is a missing sample; samples are
``interval`` apart from t = 0) and ``events`` (``at`` plus an event with its fields). The
policies are evaluated at every sample time; a plan in ``act`` mode applies its new settings
(the engine "restarts" with them). ``expect`` entries must be matched by plans within one
interval of ``at``; ``expect_no_actions`` means nothing at all may happen and
``expect_no_other_actions`` nothing beyond what is expected.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tunerd.policy.engine import ActionPlan, EngineContext, evaluate, new_states
from tunerd.policy.schema import EVENTS, MODES, Policy, PolicyError, load_policy_files
from tunerd.signals import SIGNALS
from tunerd.store import Event, Store
from tunerd.tune import TUNABLES
from tunerd.units import UnitError, parse_duration
from tunerd.yamlfile import Problem, YamlError, load_yaml, located

__all__ = ["SeriesError", "TestOutcome", "expand_series", "run_test_file"]

_TERM = re.compile(
    r"^(?P<start>[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|_)(?:(?P<step>[-+](?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)?x(?P<count>\d+))?$"
)
ENGINE = "engine"


class SeriesError(ValueError):
    """A series in the wrong notation; the message quotes the term."""


def expand_series(text: str | int | float) -> list[float | None]:
    """``'0.5x2 1+1x2 _'`` → ``[0.5, 0.5, 0.5, 1, 2, 3, None]`` (promtool's notation)."""
    if isinstance(text, bool):
        raise SeriesError(f"invalid series {text!r}")
    if isinstance(text, int | float):
        return [float(text)]
    values: list[float | None] = []
    for term in text.split():
        match = _TERM.match(term)
        if match is None:
            raise SeriesError(f"invalid series term '{term}' (expected a, axN, a+bxN, a-bxN or _)")
        count = int(match["count"]) if match["count"] is not None else 0
        if match["start"] == "_":
            if match["step"]:
                raise SeriesError(f"invalid series term '{term}': a missing sample has no step")
            values += [None] * (count + 1 if match["count"] is not None else 1)
            continue
        start = float(match["start"])
        step = float(match["step"]) if match["step"] else 0.0
        if match["count"] is None:
            values.append(start)
        else:
            values += [start + step * index for index in range(count + 1)]
    return values


@dataclass
class TestOutcome:
    name: str
    passed: bool
    failures: list[str] = field(default_factory=list)
    plans: list[ActionPlan] = field(default_factory=list)


def _describe(plan: ActionPlan) -> str:
    parts = [f"{knob} {before}→{after}" for knob, (before, after) in plan.changes.items()]
    if plan.restart is not None:
        parts.append("restart")
    if plan.rollback:
        parts.append("rollback")
    if plan.hold:
        parts.append("hold")
    parts += [f"notify {severity}" for _, severity, _ in plan.notify]
    return f"at {plan.time:g}s ({', '.join(plan.policies)}): {', '.join(parts) or 'nothing'}"


def _matches(plan: ActionPlan, expected: dict[str, Any]) -> bool:
    for knob, value in (expected.get("tune") or {}).items():
        if plan.after.get(knob) != value or knob not in plan.changes:
            return False
    if expected.get("restart") and plan.restart is None:
        return False
    if expected.get("rollback") and not plan.rollback:
        return False
    if expected.get("hold") and not plan.hold:
        return False
    severity = (
        (expected.get("notify") or {}).get("severity") if isinstance(expected.get("notify"), dict) else None
    )
    if expected.get("notify") and not plan.notify:
        return False
    return not (severity and severity not in {level for _, level, _ in plan.notify})


def _run_one(
    policies: Sequence[Policy], engine: dict[str, Any], interval: float, test: dict[str, Any]
) -> TestOutcome:
    store = Store(capacity=100_000, max_events=10_000)
    series = {name: expand_series(text) for name, text in (test.get("series") or {}).items()}
    length = max((len(values) for values in series.values()), default=0)
    events = sorted(test.get("events") or [], key=lambda item: parse_duration(item["at"]))
    if events:
        length = max(length, int(parse_duration(events[-1]["at"]) / interval) + 1)
    context = EngineContext(
        name=ENGINE,
        settings=dict(engine.get("settings") or {}),
        bounds=engine.get("bounds") or {},
        ladders=engine.get("ladders") or {},
        mode=engine.get("mode", "act"),
    )
    states = new_states(policies)
    plans: list[ActionPlan] = []
    pending_events = list(events)
    for index in range(length):
        now = index * interval
        for name, values in series.items():
            if index < len(values):
                store.record(name, ENGINE, now, values[index])
        while pending_events and parse_duration(pending_events[0]["at"]) <= now:
            item = pending_events.pop(0)
            kind = next(key for key in item if key != "at")
            store.add_event(Event(parse_duration(item["at"]), kind, ENGINE, data=dict(item[kind] or {})))
        states, plan = evaluate(policies, states, store, context, now)
        if plan is not None:
            plans.append(plan)
            if plan.mode == "act" and plan.changes and not plan.hold:
                context = EngineContext(
                    name=ENGINE,
                    settings=plan.after,
                    bounds=context.bounds,
                    ladders=context.ladders,
                    mode=context.mode,
                )
    outcome = TestOutcome(str(test.get("name")), True, plans=plans)
    used: set[int] = set()
    for expected in test.get("expect") or []:
        at = parse_duration(expected["at"])
        hit = next(
            (
                i
                for i, plan in enumerate(plans)
                if abs(plan.time - at) <= interval and i not in used and _matches(plan, expected)
            ),
            None,
        )
        if hit is None:
            outcome.failures.append(f"expected at {expected['at']}: {_expectation(expected)}")
        else:
            used.add(hit)
    if test.get("expect_no_actions") and plans:
        outcome.failures.append("expected no actions")
    if test.get("expect_no_other_actions"):
        others = [plan for i, plan in enumerate(plans) if i not in used]
        if others:
            outcome.failures.append(f"expected no other actions, got {len(others)} more")
    outcome.passed = not outcome.failures
    return outcome


def _expectation(expected: dict[str, Any]) -> str:
    parts = [f"{knob} → {value}" for knob, value in (expected.get("tune") or {}).items()]
    for flag in ("restart", "rollback", "hold"):
        if expected.get(flag):
            parts.append(flag)
    if expected.get("notify"):
        parts.append(f"notify {expected['notify']}")
    return ", ".join(parts) or "an action"


def _check_file(data: Any) -> list[Problem]:
    problems: list[Problem] = []
    if not isinstance(data, dict):
        return [Problem((), "expected a mapping with policies, engine, interval and tests")]
    for key in set(data) - {"policies", "engine", "interval", "tests", "mode"}:
        problems.append(Problem((str(key),), "unknown field (allowed: policies, engine, interval, tests)"))
    if not isinstance(data.get("policies"), list) or not data["policies"]:
        problems.append(Problem(("policies",), "expected a list of policy files"))
    try:
        parse_duration(data.get("interval", "5s"))
    except UnitError as error:
        problems.append(Problem(("interval",), str(error)))
    engine = data.get("engine") or {}
    if not isinstance(engine, dict):
        problems.append(Problem(("engine",), "expected a mapping"))
        engine = {}
    for key in set(engine) - {"settings", "bounds", "ladders", "mode"}:
        problems.append(
            Problem(("engine", str(key)), "unknown field (allowed: settings, bounds, ladders, mode)")
        )
    for section in ("settings", "bounds", "ladders"):
        for knob in engine.get(section) or {}:
            if knob not in TUNABLES:
                problems.append(Problem(("engine", section, str(knob)), f"'{knob}' is not a tunable"))
    if engine.get("mode", "act") not in MODES:
        problems.append(Problem(("engine", "mode"), f"expected one of {', '.join(MODES)}"))
    tests = data.get("tests")
    if not isinstance(tests, list) or not tests:
        problems.append(Problem(("tests",), "expected a list of tests"))
        return problems
    for index, test in enumerate(tests):
        path: tuple[str | int, ...] = ("tests", index)
        if not isinstance(test, dict) or "name" not in test:
            problems.append(Problem(path, "each test needs a name"))
            continue
        context = f"test '{test['name']}'"
        for name, text in (test.get("series") or {}).items():
            if name not in SIGNALS:
                problems.append(Problem((*path, "series", str(name)), f"unknown signal '{name}'", context, 2))
            try:
                expand_series(text)
            except SeriesError as error:
                problems.append(Problem((*path, "series", str(name)), str(error), context, 2))
        for position, item in enumerate(test.get("events") or []):
            kinds = [key for key in (item if isinstance(item, dict) else {}) if key != "at"]
            if not isinstance(item, dict) or "at" not in item or len(kinds) != 1 or kinds[0] not in EVENTS:
                problems.append(
                    Problem(
                        (*path, "events", position),
                        f"expected `at` and one event of {', '.join(EVENTS)}",
                        context,
                        2,
                    )
                )
        for position, item in enumerate(test.get("expect") or []):
            if not isinstance(item, dict) or "at" not in item:
                problems.append(
                    Problem((*path, "expect", position), "each expectation needs `at`", context, 2)
                )
                continue
            for key in set(item) - {"at", "tune", "restart", "rollback", "hold", "notify"}:
                problems.append(Problem((*path, "expect", position, str(key)), "unknown field", context, 2))
        for key in ("events", "expect"):
            for position, item in enumerate(test.get(key) or []):
                if isinstance(item, dict) and "at" in item:
                    try:
                        parse_duration(item["at"])
                    except UnitError as error:
                        problems.append(Problem((*path, key, position, "at"), str(error), context, 2))
    return problems


def run_test_file(path: str | Path) -> list[TestOutcome]:
    """Run every test of one file. :class:`PolicyError` (exit 2) for a bad file."""
    try:
        source = load_yaml(path)
    except YamlError as error:
        raise PolicyError(str(error).splitlines()) from None
    problems = _check_file(source.data)
    if problems:
        raise PolicyError(located(source, problems))
    base = Path(path).parent
    policies = load_policy_files([base / name for name in source.data["policies"]])
    interval = parse_duration(source.data.get("interval", "5s"))
    engine = source.data.get("engine") or {}
    return [_run_one(policies, engine, interval, test) for test in source.data["tests"]]


def describe_plans(plans: Sequence[ActionPlan]) -> list[str]:
    return [_describe(plan) for plan in plans] or ["nothing happened"]
