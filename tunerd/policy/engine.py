"""Policy evaluation: Prometheus-style states per policy, and the action plan they produce. Pure.

:func:`evaluate` takes the policies, their states, the store, an engine's context and the
time, and returns the new states and at most one :class:`ActionPlan`. It never sends,
restarts or reads a clock; the same inputs always give the same plan.

States go ``inactive`` → ``pending`` (a condition with ``for`` holds, not yet long enough)
→ ``firing`` (the tick it acts) → ``cooldown`` (for ``cooldown``) → ``inactive``. A condition
with ``for: D`` fires at the first evaluation ``t`` where it has held at every sample since one
at or before ``t − D``; a missing reading (``None``) neither breaks nor extends the hold; an
absent series is false. After a policy acts, its ``for`` counts only samples after the action.

Policies that fire at the same tick merge into one plan in a fixed order — crash policies
first, then memory, then saturation, then the rest, each group in file order: the first tune
of a knob wins, ``first_of`` takes the first alternative that changes something, ``hold``
drops the tunes and the restart, ``rollback`` drops the tunes, and a policy whose tunes all
change nothing asks for no restart. A ``fit`` moves a knob to the target computed from the
calibrated box (``EngineContext.fits``) — only down in a crash or memory policy — and, once
computed, is a ``first_of``'s answer even when the knob is already there; without a target
the ``first_of`` goes on to its notches. At most one restart. Each policy's mode is capped by the
global mode; the plan takes the highest of them, and a policy with a more careful mode than
the plan's only proposes (its alerts go out, its tunes are reasons, not changes).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tunerd import detect
from tunerd.gate.tuning import GateResult, apply_gate
from tunerd.outcomes import Health, Mode, PolicyStatus
from tunerd.policy.schema import (
    AllOf,
    AnyOf,
    EventCondition,
    FirstOfAction,
    GateAction,
    HoldAction,
    MetricCondition,
    NoEventCondition,
    NotifyAction,
    NotOf,
    Policy,
    RestartAction,
    RestartSpec,
    RollbackAction,
    SignalCondition,
    TuneAction,
)
from tunerd.store import Store
from tunerd.tune import TuneResult, apply_tune

__all__ = [
    "ActionPlan",
    "EngineContext",
    "NotifyRequest",
    "PolicyState",
    "evaluate",
    "matures_at",
    "new_states",
]

_CATEGORY_ORDER = {"crash": 0, "memory": 1, "saturation": 2, "other": 3}
_MEMORY_METRICS = {
    "engine_memory_bytes",
    "engine_over_budget_bytes",
    "engine_outside_budget_bytes",
    "other_processes_memory_bytes",
    "gpu_memory_used_bytes",
    "gpu_memory_free_bytes",
    "gpu_memory_used_ratio",
}
_SATURATION_METRICS = {
    "kv_cache_usage",
    "num_requests_waiting",
    "num_requests_waiting_capacity",
    "num_preemptions_total",
    "num_requests_running",
}


@dataclass(frozen=True)
class EngineContext:
    """What evaluation needs to know about one engine besides its signals."""

    name: str
    settings: Mapping[str, Any]
    bounds: Mapping[str, Sequence[Any]] = field(default_factory=dict)
    ladders: Mapping[str, Sequence[Any]] = field(default_factory=dict)
    failed: Mapping[str, Sequence[Any]] = field(default_factory=dict)  # values that failed lately
    mode: Mode = Mode.ADVISE  # the global mode
    observed_since: float = 0.0  # when tunerd started watching (for no_event)
    #: knob → (target, why, prediction): what a ``tune: {knob: fit}`` moves to, computed from
    #: the calibrated box (:func:`tunerd.planner.calibration.fits`); absent: nothing calibrated
    fits: Mapping[str, tuple[Any, str, Mapping[str, Any] | None]] = field(default_factory=dict)
    #: the engine's gate's live limits (``target_fraction``…); None when it has no gate (a
    #: ``gate:`` action does not apply), empty when the gate did not answer (it says so)
    gate: Mapping[str, Any] | None = None
    #: limit → (value, why): what a ``gate: {limit: fit}`` moves to, computed from the gate's
    #: admitted need and the pool's usage (:func:`tunerd.gate.tuning.fit_fraction`)
    gate_fits: Mapping[str, tuple[Any, str]] = field(default_factory=dict)


@dataclass(frozen=True)
class PolicyState:
    name: str
    state: PolicyStatus = PolicyStatus.INACTIVE
    since: float | None = None
    cooldown_until: float | None = None
    last_fired: float | None = None
    last_evaluated: float | None = None
    holds: Mapping[tuple[int, ...], float | None] = field(default_factory=dict)
    health: Health = Health.OK
    last_error: str | None = None
    clear: bool = True  # the condition does not hold, not even pending its `for` (a resolve is due)


@dataclass(frozen=True)
class NotifyRequest:
    """A policy's ``notify`` action in a plan: who asked, how loud, to which sinks."""

    policy: str
    severity: str  # info | warning | critical
    sinks: tuple[str, ...] | None = None  # None: every sink


