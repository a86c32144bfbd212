"""Incidents: what filled the GPU, who grew, what tunerd did — read from an incident's recording.

The daemon writes an incident (:mod:`tunerd.state`) at every crash and every action it or a
policy takes: a recording (:mod:`tunerd.recording`) of the minutes before and after, and the
detail it had at hand (the crash's kind and excerpt, the processes on the GPU, the start-up
figures, the decision that fired). This module turns that into the post-mortem
``tunerd incident show`` prints and alerts quote. Pure: bytes in, dictionaries and text out.
"""

from __future__ import annotations

import datetime as dt
import itertools
import math
import re
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

from tunerd import chart
from tunerd.recording import Recording, RecordingError, iter_json_lines, parse_lines
from tunerd.units import format_size

__all__ = [
    "AFTER_S",
    "BEFORE_S",
    "LOOKBACK_S",
    "MAX_PACKED_BYTES",
    "chart_of",
    "html_page",
    "pack",
    "postmortem",
    "render",
    "series",
    "short",
    "unpack",
]

BEFORE_S = 300.0  # the ticks an incident keeps before its moment
AFTER_S = 120.0  # and after it (the incident is completed once they have passed)
LOOKBACK_S = 300.0  # samples before the first tick: what the detectors look back over
MAX_PACKED_BYTES = 4 << 20  # a recording larger than this, compressed, keeps its newest part
GROWTH_WORTH_NAMING = 256 << 20  # a rise below this is noise in a post-mortem

NEIGHBOUR = "a neighbour grew into the engine's room"
PLATEAU = "the engine grew past its budget (the prefill plateau: activations beside a full pool)"
OOM = "the engine ran out of memory"
SATURATED = "the KV pool saturated"
SHED = "the gate shed load: more was asked than the KV pool holds"
#: the causes in Chinese, for the alerts' second language
CAUSES_ZH = {
    NEIGHBOUR: "其他进程增长，挤占了引擎的显存",
    PLATEAU: "引擎超出了预算（prefill 平台：KV 池满时的激活峰值）",
    OOM: "引擎显存不足",
    SATURATED: "KV 缓存池饱和",
    SHED: "网关削减了负载：请求超出了 KV 缓存池的容量",
}


