"""Recordings: what one engine's policies saw, tick by tick, in a file a person can keep.

A recording is JSON lines (docs/incidents.md). The first line is the header::

    {"format": "tunerd-recording", "version": 1, "engine": "main", "settings": {...},
     "signals": ["gpu_memory_used_bytes", ...], "source": "daemon", "states": {...}}

``states`` are the policies' states (pending ``for`` holds, cooldowns) when the first tick was
evaluated, so a replay that starts mid-story starts where the daemon stood. Then, oldest first:

- ``{"t": T, "g": G, "samples": {signal: value | null}}`` — the readings taken at ``T`` (engine
  generation ``G``); samples may start before the first tick (the look-back the detectors use);
- ``{"t": T, "event": "engine_crash", "data": {...}}``;
- ``{"t": T, "tick": true, "context": {...}, "decision": {...}}`` — the daemon evaluated its
  policies at ``T``: ``context`` (settings, bounds, ladders, fits, the gate…) when it differs
  from the previous tick's, ``decision`` (``policy``, ``actions``) when a plan came out.

Replaying is exact by construction: the lines are fed to a fresh :class:`~tunerd.store.Store`
in order and the policies evaluated at each tick with the recorded context, as the daemon did.
It is open-loop: what the recorded engine did next stands, whatever the replayed policies
would have done instead (docs/incidents.md says what that means for reading a difference).

Pure: no I/O; :func:`parse_lines` takes text lines and says which one is wrong.
"""

from __future__ import annotations

import json
import math
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tunerd.outcomes import Health, Mode, PolicyStatus
from tunerd.policy.engine import ActionPlan, EngineContext, PolicyState, evaluate
from tunerd.policy.schema import Policy
from tunerd.signals import SIGNALS
from tunerd.store import Event, Store
from tunerd.tune import shown

__all__ = [
    "FORMAT",
    "VERSION",
    "Decision",
    "Recording",
    "RecordingError",
    "Tape",
    "compare",
    "context_from_dict",
    "context_to_dict",
    "describe",
    "parse_lines",
    "replay",
    "state_from_dict",
    "state_to_dict",
]

FORMAT = "tunerd-recording"
VERSION = 1
MAX_LINE_BYTES = 1 << 20  # one line of a recording is a tick: far below a mebibyte


class RecordingError(ValueError):
    """A recording that cannot be read; the message names the line."""


# -- what a tick's context and a policy's state are, as JSON -------------------------------------
def context_to_dict(context: EngineContext) -> dict[str, Any]:
    return {
        "settings": dict(context.settings),
        "bounds": {knob: list(values) for knob, values in context.bounds.items()},
        "ladders": {knob: list(values) for knob, values in context.ladders.items()},
        "failed": {knob: list(values) for knob, values in context.failed.items()},
        "mode": str(context.mode),
        "observed_since": context.observed_since,
        "fits": {knob: list(item) for knob, item in context.fits.items()},
        "gate": None if context.gate is None else dict(context.gate),
        "gate_fits": {limit: list(item) for limit, item in context.gate_fits.items()},
    }


def context_from_dict(engine: str, data: Mapping[str, Any]) -> EngineContext:
    return EngineContext(
        name=engine,
        settings=dict(data.get("settings") or {}),
        bounds=dict(data.get("bounds") or {}),
        ladders=dict(data.get("ladders") or {}),
        failed=dict(data.get("failed") or {}),
        mode=Mode(data.get("mode", "observe")),
        observed_since=float(data.get("observed_since") or 0.0),
        fits={knob: tuple(item) for knob, item in (data.get("fits") or {}).items()},
        gate=None if data.get("gate") is None else dict(data["gate"]),
        gate_fits={limit: tuple(item) for limit, item in (data.get("gate_fits") or {}).items()},
    )


def state_to_dict(state: PolicyState) -> dict[str, Any]:
    return {
        "state": str(state.state),
        "since": state.since,
        "cooldown_until": state.cooldown_until,
        "last_fired": state.last_fired,
        "last_evaluated": state.last_evaluated,
        "holds": [[list(path), since] for path, since in state.holds.items()],
        "health": str(state.health),
        "last_error": state.last_error,
        "clear": state.clear,
    }