@dataclass(frozen=True)
class ActionPlan:
    """What the policies that fired at one tick ask for, merged. Nothing is done yet."""

    engine: str
    time: float
    policies: tuple[str, ...]
    mode: Mode
    before: Mapping[str, Any]
    after: Mapping[str, Any]
    tunes: tuple[TuneResult, ...] = ()
    restart: RestartSpec | None = None
    rollback: bool = False
    hold: bool = False
    notify: tuple[NotifyRequest, ...] = ()
    evidence: Mapping[str, Any] = field(default_factory=dict)
    reasons: tuple[str, ...] = ()
    #: what the new settings are predicted to give on the calibrated box (the daemon adds it)
    prediction: Mapping[str, Any] | None = None
    #: a memory policy asks for a restart now (not in a quiet moment): it waits out the settle
    #: period after the last restart instead of being dropped by it
    urgent: bool = False
    #: what ``gate:`` actions ask of the engine's gate: applied live, no restart
    gate: tuple[GateResult, ...] = ()

    @property
    def changes(self) -> dict[str, tuple[Any, Any]]:
        return {tune.knob: (tune.before, tune.after) for tune in self.tunes if tune.changed}

    @property
    def gate_changes(self) -> dict[str, tuple[Any, Any]]:
        return {result.knob: (result.before, result.after) for result in self.gate if result.changed}


def new_states(policies: Sequence[Policy]) -> dict[str, PolicyState]:
    return {policy.name: PolicyState(policy.name) for policy in policies}


def _durations(node: Any, path: tuple[int, ...] = ()) -> list[tuple[tuple[int, ...], float]]:
    """Each metric or signal condition's ``for``, by the node path :class:`_Evaluation` uses."""
    if isinstance(node, AllOf | AnyOf):
        children = node.all if isinstance(node, AllOf) else node.any
        return [found for index, child in enumerate(children) for found in _durations(child, (*path, index))]
    if isinstance(node, NotOf):
        return _durations(node.not_, (*path, 0))
    if isinstance(node, MetricCondition | SignalCondition):
        return [(path, node.for_)]
    return []


def matures_at(policies: Sequence[Policy], states: Mapping[str, PolicyState], now: float) -> float | None:
    """The earliest time after ``now`` at which a ``for`` now counting will have held long
    enough. The daemon evaluates again then rather than at its next tick, so a condition is
    acted on within its ``for`` plus one sampling interval (DESIGN §8), not two."""
    due: float | None = None
    for policy in policies:
        state = states.get(policy.name)
        if state is None or state.state is not PolicyStatus.PENDING:
            continue
        for path, duration in _durations(policy.when):
            since = state.holds.get(path)
            if duration and since is not None and since + duration > now:
                due = since + duration if due is None else min(due, since + duration)
    return due


# -- conditions ---------------------------------------------------------------------------


