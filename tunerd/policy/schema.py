"""The policy language of DESIGN §4.5: pydantic models, loaded from YAML with every error located.

A file holds ``version: 1`` and ``policies:``. Each policy has ``when`` (a condition tree) and
``then`` (actions). Condition nodes are told apart by their key — ``metric``, ``signal``,
``event``, ``no_event``, ``all``, ``any``, ``not`` — and each is a pydantic model with
``extra="forbid"``; so are the actions (``tune``, ``first_of``, ``restart``, ``rollback``,
``hold``, ``notify``, ``gate``). :func:`load_policy_file` reports *every* problem of a file, each as
``file:line: policy 'name': when.all[0].for: invalid duration 'banana'``, and returns nothing
when there is any (a file loads completely or not at all).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from tunerd.diagnosis import CRASH_KINDS
from tunerd.gate.tuning import gate_problem
from tunerd.signals import SIGNALS
from tunerd.tune import TUNABLES, tune_problem
from tunerd.units import UnitError, parse_duration, parse_size
from tunerd.yamlfile import Located, Problem, YamlError, load_yaml, located

__all__ = [
    "DETECTOR_SIGNALS",
    "EVENTS",
    "MAX_DURATION_S",
    "MODES",
    "Duration",
    "Policy",
    "PolicyError",
    "PolicyFile",
    "PositiveDuration",
    "duration_problem",
    "load_policy_file",
    "load_policy_files",
]

MODES = ("observe", "advise", "act")
EVENTS = ("engine_crash", "engine_start_failed", "engine_unhealthy", "gpu_lost")
DETECTOR_SIGNALS = ("memory_ratchet", "over_budget", "neighbour_growth", "pool_saturation")


class PolicyError(Exception):
    """Policy files that did not load; ``problems`` are located one-line messages."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


MAX_DURATION_S = 30 * 86400.0  # no window, timeout or wait tunerd reads is longer than 30 days


