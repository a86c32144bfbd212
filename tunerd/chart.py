"""Charts a person can read in a screenshot: GPU memory over time as inline SVG.

``tunerd incident show --html`` and ``tunerd demo``'s report draw with it. The rules (issue 20):

- real time ticks on a round step (wall-clock UTC, or time since the start);
- each panel's y-range fitted to the band where the action is, the card's total marked (a
  0–24 GiB scale squashes the 21–24 GiB that matter into a sliver);
- what is not there is not drawn: an engine down for a restart, or readings missing, is a gap,
  never a ramp (a reading holds until the next one: steps);
- every mark inside the plot and labelled, in lanes so that labels never overlap; a crash is
  drawn over the marks that share its moment, and marks closer than a few pixels are spread
  apart so that none hides another;
- a legend with each colour *and* its name;
- memory stacked by bill, the first layer at the bottom.

The SVG is plain XML (no scripts, nothing fetched) with classes a test can query: ``panel``,
``plot``, ``x-ticks``, ``mark`` (``data-kind``, ``data-time``), ``legend-item``
(``data-name``). Pure: numbers in, text out.
"""

from __future__ import annotations

import datetime as dt
import html
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from tunerd.units import GIB

__all__ = [
    "MARK_COLOURS",
    "Layer",
    "Line",
    "Mark",
    "Panel",
    "mark_list",
    "page",
    "svg",
    "time_ticks",
    "value_ticks",
]

Unit = Literal["bytes", "ratio", "count"]
Clock = Literal["utc", "elapsed"]