def state_from_dict(name: str, data: Mapping[str, Any]) -> PolicyState:
    return PolicyState(
        name,
        PolicyStatus(data.get("state", "inactive")),
        since=data.get("since"),
        cooldown_until=data.get("cooldown_until"),
        last_fired=data.get("last_fired"),
        last_evaluated=data.get("last_evaluated"),
        holds={tuple(int(i) for i in path): since for path, since in data.get("holds") or []},
        health=Health(data.get("health", "ok")),
        last_error=data.get("last_error"),
        clear=bool(data.get("clear", True)),
    )


def describe(plan: ActionPlan) -> dict[str, Any]:
    """A plan as a decision: which policies and what they asked, in words that compare."""
    actions = [
        f"tune {knob} {shown(before)}→{shown(after)}" for knob, (before, after) in plan.changes.items()
    ]
    actions += [
        f"gate {limit} {shown(before)}→{shown(after)}" for limit, (before, after) in plan.gate_changes.items()
    ]
    if plan.restart is not None:
        actions.append("restart")
    if plan.rollback:
        actions.append("rollback")
    if plan.hold:
        actions.append("hold")
    actions += [f"notify {request.severity}" for request in plan.notify]
    return {"policy": ",".join(plan.policies), "actions": actions}


# -- the daemon's side: what it keeps to write a recording --------------------------------------
@dataclass
class Tape:
    """One engine's ticks as the daemon evaluated them: every tick's time, the context and the
    policy states whenever they changed, and the decisions. Bounded: ``capacity`` ticks (an
    hour at 4 Hz, four at 1 Hz); a recording or an incident is cut from what it still holds."""

    capacity: int = 14_400
    ticks: deque[float] = field(default_factory=deque)
    contexts: deque[tuple[float, dict[str, Any]]] = field(default_factory=deque)
    states: deque[tuple[float, dict[str, dict[str, Any]]]] = field(default_factory=deque)
    decisions: deque[tuple[float, dict[str, Any]]] = field(default_factory=deque)

    def tick(
        self,
        now: float,
        context: EngineContext,
        before: Mapping[str, PolicyState],
        plan: ActionPlan | None,
    ) -> None:
        """The daemon evaluated at ``now`` with ``context``, starting from the states ``before``."""
        self.ticks.append(now)
        as_dict = context_to_dict(context)
        last = self.contexts[-1][1] if self.contexts else None
        if last != as_dict:
            if last is not None:  # what did not change is shared with the entry before
                as_dict = {
                    key: last[key] if last.get(key) == value else value for key, value in as_dict.items()
                }
            self.contexts.append((now, as_dict))
        states = {name: _timeless(state) for name, state in before.items()}
        if not self.states or self.states[-1][1] != states:
            self.states.append((now, states))
        if plan is not None:
            self.decisions.append((now, describe(plan)))
        self._trim()

    def _trim(self) -> None:
        while len(self.ticks) > self.capacity:
            self.ticks.popleft()
        oldest = self.ticks[0]
        for ring in (self.contexts, self.states):
            while len(ring) > 1 and ring[1][0] <= oldest:  # the one in force at the oldest tick stays
                ring.popleft()
        while self.decisions and self.decisions[0][0] < oldest:
            self.decisions.popleft()

    def lines(
        self,
        store: Store,
        engine: str,
        since: float,
        until: float,
        *,
        lookback: float = 0.0,
        source: str = "daemon",
    ) -> list[dict[str, Any]]:
        """The recording of the ticks in ``[since, until]``, with the samples from ``since -
        lookback``: header first. Empty when no tick falls in the window."""
        ticks = [t for t in self.ticks if since <= t <= until]
        if not ticks:
            return []
        first = ticks[0]
        previous = max((t for t in self.ticks if t < first), default=None)
        states = _in_force(self.states, first) or {}
        context = _in_force(self.contexts, first) or {}
        signals = sorted(signal for signal, scope in store.recorded() if scope == engine)
        header = {
            "format": FORMAT,
            "version": VERSION,
            "engine": engine,
            "settings": dict(context.get("settings") or {}),
            "signals": signals,
            "source": source,
            "from": first,
            "states": {name: dict(state, last_evaluated=previous) for name, state in states.items()},
        }
        body: list[tuple[float, int, dict[str, Any]]] = []
        by_time: dict[tuple[float, int], dict[str, float | None]] = {}
        for signal in signals:
            for sample in store.span(signal, engine, first - lookback, ticks[-1]):
                by_time.setdefault((sample.time, sample.generation), {})[signal] = sample.value
        body += [(t, 0, {"t": t, "g": g, "samples": values}) for (t, g), values in by_time.items()]
        body += [
            (event.time, 1, {"t": event.time, "event": event.kind, "data": dict(event.data)})
            for event in store.events(since=first - lookback, scope=engine)
            if event.time <= ticks[-1]
        ]
        decisions = {t: d for t, d in self.decisions if first <= t <= until}
        contexts = list(self.contexts)  # (time, context) oldest first: walked beside the ticks
        position = 0
        last_context: dict[str, Any] | None = None
        for t in ticks:
            while position + 1 < len(contexts) and contexts[position + 1][0] <= t:
                position += 1
            in_force = contexts[position][1] if contexts and contexts[position][0] <= t else None
            line: dict[str, Any] = {"t": t, "tick": True}
            if in_force is not None and in_force is not last_context:
                line["context"] = last_context = in_force
            if t in decisions:
                line["decision"] = decisions[t]
            body.append((t, 2, line))
        body.sort(key=lambda item: (item[0], item[1]))
        return [header, *(line for _, _, line in body)]