def pack(lines: Sequence[Mapping[str, Any]]) -> bytes:
    """A recording's lines, compressed; past :data:`MAX_PACKED_BYTES` the oldest body lines go
    (the header stays)."""
    body = list(lines[1:]) if lines else []
    while True:
        packed = zlib.compress("".join(iter_json_lines([*lines[:1], *body])).encode(), 6)
        if len(packed) <= MAX_PACKED_BYTES or len(body) < 2:
            return packed
        body = body[len(body) // 4 :]


def unpack(packed: bytes, where: str = "incident") -> Recording:
    try:
        text = zlib.decompress(packed).decode()
    except (zlib.error, UnicodeDecodeError) as error:
        raise RecordingError(f"{where}: its recording cannot be read ({error})") from None
    return parse_lines(text.splitlines(), where)


def series(recording: Recording, signal: str) -> list[tuple[float, float | None, int]]:
    """One signal's samples in the recording: (time, value, generation)."""
    return [
        (float(line["t"]), line["samples"][signal], int(line.get("g", 0)))
        for line in recording.lines
        if "samples" in line and signal in line["samples"]
    ]


def _values(points: Sequence[tuple[float, float | None, int]]) -> list[tuple[float, float]]:
    return [(t, float(v)) for t, v, _ in points if v is not None and math.isfinite(v)]


def _at(points: Sequence[tuple[float, float]], when: float) -> float | None:
    found = None
    for t, v in points:
        if t > when:
            break
        found = v
    return found


def postmortem(incident: Mapping[str, Any], recording: Recording | None) -> dict[str, Any]:
    """What an operator asks first: the bills at the peak, who grew by how much, the suspected
    cause and its evidence, what tunerd did. Keys are stable (``tunerd incident show --json``)."""
    detail = dict(incident.get("detail") or {})
    at = float(incident.get("time") or 0.0)
    out: dict[str, Any] = {
        "id": incident.get("id"),
        "engine": incident.get("engine"),
        "kind": incident.get("kind"),
        "at": incident.get("at"),
        "summary": incident.get("summary"),
        "complete": bool(incident.get("complete")),
        "crash": detail.get("crash"),
        "decision": detail.get("decision"),
        "settings": detail.get("settings"),
        "processes": detail.get("processes") or [],
        "peak": None,
        "bills": None,
        "grew": [],
        "cause": None,
        "evidence": [],
        "actions": detail.get("actions") or [],
        "window": None,
        "plateaus": [],
    }
    if recording is None:
        return out
    # the prefill plateaus that fell back while it was recorded (the daemon's
    # ``transient_plateau`` events: height, how long, what was in flight)
    out["plateaus"] = [
        dict(line["data"])
        for line in recording.lines
        if line.get("event") == "transient_plateau" and isinstance(line.get("data"), dict)
    ]
    used = _values(series(recording, "gpu_memory_used_bytes"))
    total = _values(series(recording, "gpu_memory_total_bytes"))
    engine = _values(series(recording, "engine_memory_bytes"))
    others = _values(series(recording, "other_processes_memory_bytes"))
    kv = _values(series(recording, "kv_cache_usage"))
    running = _values(series(recording, "num_requests_running"))
    waiting = _values(series(recording, "num_requests_waiting"))
    preemptions = _values(series(recording, "num_preemptions_total"))
    times = [float(line["t"]) for line in recording.lines]
    if times:
        out["window"] = {"from": min(times), "to": max(times), "ticks": recording.ticks}
    # the peak: the most used on the GPU up to the incident's moment (after it a restart empties it)
    upto = [(t, v) for t, v in used if t <= at + 1e-6] or used
    if upto:
        peak_t, peak_v = max(upto, key=lambda item: item[1])
        engine_at = _at(engine, peak_t)
        others_at = _at(others, peak_t)
        unattributed = None
        if engine_at is not None and others_at is not None:
            unattributed = max(0.0, peak_v - engine_at - others_at)
        out["peak"] = {
            "time": peak_t,
            "used_bytes": peak_v,
            "total_bytes": _at(total, peak_t),
            "engine_bytes": engine_at,
            "others_bytes": others_at,
            "unattributed_bytes": unattributed,
            "kv_cache_usage": _at(kv, peak_t),
            "running": _at(running, peak_t),
            "waiting": _at(waiting, peak_t),
        }
        for key, signal in _GATE_AT_PEAK.items():  # what was in flight at the gate, when there is one
            found = _at(_values(series(recording, signal)), peak_t)
            if found is not None:
                out["peak"][key] = found
        out["bills"] = _bills(detail.get("figures") or {}, engine_at)
        out["grew"] = _grew(
            {"engine": engine, "neighbours": others, "gpu": used, **_per_neighbour(recording)},
            first=min(times) if times else at,
            upto=peak_t,
        )
    over_budget = _values(series(recording, "engine_over_budget_bytes"))
    shed = _values(series(recording, "gate_shed_total"))
    signals = {"kv": kv, "preemptions": preemptions, "over_budget": over_budget, "shed": shed}
    out["cause"], out["evidence"] = _cause(out, detail, signals, at)
    return out


#: the gate's signals a post-mortem's peak quotes, by the key it quotes them under
_GATE_AT_PEAK = {
    "gate_in_flight": "gate_in_flight",
    "gate_prompt_tokens_in_flight": "gate_in_flight_prompt_tokens",
    "gate_longest_prompt": "gate_longest_prompt_in_flight",
    "gate_queued": "gate_queued",
}


#: the largest neighbours' own layers (the rest of them share one)
_NEIGHBOUR_COLOURS = ("#c62828", "#ad1457", "#f06292")


def _order(neighbours: Mapping[str, Any]) -> list[str]:
    """The memory panel's layers bottom first: the engine's bills, each large neighbour, the
    other neighbours, what no process owns."""
    engine = [name for name in BILL_COLOURS if name.startswith("engine")]
    rest = ["neighbours (other processes)", "unattributed (no process owns it)"]
    return [*engine, *neighbours, *rest]


def _per_neighbour(recording: Recording) -> dict[str, list[tuple[float, float]]]:
    """Each neighbour's memory over the recording (its ``gpu_processes`` events), by a name a
    person can find it by: ``pid 4242 (python)``."""
    found: dict[str, list[tuple[float, float]]] = {}
    looked = False  # a process that came after the first look held nothing before it came
    for line in recording.lines:
        if line.get("event") != "gpu_processes":
            continue
        seen = set()
        for item in (line.get("data") or {}).get("processes") or []:
            if not isinstance(item, Mapping) or item.get("engine") or item.get("pid") is None:
                continue
            used = item.get("used_bytes")
            if not isinstance(used, (int, float)):
                continue
            who = f"pid {item['pid']} ({str(item.get('name') or '?')[:40]})"
            if who not in found and looked:
                found[who] = [(float(line["t"]), 0.0)]
            found.setdefault(who, []).append((float(line["t"]), float(used)))
            seen.add(who)
        for who, points in found.items():  # gone: it holds nothing from here
            if who not in seen and points[-1][1] != 0.0:
                points.append((float(line["t"]), 0.0))
        looked = True
    return found


def _bills(figures: Mapping[str, Any], engine_at: float | None) -> dict[str, float | None] | None:
    """The engine's memory at the peak by bill: weights, KV pool and CUDA graphs from its
    start-up figures, the rest (activations, the CUDA context, fragments) what is left."""
    weights, kv, graphs = (
        figures.get(key) for key in ("weights_bytes", "kv_available_bytes", "cuda_graph_bytes")
    )
    if engine_at is None or all(value is None for value in (weights, kv, graphs)):
        return None
    known = sum(float(value) for value in (weights, kv, graphs) if value is not None)
    return {
        "weights_bytes": weights,
        "kv_pool_bytes": kv,
        "cuda_graphs_bytes": graphs,
        "activations_and_runtime_bytes": max(0.0, engine_at - known),
    }


def _grew(
    owners: Mapping[str, Sequence[tuple[float, float]]], first: float, upto: float
) -> list[dict[str, Any]]:
    """Each owner's rise from its least in the window before the peak to the peak, largest
    first; only rises worth naming."""
    found = []
    for owner, points in owners.items():
        before = [v for t, v in points if first <= t <= upto]
        if not before:
            continue
        low = min(before)
        at_peak = _at(points, upto)
        if at_peak is None:
            continue
        rise = at_peak - low
        if rise >= GROWTH_WORTH_NAMING:
            found.append({"who": owner, "from_bytes": low, "to_bytes": at_peak, "by_bytes": rise})
    return sorted(found, key=lambda item: -item["by_bytes"])


def _cause(
    out: Mapping[str, Any],
    detail: Mapping[str, Any],
    signals: Mapping[str, Sequence[tuple[float, float]]],
    at: float,
) -> tuple[str | None, list[str]]:
    """The suspected cause, in one phrase, and the facts that point to it."""
    kv, preemptions, over_budget = signals["kv"], signals["preemptions"], signals["over_budget"]
    shed = signals.get("shed") or []
    evidence: list[str] = []
    crash = detail.get("crash") or {}
    grew = {item["who"]: item for item in out.get("grew") or []}
    if crash.get("kind"):
        evidence.append(
            f"crash: {crash['kind']}" + (f" — {brief(crash['message'])}" if crash.get("message") else "")
        )
    for who in ("neighbours", "engine"):
        if who in grew:
            item = grew[who]
            evidence.append(
                f"{who} grew {format_size(item['by_bytes'])} ({format_size(item['from_bytes'])} → "
                f"{format_size(item['to_bytes'])})"
            )
    plateaus = [p for p in out.get("plateaus") or [] if isinstance(p.get("height_bytes"), (int, float))]
    if plateaus:
        tallest = max(plateaus, key=lambda p: p["height_bytes"])
        stood = tallest.get("duration_s")
        prompt = tallest.get("prompt_tokens")
        evidence.append(
            f"{len(plateaus)} prefill plateau{'s' if len(plateaus) > 1 else ''} fell back in the window "
            f"(tallest +{format_size(tallest['height_bytes'])}"
            + (f" for {stood:.1f} s" if isinstance(stood, (int, float)) else "")
            + (f", {prompt:,} prompt tokens prefilled" if isinstance(prompt, int) else "")
            + ")"
        )
    saturated = [v for t, v in kv if t <= at + 1e-6 and v >= 0.95]
    rose = preemptions[-1][1] - preemptions[0][1] if len(preemptions) > 1 else 0.0
    if saturated:
        evidence.append(f"KV pool at {max(saturated):.0%} used")
    if rose > 0:
        evidence.append(f"{rose:.0f} preemptions in the window")
    shed_count = sum(
        b - a for (_, a), (_, b) in itertools.pairwise(shed) if b > a
    )  # a gate's restart: no rise
    gate = detail.get("gate") or {}
    if shed_count > 0 or detail.get("shed"):
        evidence.append(
            f"the gate shed {detail.get('shed') or shed_count:.0f} requests (429 queue full, 503 waited)"
        )
    if gate.get("in_flight") is not None:
        flying, prompts, longest, queued, need = (
            _count(gate.get(key))
            for key in (
                "in_flight",
                "in_flight_prompt_tokens",
                "longest_prompt_in_flight",
                "queued",
                "queued_tokens",
            )
        )
        evidence.append(
            f"at the gate: {flying} in flight ({prompts} prompt tokens, the longest {longest}), "
            f"{queued} queued ({need} tokens of KV need)"
        )
    decision = detail.get("decision") or {}
    if decision.get("policy"):
        evidence.append(
            f"policy {decision['policy']} fired: {', '.join(decision.get('actions') or []) or 'no action'}"
        )
    neighbour = grew.get("neighbours")
    own = grew.get("engine")
    over = max((v for t, v in over_budget if t <= at + 1e-6), default=0.0)
    if over >= GROWTH_WORTH_NAMING:
        evidence.append(f"the engine held {format_size(over)} more than its budget")
    if neighbour is not None and (own is None or neighbour["by_bytes"] >= own["by_bytes"]):
        cause = NEIGHBOUR
    elif own is not None and over >= GROWTH_WORTH_NAMING:
        cause = PLATEAU
    elif crash.get("kind") == "cuda_oom":
        cause = OOM
    elif out.get("kind") == "shed":
        cause = SHED
    elif saturated or rose > 0:
        cause = SATURATED
    elif crash.get("kind"):
        cause = f"the engine failed: {crash['kind']}"
    elif decision.get("policy"):
        cause = f"policy {decision['policy']} asked for it"
    else:
        cause = None
    return cause, evidence


# -- words --------------------------------------------------------------------------------------
def _count(value: Any) -> str:
    return f"{value:,.0f}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "?"


def _size(value: Any) -> str:
    return "?" if value is None else format_size(float(value))


def render(found: Mapping[str, Any]) -> str:
    """The terminal post-mortem of :func:`postmortem`'s result."""
    lines = [
        f"incident {found['id']} · {found['engine']} · {found['kind']} · {found['at']}",
        f"  {found['summary']}",
    ]
    if not found.get("complete"):
        lines.append("  (the minutes after it are not in yet: tunerd completes an incident 2 minutes on)")
    peak = found.get("peak")
    lines.append("")
    lines.append("What filled the GPU")
    if peak is None:
        lines.append("  no GPU samples in the recording")
    else:
        total = f" of {_size(peak['total_bytes'])}" if peak.get("total_bytes") else ""
        lines.append(f"  at the peak ({_clock(peak['time'])}): {_size(peak['used_bytes'])} used{total}")
        lines.append(
            f"    engine {_size(peak['engine_bytes'])} · neighbours {_size(peak['others_bytes'])} · "
            f"unattributed {_size(peak['unattributed_bytes'])}"
        )
        if peak.get("kv_cache_usage") is not None:
            running = "?" if peak.get("running") is None else f"{peak['running']:.0f}"
            waiting = "?" if peak.get("waiting") is None else f"{peak['waiting']:.0f}"
            lines.append(
                f"    KV pool {peak['kv_cache_usage']:.0%} used · {running} running · {waiting} waiting"
            )
        if peak.get("gate_in_flight") is not None:
            lines.append(
                f"    at the gate: {peak['gate_in_flight']:.0f} in flight, "
                f"{peak.get('gate_prompt_tokens_in_flight', 0):,.0f} prompt tokens (the longest "
                f"{peak.get('gate_longest_prompt', 0):,.0f}), {peak.get('gate_queued', 0):.0f} queued"
            )
        bills = found.get("bills")
        if bills:
            lines.append(
                f"    bills: weights {_size(bills['weights_bytes'])} · "
                f"KV pool {_size(bills['kv_pool_bytes'])} · "
                f"CUDA graphs {_size(bills['cuda_graphs_bytes'])} · "
                f"activations and runtime {_size(bills['activations_and_runtime_bytes'])}"
            )
    for process in found.get("processes") or []:
        lines.append(
            f"    pid {process.get('pid')} {process.get('name') or '?'}: {_size(process.get('used_bytes'))}"
        )
    lines.append("")
    lines.append("Who grew")
    grew = found.get("grew") or []
    lines += [
        f"  {item['who']}: +{_size(item['by_bytes'])} "
        f"({_size(item['from_bytes'])} → {_size(item['to_bytes'])})"
        for item in grew
    ] or [f"  nothing rose by more than {format_size(GROWTH_WORTH_NAMING)} before the peak"]
    lines.append("")
    lines.append(f"Suspected cause: {found.get('cause') or 'not clear from the signals'}")
    lines += [f"  - {fact}" for fact in found.get("evidence") or []]
    crash = found.get("crash") or {}
    words = [line for line in crash.get("excerpt") or [] if not _ACCESS_LINE.search(str(line))]
    if words:
        lines.append("  the engine's last words (its access log left out):")
        lines += [f"    | {line}" for line in words[-8:]]
    lines.append("")
    lines.append("What tunerd did")
    actions = found.get("actions") or []
    lines += [
        f"  #{action.get('id')} {action.get('kind')} → {action.get('outcome')}: "
        f"{brief(action.get('reason'), 240)}"
        for action in actions
    ] or ["  nothing yet"]
    lines.append("")
    lines.append(
        f"  tunerd record --incident {found['id']} FILE   its recording, to replay with other policies"
    )
    return "\n".join(lines)


def short(found: Mapping[str, Any], language: str = "en") -> str:
    """Two lines for an alert: the cause and the peak, and the command to see the rest."""
    peak = found.get("peak") or {}
    grew = found.get("grew") or []
    if language == "zh":
        cause = CAUSES_ZH.get(found.get("cause") or "", found.get("cause") or "信号中看不出原因")
        top = (
            f"峰值 {_size(peak.get('used_bytes'))}（引擎 {_size(peak.get('engine_bytes'))}，"
            f"其他进程 {_size(peak.get('others_bytes'))}）"
        )
        who = {"engine": "引擎", "neighbours": "其他进程", "gpu": "整卡"}
        rise = (
            f"；增长最多：{who.get(grew[0]['who'], grew[0]['who'])} +{_size(grew[0]['by_bytes'])}"
            if grew
            else ""
        )
        return f"疑似原因：{cause}。{top}{rise}。详情：tunerd incident show {found['id']}"
    cause = found.get("cause") or "not clear from the signals"
    top = (
        f"peak {_size(peak.get('used_bytes'))} (engine {_size(peak.get('engine_bytes'))}, "
        f"neighbours {_size(peak.get('others_bytes'))})"
    )
    rise = f"; grew most: {grew[0]['who']} +{_size(grew[0]['by_bytes'])}" if grew else ""
    return f"Suspected cause: {cause}. {top}{rise}. More: tunerd incident show {found['id']}"


_LOG_PREFIX = re.compile(r"^\(\w+ pid=\d+\)\s+\w+\s+\d\d-\d\d \d\d:\d\d:\d\d \[[^\]]*\]\s*")
_ACCESS_LINE = re.compile(r'^INFO:\s+[\d.:\[\]a-f]+ - "')


def brief(text: Any, limit: int = 160) -> str:
    """A log message for one line: the engine's log prefix gone, cut at ``limit`` characters."""
    found = _LOG_PREFIX.sub("", " ".join(str(text or "").split()))
    return found if len(found) <= limit else found[: limit - 1].rstrip() + "…"


def _clock(moment: float) -> str:
    return dt.datetime.fromtimestamp(moment, tz=dt.UTC).strftime("%H:%M:%S UTC")


# -- the chart ----------------------------------------------------------------------------------
#: the layers of the memory panel, bottom first
BILL_COLOURS = {
    "engine: weights": "#5c6bc0",
    "engine: KV cache pool": "#26a69a",
    "engine: CUDA graphs": "#8d6e63",
    "engine: activations, context and the rest": "#ffb74d",
    "engine (a start whose bills are not known)": "#90a4ae",
    "neighbours (other processes)": "#e57373",
    "unattributed (no process owns it)": "#bdbdbd",
}


def chart_of(
    incident: Mapping[str, Any], recording: Recording, actions: Sequence[Mapping[str, Any]] | None = None
) -> tuple[list[chart.Panel], list[chart.Mark]]:
    """An incident's panels — GPU memory stacked by bill, the KV pool's use, the requests —
    and its marks (the crash, each action). The engine's bills come from its start-up figures,
    for the start that was running at the incident's moment; another start's memory is one
    layer. Readings while the engine was down are a gap. ``actions``: the incident's actions
    as they stand now (else as they were written)."""
    detail = dict(incident.get("detail") or {})
    at = float(incident.get("time") or 0.0)
    rows = _readings(recording)
    times = [t for t, _, _ in rows]
    generation = None
    for t, g, _ in rows:
        if t <= at + 1e-6:
            generation = g

    def get(values: Mapping[str, Any], signal: str) -> float | None:
        value = values.get(signal)
        return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None

    starts = {str(generation): detail.get("figures") or {}}  # older incidents kept only these
    for key, figures in (detail.get("figures_by_generation") or {}).items():
        if isinstance(figures, Mapping):
            starts[str(key)] = figures
    bills = {key: _known_bills(figures) for key, figures in starts.items()}
    layers: dict[str, list[float | None]] = {name: [] for name in BILL_COLOURS}
    budget: list[float | None] = []
    totals = []
    serving = []  # the readings with the engine there: the chart's y-range is fitted to them
    per_neighbour = _per_neighbour(recording)
    top_neighbours = dict(sorted(per_neighbour.items(), key=lambda item: -max(v for _, v in item[1]))[:3])
    for t, g, line in rows:
        used, total = get(line, "gpu_memory_used_bytes"), get(line, "gpu_memory_total_bytes")
        engine, others = get(line, "engine_memory_bytes"), get(line, "other_processes_memory_bytes")
        if total:
            totals.append(total)
        here = engine is not None and engine > 0
        serving.append(here)
        known = bills.get(str(g)) if here else None
        rest = float(engine or 0.0)
        for name in _BILLS:
            part = min(known[name], rest) if known is not None else 0.0
            layers[name].append(part if known is not None else None)
            rest -= part
        layers["engine: activations, context and the rest"].append(rest if known is not None else None)
        layers["engine (a start whose bills are not known)"].append(
            engine if here and known is None else None
        )
        named = 0.0
        for who, points in top_neighbours.items():
            value = _at(points, t)
            layers.setdefault(who, []).append(value if value else None)
            named += value or 0.0
        rest_of_them = None if others is None else (max(0.0, others - named) if top_neighbours else others)
        layers["neighbours (other processes)"].append(rest_of_them)
        unattributed = None
        if used is not None:
            unattributed = max(0.0, used - float(engine or 0.0) - float(others or 0.0))
        layers["unattributed (no process owns it)"].append(unattributed)
        over = get(line, "engine_over_budget_bytes")
        budget.append(engine - over if here and engine is not None and over is not None else None)

    gate_queued = [get(line, "gate_queued") for _, _, line in rows]

    def metric(signal: str) -> list[float | None]:  # the engine's own figures: only while it is there
        return [get(line, signal) if here else None for (_, _, line), here in zip(rows, serving, strict=True)]

    memory = chart.Panel(
        title=f"GPU memory of {recording.engine}'s GPU, by bill",
        unit="bytes",
        times=times,
        layers=[
            chart.Layer(name, BILL_COLOURS.get(name) or _NEIGHBOUR_COLOURS[index % 3], layers[name])
            for index, name in enumerate(_order(top_neighbours))
            if any(value is not None for value in layers[name])
        ],
        lines=[
            chart.Line("the engine's budget (gpu_memory_utilization × total)", "#1b5e20", budget, dashed=True)
        ]
        if any(value is not None for value in budget)
        else [],
        ceiling=("the card's total", max(totals)) if totals else None,
        height=300,
        fit_rows=serving if any(serving) else None,
    )
    kv = chart.Panel(
        title="KV cache pool used",
        unit="ratio",
        times=times,
        lines=[chart.Line("KV cache used", "#00695c", metric("kv_cache_usage"))],
        ceiling=("pool full", 1.0),
        height=90,
        fit=False,
    )
    requests = chart.Panel(
        title="requests",
        unit="count",
        times=times,
        lines=[
            chart.Line("running", "#283593", metric("num_requests_running")),
            chart.Line("waiting", "#c62828", metric("num_requests_waiting"), dashed=True),
            *(
                [chart.Line("queued at the gate", "#6d4c41", gate_queued, dashed=True)]
                if any(value is not None for value in gate_queued)
                else []
            ),
        ],
        height=90,
        fit=False,
    )
    marks = [
        chart.Mark(
            float(line["t"]),
            "crash",
            brief(
                f"{(line.get('data') or {}).get('kind') or 'crash'}: "
                f"{(line.get('data') or {}).get('message') or ''}",
                120,
            ),
        )
        for line in recording.lines
        if line.get("event") == "engine_crash"
    ]
    for action in detail.get("actions") or [] if actions is None else actions:
        moment = _moment(action.get("epoch")) or _moment(action.get("time"))  # older incidents: ISO only
        if moment is not None:
            marks.append(
                chart.Mark(
                    moment,
                    str(action.get("kind") or "action"),
                    brief(f"#{action.get('id')} → {action.get('outcome')}: {action.get('reason')}", 160),
                )
            )
    marks += _shed_marks(rows)
    if not marks:
        marks.append(
            chart.Mark(at, str(incident.get("kind") or "incident"), str(incident.get("summary") or ""))
        )
    return [memory, kv, requests], marks


#: read from a GPU reading's own line only: a line without them is not a reading of memory
_MEMORY_SIGNALS = frozenset(
    {
        "gpu_memory_used_bytes",
        "gpu_memory_total_bytes",
        "engine_memory_bytes",
        "engine_over_budget_bytes",
        "other_processes_memory_bytes",
    }
)


_BILLS = ("engine: weights", "engine: KV cache pool", "engine: CUDA graphs")


def _known_bills(figures: Mapping[str, Any]) -> dict[str, float] | None:
    """A start's bills from its start-up figures (None: none known)."""
    values = [figures.get(key) for key in ("weights_bytes", "kv_available_bytes", "cuda_graph_bytes")]
    found = [float(v) if isinstance(v, (int, float)) and math.isfinite(v) and v > 0 else 0.0 for v in values]
    return dict(zip(_BILLS, found, strict=True)) if any(found) else None


def _shed_marks(rows: Sequence[tuple[float, int, Mapping[str, Any]]]) -> list[chart.Mark]:
    """A mark where the gate began to shed (the first rise of its count after none)."""
    marks: list[chart.Mark] = []
    before: float | None = None
    shedding = False
    for t, _, values in rows:
        total = values.get("gate_shed_total")
        if not isinstance(total, (int, float)):
            continue
        rising = before is not None and total > before
        if before is not None and rising and not shedding:
            marks.append(chart.Mark(t, "shed", f"the gate began to shed: {total - before:.0f} refused"))
        shedding, before = rising, float(total)
    return marks


def _readings(recording: Recording) -> list[tuple[float, int, dict[str, Any]]]:
    """The recording's GPU readings, oldest first: (time, generation, signals). The memory
    signals are the line's own; the engine's metrics (scraped at their own pace) are the
    latest at or before it, if they are not older than two usual steps between readings."""
    lines = [line for line in recording.lines if isinstance(line.get("samples"), Mapping)]
    moments = [
        float(line["t"])
        for line in lines
        if "gpu_memory_used_bytes" in line["samples"] or "engine_memory_bytes" in line["samples"]
    ]
    steps = sorted(b - a for a, b in itertools.pairwise(moments) if b > a)
    fresh = 2 * steps[(3 * len(steps)) // 4] if steps else math.inf
    latest: dict[str, tuple[float, Any]] = {}
    rows = []
    for line in lines:
        t, samples = float(line["t"]), line["samples"]
        for signal, value in samples.items():
            if signal not in _MEMORY_SIGNALS:
                latest[signal] = (t, value)
        if "gpu_memory_used_bytes" in samples or "engine_memory_bytes" in samples:
            values = {signal: value for signal, (when, value) in latest.items() if t - when <= fresh}
            values.update({signal: samples.get(signal) for signal in _MEMORY_SIGNALS})
            rows.append((t, int(line.get("g", 0)), values))
    return rows


def _moment(value: Any) -> float | None:
    """A time as the state keeps it (epoch seconds, or ISO 8601 text) in epoch seconds."""
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    if isinstance(value, str):
        try:
            stamp = dt.datetime.fromisoformat(value)
        except ValueError:
            return None
        return (stamp if stamp.tzinfo else stamp.replace(tzinfo=dt.UTC)).timestamp()
    return None


def html_page(found: Mapping[str, Any], incident: Mapping[str, Any], recording: Recording | None) -> str:
    """``tunerd incident show ID --html FILE``: the chart and the post-mortem (``found``, of
    :func:`postmortem`) on one page."""
    title = f"tunerd incident {found['id']} · {found['engine']} · {found['kind']} · {found['at']}"
    intro = [
        str(found.get("summary") or ""),
        f"Suspected cause: {found.get('cause') or 'not clear from the signals'}",
    ]
    if recording is None:
        return chart.page(title, intro, "<p>(no recording)</p>", [("Post-mortem", render(found))])
    panels, marks = chart_of(incident, recording, found.get("actions"))
    return chart.page(
        title,
        intro,
        chart.svg(panels, marks, clock="utc"),
        [("Marks", chart.mark_list(marks, clock="utc")), ("Post-mortem", render(found))],
    )
