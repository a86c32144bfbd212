"""The daemon's incident recorder: every crash and every action becomes an incident in the state.

At a crash the incident is written in the tick that sees it, before the recovery restart
begins (a crash loop cannot lose it; it is in SQLite with ``synchronous=FULL``, so kill -9 of
tunerd keeps it): the recording of the five minutes before, the crash's kind and the engine's
last log lines, the processes on the GPU at that moment, the start-up figures. Each action
the state records (a tune, restart, rollback, hold, gate change) joins the incident of its
engine opened within :data:`JOIN_S` (the restart that answered a crash joins the crash) or
opens one. Two minutes on (counted from the engine's return when a restart was in flight: a
restart of minutes would fill them with a gap; at most half an hour on), the incident's
recording is written again with the minutes after it, and it is complete. An incident that
cannot be written is said and tried at the next tick; it never stops the loop.
"""

from __future__ import annotations

import math
import queue
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tunerd.acting import EngineLoop
from tunerd.engine.saga import diagnosis_tail
from tunerd.gpu import GpuReading
from tunerd.incident import AFTER_S, BEFORE_S, LOOKBACK_S, brief, pack, postmortem, short
from tunerd.policy.engine import ActionPlan
from tunerd.recording import Recording, describe
from tunerd.signals import engine_gpus
from tunerd.state import State, StateError
from tunerd.store import Store

__all__ = ["INCIDENT_KINDS", "IncidentRecorder"]

#: the history kinds that make an incident (alerts, pins and resumes are a person's words);
#: besides these, every crash and every spell of the gate shedding load (``shed``)
INCIDENT_KINDS = ("tune", "restart", "rollback", "hold", "gate")
JOIN_S = 120.0  # an action within this of an open incident of its engine joins it
STARTS_KEPT = 8  # the starts whose figures an incident keeps
ANSWER_WAIT_S = 20.0  # a recording asked of the loop thread is waited for this long at most
PROCESS_READINGS_KEPT = 8192  # changes of the processes on an engine's GPUs kept for its incidents
PROCESS_CHANGE_BYTES = 32 << 20  # a process that moved less than this has not changed
MAX_AFTER_S = 1800.0  # an incident is completed this long after its moment, whatever is in flight


@dataclass
class _Engine:
    seen: int | None = None  # the newest history id looked at (None: not yet read)
    open: dict[int, float] = field(default_factory=dict)  # incident id → its moment, until complete
    #: incident id → the last tick a restart of the engine was in flight: its minutes after
    #: count from the engine's return (a restart of minutes would fill them with a gap)
    busy: dict[int, float] = field(default_factory=dict)
    #: generation (as text) → the start-up figures of that start, the newest few kept: an
    #: incident's chart splits each start's memory by bill
    starts: dict[str, dict[str, Any]] = field(default_factory=dict)
    crash: tuple[dict[str, Any], float] | None = None  # a crash whose incident is still to write
    #: the processes on the engine's GPUs, (time, list) at each tick they changed: an
    #: incident's recording carries them (``gpu_processes`` events), its chart per PID
    processes: deque[tuple[float, list[dict[str, Any]]]] = field(
        default_factory=lambda: deque(maxlen=PROCESS_READINGS_KEPT)
    )
    shed_seen: float | None = None  # the gate's shed count at the last tick
    #: the open shed incident: (id, requests shed since it opened)
    shedding: tuple[int, float] | None = None