class _Evaluation:
    """One policy's conditions at one time, tracking ``for`` holds by node path."""

    def __init__(self, store: Store, context: EngineContext, now: float, state: PolicyState) -> None:
        self.store = store
        self.context = context
        self.now = now
        self.previous = state.last_evaluated
        self.old_holds = dict(state.holds)
        self.holds: dict[tuple[int, ...], float | None] = {}
        self.evidence: dict[str, Any] = {}

    def run(self, node: Any, path: tuple[int, ...] = ()) -> bool | None:
        if isinstance(node, AllOf):
            results = [self.run(child, (*path, index)) for index, child in enumerate(node.all)]
            return False if False in results else (None if None in results else True)
        if isinstance(node, AnyOf):
            results = [self.run(child, (*path, index)) for index, child in enumerate(node.any)]
            return True if True in results else (None if None in results else False)
        if isinstance(node, NotOf):
            result = self.run(node.not_, (*path, 0))
            return None if result is None else not result
        if isinstance(node, MetricCondition):
            return self._held(path, self._metric(node), node.for_)
        if isinstance(node, SignalCondition):
            return self._held(path, self._signal(node), node.for_)
        if isinstance(node, EventCondition):
            return self._event(node)
        if isinstance(node, NoEventCondition):
            return self._no_event(node)
        raise TypeError(f"unknown condition {type(node).__name__}")

    def _held(self, path: tuple[int, ...], value: bool | None, duration: float) -> bool | None:
        since = self.old_holds.get(path)
        if value is True:
            since = self.now if since is None else since
        elif value is False:
            since = None
        self.holds[path] = since
        if value is None:
            return None  # a missing reading neither fires nor clears
        if not duration:
            return value
        return since is not None and since <= self.now - duration

    def _metric(self, node: MetricCondition) -> bool | None:
        scope = self.context.name
        if node.rate_above is not None or node.rate_below is not None:
            if not self.store.points(node.metric, scope, self.now, node.window)[0]:
                return False
            rate = detect.counter_rate(self.store, node.metric, scope, self.now, node.window)
            if rate is None:
                return None
            self.evidence[f"{node.metric}_rate"] = rate
            return rate > node.rate_above if node.rate_above is not None else rate < (node.rate_below or 0)
        sample = self.store.at(node.metric, scope, self.now)
        if sample is None:
            return False  # an absent series makes its conditions false
        value = sample.value
        if value is None:
            return None  # a missing reading neither fires nor clears
        self.evidence[node.metric] = value
        if node.above is not None:
            return value > node.above
        if node.below is not None:
            return value < node.below
        return value == node.equals

    def _signal(self, node: SignalCondition) -> bool | None:
        scope, store, now = self.context.name, self.store, self.now
        if node.signal == "memory_ratchet":
            found = detect.memory_ratchet(store, scope, now, node.headroom_below)
        elif node.signal == "over_budget":
            found = detect.over_budget(store, scope, now, node.by)
        elif node.signal == "neighbour_growth":
            found = detect.neighbour_growth(store, scope, now, node.by, node.window)
        else:
            found = detect.pool_saturation(store, scope, now, node.usage_above)
        if found.evidence:
            self.evidence[node.signal] = found.evidence
        return found.active

    def _matching(self, kind_event: str, kind: str | None, since: float) -> list[Any]:
        return [
            event
            for event in self.store.events(since=since, kind=kind_event, scope=self.context.name)
            if event.time <= self.now and (kind is None or event.data.get("kind") == kind)
        ]

    def _event(self, node: EventCondition) -> bool:
        if node.within is not None:
            events = self._matching(node.event, node.kind, self.now - node.within)
            hit = len(events) >= node.at_least and any(e.time > (self.previous or -math.inf) for e in events)
        else:
            events = [
                e
                for e in self._matching(node.event, node.kind, -math.inf)
                if e.time > (self.previous if self.previous is not None else -math.inf)
            ]
            hit = len(events) >= node.at_least
        if hit:
            self.evidence[node.event] = [dict(e.data) | {"time": e.time} for e in events[-3:]]
        return hit

    def _no_event(self, node: NoEventCondition) -> bool:
        if self.now - self.context.observed_since < node.for_:
            return False  # not watched long enough to say nothing happened
        return not self._matching(node.no_event, node.kind, self.now - node.for_)


# -- categories and plans -----------------------------------------------------------------


def _category(node: Any) -> str:
    kinds: set[str] = set()

    def walk(item: Any) -> None:
        if isinstance(item, AllOf | AnyOf):
            for child in item.all if isinstance(item, AllOf) else item.any:
                walk(child)
        elif isinstance(item, NotOf):
            return  # what must *not* hold does not make a policy about it
        elif isinstance(item, EventCondition):
            kinds.add("crash")
        elif isinstance(item, SignalCondition):
            kinds.add("saturation" if item.signal == "pool_saturation" else "memory")
        elif isinstance(item, MetricCondition):
            if item.metric in _MEMORY_METRICS:
                kinds.add("memory")
            elif item.metric in _SATURATION_METRICS:
                kinds.add("saturation")

    walk(node)
    return min(kinds, key=_CATEGORY_ORDER.__getitem__) if kinds else "other"


def _mode(policy: Policy, global_mode: Mode) -> Mode:
    """A policy's own mode, never more than the global one."""
    return min(Mode(policy.mode or global_mode), Mode(global_mode))