def _duration(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError(f"invalid duration {value!r}: expected e.g. '10m'")
    try:
        seconds = parse_duration(value)
    except (UnitError, OverflowError) as error:
        raise ValueError(str(error)) from None
    if not math.isfinite(seconds):
        raise ValueError(f"invalid duration {value!r}: expected e.g. '10m'")
    if seconds > MAX_DURATION_S:
        raise ValueError(f"duration {value!r} is longer than 30 days")
    return seconds


def duration_problem(value: Any, positive: bool = False) -> str | None:
    """Why ``value`` is not a duration a policy or a policy test may give (None when it is):
    ``10m`` or seconds, at most 30 days, more than zero when ``positive``."""
    try:
        (_positive_duration if positive else _duration)(value)
    except ValueError as error:
        return str(error)
    return None


def _positive_duration(value: Any) -> float:
    seconds = _duration(value)
    if seconds <= 0:
        raise ValueError(f"duration {value!r} must be more than zero")
    return seconds


def _size(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise ValueError(f"invalid size {value!r}: expected e.g. '512MiB'")
    try:
        return parse_size(value)
    except (UnitError, OverflowError) as error:
        raise ValueError(str(error)) from None


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"expected a number, got {value!r}")
    try:
        number = float(value)
    except OverflowError:
        raise ValueError(f"number out of range: {value!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"expected a finite number, got {value!r}")
    return number


Duration = Annotated[float, BeforeValidator(_duration)]
PositiveDuration = Annotated[float, BeforeValidator(_positive_duration)]
Size = Annotated[int, BeforeValidator(_size)]
Number = Annotated[float, BeforeValidator(_number)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, strict=True)


# -- conditions ---------------------------------------------------------------------------


class MetricCondition(_Strict):
    metric: str
    above: Number | None = None
    below: Number | None = None
    equals: Number | None = None
    rate_above: Number | None = None
    rate_below: Number | None = None
    window: PositiveDuration = 60.0  # for rates
    for_: Duration = Field(default=0.0, alias="for")


class SignalCondition(_Strict):
    signal: Literal["memory_ratchet", "over_budget", "neighbour_growth", "pool_saturation"]
    headroom_below: Size | None = None  # memory_ratchet: free memory at the top below this
    by: Size | None = None  # over_budget / neighbour_growth: at least this much
    usage_above: Number = 0.85  # pool_saturation
    window: PositiveDuration = 600.0  # neighbour_growth: grown within this window
    for_: Duration = Field(default=0.0, alias="for")


class EventCondition(_Strict):
    event: Literal["engine_crash", "engine_start_failed", "engine_unhealthy", "gpu_lost"]
    kind: str | None = None
    at_least: int = Field(default=1, ge=1)  # this many within `within` (a crash loop)
    within: PositiveDuration | None = None


class NoEventCondition(_Strict):
    no_event: Literal["engine_crash", "engine_start_failed", "engine_unhealthy", "gpu_lost"]
    kind: str | None = None
    for_: PositiveDuration = Field(alias="for")


class AllOf(_Strict):
    all: list[Condition]


class AnyOf(_Strict):
    any: list[Condition]


class NotOf(_Strict):
    not_: Condition = Field(alias="not")


Condition = MetricCondition | SignalCondition | EventCondition | NoEventCondition | AllOf | AnyOf | NotOf


# -- actions ------------------------------------------------------------------------------


class TuneAction(_Strict):
    tune: dict[str, str | int | float | bool]


class FirstOfAction(_Strict):
    first_of: list[TuneAction]


class RestartSpec(_Strict):
    drain: Duration = 60.0
    quiet: bool = False


class RestartAction(_Strict):
    restart: RestartSpec


class RollbackAction(_Strict):
    rollback: bool = True


class HoldAction(_Strict):
    hold: bool = True


class GateAction(_Strict):
    """``gate: {target_fraction: 0.8 | step_down | step_up, ...}``: the engine's gate, live."""

    gate: dict[str, str | int | float]


class NotifySpec(_Strict):
    severity: Literal["info", "warning", "critical"] = "warning"
    to: list[str] | None = None


class NotifyAction(_Strict):
    notify: NotifySpec


Action = TuneAction | FirstOfAction | RestartAction | RollbackAction | HoldAction | NotifyAction | GateAction


class Policy(_Strict):
    name: str = Field(min_length=1)
    description: str | None = ""
    when: Condition
    then: list[Action] = Field(min_length=1)
    cooldown: Duration = 0.0
    mode: Literal["observe", "advise", "act"] | None = None
    engines: list[str] | None = None


class _PolicyHead(_Strict):
    """A policy's own fields; ``when`` and ``then`` are checked node by node."""

    name: str = Field(min_length=1)
    description: str | None = ""
    when: Any = None
    then: Any = None
    cooldown: Duration = 0.0
    mode: Literal["observe", "advise", "act"] | None = None
    engines: list[str] | None = None


class PolicyFile(_Strict):
    version: Literal[1]
    policies: list[Policy]


# -- loading ------------------------------------------------------------------------------

_CONDITION_KEYS: dict[str, type[_Strict]] = {
    "metric": MetricCondition,
    "signal": SignalCondition,
    "event": EventCondition,
    "no_event": NoEventCondition,
    "all": AllOf,
    "any": AnyOf,
    "not": NotOf,
}
_ACTION_KEYS: dict[str, type[_Strict]] = {
    "tune": TuneAction,
    "first_of": FirstOfAction,
    "restart": RestartAction,
    "rollback": RollbackAction,
    "hold": HoldAction,
    "notify": NotifyAction,
    "gate": GateAction,
}


class _Checker:
    """Walks the raw data, builds models node by node and collects every problem."""

    def __init__(self, context: str, shown_from: int = 0) -> None:
        self.context = context
        self.shown_from = shown_from
        self.problems: list[Problem] = []

    def problem(self, path: tuple[str | int, ...], message: str) -> None:
        self.problems.append(Problem(path, message, self.context, self.shown_from))

    def model(self, cls: type[_Strict], data: dict[str, Any], path: tuple[str | int, ...]) -> Any:
        try:
            return cls.model_validate(data)
        except ValidationError as error:
            for item in error.errors():
                loc = tuple(part for part in item["loc"] if not (isinstance(part, str) and "[" in part))
                message = item["msg"].removeprefix("Value error, ")
                if item["type"] == "extra_forbidden":
                    message = f"unknown field (allowed: {', '.join(_fields(cls))})"
                elif item["type"] == "literal_error":
                    message = f"{message}, got {item.get('input')!r}"
                elif item["type"] == "missing":
                    message = "required field is missing"
                self.problem((*path, *loc), message)
            return None

    def node(
        self,
        data: Any,
        path: tuple[str | int, ...],
        kinds: dict[str, type[_Strict]],
        what: str,
        build: Callable[[type[_Strict], dict[str, Any], tuple[str | int, ...]], Any],
    ) -> Any:
        if not isinstance(data, dict):
            self.problem(path, f"expected a {what} (one of: {', '.join(kinds)}), got {type(data).__name__}")
            return None
        keys = [key for key in kinds if key in data]
        if len(keys) != 1:
            found = ", ".join(map(str, data)) or "nothing"
            self.problem(path, f"expected exactly one of {', '.join(kinds)} in a {what}, found {found}")
            return None
        return build(kinds[keys[0]], data, path)

    def condition(self, data: Any, path: tuple[str | int, ...]) -> Any:
        return self.node(data, path, _CONDITION_KEYS, "condition", self._build_condition)

    def _build_condition(self, cls: type[_Strict], data: dict[str, Any], path: tuple[str | int, ...]) -> Any:
        if cls in (AllOf, AnyOf):
            key = "all" if cls is AllOf else "any"
            children = data.get(key)
            if not isinstance(children, list) or not children:
                self.problem((*path, key), "expected a non-empty list of conditions")
                return None
            extra = set(data) - {key}
            if extra:
                self.problem((*path, sorted(extra)[0]), f"unknown field (allowed: {key})")
            built = [self.condition(child, (*path, key, index)) for index, child in enumerate(children)]
            if None in built:
                return None
            return AllOf.model_construct(all=built) if cls is AllOf else AnyOf.model_construct(any=built)
        if cls is NotOf:
            extra = set(data) - {"not"}
            if extra:
                self.problem((*path, sorted(extra)[0]), "unknown field (allowed: not)")
            child = self.condition(data.get("not"), (*path, "not"))
            return NotOf.model_construct(not_=child) if child is not None else None
        model = self.model(cls, data, path)
        if cls is MetricCondition:
            self._check_metric(data, path)
        if isinstance(model, EventCondition | NoEventCondition) and model.kind is not None:
            kind_ok = model.kind in CRASH_KINDS
            if not kind_ok:
                self.problem(
                    (*path, "kind"), f"unknown crash kind '{model.kind}' (kinds: {', '.join(CRASH_KINDS)})"
                )
        return model

    def _check_metric(self, data: dict[str, Any], path: tuple[str | int, ...]) -> None:
        metric = data.get("metric")
        if not isinstance(metric, str) or metric not in SIGNALS:
            self.problem((*path, "metric"), f"unknown signal '{metric}' (see docs/signals.md)")
        tests = [name for name in ("above", "below", "equals", "rate_above", "rate_below") if name in data]
        if len(tests) != 1:
            self.problem(path, "give exactly one of above, below, equals, rate_above, rate_below")

    def action(self, data: Any, path: tuple[str | int, ...]) -> Any:
        return self.node(data, path, _ACTION_KEYS, "action", self._build_action)

    def _build_action(self, cls: type[_Strict], data: dict[str, Any], path: tuple[str | int, ...]) -> Any:
        if cls is RestartAction and data.get("restart") is True:
            data = {**data, "restart": {}}
        if cls is NotifyAction and data.get("notify") in (True, None):
            data = {**data, "notify": {}}
        if cls is FirstOfAction:
            options = data.get("first_of")
            if not isinstance(options, list) or not options:
                self.problem((*path, "first_of"), "expected a non-empty list of tune actions")
                return None
            for index, option in enumerate(options):
                if not isinstance(option, dict) or set(option) != {"tune"}:
                    self.problem((*path, "first_of", index), "each alternative must be a `tune:` action")
                    return None
                self._check_tune(option.get("tune"), (*path, "first_of", index, "tune"))
        model = self.model(cls, data, path)
        if isinstance(model, TuneAction):
            self._check_tune(data.get("tune"), (*path, "tune"))
        if isinstance(model, GateAction):
            if not model.gate:
                self.problem((*path, "gate"), "expected a mapping of limit: value, step_down or step_up")
            for knob, operation in model.gate.items():
                if (problem := gate_problem(knob, operation)) is not None:
                    self.problem((*path, "gate", knob), problem)
        return model

    def _check_tune(self, tune: Any, path: tuple[str | int, ...]) -> None:
        if not isinstance(tune, dict) or not tune:
            self.problem(path, "expected a mapping of knob: operation")
            return
        for knob, operation in tune.items():
            if knob not in TUNABLES:
                self.problem(
                    (*path, str(knob)), f"'{knob}' is not a tunable flag (tunables: {', '.join(TUNABLES)})"
                )
                continue
            problem = tune_problem(knob, operation)
            if problem is not None:
                self.problem((*path, str(knob)), problem)


def _fields(cls: type[BaseModel]) -> list[str]:
    return [field.alias or name for name, field in cls.model_fields.items()]


def _validate(source: Located) -> tuple[PolicyFile | None, list[Problem]]:
    data = source.data
    file_checker = _Checker("")
    if not isinstance(data, dict):
        return None, [Problem((), "expected a mapping with 'version: 1' and 'policies:'")]
    for key in set(data) - {"version", "policies"}:
        file_checker.problem((str(key),), "unknown field (allowed: version, policies)")
    if data.get("version") != 1 or isinstance(data.get("version"), bool):
        file_checker.problem(("version",), f"expected 'version: 1', got {data.get('version')!r}")
    raw_policies = data.get("policies")
    if not isinstance(raw_policies, list):
        file_checker.problem(("policies",), "expected a list of policies")
        return None, file_checker.problems
    problems = list(file_checker.problems)
    policies: list[Policy] = []
    seen: dict[str, int] = {}
    for index, raw in enumerate(raw_policies):
        path: tuple[str | int, ...] = ("policies", index)
        name = raw.get("name") if isinstance(raw, dict) else None
        checker = _Checker(
            f"policy '{name}'" if isinstance(name, str) else f"policies[{index}]", shown_from=2
        )
        if not isinstance(raw, dict):
            checker.problem(path, "expected a mapping")
            problems += checker.problems
            continue
        if isinstance(name, str):
            if name in seen:
                checker.problem((*path, "name"), f"duplicate policy name (first at policies[{seen[name]}])")
            seen.setdefault(name, index)
        head = checker.model(_PolicyHead, raw, path)
        if "when" not in raw:
            checker.problem((*path, "when"), "required field is missing")
        when = checker.condition(raw["when"], (*path, "when")) if "when" in raw else None
        then_raw = raw.get("then")
        actions: list[Any] = []
        if not isinstance(then_raw, list) or not then_raw:
            checker.problem((*path, "then"), "expected a non-empty list of actions")
        else:
            actions = [
                checker.action(item, (*path, "then", position)) for position, item in enumerate(then_raw)
            ]
        problems += checker.problems
        if not checker.problems and head is not None:
            fields = head.model_dump(exclude={"when", "then"})
            policies.append(Policy.model_construct(**fields, when=when, then=actions))
    if problems:
        return None, problems
    return PolicyFile.model_construct(version=1, policies=policies), []


def load_policy_file(path: str | Path, text: str | None = None) -> PolicyFile:
    """Load one file; :class:`PolicyError` lists every problem, located."""
    try:
        source = load_yaml(path, text)
    except YamlError as error:
        raise PolicyError(str(error).splitlines()) from None
    try:
        result, problems = _validate(source)
    except RecursionError:
        raise PolicyError([f"{path}: conditions nested too deeply"]) from None
    if problems or result is None:
        raise PolicyError(located(source, problems) or [f"{path}: no policies"])
    return result


def load_policy_files(paths: Sequence[str | Path]) -> list[Policy]:
    """Load several files as one set (names unique across them); all problems or none."""
    policies: list[Policy] = []
    problems: list[str] = []
    seen: dict[str, str] = {}
    for path in paths:
        try:
            loaded = load_policy_file(path)
        except PolicyError as error:
            problems += error.problems
            continue
        for policy in loaded.policies:
            if policy.name in seen:
                problems.append(f"{path}: policy '{policy.name}': name already used in {seen[policy.name]}")
            seen.setdefault(policy.name, str(path))
            policies.append(policy)
    if problems:
        raise PolicyError(problems)
    return policies