class IncidentRecorder:
    def __init__(self, state: State, store: Store, say: Callable[..., None]) -> None:
        self.state = state
        self.store = store
        self.say = say
        self._engines: dict[str, _Engine] = {}
        #: engine → (when, the short post-mortem by language) of its last crash's incident
        self._latest: dict[str, tuple[float, dict[str, str]]] = {}

    def postmortem_for(self, engine: str, now: float) -> dict[str, str] | None:
        """The short post-mortem of the engine's crash incident of the last two minutes (the
        alerts of that crash quote it), else None."""
        found = self._latest.get(engine)
        return found[1] if found is not None and now - found[0] <= JOIN_S else None

    def _of(self, loop: EngineLoop) -> _Engine:
        return self._engines.setdefault(loop.name, _Engine())

    def crash(
        self,
        loop: EngineLoop,
        crash: Mapping[str, Any],
        reading: GpuReading,
        now: float,
        plan: ActionPlan | None = None,
    ) -> None:
        """The engine crashed: its incident, now — with what the policies decided at this tick —
        before the recovery starts (it starts after this returns)."""
        found = self._of(loop)
        detail = {
            "decision": describe(plan) if plan is not None else None,
            "crash": dict(crash)
            | {"excerpt": diagnosis_tail(loop.supervisor.process) if loop.supervisor.process else []},
            **self._moment(loop, found, reading),
        }
        found.crash = (detail, now)
        self._write_crash(loop, found)

    def _write_crash(self, loop: EngineLoop, found: _Engine) -> None:
        if found.crash is None:
            return
        detail, at = found.crash
        kind = detail["crash"].get("kind") or "unknown"
        summary = (
            f"{loop.name} crashed ({kind}): {brief(detail['crash'].get('message')) or 'no failure text'}"
        )
        lines = self._lines(loop, at)
        incident = self._open(loop, found, "crash", at, summary=summary, detail=detail, lines=lines)
        if incident is None:
            return  # tried again at the next tick
        found.crash = None
        if lines:
            report = postmortem(
                {"id": incident, "engine": loop.name, "kind": "crash", "time": at, "detail": detail},
                Recording(lines[0], lines[1:]),
            )
            self._latest[loop.name] = (at, {language: short(report, language) for language in ("en", "zh")})

    def tick(self, loop: EngineLoop, reading: GpuReading, now: float) -> None:
        """New actions of the engine become incidents (or join one); incidents whose minutes
        after have passed are completed."""
        found = self._of(loop)
        self._starts(loop, found)
        self._note_processes(loop, found, reading, now)
        self._write_crash(loop, found)
        if found.seen is None:  # what happened before tunerd started is history, not news
            newest = self.state.history(loop.name, limit=1)
            found.seen = newest[0]["id"] if newest else 0
        for action in self.state.history_after(loop.name, found.seen):
            found.seen = action["id"]
            if action["kind"] in INCIDENT_KINDS:
                self._action(loop, found, action, reading, now)
        shed = self._shed(loop, found, reading, now)
        restarting = loop.supervisor.in_flight()
        for incident, at in list(found.open.items()):
            if restarting or (shed and found.shedding is not None and found.shedding[0] == incident):
                found.busy[incident] = now  # its minutes after count from when this ends
            if now >= self._done_at(found, incident, at):
                self._complete(loop, found, incident, at, now)

    @staticmethod
    def _note_processes(loop: EngineLoop, found: _Engine, reading: GpuReading, now: float) -> None:
        """The processes on the engine's GPUs now, kept when they changed (one came or went,
        or one moved by :data:`PROCESS_CHANGE_BYTES`)."""
        listed = _processes(loop, reading)
        if found.processes:
            before = {(item["gpu"], item["pid"]): item["used_bytes"] or 0 for item in found.processes[-1][1]}
            now_held = {(item["gpu"], item["pid"]): item["used_bytes"] or 0 for item in listed}
            if before.keys() == now_held.keys() and all(
                abs(now_held[key] - before[key]) < PROCESS_CHANGE_BYTES for key in before
            ):
                return
        found.processes.append((now, listed))

    def _shed(self, loop: EngineLoop, found: _Engine, reading: GpuReading, now: float) -> bool:
        """The gate shed requests since the last tick: that opens a ``shed`` incident, or adds
        to the open one (a shedding spell is one incident, complete two minutes after it
        stopped). True while it sheds."""
        latest = self.store.latest("gate_shed_total", loop.name)
        total = latest.value if latest is not None else None
        before, found.shed_seen = found.shed_seen, total
        if total is None or before is None or total <= before:  # none, the first look, or a gate restart
            return False
        count = total - before
        if found.shedding is not None and found.shedding[0] in found.open:
            incident, so_far = found.shedding
            found.shedding = (incident, so_far + count)
            return True
        gate = dict(loop.gate or {})
        summary = (
            f"the gate shed {count:.0f} requests of {loop.name} (429: its queue full; 503: waited past "
            f"max_wait); {gate.get('queued', '?')} queued, {gate.get('in_flight', '?')} in flight"
        )
        detail = {"gate": gate, "decision": _decision(loop, now), **self._moment(loop, found, reading)}
        opened = self._open(
            loop, found, "shed", now, summary=summary, detail=detail, lines=self._lines(loop, now)
        )
        if opened is not None:
            found.shedding = (opened, count)
        return True

    def _complete(self, loop: EngineLoop, found: _Engine, incident: int, at: float, now: float) -> None:
        """The incident's recording with the minutes after it, and the start-up figures of the
        engine running now (its chart splits that start's memory by bill too); a shedding
        spell's count of the requests shed."""
        record = self.state.incident(incident)
        detail = None
        summary = None
        if record is not None:
            detail = dict(record["detail"])
            detail["figures_by_generation"] = {
                **(detail.get("figures_by_generation") or {}),
                **self._starts(loop, found),
            }
            if found.shedding is not None and found.shedding[0] == incident:
                detail["shed"] = found.shedding[1]
                summary = (
                    f"the gate shed {found.shedding[1]:.0f} requests of {loop.name} (429: its queue full; "
                    "503: waited past max_wait)"
                )
        self.state.update_incident(
            incident,
            now,
            detail=detail,
            recording=self._recording(loop, at, after=max(0.0, now - at)),
            complete=now >= self._done_at(found, incident, at),
            summary=summary,
        )
        self._close(found, incident)
        if found.shedding is not None and found.shedding[0] == incident:
            found.shedding = None

    def _starts(self, loop: EngineLoop, found: _Engine) -> dict[str, dict[str, Any]]:
        """The start-up figures of the engine's starts seen, the running one's added when it
        has been observed."""
        record = self.state.engine(loop.name)
        process = loop.supervisor.process
        observation = loop.observation
        if (
            record is not None
            and process is not None
            and observation is not None
            and observation.pid == process.pid
        ):
            found.starts[str(record.generation)] = _figures(loop)
            while len(found.starts) > STARTS_KEPT:
                del found.starts[next(iter(found.starts))]
        return dict(found.starts)

    @staticmethod
    def _done_at(found: _Engine, incident: int, at: float) -> float:
        """When an incident is complete: :data:`AFTER_S` after its moment or after the engine
        came back from the restart in flight then, within :data:`MAX_AFTER_S`."""
        return min(max(at, found.busy.get(incident, at)) + AFTER_S, at + MAX_AFTER_S)

    @staticmethod
    def _close(found: _Engine, incident: int) -> None:
        del found.open[incident]
        found.busy.pop(incident, None)

    def flush(self, loops: list[EngineLoop], now: float) -> None:
        """tunerd stops: each open incident gets the minutes after it that there were (it stays
        incomplete unless all of them had passed)."""
        for loop in loops:
            found = self._of(loop)
            self._write_crash(loop, found)
            for incident, at in list(found.open.items()):
                self._complete(loop, found, incident, at, now)

    def _action(
        self, loop: EngineLoop, found: _Engine, action: Mapping[str, Any], reading: GpuReading, now: float
    ) -> None:
        entry = {
            key: action.get(key) for key in ("id", "kind", "outcome", "reason", "policy", "time", "epoch")
        }
        joined = next((i for i, at in found.open.items() if now - at <= JOIN_S), None)
        if joined is not None:
            record = self.state.incident(joined)
            if record is not None:
                detail = dict(record["detail"])
                detail["actions"] = [*detail.get("actions", []), entry]
                self.state.update_incident(
                    joined, now, action_ids=[*record["action_ids"], action["id"]], detail=detail
                )
                return
        detail = {
            "actions": [entry],
            "decision": _decision(loop, now),
            "evidence": action.get("evidence"),
            **self._moment(loop, found, reading),
        }
        if action.get("from_settings"):
            detail["settings"] = action["from_settings"]
        who = action.get("policy") or "a person"
        summary = f"{action['kind']} by {who} ({action['outcome']}): {brief(action['reason'])}"
        lines = self._lines(loop, now)
        kind = str(action["kind"])
        self._open(
            loop, found, kind, now, summary=summary, detail=detail, lines=lines, action_ids=[action["id"]]
        )

    def _moment(self, loop: EngineLoop, found: _Engine, reading: GpuReading) -> dict[str, Any]:
        """What every incident keeps of its moment: the processes on the GPU, the start-up
        figures (this start's, and each start's seen), the settings."""
        return {
            "processes": _processes(loop, reading),
            "figures": _figures(loop),
            "figures_by_generation": self._starts(loop, found),
            "settings": loop.supervisor.running_settings() or dict(loop.config.settings),
        }

    def _open(
        self,
        loop: EngineLoop,
        found: _Engine,
        kind: str,
        at: float,
        *,
        summary: str,
        detail: Mapping[str, Any],
        lines: list[dict[str, Any]],
        action_ids: list[int] | None = None,
    ) -> int | None:
        """A new incident in the state, open until its minutes after have passed; None (said)
        when the state refused it."""
        try:
            incident = self.state.add_incident(
                engine=loop.name,
                kind=kind,
                at=at,
                summary=summary,
                detail=dict(detail),
                recording=pack(lines),
                now=at,
                action_ids=action_ids or [],
            )
        except StateError as error:
            self.say("incident_unwritten", engine=loop.name, kind=kind, error=str(error))
            return None
        found.open[incident] = at
        self.say("incident", engine=loop.name, id=incident, kind=kind, summary=summary)
        return incident

    def _lines(self, loop: EngineLoop, at: float, after: float = 0.0) -> list[dict[str, Any]]:
        """The recording of ``at``: the tape's lines, with the processes on the GPU as
        ``gpu_processes`` events — the one in force at its first line, and each change."""
        lines = loop.tape.lines(
            self.store, loop.name, at - BEFORE_S, at + after, lookback=LOOKBACK_S, source="incident"
        )
        if len(lines) < 2:
            return lines
        first, until = float(lines[1]["t"]), at + after
        kept = self._of(loop).processes
        earlier = [entry for entry in kept if entry[0] < first][-1:]
        changes = [
            {"t": max(t, first), "event": "gpu_processes", "data": {"processes": listed}}
            for t, listed in [*earlier, *(entry for entry in kept if first <= entry[0] <= until)]
        ]
        return [lines[0], *sorted([*lines[1:], *changes], key=lambda line: float(line["t"]))]

    def _recording(self, loop: EngineLoop, at: float, after: float = 0.0) -> bytes:
        return pack(self._lines(loop, at, after))


