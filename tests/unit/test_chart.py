"""tunerd.chart: the rules of issue 20's chart, asserted on the SVG's structure (the SVG is
XML; these tests read it with ElementTree, as a browser would)."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET

import pytest

from tunerd import chart
from tunerd.units import GIB

SVG = "{http://www.w3.org/2000/svg}"


def _tree(text: str) -> ET.Element:
    return ET.fromstring(text)


def _all(root: ET.Element, cls: str, tag: str = "*") -> list[ET.Element]:
    return [el for el in root.iter() if el.get("class") == cls and (tag == "*" or el.tag == SVG + tag)]


def _plots(root: ET.Element) -> list[tuple[float, float, float, float]]:
    return [
        (float(r.get("x", 0)), float(r.get("y", 0)), float(r.get("width", 0)), float(r.get("height", 0)))
        for r in _all(root, "plot", "rect")
    ]


def _memory_panel(times: list[float], engine: list[float | None], others: list[float | None]) -> chart.Panel:
    return chart.Panel(
        title="GPU memory",
        unit="bytes",
        times=times,
        layers=[chart.Layer("engine", "#5c6bc0", engine), chart.Layer("neighbours", "#e57373", others)],
        lines=[
            chart.Line(
                "budget", "#1b5e20", [22.8 * GIB if v is not None else None for v in engine], dashed=True
            )
        ],
        ceiling=("the card's total", 24 * GIB),
    )


def test_time_ticks_are_round_and_inside() -> None:
    step, ticks = chart.time_ticks(1_000.0, 1_000.0 + 420)  # seven minutes
    assert step == 60
    assert ticks == [1_020.0 + 60 * k for k in range(7)]
    step, ticks = chart.time_ticks(0.0, 9.0)
    assert step == 1
    assert ticks[0] == 0
    assert ticks[-1] == 9
    step, ticks = chart.time_ticks(0.0, 30 * 86_400.0)  # a month: past the table, still at most 10
    assert len(ticks) <= 11
    assert step % 86_400 == 0


def test_value_ticks_use_gib_steps_for_bytes() -> None:
    step, ticks = chart.value_ticks(21 * GIB, 24 * GIB, "bytes")
    assert step == 0.5 * GIB
    assert ticks[0] == 21 * GIB
    assert ticks[-1] == 24 * GIB


def test_the_band_that_matters_is_fitted_and_the_rest_squeezed_below_it() -> None:
    """The issue's complaint: a 0–24 GiB scale squashes 21–24 GiB into a sliver."""
    times = [float(t) for t in range(0, 300, 5)]
    engine = [21.5 * GIB + t * 2e6 for t in times]
    root = _tree(chart.svg([_memory_panel(times, list(engine), [0.3 * GIB] * len(times))], clock="elapsed"))
    (panel,) = _all(root, "panel", "g")
    low, high = float(panel.get("data-low", 0)), float(panel.get("data-high", 0))
    assert 20 * GIB <= low <= 21.8 * GIB
    assert 24 * GIB <= high <= 24.5 * GIB  # the card's total is inside the range
    assert "squeezed into the bottom strip" in "".join(root.itertext())
    assert _all(root, "axis-break", "g")
    labels = [el.text for el in _all(root, "y-tick", "text")]
    assert labels[0] == "0 GiB"
    assert "24 GiB" in labels


def test_a_restart_is_a_gap_not_a_ramp() -> None:
    times = [float(t) for t in range(0, 100, 5)]
    engine: list[float | None] = [20 * GIB if not 40 <= t < 70 else None for t in times]
    root = _tree(chart.svg([_memory_panel(times, engine, [0.3 * GIB] * len(times))], clock="elapsed"))
    engine_polygons = [el for el in _all(root, "layer", "polygon") if el.get("data-name") == "engine"]
    assert len(engine_polygons) == 2  # before and after the restart
    budget = [el for el in _all(root, "line", "polyline") if el.get("data-name") == "budget"]
    assert len(budget) == 2
    neighbours = [el for el in _all(root, "layer", "polygon") if el.get("data-name") == "neighbours"]
    assert len(neighbours) == 1  # measured all along: no gap


def test_missing_readings_are_a_gap_too() -> None:
    times = [0.0, 1.0, 2.0, 3.0, 60.0, 61.0, 62.0]  # a minute with no reading
    root = _tree(chart.svg([_memory_panel(times, [20 * GIB] * 7, [GIB] * 7)], clock="elapsed"))
    assert len([el for el in _all(root, "layer", "polygon") if el.get("data-name") == "engine"]) == 2


def test_a_slower_sampler_is_not_a_gap() -> None:
    times = [0.0, 0.5, 1.0, 1.5, 26.0, 51.0, 76.0, 101.0]  # 0.5 s, then a loaded box's 25 s
    root = _tree(chart.svg([_memory_panel(times, [20 * GIB] * 8, [GIB] * 8)], clock="elapsed"))
    assert len([el for el in _all(root, "layer", "polygon") if el.get("data-name") == "engine"]) == 1


