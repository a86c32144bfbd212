"""``tunerd policy test``: run policies over series written in promtool's notation (DESIGN §4.6).

A test file names the policy files (relative to itself), an engine (settings, bounds, ladders,
mode), an ``interval`` and tests. Each test gives ``series`` per signal (``'0.5x11 0.9x132'``:
``axN`` is N+1 samples of a, ``a+bxN`` grows by b, ``_`` is a missing sample; samples are
``interval`` apart from t = 0) and ``events`` (``at`` plus an event with its fields). The
policies are evaluated at every sample time; a plan in ``act`` mode applies its new settings
(the engine "restarts" with them). ``expect`` entries must be matched by plans within one
interval of ``at``; ``expect_no_actions`` means nothing at all may happen and
``expect_no_other_actions`` nothing beyond what is expected.

:func:`load_test_file` checks a whole file (and loads the policies it names) before anything
runs: every problem is :class:`PolicyError`, located; a test runs for at most
:data:`MAX_SAMPLES` evaluations.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tunerd.policy.engine import ActionPlan, EngineContext, evaluate, new_states
from tunerd.policy.schema import EVENTS, MODES, Policy, PolicyError, duration_problem, load_policy_files
from tunerd.recording import Recording, RecordingError, compare, parse_lines, replay
from tunerd.signals import SIGNALS
from tunerd.store import Event, Store
from tunerd.tune import TUNABLES, bounds_problem, shown, validate_value
from tunerd.units import parse_duration
from tunerd.yamlfile import Problem, YamlError, load_yaml, located

__all__ = [
    "SeriesError",
    "TestFile",
    "TestOutcome",
    "evaluations",
    "expand_series",
    "load_test_file",
    "run_test_file",
    "run_tests",
]

_TERM = re.compile(
    r"^(?P<start>[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|_)(?:(?P<step>[-+](?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)?x(?P<count>\d+))?$"
)
ENGINE = "engine"
MAX_SAMPLES = 1_000_000
SEVERITIES = ("info", "warning", "critical")


class SeriesError(ValueError):
    """A series in the wrong notation; the message quotes the term."""


def expand_series(text: str | int | float) -> list[float | None]:
    """``'0.5x2 1+1x2 _'`` → ``[0.5, 0.5, 0.5, 1, 2, 3, None]`` (promtool's notation)."""
    if isinstance(text, bool):
        raise SeriesError(f"invalid series {text!r}")
    if isinstance(text, int | float):
        return [float(text)]
    values: list[float | None] = []
    if not isinstance(text, str):
        raise SeriesError(f"invalid series {text!r}: expected a string such as '0.5x11 0.9x132'")
    for term in text.split():
        match = _TERM.match(term)
        if match is None:
            raise SeriesError(f"invalid series term '{term}' (expected a, axN, a+bxN, a-bxN or _)")
        count = int(match["count"]) if match["count"] is not None else 0
        if len(values) + count > MAX_SAMPLES:
            raise SeriesError(f"invalid series term '{term}': more than {MAX_SAMPLES:,} samples")
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
    parts = [f"{knob} {shown(before)}→{shown(after)}" for knob, (before, after) in plan.changes.items()]
    if plan.restart is not None:
        parts.append("restart")
    if plan.rollback:
        parts.append("rollback")
    if plan.hold:
        parts.append("hold")
    parts += [f"notify {request.severity}" for request in plan.notify]
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
    return not (severity and severity not in {request.severity for request in plan.notify})


def evaluations(test: dict[str, Any], interval: float) -> int:
    """How many times a checked test evaluates the policies: once per sample of its longest
    series, and at least once at or after its last event."""
    length = max((len(expand_series(text)) for text in (test.get("series") or {}).values()), default=0)
    last = max((parse_duration(item["at"]) for item in test.get("events") or []), default=None)
    if last is not None:
        length = max(length, math.ceil(last / interval - 1e-9) + 1)
    return length


def _run_recorded(policies: Sequence[Policy], recording: Recording, test: dict[str, Any]) -> TestOutcome:
    """A test whose input is a recording: its ticks replayed; ``expect`` times count from the
    recording's first tick; ``expect_as_recorded`` asks for exactly the recorded decisions."""
    start = float(recording.header.get("from") or 0.0)
    replayed = replay(recording, policies)
    plans = [replace(plan, time=t - start) for t, plan in replayed]
    ticks = [float(line["t"]) for line in recording.lines if line.get("tick")]
    gaps = sorted(b - a for a, b in itertools.pairwise(ticks))
    interval = gaps[len(gaps) // 2] if gaps else 1.0  # the tick's pace (a restart's gap is not)
    outcome = _judge(test, plans, interval)
    if test.get("expect_as_recorded"):
        for decision in compare(recording, replayed):
            if not (decision.recorded and decision.replayed):
                side = "only replayed" if decision.replayed else "only recorded"
                outcome.failures.append(
                    f"at {decision.at - start:g}s {side}: {decision.policy}: {', '.join(decision.actions)}"
                )
        outcome.passed = not outcome.failures
    return outcome


def _run_one(
    policies: Sequence[Policy], engine: dict[str, Any], interval: float, test: dict[str, Any]
) -> TestOutcome:
    if isinstance(test.get("_recording"), Recording):
        return _run_recorded(policies, test["_recording"], test)
    store = Store(capacity=100_000, max_events=10_000)
    series = {name: expand_series(text) for name, text in (test.get("series") or {}).items()}
    length = evaluations(test, interval)
    events = sorted(test.get("events") or [], key=lambda item: parse_duration(item["at"]))
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
    return _judge(test, plans, interval)


def _judge(test: dict[str, Any], plans: list[ActionPlan], interval: float) -> TestOutcome:
    """A test's expectations against the plans it produced."""
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


def _check_engine(engine: Any) -> list[Problem]:
    if not isinstance(engine, dict):
        return [Problem(("engine",), "expected a mapping with settings, bounds, ladders, mode")]
    problems = [
        Problem(("engine", str(key)), "unknown field (allowed: settings, bounds, ladders, mode)")
        for key in set(engine) - {"settings", "bounds", "ladders", "mode"}
    ]
    for section in ("settings", "bounds", "ladders"):
        content = engine.get(section) or {}
        if not isinstance(content, dict):
            problems.append(Problem(("engine", section), "expected a mapping of knob: value"))
            continue
        for knob, value in content.items():
            where = ("engine", section, str(knob))
            if knob not in TUNABLES:
                problem: str | None = f"'{knob}' is not a tunable"
            elif section == "settings":
                problem = validate_value(knob, value)
            elif section == "bounds":
                problem = bounds_problem(knob, value)
            elif not isinstance(value, list) or not value or any(validate_value(knob, v) for v in value):
                problem = f"expected a list of valid {knob} values"
            else:
                problem = None
            if problem is not None:
                problems.append(Problem(where, problem))
    if not isinstance(engine.get("mode", "act"), str) or engine.get("mode", "act") not in MODES:
        problems.append(Problem(("engine", "mode"), f"expected one of {', '.join(MODES)}"))
    return problems


def _check_test(test: Any, path: tuple[str | int, ...]) -> list[Problem]:
    if not isinstance(test, dict) or not isinstance(test.get("name"), str):
        return [Problem(path, "each test is a mapping with a name")]
    context = f"test '{test['name']}'"
    problems = [
        Problem(
            (*path, str(key)),
            "unknown field (allowed: name, series, events, recording, expect, "
            "expect_no_actions, expect_no_other_actions, expect_as_recorded)",
            context,
            2,
        )
        for key in set(test)
        - {
            "name",
            "series",
            "events",
            "recording",
            "expect",
            "expect_no_actions",
            "expect_no_other_actions",
            "expect_as_recorded",
        }
    ]
    if "recording" in test:
        if not isinstance(test["recording"], str) or not test["recording"]:
            problems.append(Problem((*path, "recording"), "expected the recording's file name", context, 2))
        for other in ("series", "events"):
            if other in test:
                problems.append(
                    Problem(
                        (*path, other), "a test's input is a recording or series/events, not both", context, 2
                    )
                )
    series = test.get("series") or {}
    if not isinstance(series, dict):
        problems.append(Problem((*path, "series"), "expected a mapping of signal: series", context, 2))
        series = {}
    for name, text in series.items():
        if name not in SIGNALS:
            problems.append(Problem((*path, "series", str(name)), f"unknown signal '{name}'", context, 2))
        try:
            expand_series(text)
        except SeriesError as error:
            problems.append(Problem((*path, "series", str(name)), str(error), context, 2))
    for key, allowed in (
        ("events", set(EVENTS)),
        ("expect", {"tune", "restart", "rollback", "hold", "notify"}),
    ):
        items = test.get(key) or []
        if not isinstance(items, list):
            problems.append(Problem((*path, key), "expected a list", context, 2))
            continue
        for position, item in enumerate(items):
            where = (*path, key, position)
            if not isinstance(item, dict) or "at" not in item:
                problems.append(Problem(where, "each entry is a mapping with `at`", context, 2))
                continue
            if (problem := duration_problem(item["at"])) is not None:
                problems.append(Problem((*where, "at"), problem, context, 2))
            others = [k for k in item if k != "at"]
            if key == "events":
                if len(others) != 1 or others[0] not in allowed:
                    problems.append(
                        Problem(where, f"expected `at` and one event of {', '.join(EVENTS)}", context, 2)
                    )
                elif not isinstance(item[others[0]] or {}, dict):
                    problems.append(
                        Problem(
                            (*where, str(others[0])),
                            "event fields are a mapping, e.g. {kind: cuda_oom}",
                            context,
                            2,
                        )
                    )
            else:
                for other in others:
                    if other not in allowed:
                        problems.append(Problem((*where, str(other)), "unknown field", context, 2))
                if "tune" in item and not isinstance(item["tune"], dict):
                    problems.append(
                        Problem((*where, "tune"), "expected a mapping of knob: value", context, 2)
                    )
                notify = item.get("notify")
                severity = notify.get("severity", "warning") if isinstance(notify, dict) else "warning"
                known = isinstance(severity, str) and severity in SEVERITIES
                if "notify" in item and (not isinstance(notify, dict | bool) or not known):
                    problems.append(
                        Problem(
                            (*where, "notify"),
                            f"expected true or {{severity: {' | '.join(SEVERITIES)}}}",
                            context,
                            2,
                        )
                    )
    return problems


def _check_file(data: Any) -> list[Problem]:
    if not isinstance(data, dict):
        return [Problem((), "expected a mapping with policies, engine, interval and tests")]
    problems = [
        Problem((str(key),), "unknown field (allowed: policies, engine, interval, tests)")
        for key in set(data) - {"policies", "engine", "interval", "tests"}
    ]
    files = data.get("policies")
    if not isinstance(files, list) or not files or not all(isinstance(item, str) for item in files):
        problems.append(Problem(("policies",), "expected a list of policy file names"))
    interval = data.get("interval", "5s")
    if (problem := duration_problem(interval, positive=True)) is not None:
        problems.append(Problem(("interval",), problem))
    problems += _check_engine(data.get("engine") or {})
    tests = data.get("tests")
    if not isinstance(tests, list) or not tests:
        problems.append(Problem(("tests",), "expected a list of tests"))
        return problems
    for index, test in enumerate(tests):
        problems += _check_test(test, ("tests", index))
        if not problems and evaluations(test, parse_duration(interval)) > MAX_SAMPLES:
            problems.append(
                Problem(
                    ("tests", index), f"runs for more than {MAX_SAMPLES:,} evaluations: use a longer interval"
                )
            )
    return problems


@dataclass(frozen=True)
class TestFile:
    """A checked policy test file: its policies loaded, ready to run."""

    __test__ = False  # not a pytest class

    path: str
    policies: list[Policy]
    engine: dict[str, Any]
    interval: float
    tests: list[dict[str, Any]]


def load_test_file(path: str | Path, text: str | None = None) -> TestFile:
    """Check one test file (``text``, or the file at ``path``) and load the policies it names,
    relative to ``path``. :class:`PolicyError` (exit 2) lists every problem, located."""
    try:
        source = load_yaml(path, text)
    except YamlError as error:
        raise PolicyError(str(error).splitlines()) from None
    problems = _check_file(source.data)
    if problems:
        raise PolicyError(located(source, problems))
    base = Path(path).parent
    policies = load_policy_files([base / name for name in source.data["policies"]])
    for test in source.data["tests"]:
        if "recording" in test:
            where = base / test["recording"]
            try:
                with where.open(encoding="utf-8", errors="replace") as handle:
                    test["_recording"] = parse_lines(handle, str(where))
            except OSError as error:
                raise PolicyError(
                    [f"{path}: test '{test['name']}': {where}: {error.strerror or error}"]
                ) from None
            except RecordingError as error:
                raise PolicyError([f"{path}: test '{test['name']}': {error}"]) from None
    return TestFile(
        path=str(path),
        policies=policies,
        engine=source.data.get("engine") or {},
        interval=parse_duration(source.data.get("interval", "5s")),
        tests=source.data["tests"],
    )


def run_tests(loaded: TestFile) -> list[TestOutcome]:
    """Run every test of a checked file."""
    return [_run_one(loaded.policies, loaded.engine, loaded.interval, test) for test in loaded.tests]


def run_test_file(path: str | Path) -> list[TestOutcome]:
    """Run every test of one file. :class:`PolicyError` (exit 2) for a bad file."""
    return run_tests(load_test_file(path))


def describe_plans(plans: Sequence[ActionPlan]) -> list[str]:
    return [_describe(plan) for plan in plans] or ["nothing happened"]