def _decision(loop: EngineLoop, now: float) -> dict[str, Any] | None:
    """The policies' latest decision for the engine, if it came within :data:`JOIN_S`."""
    return next((d for t, d in reversed(loop.tape.decisions) if now - t <= JOIN_S), None)


def _processes(loop: EngineLoop, reading: GpuReading) -> list[dict[str, Any]]:
    """The processes on the engine's GPUs at the moment, the engine's marked, largest first."""
    out = []
    for gpu in engine_gpus(reading.gpus, loop.config.gpus):
        for process in gpu.processes or ():
            out.append(
                {
                    "gpu": gpu.index,
                    "pid": process.pid,
                    "name": process.name,
                    "used_bytes": process.used_bytes,
                    "engine": process.pid in loop.engine_pids,
                }
            )
        if gpu.unattributed_bytes:
            out.append(
                {
                    "gpu": gpu.index,
                    "pid": None,
                    "name": "(unattributed)",
                    "used_bytes": gpu.unattributed_bytes,
                }
            )
    return sorted(out, key=lambda item: -(item["used_bytes"] or 0))


def _figures(loop: EngineLoop) -> dict[str, Any]:
    observation = loop.observation
    if observation is None:
        return {}
    return {
        "weights_bytes": observation.weights_bytes,
        "kv_available_bytes": observation.kv_available_bytes,
        "cuda_graph_bytes": observation.cuda_graph_bytes,
        "cuda_total_bytes": observation.cuda_total_bytes,
        "kv_cache_tokens": observation.kv_cache_tokens,
    }