def test_a_reading_holds_until_the_next_one() -> None:
    """Steps: the polygon's top edge is flat from one reading to the next, then jumps."""
    times = [0.0, 10.0, 20.0]
    root = _tree(
        chart.svg([_memory_panel(times, [20 * GIB, 22 * GIB, 21 * GIB], [None] * 3)], clock="elapsed")
    )
    (engine,) = [el for el in _all(root, "layer", "polygon") if el.get("data-name") == "engine"]
    points = [tuple(map(float, pair.split(","))) for pair in engine.get("points", "").split()]
    upper = points[: len(points) // 2]
    assert upper[0][1] == upper[1][1]
    assert upper[0][0] < upper[1][0]
    assert upper[1][0] == upper[2][0]
    assert upper[1][1] != upper[2][1]


def test_every_mark_is_inside_the_plot_labelled_and_none_overlaps() -> None:
    """The crash-loop's crash and hold were drawn outside the picture; crash marks hid under
    tune marks. Marks past the readings, on one moment, and at the very edges."""
    times = [float(t) for t in range(100, 400, 5)]
    marks = [
        chart.Mark(40.0, "crash", "before the first reading"),
        chart.Mark(200.0, "crash", "cuda_oom"),
        chart.Mark(200.0, "tune", "gpu_memory_utilization 0.97→0.95"),
        chart.Mark(200.4, "restart", "restarting"),
        chart.Mark(460.0, "hold", "after the last reading: crash loop"),
        chart.Mark(461.0, "crash", "<b>escaped</b> & all"),
    ]
    text = chart.svg([_memory_panel(times, [20 * GIB] * len(times), [GIB] * len(times))], marks, clock="utc")
    root = _tree(text)
    ((px, _, pw, _),) = _plots(root)
    width = float(root.get("width", 0))
    drawn = _all(root, "mark", "g")
    assert sorted(el.get("data-kind") for el in drawn) == sorted(mark.kind for mark in marks)
    xs = [float(el.get("data-x", 0)) for el in drawn]
    assert all(px < x < px + pw for x in xs)
    assert len({round(x, 1) for x in xs}) == len(xs)  # none on another's pixel
    boxes = []
    for el in drawn:
        label = el.find(SVG + "rect")
        assert label is not None
        x, y, w = float(label.get("x", 0)), float(label.get("y", 0)), float(label.get("width", 0))
        assert x >= 0
        assert x + w <= width
        boxes.append((x, y, w))
        words = "".join(el.itertext())
        assert el.get("data-kind") in words  # labelled with its kind
    for i, (x1, y1, w1) in enumerate(boxes):
        for x2, y2, w2 in boxes[i + 1 :]:
            assert y1 != y2 or x1 + w1 <= x2 or x2 + w2 <= x1, "two labels overlap"
    # a crash is drawn after (over) the tune at its moment
    kinds = [el.get("data-kind") for el in drawn]
    assert kinds.index("tune") < max(i for i, kind in enumerate(kinds) if kind == "crash")
    assert "&lt;b&gt;escaped&lt;/b&gt; &amp; all" in text


def test_the_legend_names_every_colour() -> None:
    times = [0.0, 1.0]
    marks = [chart.Mark(0.5, "crash", "x"), chart.Mark(0.7, "tune", "y")]
    root = _tree(chart.svg([_memory_panel(times, [GIB, GIB], [GIB, GIB])], marks, clock="elapsed"))
    names = {el.get("data-name") for el in _all(root, "legend-item", "g")}
    assert names == {"engine", "neighbours", "budget", "the card's total", "crash (mark)", "tune (mark)"}
    for item in _all(root, "legend-item", "g"):
        assert "".join(item.itertext()) == item.get("data-name")  # the name is written, not only coloured


@pytest.mark.parametrize("clock", ["utc", "elapsed"])
def test_the_time_axis_says_what_it_is(clock: chart.Clock) -> None:
    start = 1_796_224_190.0 if clock == "utc" else 0.0
    times = [start + t for t in range(0, 600, 10)]
    root = _tree(chart.svg([_memory_panel(times, [GIB] * 60, [GIB] * 60)], clock=clock))
    ticks = [el.text or "" for el in _all(root, "tick", "text")]
    assert len(ticks) >= 5
    words = "".join(root.itertext())
    if clock == "utc":
        assert "time (UTC)" in words
        assert all(len(tick) in {5, 8} and ":" in tick for tick in ticks)
    else:
        assert ticks[0] == "0:00"
        assert all(tick.endswith(":00") for tick in ticks)


def test_hostile_numbers_draw_nothing_wrong() -> None:
    """NaN, infinities, one reading, no readings: a chart still, and valid XML."""
    nan, inf = math.nan, math.inf
    panels = [
        _memory_panel([0.0, 1.0, 2.0, 3.0], [nan, inf, 20 * GIB, None], [None, nan, GIB, GIB]),
        chart.Panel("one", "ratio", [5.0], lines=[chart.Line("kv", "#000", [0.5])], fit=False),
        chart.Panel("none", "count", [], lines=[]),
    ]
    root = _tree(chart.svg(panels, [chart.Mark(2.0, "crash", "x")], clock="utc"))
    assert len(_all(root, "panel", "g")) == 3
    assert _tree(chart.svg([], [])) is not None  # nothing at all
    assert "nan" not in chart.svg(panels).lower().replace("name", "")


def test_the_page_is_self_contained() -> None:
    page = chart.page("t <1>", ["intro & more"], "<svg/>", [("Post-mortem", "a < b")])
    assert page.startswith("<!doctype html>")
    assert "t &lt;1&gt;" in page
    assert "intro &amp; more" in page
    assert "a &lt; b" in page
    assert "<script" not in page
    assert "http" not in page