def _notify(policy: Policy, action: NotifyAction) -> NotifyRequest:
    return NotifyRequest(
        policy.name, action.notify.severity, tuple(action.notify.to) if action.notify.to else None
    )


def _plan(fired: list[tuple[Policy, dict[str, Any]]], context: EngineContext, now: float) -> ActionPlan:
    fired = sorted(fired, key=lambda item: _CATEGORY_ORDER[_category(item[0].when)])
    # Only the policies at the plan's mode act; a more careful one (advise under act) does not
    # hold the others back: it is reported as a proposal and its alerts still go out.
    mode = max(_mode(policy, context.mode) for policy, _ in fired)
    proposals = [policy for policy, _ in fired if _mode(policy, context.mode) != mode]
    settings = dict(context.settings)
    tunes: list[TuneResult] = []
    touched: set[str] = set()
    restart: RestartSpec | None = None
    rollback = hold = False
    notify: list[NotifyRequest] = []
    reasons: list[str] = []
    gate: list[GateResult] = []
    gated: set[str] = set()

    def gate_limits(knobs: Mapping[str, Any], dry: bool = False) -> list[GateResult]:
        if context.gate is None:
            return []  # no gate in front of this engine: the action does not apply to it
        results = []
        for knob, operation in knobs.items():
            if knob in gated:
                value = context.gate.get(knob)
                results.append(
                    GateResult(knob, value, value, f"gate {knob} already changed by an earlier policy")
                )
                continue
            result = apply_gate(
                knob, operation, context.gate.get(knob), context.settings, context.gate_fits.get(knob)
            )
            results.append(result)
            if not dry and result.changed:
                gated.add(knob)
        return results

    def tune(knobs: Mapping[str, Any], dry: bool = False, fit_up: bool = True) -> list[TuneResult]:
        results = []
        for knob, operation in knobs.items():
            if knob in touched:
                results.append(
                    TuneResult(
                        knob,
                        settings.get(knob),
                        settings.get(knob),
                        f"{knob} already tuned by an earlier policy in this plan",
                    )
                )
                continue
            result = apply_tune(
                knob,
                operation,
                settings.get(knob),
                context.bounds.get(knob),
                ladder=context.ladders.get(knob),
                failed=context.failed.get(knob, ()),
                fit=context.fits.get(knob),
                fit_up=fit_up,
            )
            results.append(result)
            if not dry and result.changed:
                settings[knob] = result.after
                touched.add(knob)
        return results

    for policy, _ in fired:
        policy_tunes: list[TuneResult] = []
        wants_restart: RestartSpec | None = None
        # A crash or memory policy asks for safer settings: its fits only lower.
        up = _category(policy.when) not in {"crash", "memory"}
        if policy in proposals:
            for action in policy.then:
                if isinstance(action, NotifyAction):
                    notify.append(_notify(policy, action))
                elif isinstance(action, TuneAction | FirstOfAction):
                    knobs = action.tune if isinstance(action, TuneAction) else action.first_of[0].tune
                    reasons += [
                        f"{policy.name} (mode {_mode(policy, context.mode)}, proposed only): {r.reason}"
                        for r in tune(knobs, dry=True, fit_up=up)
                    ]
                elif isinstance(action, GateAction):
                    reasons += [
                        f"{policy.name} (mode {_mode(policy, context.mode)}, proposed only): {r.reason}"
                        for r in gate_limits(action.gate, dry=True)
                    ]
            continue
        for action in policy.then:
            if isinstance(action, TuneAction):
                policy_tunes += tune(action.tune, fit_up=up)
            elif isinstance(action, FirstOfAction):
                # The first alternative whose knob is not at its bound: one already moved by an
                # earlier policy in this plan counts as taken (no second knob on top of it).
                for option in action.first_of:
                    if any(knob in touched for knob in option.tune):
                        policy_tunes += tune(option.tune, dry=True, fit_up=up)
                        break
                    tried = tune(option.tune, dry=True, fit_up=up)
                    if any(result.changed for result in tried):
                        policy_tunes += tune(option.tune, fit_up=up)
                        break
                    if any(result.settled for result in tried):
                        policy_tunes += tried  # a computed fit says it is fine: no notch on top
                        break
                else:
                    policy_tunes += tune(action.first_of[0].tune, dry=True, fit_up=up)
            elif isinstance(action, RestartAction):
                wants_restart = action.restart
            elif isinstance(action, RollbackAction) and action.rollback:
                rollback = True
            elif isinstance(action, HoldAction) and action.hold:
                hold = True
            elif isinstance(action, NotifyAction):
                notify.append(_notify(policy, action))
            elif isinstance(action, GateAction):
                limited = gate_limits(action.gate)
                gate += limited
                reasons += [f"{policy.name}: {result.reason}" for result in limited]
        tunes += policy_tunes
        reasons += [f"{policy.name}: {result.reason}" for result in policy_tunes]
        if wants_restart is not None:
            if policy_tunes and not any(result.changed for result in policy_tunes):
                reasons.append(f"{policy.name}: its tunes change nothing, so no restart")
            elif restart is None:
                restart = wants_restart
    if hold:
        reasons.append("hold: tuning stops; a person decides")
        tunes = [replace(t, after=t.before, reason=f"{t.reason} (dropped: hold)") for t in tunes]
        gate = [replace(g, after=g.before, reason=f"{g.reason} (dropped: hold)") for g in gate]
        settings = dict(context.settings)
        restart = None
    elif rollback:
        reasons.append("rollback: return to the last known good settings")
        tunes = [replace(t, after=t.before, reason=f"{t.reason} (dropped: rollback)") for t in tunes]
        settings = dict(context.settings)
    acting = [policy for policy, _ in fired if policy not in proposals]
    urgent = (
        restart is not None
        and not restart.quiet
        and any(_category(policy.when) == "memory" for policy in acting)
    )
    return ActionPlan(
        engine=context.name,
        time=now,
        urgent=urgent,
        policies=tuple(policy.name for policy, _ in fired),
        mode=mode,
        before=dict(context.settings),
        after=settings,
        tunes=tuple(tunes),
        restart=restart,
        rollback=rollback,
        hold=hold,
        notify=tuple(notify),
        evidence={policy.name: evidence for policy, evidence in fired},
        reasons=tuple(reasons),
        gate=tuple(gate),
    )