@dataclass
class _Ask:
    engine: str
    since: float | None
    until: float | None
    done: threading.Event = field(default_factory=threading.Event)
    answer: tuple[int, dict[str, Any]] = (503, {"error": "not answered"})


class LiveRecordings:
    """``GET /recording`` of the status socket (``tunerd record ENGINE --for D``): the status
    server's thread asks, the loop thread answers between its jobs — the store and the tapes
    are the loop's, never read from another thread. The asking thread waits
    :data:`ANSWER_WAIT_S` at most (a restart step in progress holds the loop that long)."""

    def __init__(
        self,
        store: Store,
        engines: Callable[[], Sequence[EngineLoop]],
        now: Callable[[], float],
        interval_s: Callable[[], float],
        nudge: Callable[[], None],
        *,
        retention_s: float = math.inf,
    ) -> None:
        self.store = store
        self._retention = retention_s  # what the store keeps of each signal
        self._engines = engines
        self._now = now
        self._interval = interval_s
        self._nudge = nudge
        self._asks: queue.SimpleQueue[_Ask] = queue.SimpleQueue()

    def ask(self, query: Mapping[str, str]) -> tuple[int, dict[str, Any]]:
        """On the status server's thread: the window ``since``–``until`` (the daemon's clock,
        epoch seconds; absent: all it holds, and now) of ``engine``; without ``since`` and
        with ``probe``, only what it holds (``now``, ``oldest``, ``capacity_s``)."""
        engine = query.get("engine", "")
        try:
            since = float(query["since"]) if "since" in query else None
            until = float(query["until"]) if "until" in query else None
        except ValueError:
            return 400, {"error": "since and until are seconds since the epoch"}
        if any(value is not None and not math.isfinite(value) for value in (since, until)):
            return 400, {"error": "since and until are seconds since the epoch"}
        ask = _Ask(engine, since, until if "probe" not in query else -math.inf)
        self._asks.put(ask)
        self._nudge()
        if not ask.done.wait(ANSWER_WAIT_S):
            return 503, {
                "error": f"tunerd's loop did not answer within {ANSWER_WAIT_S:g} s (a restart step?)"
            }
        return ask.answer

    def answer(self) -> None:
        """On the loop thread: every pending ask."""
        while True:
            try:
                ask = self._asks.get_nowait()
            except queue.Empty:
                return
            try:
                ask.answer = self._cut(ask)
            except Exception as error:  # one bad ask answers 500; the loop goes on
                ask.answer = (500, {"error": f"{type(error).__name__}: {error}"})
            ask.done.set()

    def _cut(self, ask: _Ask) -> tuple[int, dict[str, Any]]:
        loop = next((loop for loop in self._engines() if loop.name == ask.engine), None)
        if loop is None:
            names = ", ".join(loop.name for loop in self._engines())
            return 404, {"error": f"no engine {ask.engine!r} (tunerd runs: {names})"}
        now = self._now()
        ticks = loop.tape.ticks
        held = {
            "engine": loop.name,
            "now": now,
            "oldest": ticks[0] if ticks else None,
            # what a recording can span: the ticks the tape keeps, the samples the store keeps
            "capacity_s": min(loop.tape.capacity * self._interval(), self._retention),
        }
        if ask.until == -math.inf:  # a probe
            return 200, held
        since = ask.since if ask.since is not None else (ticks[0] if ticks else now)
        until = min(ask.until, now) if ask.until is not None else now
        lines = loop.tape.lines(self.store, loop.name, since, until, lookback=LOOKBACK_S, source="daemon")
        return 200, held | {"lines": lines}