def _timeless(state: PolicyState) -> dict[str, Any]:
    found = state_to_dict(state)
    found.pop("last_evaluated")  # changes every tick; the tick before the window says it
    return found


def _in_force(ring: Iterable[tuple[float, Any]], at: float) -> Any:
    found = None
    for time, value in ring:
        if time > at:
            break
        found = value
    return found


# -- reading one -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Recording:
    header: dict[str, Any]
    lines: list[dict[str, Any]]

    @property
    def engine(self) -> str:
        return str(self.header["engine"])

    @property
    def ticks(self) -> int:
        return sum(1 for line in self.lines if line.get("tick"))

    def decisions(self) -> list[tuple[float, dict[str, Any]]]:
        return [
            (line["t"], line["decision"]) for line in self.lines if line.get("tick") and "decision" in line
        ]


def parse_lines(lines: Iterable[str], where: str = "recording") -> Recording:
    """Check and read a recording's lines. :class:`RecordingError` names the first bad line."""
    header: dict[str, Any] | None = None
    body: list[dict[str, Any]] = []
    last = -math.inf
    for number, text in enumerate(lines, start=1):
        if len(text) > MAX_LINE_BYTES:
            raise RecordingError(
                f"{where}:{number}: a line of {len(text):,} bytes (at most {MAX_LINE_BYTES:,})"
            )
        if not text.strip():
            continue
        try:
            item = json.loads(text)
        except json.JSONDecodeError as error:
            raise RecordingError(
                f"{where}:{number}: not JSON ({error.msg} at column {error.colno})"
            ) from None
        if not isinstance(item, dict):
            raise RecordingError(f"{where}:{number}: expected a JSON object")
        if header is None:
            header = _check_header(item, f"{where}:{number}")
            continue
        problem = _line_problem(item)
        if problem is not None:
            raise RecordingError(f"{where}:{number}: {problem}")
        if item["t"] < last:
            raise RecordingError(f"{where}:{number}: time {item['t']} goes back (the line before: {last})")
        last = item["t"]
        body.append(item)
    if header is None:
        raise RecordingError(f"{where}: empty (a recording starts with its header line)")
    return Recording(header, body)


def _check_header(item: dict[str, Any], where: str) -> dict[str, Any]:
    if item.get("format") != FORMAT:
        raise RecordingError(f'{where}: not a tunerd recording (its first line has no "format": "{FORMAT}")')
    version = item.get("version")
    if version != VERSION:
        raise RecordingError(f"{where}: recording version {version!r}; this tunerd reads version {VERSION}")
    if not isinstance(item.get("engine"), str) or not item["engine"]:
        raise RecordingError(f"{where}: the header names no engine")
    if not isinstance(item.get("states") or {}, dict) or not isinstance(item.get("settings") or {}, dict):
        raise RecordingError(f"{where}: the header's states and settings are mappings")
    try:
        for name, state in (item.get("states") or {}).items():
            state_from_dict(str(name), state)
    except (TypeError, ValueError, AttributeError) as error:
        raise RecordingError(f"{where}: a policy state that cannot be read ({error})") from None
    return item