def evaluate(
    policies: Sequence[Policy],
    states: Mapping[str, PolicyState],
    store: Store,
    context: EngineContext,
    now: float,
) -> tuple[dict[str, PolicyState], ActionPlan | None]:
    """Evaluate every policy that applies to ``context.name`` at ``now``."""
    new: dict[str, PolicyState] = dict(states)
    fired: list[tuple[Policy, dict[str, Any]]] = []
    for policy in policies:
        if policy.engines is not None and context.name not in policy.engines:
            continue
        state = states.get(policy.name, PolicyState(policy.name))
        try:
            evaluation = _Evaluation(store, context, now, state)
            result = evaluation.run(policy.when)
        except Exception as error:  # one broken policy must not stop the others
            new[policy.name] = replace(
                state, health=Health.ERROR, last_error=f"{type(error).__name__}: {error}", last_evaluated=now
            )
            continue
        holds = evaluation.holds
        cooling = state.cooldown_until is not None and now < state.cooldown_until
        if result is True and not cooling:
            fired.append((policy, evaluation.evidence))
            new[policy.name] = PolicyState(
                policy.name,
                PolicyStatus.FIRING,
                since=state.since if state.state is PolicyStatus.PENDING else now,
                cooldown_until=now + policy.cooldown if policy.cooldown else None,
                last_fired=now,
                last_evaluated=now,
                holds={},  # after acting, `for` counts only later samples
                clear=False,
            )
            continue
        pending = any(since is not None for since in holds.values())
        if cooling:
            status, since = PolicyStatus.COOLDOWN, state.since
        elif pending:
            status = PolicyStatus.PENDING
            since = (
                state.since
                if state.state is PolicyStatus.PENDING
                else min(s for s in holds.values() if s is not None)
            )
        else:
            status, since = PolicyStatus.INACTIVE, None
        new[policy.name] = PolicyState(
            policy.name,
            status,
            since=since,
            cooldown_until=state.cooldown_until if cooling else None,
            last_fired=state.last_fired,
            last_evaluated=now,
            holds=holds,
            clear=result is not True and not pending,
        )
    if context.gate is None:  # no gate in front: a policy that only retunes one does not apply
        fired = [item for item in fired if not all(isinstance(a, GateAction) for a in item[0].then)]
    if not fired:
        return new, None
    try:
        return new, _plan(fired, context, now)
    except Exception as error:  # a plan that cannot be built is the firing policies' error
        for policy, _ in fired:
            new[policy.name] = replace(
                new[policy.name], health=Health.ERROR, last_error=f"plan: {type(error).__name__}: {error}"
            )
        return new, None
