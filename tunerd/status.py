"""``tunerd status``: what the daemon knows, as DESIGN §4.8's JSON and as one screen. Pure.

The daemon gathers its engines' pieces — the latest GPU reading, the last ``/metrics`` scrape,
policy states, history, the restart in flight — and :func:`engine_status` and
:func:`status_document` make the JSON of them; the status server hands it out; :func:`render`
draws it for a person in at most 100 columns — colour only on a terminal and never with
``NO_COLOR`` set.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from tunerd.units import GIB

if TYPE_CHECKING:  # types only: `tunerd status` renders without loading the policy engine
    from tunerd.gpu import GpuSample
    from tunerd.outcomes import Mode, Progress
    from tunerd.policy.engine import PolicyState
    from tunerd.signals import EngineMemory

__all__ = ["BILLS", "WIDTH", "bills", "engine_state", "engine_status", "render", "status_document"]

WIDTH = 100
#: the bar's parts, in order: key, label, glyph without colour, ANSI colour
BILLS = (
    ("weights", "weights", "W", "34"),  # label: the legend's word (the engine's other memory: "engine")
    ("kv_pool", "KV pool", "K", "32"),
    ("engine_other", "engine", "e", "36"),
    ("other_processes", "others", "o", "33"),
    ("free", "free", ".", "2"),
)


def engine_state(
    *, held: bool, pinned: bool, step: str | None, alive: bool, healthy: bool, crashed: bool
) -> str:
    """DESIGN §4.8's engine state: a hold or pin first (what a person must know), then a
    restart in flight, then what the process does."""
    if held:
        return "held"
    if pinned:
        return "pinned"
    if step == "stopping":
        return "draining"
    if step is not None:
        return "restarting"
    if alive:
        return "running" if healthy else "starting"
    return "crashed" if crashed else "stopped"


def bills(
    *,
    weights: int | None,
    kv_pool: int | None,
    engine_bytes: int | None,
    other_processes: int | None,
    free: int | None,
    total: int | None = None,
) -> dict[str, int | None]:
    """The four bills and what is free, in bytes: ``weights`` and ``kv_pool`` from the engine's
    own log and ``cache_config_info``; ``engine_other`` is the rest of what the engine's
    processes hold on the GPU (activations, CUDA context and graphs); ``total``, the GPU's, the
    bar's whole. Unknown stays None."""
    other = None
    if engine_bytes is not None and weights is not None and kv_pool is not None:
        other = max(0, engine_bytes - weights - kv_pool)
    return {
        "weights": weights,
        "kv_pool": kv_pool,
        "engine_other": other,
        "other_processes": other_processes,
        "free": free,
        "total": total,
    }


