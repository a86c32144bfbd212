"""``tunerd status``: what the daemon knows, as DESIGN §4.8's JSON and as one screen. Pure.

The daemon builds the JSON (:meth:`tunerd.daemon.Daemon.status`) from its engines, the latest
GPU reading, the last ``/metrics`` scrape, its policy states and history; the status server
hands it out; :func:`render` draws it for a person in at most 100 columns — colour only on a
terminal and never with ``NO_COLOR`` set.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

__all__ = ["BILLS", "WIDTH", "bills", "engine_state", "render"]

GIB = 1 << 30
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
) -> dict[str, int | None]:
    """The four bills and what is free, in bytes: ``weights`` and ``kv_pool`` from the engine's
    own log and ``cache_config_info``; ``engine_other`` is the rest of what the engine's
    processes hold on the GPU (activations, CUDA context and graphs). Unknown stays None."""
    other = None
    if engine_bytes is not None and weights is not None and kv_pool is not None:
        other = max(0, engine_bytes - weights - kv_pool)
    return {
        "weights": weights,
        "kv_pool": kv_pool,
        "engine_other": other,
        "other_processes": other_processes,
        "free": free,
    }


def _gib(value: Any) -> str:
    return "?" if value is None else f"{value / GIB:.1f} GiB"


def _paint(text: str, code: str, color: bool) -> str:
    return f"\033[{code}m{text}\033[0m" if color else text


def _bar(parts: Mapping[str, Any], width: int, color: bool) -> str:
    known = {key: value for key, value in parts.items() if isinstance(value, int) and value > 0}
    total = sum(known.values())
    if not total:
        return "[" + "?" * width + "]"
    cells: list[str] = []
    used = 0
    for index, (key, _, glyph, code) in enumerate(BILLS):
        if key not in known:
            continue
        last = all(k not in known for k, *_ in BILLS[index + 1 :])
        count = width - used if last else round(known[key] / total * width)
        count = max(0, min(count, width - used))
        used += count
        cells.append(_paint(("█" if color else glyph) * count, code, color))
    return "[" + "".join(cells) + "]"


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
    return line if len(line) <= width else line[: width - 1] + "…"


def _percent(value: Any) -> str:
    return "?" if value is None else f"{value * 100:.0f}%"


def render(status: Mapping[str, Any], *, color: bool = False) -> str:
    """One screen for a person: GPUs, then per engine its state, settings, the bills as a bar,
    the pool, policies, guards and last actions. Lines never exceed :data:`WIDTH` columns (the
    bar's escape codes aside)."""
    lines = [f"tunerd — mode {status.get('mode', '?')} — {_when(status.get('time'))}"]
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
        lines.append(
            _fit(
                f"{engine['name']}  {engine.get('state')}  generation {engine.get('generation')}  "
                f"pid {engine.get('pid') or '-'}  {health}{lkg}"
            )
        )
        settings = engine.get("settings") or {}
        lines += _wrap("  settings  ", [f"{key} {value}" for key, value in settings.items()] or ["none"])
        parts = engine.get("bills") or {}
        lines.append("  memory    " + _bar(parts, WIDTH - 14, color))
        legend = " · ".join(f"{glyph} {label} {_number(parts.get(key))}" for key, label, glyph, _ in BILLS)
        lines.append(_fit(f"            GiB: {legend}"))
        metrics = engine.get("metrics") or {}
        running, waiting = metrics.get("num_requests_running", "?"), metrics.get("num_requests_waiting", "?")
        lines.append(
            _fit(
                f"  pool      KV usage {_percent(metrics.get('kv_cache_usage'))} · running {running} · "
                f"waiting {waiting} · preemptions {metrics.get('num_preemptions_total', '?')}"
            )
        )
        policies = engine.get("policies") or []
        shown = [
            f"{p['name']} {p['state']}"
            + (f" since {_when(p.get('since'))}" if p.get("state") != "inactive" and p.get("since") else "")
            + ("" if p.get("health") == "ok" else f" ({p.get('health')}: {p.get('last_error')})")
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
            lines.append(
                _fit(
                    f"{head}{_when(action.get('time'))} {action.get('kind')} {action.get('outcome')}"
                    f"{policy} — {action.get('reason')}"
                )
            )
    return "\n".join(lines) + "\n"