def _line_problem(item: dict[str, Any]) -> str | None:
    t = item.get("t")
    if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t):
        return "each line has a finite time `t`"
    if "samples" in item:
        samples = item["samples"]
        if (
            not isinstance(samples, dict)
            or isinstance(item.get("g", 0), bool)
            or not isinstance(item.get("g", 0), int)
        ):
            return "samples are a mapping of signal: value with an integer generation `g`"
        for signal, value in samples.items():
            if signal not in SIGNALS:
                return f"unknown signal '{signal}'"
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
                return f"the value of {signal} is not a number: {value!r}"
        return None
    if "event" in item:
        if not isinstance(item["event"], str) or not isinstance(item.get("data") or {}, dict):
            return "an event line has a kind (`event`) and a mapping `data`"
        return None
    if item.get("tick") is True:
        context = item.get("context")
        if context is not None:
            if not isinstance(context, dict):
                return "a tick's context is a mapping"
            try:
                context_from_dict("check", context)
            except (TypeError, ValueError, AttributeError) as error:
                return f"a tick's context cannot be read ({error})"
        decision = item.get("decision")
        if decision is not None and (
            not isinstance(decision, dict) or not isinstance(decision.get("actions"), list)
        ):
            return "a tick's decision has a policy and a list of actions"
        return None
    return "expected samples, an event or a tick"


# -- replaying one ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Decision:
    """One decision of a replay against the recording: ``recorded`` — the daemon made it (same
    time, policies and actions); ``replayed`` — the policies given to the replay made it."""

    at: float
    policy: str
    actions: tuple[str, ...]
    recorded: bool
    replayed: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "at": self.at,
            "policy": self.policy,
            "actions": list(self.actions),
            "recorded": self.recorded,
            "replayed": self.replayed,
        }


def replay(recording: Recording, policies: Sequence[Policy]) -> list[tuple[float, ActionPlan]]:
    """Evaluate ``policies`` at each of the recording's ticks, as the daemon did: the plans."""
    engine = recording.engine
    samples = sum(1 for line in recording.lines if "samples" in line)
    store = Store(capacity=max(samples, 1), max_events=max(len(recording.lines), 1))
    saved = recording.header.get("states") or {}
    states = {policy.name: state_from_dict(policy.name, saved.get(policy.name) or {}) for policy in policies}
    context = context_from_dict(engine, {"settings": recording.header.get("settings") or {}})
    plans: list[tuple[float, ActionPlan]] = []
    for line in recording.lines:
        t = float(line["t"])
        if "samples" in line:
            generation = int(line.get("g", 0))
            for signal, value in line["samples"].items():
                store.record(signal, engine, t, None if value is None else float(value), generation)
        elif "event" in line:
            store.add_event(Event(t, line["event"], engine, data=dict(line.get("data") or {})))
        elif line.get("tick"):
            if "context" in line:
                context = context_from_dict(engine, line["context"])
            states, plan = evaluate(policies, states, store, context, t)
            if plan is not None:
                plans.append((t, plan))
    return plans


def compare(recording: Recording, plans: Sequence[tuple[float, ActionPlan]]) -> list[Decision]:
    """The replay's decisions beside the recorded ones, in time order: each matched pair once
    (``recorded`` and ``replayed``), then what only one side decided."""
    recorded = [
        (t, str(d.get("policy", "")), tuple(str(a) for a in d.get("actions") or []))
        for t, d in recording.decisions()
    ]
    replayed = [(t, describe(plan)) for t, plan in plans]
    out: list[Decision] = []
    left = list(recorded)
    for t, decided in replayed:
        key = (t, decided["policy"], tuple(decided["actions"]))
        hit = key in left
        if hit:
            left.remove(key)
        out.append(Decision(t, key[1], key[2], recorded=hit, replayed=True))
    out += [Decision(t, policy, actions, recorded=True, replayed=False) for t, policy, actions in left]
    return sorted(out, key=lambda d: (d.at, not d.replayed))


def iter_json_lines(lines: Iterable[Mapping[str, Any]]) -> Iterator[str]:
    """A recording's lines as text (one JSON object per line, compact, keys in order)."""
    for line in lines:
        yield json.dumps(_clean(line), separators=(",", ":"), allow_nan=False) + "\n"


def _clean(value: Any) -> Any:
    """JSON's own values only: a non-finite number is null, a tuple a list, anything else text."""
    if isinstance(value, bool) or value is None or isinstance(value, str | int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(key): _clean(item) for key, item in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_clean(item) for item in value]
    return str(value)