def engine_status(
    *,
    name: str,
    state: str,
    generation: int,
    settings: Mapping[str, Any],
    pid: int | None,
    healthy: bool,
    last_known_good: Mapping[str, Any] | None,
    paused: str | None,
    pinned: bool,
    held: bool,
    weights: int | None,
    kv_pool: int | None,
    memory: EngineMemory | None,
    free: int | None,
    metrics: Mapping[str, Any] | None,
    policies: Iterable[PolicyState],
    total: int | None = None,
    restarts_in_window: int,
    budget_left: int,
    last_actions: Sequence[Mapping[str, Any]],
    restart: Progress | None,
    stuck: Mapping[str, Any] | None = None,
    calibration: Mapping[str, Any] | None = None,
    recommendation: Mapping[str, Any] | None = None,
    gate: Mapping[str, Any] | None = None,
    plateaus: Sequence[Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """One engine of ``tunerd status --json`` (DESIGN §4.8), and more: ``paused`` (why), ``pinned``
    and ``restart`` — the saga in flight, its step, what it waits for and its deadline — and
    ``stuck``: the saga's step whose write the state refused (a full disk), tried again at
    ``next_try`` (None while the state takes them); ``calibration``: the box as measured (the
    bills of the observed start, the headroom they left, the last prediction's error, the
    ``fit`` targets), None until an engine has been seen serving; ``recommendation``:
    right-sizing from the requests served (``tunerd advise``'s per-knob target, lower, upper,
    reason and predicted pool, and ``requests``), None before the first scrape; ``plateaus``:
    the engine's memory rises of the last ten minutes, oldest first — the seed's "prefill
    plateau", each a ``step`` that stayed (the ratchet), a ``transient`` that fell back or one
    still ``rising``, with its height, how long it stood and what was in flight
    (:meth:`tunerd.detect.Plateau.to_dict`); None while the engine's memory is not read."""
    return {
        "name": name,
        "state": state,
        "generation": generation,
        "settings": dict(settings),
        "pid": pid,
        "healthy": healthy,
        "last_known_good": None if last_known_good is None else dict(last_known_good),
        "paused": paused,
        "pinned": pinned,
        "restart": None if restart is None else restart.to_dict(),
        "stuck": None if stuck is None else dict(stuck),
        "bills": bills(
            weights=weights,
            kv_pool=kv_pool,
            engine_bytes=memory.engine_memory_bytes if memory else None,
            other_processes=memory.other_processes_memory_bytes if memory else None,
            free=free,
            total=total,
        ),
        "metrics": None if metrics is None else dict(metrics),
        "calibration": None if calibration is None else dict(calibration),
        "recommendation": None if recommendation is None else dict(recommendation),
        "gate": None if gate is None else dict(gate),
        "plateaus": None if plateaus is None else [dict(plateau) for plateau in plateaus],
        "policies": [
            {
                "name": policy.name,
                "state": str(policy.state),
                "since": policy.since,
                "health": str(policy.health),
                "last_error": policy.last_error,
            }
            for policy in policies
        ],
        "guards": {"restarts_in_window": restarts_in_window, "budget_left": budget_left, "held": held},
        "last_actions": [
            {key: action[key] for key in ("id", "time", "kind", "mode", "outcome", "policy", "reason")}
            for action in last_actions
        ],
    }


def status_document(
    *,
    mode: Mode,
    now: float,
    gpus: Iterable[GpuSample],
    engines: Sequence[Mapping[str, Any]],
    state_trouble: Sequence[Mapping[str, Any]] = (),
    gpu_source: Mapping[str, Any] | None = None,
    wall_time: float | None = None,
) -> dict[str, Any]:
    """The whole of ``tunerd status --json``: the mode, the GPUs, each engine — and
    ``state_trouble``: each write the state refuses now (which engine, what for, why, since
    when, the tries, the next), empty while it takes them; ``gpu_source``: how the GPU
    source is doing (``state`` ok, failing or degraded, the failures, the latest error, the
    calls the driver lacks); ``wall_time``: the real time, when tunerd runs on the simulator's
    clock (``time`` is then the simulated one)."""
    return {
        "mode": str(mode),
        "time": now,
        "wall_time": wall_time,
        "state_trouble": [dict(trouble) for trouble in state_trouble],
        "gpu_source": dict(gpu_source) if gpu_source is not None else None,
        "gpus": [
            {
                "index": gpu.index,
                "uuid": gpu.uuid,
                "name": gpu.name,
                "used_bytes": gpu.memory_used_bytes,
                "total_bytes": gpu.memory_total_bytes,
                "free_bytes": gpu.memory_free_bytes,
            }
            for gpu in gpus
        ],
        "engines": list(engines),
    }


def _calibration_lines(calibration: Mapping[str, Any] | None) -> list[str]:
    """The box as measured, in one or two lines: the headroom at the observed worst, the
    last prediction's error, the utilization a fit would pick."""
    if not calibration or not calibration.get("bills"):
        return []
    bills = calibration["bills"]
    error = calibration.get("prediction_error_ratio")
    fit = (calibration.get("fits") or {}).get("gpu_memory_utilization") or {}
    parts = [
        f"peak {_gib(bills.get('over_budget_bytes'))} over budget",
        f"headroom at the worst {_gib(bills.get('headroom_bytes'))}",
    ]
    if error is not None:
        parts.append(f"last pool prediction {error:+.1%}")
    if fit.get("value") is not None:
        parts.append(f"fit utilization {fit['value']}")
    return _wrap("  measured  ", parts)


def _gate_lines(gate: Mapping[str, Any] | None) -> list[str]:
    """The engine's gate in one line: open or held, what is in flight and waiting."""
    if not gate:
        return []
    if gate.get("error"):
        return _wrap("  gate      ", [f"no answer ({gate['error']})"])
    held = f"HELD ({gate.get('hold_reason') or 'restart'})" if gate.get("held") else "open"
    decisions = gate.get("decisions") or {}
    shed = sum(n for key, n in decisions.items() if key.startswith(("rejected/", "timed_out/")))
    parts = [
        f"{held} at {gate.get('listen', '?')}",
        f"in flight {gate.get('in_flight', '?')} (budget {_number_tokens(gate.get('budget_tokens'))} tokens)",
        f"queued {gate.get('queued', '?')}",
        f"turned away {shed}",
    ]
    return _wrap("  gate      ", parts)


def _plateau_lines(plateaus: Sequence[Mapping[str, Any]] | None) -> list[str]:
    """The seed's "prefill plateau" under vLLM's name: the latest rise that stayed (what the
    ``memory_ratchet`` policies act on) and the tallest that fell back, with what was in
    flight; "none" when the last ten minutes held none."""
    if not isinstance(plateaus, list):
        return []
    plateaus = [p for p in plateaus if isinstance(p, dict)]  # the daemon's answer, read as any page
    head = "  plateaus  "
    if not plateaus:
        return _wrap(head, ["prefill plateau (memory_ratchet): none in the last 10 min"])
    steps = [p for p in plateaus if p.get("kind") in ("step", "rising")]
    transients = [p for p in plateaus if p.get("kind") == "transient"]
    parts = []
    if steps:
        step = steps[-1]
        kept = "kept (the allocator holds it)" if step.get("kind") == "step" else "rising"
        parts.append(
            f"prefill plateau (memory_ratchet) +{_size(step.get('height_bytes'))} at "
            f"{_when(step.get('at'))}, {kept}"
        )
        until, at = step.get("in_flight_until"), step.get("at")
        read = until - at if isinstance(until, (int, float)) and isinstance(at, (int, float)) else 0.0
        parts += _in_flight(step, f" in its first {_seconds(read)}" if read > 0 else " as it rose")
    if transients:
        tallest = max(transients, key=lambda p: _height(p.get("height_bytes")))
        more = f" (of {len(transients)})" if len(transients) > 1 else ""
        duration = tallest.get("duration_s")
        stood = f" for {_seconds(duration)}" if isinstance(duration, (int, float)) else ""
        parts.append(
            f"transient{more} +{_size(tallest.get('height_bytes'))}{stood} at "
            f"{_when(tallest.get('at'))}, fell back"
        )
        parts += _in_flight(tallest)
    return _wrap(head, parts)


def _height(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def _seconds(value: float) -> str:
    return f"{value:.1f} s" if value < 10 else f"{value:.0f} s"


def _size(value: Any) -> str:
    """Bytes in MiB below a GiB, else GiB: a plateau's height."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return "?"
    if abs(value) < GIB:
        return f"{value / 1024**2:.0f} MiB"
    return _gib(value)


def _in_flight(plateau: Mapping[str, Any], when: str = "") -> list[str]:
    """What was in flight while a plateau stood (or ``when``), as one item of its line (or none)."""
    said = []
    if isinstance(plateau.get("prompt_tokens"), int):
        said.append(f"{plateau['prompt_tokens']:,} prompt tokens prefilled{when}")
    if isinstance(plateau.get("gate_prompt_tokens_in_flight"), int):
        said.append(f"{plateau['gate_prompt_tokens_in_flight']:,} in flight at the gate")
    if isinstance(plateau.get("running"), int):
        said.append(f"{plateau['running']} running")
    return [", ".join(said)] if said else []


def _number_tokens(value: Any) -> str:
    return "?" if not isinstance(value, int) else f"{value:,}"


def _gib(value: Any) -> str:
    return "?" if value is None else f"{value / GIB:.1f} GiB"


def _paint(text: str, code: str, color: bool) -> str:
    return f"\033[{code}m{text}\033[0m" if color else text


def _bar(parts: Mapping[str, Any], width: int, color: bool) -> str:
    """The bills as a bar of ``width`` cells, the whole being the GPU's total when it is known:
    a bill not known is ``?`` cells (what the known ones leave), never stretched over by the
    others."""
    keys = [key for key, *_ in BILLS]
    known = {key: parts[key] for key in keys if isinstance(parts.get(key), int) and parts[key] > 0}
    missing = [key for key in keys if not isinstance(parts.get(key), int)]
    total = parts.get("total")
    whole = total if isinstance(total, int) and total > 0 else sum(known.values())
    if not whole:
        return "[" + "?" * width + "]"
    cells: list[str] = []
    used = 0
    for index, (key, _, glyph, code) in enumerate(BILLS):
        if key not in known:
            continue
        last = not missing and all(k not in known for k, *_ in BILLS[index + 1 :])
        count = width - used if last else round(known[key] / whole * width)
        count = max(0, min(count, width - used))
        used += count
        cells.append(_paint(("█" if color else glyph) * count, code, color))
    if used < width:  # what no known bill accounts for
        cells.append(_paint("?" * (width - used), "2", color))
    return "[" + "".join(cells) + "]"


def _legend(parts: Mapping[str, Any], color: bool) -> str:
    """The bar's key: each bill's colour (or glyph) with its name and size, and ``?`` when a
    bill is not known."""
    items = [
        f"{_paint('█', code, True) if color else glyph} {label} {_number(parts.get(key))}"
        for key, label, glyph, code in BILLS
    ]
    if any(not isinstance(parts.get(key), int) for key, *_ in BILLS):
        items.append("? not known")
    return "GiB: " + " · ".join(items)


def _when(moment: Any) -> str:
    """HH:MM:SS, local time, of an epoch number or an ISO 8601 string (history's times)."""
    if isinstance(moment, str):
        try:
            return datetime.fromisoformat(moment).astimezone().strftime("%H:%M:%S")
        except ValueError:
            return moment
    if not isinstance(moment, (int, float)) or not math.isfinite(moment):
        return "-"
    return datetime.fromtimestamp(moment).strftime("%H:%M:%S")


def _number(value: Any) -> str:
    return "?" if value is None else f"{value / GIB:.1f}"


def _wrap(head: str, items: Sequence[str], width: int = WIDTH) -> list[str]:
    """``items`` joined with `` · ``, onto as many lines as ``width`` needs."""
    indent = " " * len(head)
    lines: list[str] = []
    current = head
    for item in items:
        empty = current in (head, indent)
        candidate = current + item if empty else f"{current} · {item}"
        if len(candidate) > width and not empty:
            lines.append(current)
            current = indent + item
        else:
            current = candidate
    lines.append(current)
    return [_fit(line, width) for line in lines]


def _fit(line: str, width: int = WIDTH) -> str:
    """``line`` in ``width`` columns: cut at the last space that leaves room for "…" (a word
    is never cut in the middle, unless one word fills the line)."""
    if len(line) <= width:
        return line
    cut = line.rfind(" ", 0, width - 1)
    if cut <= len(line) - len(line.lstrip()) + 1:
        cut = width - 1
    return line[:cut].rstrip(" ·—;,") + "…"


def _shown(value: Any) -> str:
    """A setting's value for people: never ``None`` (that is vLLM's default)."""
    if value is None:
        return "default"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def _until(deadline: Any, now: Any) -> str:
    """When a step gives up: the clock time and how far off."""
    if not isinstance(deadline, (int, float)):
        return ""
    left = f" (in {max(0.0, deadline - now):.0f} s)" if isinstance(now, (int, float)) else ""
    return f" · gives up at {_when(deadline)}{left}"


def _trouble(trouble: Mapping[str, Any], now: Any) -> list[str]:
    """A write the state refuses, for people: on what, why, since when, when next."""
    who = f"{trouble['engine']}: " if trouble.get("engine") else ""
    said = [
        f"{who}{trouble.get('what', '?')}",
        f"cannot write the state: {trouble.get('error', '?')}",
        f"since {_when(trouble.get('since'))}",
        f"{trouble.get('attempts', '?')} tries",
    ]
    after = trouble.get("next_try")
    if isinstance(after, (int, float)) and isinstance(now, (int, float)):
        said.append(f"again in {max(0.0, after - now):.0f} s")
    return said


def _percent(value: Any) -> str:
    return "?" if value is None else f"{value * 100:.0f}%"


def render(status: Mapping[str, Any], *, color: bool = False) -> str:
    """One screen for a person: GPUs, then per engine its state, settings, the bills as a bar,
    the pool, policies, guards and last actions. Lines never exceed :data:`WIDTH` columns (the
    bar's escape codes aside)."""
    wall = status.get("wall_time")
    when = _when(status.get("time"))
    if isinstance(wall, (int, float)) and isinstance(status.get("time"), (int, float)):
        simulated = datetime.fromtimestamp(status["time"]).strftime("%Y-%m-%d %H:%M:%S")  # days ahead
        when = f"simulated {simulated} (wall {_when(wall)})"  # the simulator's clock runs faster
    lines = [f"tunerd — mode {status.get('mode', '?')} — {when}"]
    for trouble in status.get("state_trouble") or []:
        lines += _wrap("STATE  ", _trouble(trouble, status.get("time")))
    source = status.get("gpu_source") or {}
    if source.get("state") in ("failing", "degraded"):
        lines += _wrap(
            "GPU    ",
            [
                f"source {source.get('source', '?')} {source['state']}: "
                f"{source.get('failures_in_a_row', '?')} readings in a row failed"
                + (f" since {_when(source.get('since'))}" if source.get("since") else ""),
                str(source.get("error") or "no detail"),
            ],
        )
    if source.get("unsupported"):
        lines += _wrap("GPU    ", [f"not available from this driver or GPU: {source['unsupported']}"])
    gpus: Sequence[Mapping[str, Any]] = status.get("gpus") or []
    if not gpus:
        lines.append("GPU    none read (gpu source: none, or the driver did not answer)")
    for gpu in gpus:
        used, total, free = gpu.get("used_bytes"), gpu.get("total_bytes"), gpu.get("free_bytes")
        name = gpu.get("name") or "?"
        lines.append(
            _fit(f"GPU {gpu.get('index')}  {name}  {_gib(used)} of {_gib(total)} used, {_gib(free)} free")
        )
    for engine in status.get("engines") or []:
        lines.append("")
        health = "healthy" if engine.get("healthy") else "not answering"
        lkg = " (last-known-good)" if engine.get("settings") == engine.get("last_known_good") else ""
        flags = "".join(
            f"  {flag}"
            for flag, on in (
                ("HELD", (engine.get("guards") or {}).get("held")),
                ("PINNED", engine.get("pinned")),
                ("PAUSED", engine.get("paused")),
            )
            if on
        )
        lines.append(
            _fit(
                f"{engine['name']}  {engine.get('state') or '?'}{flags}  "
                f"generation {engine.get('generation', '?')}  pid {engine.get('pid') or '-'}  {health}{lkg}"
            )
        )
        restart = engine.get("restart")
        if restart:
            # a stuck step's detail has a line of its own (below)
            detail = f" · {restart['detail']}" if restart.get("detail") and not engine.get("stuck") else ""
            lines += _wrap(
                "  restart   ",
                [
                    f"{str(restart.get('kind', '?')).replace('_', ' ')} · {restart.get('step', '?')}{detail}"
                    f"{_until(restart.get('deadline'), status.get('time'))}"
                ],
            )
        stuck = engine.get("stuck")
        if stuck:
            step = (restart or {}).get("step", "?")
            said = [f"the saga is stuck on step {step}", *_trouble(stuck, status.get("time"))]
            lines += _wrap("  stuck     ", said)
        if engine.get("paused"):
            lines += _wrap("  paused    ", [str(engine["paused"])])
        if engine.get("pinned"):
            lines.append("  pinned    settings frozen by a person (tunerd resume to unpin)")
        settings = engine.get("settings") or {}
        lines += _wrap(
            "  settings  ", [f"{key} {_shown(value)}" for key, value in settings.items()] or ["none"]
        )
        parts = engine.get("bills") or {}
        lines.append("  memory    " + _bar(parts, WIDTH - 14, color))
        lines.append(
            _fit(f"            {_legend(parts, False)}")
            if not color
            else f"            {_legend(parts, True)}"
        )
        metrics = engine.get("metrics") or {}
        running, waiting = metrics.get("num_requests_running", "?"), metrics.get("num_requests_waiting", "?")
        lines.append(
            _fit(
                f"  pool      KV usage {_percent(metrics.get('kv_cache_usage'))} · running {running} · "
                f"waiting {waiting} · preemptions {metrics.get('num_preemptions_total', '?')}"
            )
        )
        lines += _plateau_lines(engine.get("plateaus"))
        lines += _calibration_lines(engine.get("calibration"))
        lines += _gate_lines(engine.get("gate"))
        policies = engine.get("policies") or []
        shown = [
            f"{p['name']} {p['state']}"
            + (f" since {_when(p.get('since'))}" if p.get("state") != "inactive" and p.get("since") else "")
            + (
                ""
                if p.get("health") == "ok"
                else f" ({p.get('health')}: {p.get('last_error') or 'no detail'})"
            )
            for p in policies
        ]
        lines += _wrap("  policies  ", shown or ["none"])
        guards = engine.get("guards") or {}
        lines.append(
            _fit(
                f"  guards    {guards.get('restarts_in_window', '?')} restarts in the window · "
                f"{guards.get('budget_left', '?')} left · {'HELD' if guards.get('held') else 'not held'}"
            )
        )
        actions = engine.get("last_actions") or []
        if not actions:
            lines.append("  actions   none yet")
        for index, action in enumerate(actions[:3]):
            head = "  actions   " if index == 0 else "            "
            policy = f" ({action['policy']})" if action.get("policy") else ""
            reason = f" — {action['reason']}" if action.get("reason") else ""
            lines.append(
                _fit(
                    f"{head}{_when(action.get('time'))} {action.get('kind', '?')} "
                    f"{action.get('outcome', '?')}{policy}{reason}"
                )
            )
    return "\n".join(lines) + "\n"