#: a mark's colour by kind; kinds not named here are drawn black
MARK_COLOURS = {
    "crash": "#c62828",
    "tune": "#1565c0",
    "restart": "#00838f",
    "rollback": "#ef6c00",
    "hold": "#6a1b9a",
    "gate": "#4e342e",
    "shed": "#ad1457",
    "ratchet": "#f9a825",
    "alert": "#757575",
    "serving": "#2e7d32",
}
#: the chart's own words, by language (the panels' titles and names are the caller's)
WORDS = {
    "en": {
        "utc": "time (UTC)",
        "elapsed": "time since the start (h:mm:ss or m:ss)",
        "mark": "{kind} (mark)",
        "strip": " (0 to {low} squeezed into the bottom strip)",
    },
    "zh": {
        "utc": "时间（UTC）",
        "elapsed": "开始后的时间（h:mm:ss 或 m:ss）",
        "mark": "{kind}（标记）",
        "strip": "（0 到 {low} 压缩在底部窄条中）",
    },
}
#: drawn in this order, so the later ones lie on top (a crash over the tune that answered it)
_MARK_ORDER = ("serving", "alert", "ratchet", "gate", "shed", "hold", "tune", "restart", "rollback", "crash")
_TIME_STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400)
_GIB_STEPS = (0.125, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
_COUNT_STEPS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
_CHAR_PX = 6.4  # the width of a character of the 11 px sans-serif, near enough to keep labels apart
_LANE_PX = 16
_MAX_LANES = 8
_SPREAD_PX = 3.0  # marks closer than this are pushed apart by it
BELOW_SHARE = 0.16  # of a fitted panel's height: the strip that holds 0 … the fitted floor


@dataclass(frozen=True)
class Layer:
    """One stacked layer: a value per time of its panel; None where it is not there (a gap)."""

    name: str
    colour: str
    values: Sequence[float | None]


@dataclass(frozen=True)
class Line:
    """A line over the layers (a budget, a usage): a value per time of its panel, None a gap."""

    name: str
    colour: str
    values: Sequence[float | None]
    dashed: bool = False


@dataclass(frozen=True)
class Panel:
    """One chart of the page; the panels of one :func:`svg` share the time axis."""

    title: str
    unit: Unit
    times: Sequence[float]
    layers: Sequence[Layer] = ()
    lines: Sequence[Line] = ()
    #: a level marked across the plot and always inside its range: (label, value), e.g. the
    #: card's total memory or 100 % of the KV pool
    ceiling: tuple[str, float] | None = None
    height: int = 280
    #: fit the y-range to where the values are (else it starts at 0)
    fit: bool = True
    #: the times that count for the fit's floor, one flag per time (default: those where every
    #: layer is there; a restart's gap would pull the floor to nothing)
    fit_rows: Sequence[bool] | None = None


@dataclass(frozen=True)
class Mark:
    time: float
    kind: str
    label: str


# -- axes ---------------------------------------------------------------------------------------
def time_ticks(start: float, end: float, most: int = 10) -> tuple[float, list[float]]:
    """A round step and the ticks on it between ``start`` and ``end`` (at most ``most``)."""
    span = max(end - start, 1e-9)
    step = next((s for s in _TIME_STEPS if span / s <= most), None)
    if step is None:
        step = _TIME_STEPS[-1] * math.ceil(span / (_TIME_STEPS[-1] * most))
    first = math.ceil(start / step - 1e-9)
    last = math.floor(end / step + 1e-9)
    return float(step), [k * step for k in range(first, last + 1)]


def value_ticks(low: float, high: float, unit: Unit, most: int = 7) -> tuple[float, list[float]]:
    """A round step for the unit (GiB steps for bytes) and the ticks on it in [low, high]."""
    span = max(high - low, 1e-9)
    if unit == "ratio":
        steps: Sequence[float] = (0.05, 0.1, 0.2, 0.25, 0.5, 1.0)
    elif unit == "bytes":
        steps = [s * GIB for s in _GIB_STEPS]
    else:
        steps = _COUNT_STEPS
    step = next((s for s in steps if span / s <= most), steps[-1])
    first = math.ceil(low / step - 1e-9)
    last = math.floor(high / step + 1e-9)
    return float(step), [k * step for k in range(first, last + 1)]


def _fmt_time(moment: float, step: float, clock: Clock) -> str:
    if clock == "utc":
        stamp = dt.datetime.fromtimestamp(moment, tz=dt.UTC)
        return stamp.strftime("%H:%M" if step >= 60 and moment % 60 == 0 else "%H:%M:%S")
    whole = round(moment)
    hours, rest = divmod(abs(whole), 3600)
    minutes, seconds = divmod(rest, 60)
    sign = "-" if whole < 0 else ""
    return f"{sign}{hours}:{minutes:02}:{seconds:02}" if hours else f"{sign}{minutes}:{seconds:02}"


def _fmt_value(value: float, step: float, unit: Unit) -> str:
    if unit == "bytes":
        return f"{round(value / GIB, 3):g} GiB"
    if unit == "ratio":
        return f"{value:.0%}"
    return f"{value:,.0f}"


def _fit(panel: Panel) -> tuple[float, float]:
    """The panel's y-range: from a little below the least of the stack's top (while every
    layer is there: a restart's gap would pull it to the floor) to a little above the most of
    it, its lines and its ceiling."""
    n = len(panel.times)
    tops_all: list[float] = []
    tops_whole: list[float] = []
    for i in range(n):
        present = [layer.values[i] for layer in panel.layers if layer.values[i] is not None]
        if present:
            top = float(sum(v for v in present if v is not None))
            tops_all.append(top)
            counts = len(present) == len(panel.layers) if panel.fit_rows is None else panel.fit_rows[i]
            if counts:
                tops_whole.append(top)
    lines = [float(v) for line in panel.lines for v in line.values if v is not None and math.isfinite(v)]
    ceiling = [panel.ceiling[1]] if panel.ceiling is not None else []
    highs = tops_all + lines + ceiling
    if not highs:
        return 0.0, 1.0
    high = max(highs)
    if panel.unit == "ratio":
        high = max(high, 1.0)
    lows = (tops_whole or tops_all) + lines
    if not panel.fit or not lows:
        return 0.0, high * 1.04 or 1.0
    low = min(lows)
    margin = max((high - low) * 0.15, GIB / 4 if panel.unit == "bytes" else 0.0)
    low = max(0.0, low - margin)
    if low < 0.25 * high:
        low = 0.0
    step, _ = value_ticks(low, high, panel.unit)
    low = math.floor(low / step) * step
    return low, high + (high - low) * 0.04 or 1.0


def _finite(panel: Panel) -> Panel:
    def clean(values: Sequence[float | None]) -> list[float | None]:
        return [v if v is not None and math.isfinite(v) else None for v in values]

    return replace(
        panel,
        layers=[replace(layer, values=clean(layer.values)) for layer in panel.layers],
        lines=[replace(line, values=clean(line.values)) for line in panel.lines],
    )


def _runs(times: Sequence[float]) -> list[tuple[int, int]]:
    """Index ranges [a, b] with no gap in time: a step over five times the usual long one (the
    upper quartile of the steps: a sampler that slows under load is not a gap) breaks the run
    — readings were missing there."""
    if not times:
        return []
    steps = sorted(b - a for a, b in itertools.pairwise(times) if b > a)
    usual = steps[(3 * len(steps)) // 4] if steps else 0.0
    runs, start = [], 0
    for i in range(1, len(times)):
        if usual > 0 and times[i] - times[i - 1] > 5 * usual:
            runs.append((start, i - 1))
            start = i
    runs.append((start, len(times) - 1))
    return runs


def _present_runs(values: Sequence[float | None], runs: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Within the time runs, the ranges where ``values`` are there."""
    found = []
    for a, b in runs:
        start = None
        for i in range(a, b + 1):
            there = values[i] is not None and math.isfinite(float(values[i] or 0.0))
            if there and start is None:
                start = i
            if not there and start is not None:
                found.append((start, i - 1))
                start = None
        if start is not None:
            found.append((start, b))
    return found


# -- drawing ------------------------------------------------------------------------------------
def svg(
    panels: Sequence[Panel],
    marks: Sequence[Mark] = (),
    *,
    clock: Clock = "utc",
    width: int = 960,
    language: str = "en",
) -> str:
    """The panels stacked one above the other on one time axis, the marks across them all,
    the chart's own words in ``language`` (en, zh). A value that is not a finite number is not
    there (a gap)."""
    words = WORDS.get(language, WORDS["en"])
    panels = [_finite(panel) for panel in panels]
    marks = [mark for mark in marks if math.isfinite(mark.time)]
    left, right = 76, 24
    plot_w = width - left - right
    times = [t for panel in panels for t in panel.times]
    moments = times + [mark.time for mark in marks]
    if not moments:
        return '<svg xmlns="http://www.w3.org/2000/svg" class="tunerd-chart" width="10" height="10"/>'
    start, end = min(moments), max(moments)
    pad = max((end - start) * 0.015, 1.0)
    start, end = start - pad, end + pad

    def x(t: float) -> float:
        return left + plot_w * (t - start) / (end - start)

    ordered = sorted(marks, key=lambda mark: mark.time)
    spots = [x(mark.time) for mark in ordered]
    for i in range(1, len(spots)):  # none hides another: spread the ones on (nearly) one pixel
        if spots[i] - spots[i - 1] < _SPREAD_PX:
            spots[i] = spots[i - 1] + _SPREAD_PX
    for i in range(len(spots) - 1, -1, -1):  # … and none pushed past the plot's right edge
        limit = left + plot_w - 1 if i == len(spots) - 1 else spots[i + 1] - _SPREAD_PX
        spots[i] = min(spots[i], limit)
    labels = [_label(n, m) for n, m in enumerate(ordered, 1)]
    lanes, label_of = _lanes(spots, labels, width - 4)
    top = 8 + _LANE_PX * max(lanes, 1) + 20  # the lanes, then the first panel's title
    parts: list[str] = []
    y0 = top
    plots: list[tuple[float, float]] = []
    for number, panel in enumerate(panels):
        parts.append(_panel(panel, number, x, left=left, plot_w=plot_w, y0=y0, words=words))
        plots.append((y0, y0 + panel.height))
        y0 += panel.height + 34
    bottom = plots[-1][1] if plots else top
    step, ticks = time_ticks(start, end)
    axis = [f'<g class="x-ticks" data-step="{step:g}">']
    for tick in ticks:
        at = x(tick)
        axis.append(
            f'<line x1="{at:.1f}" x2="{at:.1f}" y1="{bottom:.1f}" y2="{bottom + 5:.1f}" stroke="#555"/>'
            f'<text class="tick" data-time="{tick:g}" x="{at:.1f}" y="{bottom + 17:.1f}" '
            f'text-anchor="middle">{_fmt_time(tick, step, clock)}</text>'
        )
    axis.append("</g>")
    parts += axis
    what = words[clock]
    parts.append(
        f'<text x="{left + plot_w / 2:.1f}" y="{bottom + 33:.1f}" text-anchor="middle" fill="#444">'
        f"{what}</text>"
    )
    parts.append(_marks(ordered, label_of, spots, bottom, width - 4))
    legend, legend_h = _legend(panels, ordered, left=left, top=bottom + 46, width=plot_w, words=words)
    parts.append(legend)
    height = round(bottom + 46 + legend_h + 8)
    head = (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="tunerd-chart" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">'
    )
    return "\n".join([head, *parts, "</svg>"])


def _panel(
    panel: Panel,
    number: int,
    xf: Callable[[float], float],
    *,
    left: float,
    plot_w: float,
    y0: float,
    words: Mapping[str, str],
) -> str:
    runs = _runs(panel.times)
    low, high = _fit(panel)
    # a fitted range keeps what lies below it in a strip at the bottom (a broken axis), so a
    # stack's lower layers show as layers, not as the plot's floor
    stub = round(panel.height * BELOW_SHARE) if low > 0 else 0

    def y(value: float) -> float:
        if value >= low or stub == 0:
            return y0 + (panel.height - stub) * (1 - (value - low) / (high - low))
        return y0 + panel.height - stub * max(value, 0.0) / low

    clip = f"clip-panel-{number}"
    out = [
        f'<g class="panel" data-title="{_attr(panel.title)}" data-low="{low:g}" data-high="{high:g}">',
        f'<clipPath id="{clip}"><rect x="{left}" y="{y0}" width="{plot_w}" '
        f'height="{panel.height}"/></clipPath>',
        f'<rect class="plot" x="{left}" y="{y0}" width="{plot_w}" height="{panel.height}" '
        'fill="#fbfbfb" stroke="#bbb"/>',
    ]
    step, ticks = value_ticks(low, high, panel.unit)
    title = panel.title
    if stub:  # the strip's ends are labelled: 0 and the floor, where the scale changes
        title += words["strip"].format(low=_fmt_value(low, step, panel.unit))
        ticks = [0.0, low, *(tick for tick in ticks if tick - low >= 0.4 * step)]
    out.append(f'<text x="{left}" y="{y0 - 5}" font-weight="bold">{html.escape(title)}</text>')
    for tick in ticks:
        at = y(tick)
        out.append(
            f'<line x1="{left}" x2="{left + plot_w}" y1="{at:.1f}" y2="{at:.1f}" stroke="#e6e6e6"/>'
            f'<text class="y-tick" x="{left - 6}" y="{at + 4:.1f}" text-anchor="end">'
            f"{_fmt_value(tick, step, panel.unit)}</text>"
        )
    out.append(f'<g clip-path="url(#{clip})">')
    base = [0.0] * len(panel.times)
    # a reading holds until the next one (a step, never a ramp); the last of a run, a sliver
    ends = list(panel.times)
    for a, b in runs:
        for i in range(a, b):
            ends[i] = panel.times[i + 1]
    for layer in panel.layers:
        for a, b in _present_runs(layer.values, runs):
            upper: list[tuple[float, float]] = []
            lower: list[tuple[float, float]] = []
            for i in range(a, b + 1):
                begin, end = xf(panel.times[i]), xf(ends[i])
                if end - begin < 2:
                    begin, end = begin - 1, begin + 1
                top, floor = y(base[i] + float(layer.values[i] or 0.0)), y(base[i])
                upper += [(begin, top), (end, top)]
                lower = [(end, floor), (begin, floor), *lower]
            points = " ".join(f"{px:.1f},{py:.1f}" for px, py in upper + lower)
            out.append(
                f'<polygon class="layer" data-name="{_attr(layer.name)}" points="{points}" '
                f'fill="{layer.colour}" fill-opacity="0.85" stroke="none"/>'
            )
        for i, value in enumerate(layer.values):
            if value is not None and math.isfinite(value):
                base[i] += value
    for line in panel.lines:
        for a, b in _present_runs(line.values, runs):
            steps = []
            for i in range(a, b + 1):
                level = y(float(line.values[i] or 0.0))
                steps += [(xf(panel.times[i]), level), (xf(ends[i]), level)]
            points = " ".join(f"{px:.1f},{py:.1f}" for px, py in steps)
            dash = ' stroke-dasharray="5 3"' if line.dashed else ""
            out.append(
                f'<polyline class="line" data-name="{_attr(line.name)}" points="{points}" fill="none" '
                f'stroke="{line.colour}" stroke-width="1.6"{dash}/>'
            )
    out.append("</g>")
    if stub:  # the break: a zigzag across the axis where the scale changes
        at = y(low)
        zigzag = " ".join(f"{left - 6 + 4 * k:.1f},{at + (3 if k % 2 else -3):.1f}" for k in range(4))
        out.append(
            f'<g class="axis-break"><line x1="{left}" x2="{left + plot_w}" y1="{at:.1f}" y2="{at:.1f}" '
            f'stroke="#888" stroke-dasharray="1 3"/><polyline points="{zigzag}" fill="none" '
            'stroke="#555" stroke-width="1.2"/></g>'
        )
    if panel.ceiling is not None:
        label, value = panel.ceiling
        at = y(value)
        out.append(
            f'<g class="ceiling"><line x1="{left}" x2="{left + plot_w}" y1="{at:.1f}" y2="{at:.1f}" '
            f'stroke="#b71c1c" stroke-width="1.2" stroke-dasharray="2 2"/>'
            f'<text x="{left + plot_w - 4}" y="{at - 4:.1f}" text-anchor="end" fill="#b71c1c">'
            f"{html.escape(label)} {_fmt_value(value, step / 4, panel.unit)}</text></g>"
        )
    out.append("</g>")
    return "\n".join(out)


def _label(number: int, mark: Mark) -> str:
    return f"{number} {mark.kind}"


def _box(at: float, text: str, right: float) -> tuple[float, float]:
    """Where a mark's label lies: right of its line, or left of it at the plot's right edge."""
    width = _CHAR_PX * len(text) + 6
    begin = at - 1 if at - 1 + width <= right else at + 1 - width
    return begin, width


def _lanes(xs: Sequence[float], labels: Sequence[str], right: float) -> tuple[int, list[int]]:
    """Each label's lane: the first whose labels all end before this one begins."""
    taken: list[list[tuple[float, float]]] = []
    lane_of = []
    for at, text in zip(xs, labels, strict=True):
        begin, width = _box(at, text, right)
        span = (begin - 3, begin + width + 3)
        free = (i for i, spans in enumerate(taken) if all(span[1] < a or span[0] > b for a, b in spans))
        lane = next(free, None)
        if lane is None:
            if len(taken) < _MAX_LANES:
                taken.append([])
                lane = len(taken) - 1
            else:  # crowded: the lane with the fewest labels
                lane = min(range(len(taken)), key=lambda i: len(taken[i]))
        taken[lane].append(span)
        lane_of.append(lane)
    return len(taken), lane_of


def _marks(
    ordered: Sequence[Mark],
    lane_of: Sequence[int],
    spots: Sequence[float],
    bottom: float,
    right: float,
) -> str:
    rank = {kind: n for n, kind in enumerate(_MARK_ORDER)}
    order = sorted(range(len(ordered)), key=lambda i: rank.get(ordered[i].kind, -1))
    out = ['<g class="marks">']
    for i in order:
        mark, at = ordered[i], spots[i]
        colour = MARK_COLOURS.get(mark.kind, "#000")
        lane_y = 8 + _LANE_PX * lane_of[i]
        text = _label(i + 1, mark)
        box, width = _box(at, text, right)
        heavy = "2.4" if mark.kind == "crash" else "1.5"
        dash = "" if mark.kind in {"crash", "tune", "restart", "rollback"} else ' stroke-dasharray="6 3"'
        out.append(
            f'<g class="mark" data-kind="{_attr(mark.kind)}" data-time="{mark.time:.3f}" data-x="{at:.1f}">'
            f"<title>{html.escape(mark.kind)}: {html.escape(mark.label)}</title>"
            f'<line x1="{at:.1f}" x2="{at:.1f}" y1="{lane_y + _LANE_PX - 2:.1f}" y2="{bottom:.1f}" '
            f'stroke="{colour}" stroke-width="{heavy}"{dash}/>'
            f'<rect class="label" x="{box:.1f}" y="{lane_y:.1f}" width="{width:.1f}" '
            f'height="{_LANE_PX - 3}" rx="2" fill="{colour}"/>'
            f'<text x="{box + 3:.1f}" y="{lane_y + 10:.1f}" fill="#fff">{html.escape(text)}</text></g>'
        )
    out.append("</g>")
    return "\n".join(out)


def _legend(
    panels: Sequence[Panel],
    marks: Sequence[Mark],
    *,
    left: float,
    top: float,
    width: float,
    words: Mapping[str, str],
) -> tuple[str, float]:
    items: list[tuple[str, str, str]] = []  # (shape, colour, name)
    seen: set[str] = set()
    for panel in panels:
        for layer in panel.layers:
            items.append(("area", layer.colour, layer.name))
        for line in panel.lines:
            items.append(("dash" if line.dashed else "line", line.colour, line.name))
        if panel.ceiling is not None and panel.ceiling[0] not in seen:
            seen.add(panel.ceiling[0])
            items.append(("dot", "#b71c1c", panel.ceiling[0]))
    kinds = list(dict.fromkeys(mark.kind for mark in marks))
    items += [("mark", MARK_COLOURS.get(kind, "#000"), words["mark"].format(kind=kind)) for kind in kinds]
    out = ['<g class="legend">']
    cx, cy = left, top
    for shape, colour, name in dict.fromkeys(items):
        item_w = 26 + _CHAR_PX * len(name) + 14
        if cx + item_w > left + width and cx > left:
            cx, cy = left, cy + 18
        if shape == "area":
            swatch = f'<rect x="{cx:.1f}" y="{cy - 9:.1f}" width="18" height="10" fill="{colour}"/>'
        elif shape == "mark":
            swatch = f'<rect x="{cx + 7:.1f}" y="{cy - 11:.1f}" width="4" height="14" fill="{colour}"/>'
        else:
            dash = {"dash": ' stroke-dasharray="5 3"', "dot": ' stroke-dasharray="2 2"'}.get(shape, "")
            swatch = (
                f'<line x1="{cx:.1f}" x2="{cx + 18:.1f}" y1="{cy - 4:.1f}" y2="{cy - 4:.1f}" '
                f'stroke="{colour}" stroke-width="2"{dash}/>'
            )
        out.append(
            f'<g class="legend-item" data-name="{_attr(name)}">{swatch}'
            f'<text x="{cx + 24:.1f}" y="{cy:.1f}">{html.escape(name)}</text></g>'
        )
        cx += item_w
    out.append("</g>")
    return "\n".join(out), cy - top + 18


def _attr(text: str) -> str:
    return html.escape(text, quote=True)


def page(
    title: str, intro: Sequence[str], chart: str, sections: Sequence[tuple[str, str]], language: str = "en"
) -> str:
    """A self-contained HTML page: a heading, lines of introduction, the chart and sections of
    preformatted text (nothing fetched, no scripts)."""
    body = [
        "<!doctype html>",
        f'<html lang="{_attr(language)}"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title>",
        "<style>body{font-family:sans-serif;max-width:1000px;margin:1.5em auto;color:#222}"
        "pre{background:#f5f5f5;padding:1em;overflow-x:auto;font-size:12px}"
        "h1{font-size:1.4em}h2{font-size:1.1em}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        *(f"<p>{html.escape(line)}</p>" for line in intro),
        chart,
    ]
    for heading, text in sections:
        body += [f"<h2>{html.escape(heading)}</h2>", "<pre>" + html.escape(text) + "</pre>"]
    body.append("</body></html>")
    return "\n".join(body)


def mark_list(marks: Sequence[Mark], clock: Clock = "utc") -> str:
    """The marks as numbered lines, as the chart numbers them."""
    ordered = sorted(marks, key=lambda mark: mark.time)
    return "\n".join(
        f"{number:>3}  {_fmt_time(mark.time, 1, clock):>8}  {mark.kind:<9} {mark.label}"
        for number, mark in enumerate(ordered, 1)
    )
