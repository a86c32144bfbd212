"""A headless browser for the tests that look at tunerd's pages as a person would: Debian's
Chromium (``/usr/bin/chromium``; ``.ci/run`` installs it), a screenshot of a local file, and a
small PNG reader to look at the pixels (8-bit RGB or RGBA, not interlaced: what Chromium
writes). Where no browser is installed the tests that need one skip, unless
``TUNERD_REQUIRE_BROWSER`` is set (CI sets it): then they fail."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import xml.etree.ElementTree as ET
import zlib
from collections import Counter
from pathlib import Path

import pytest

SVG = "{http://www.w3.org/2000/svg}"
#: the flags a root process in a closed network needs (the workplace's notes on Chromium)
_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if os.environ.get("TUNERD_REQUIRE_BROWSER"):
            pytest.fail("no chromium on PATH, and TUNERD_REQUIRE_BROWSER is set (apt-get install chromium)")
        pytest.skip("no chromium on PATH (apt-get install chromium)")
    return found


def screenshot(page: Path, out: Path, width: int = 1040, height: int = 1000) -> Path:
    """``page`` as headless Chromium draws it, ``width`` × ``height`` pixels, into ``out``."""
    profile = out.parent / f".chromium-{out.stem}"
    done = subprocess.run(
        [chromium(), *_FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}",
         f"--screenshot={out}", page.resolve().as_uri()],
        check=False, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.exists(), f"chromium wrote no screenshot (exit {done.returncode}): {done.stderr[-2000:]}"
    shutil.rmtree(profile, ignore_errors=True)
    return out


def pixels(path: Path) -> tuple[int, int, Counter[tuple[int, int, int]]]:
    """A PNG's width, height and how many pixels of each RGB colour it has."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    at, idat = 8, b""
    width = height = channels = 0
    while at < len(data):
        (length,) = struct.unpack(">I", data[at : at + 4])
        kind, body = data[at + 4 : at + 8], data[at + 8 : at + 8 + length]
        at += 12 + length
        if kind == b"IHDR":
            width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert (depth, interlace) == (8, 0), (depth, interlace)
            assert colour in {2, 6}, colour
            channels = 3 if colour == 2 else 4
        elif kind == b"IDAT":
            idat += body
    raw = zlib.decompress(idat)
    stride = width * channels
    previous = bytearray(stride)
    counts: Counter[tuple[int, int, int]] = Counter()
    for row in range(height):
        start = row * (stride + 1)
        kind, line = raw[start], bytearray(raw[start + 1 : start + 1 + stride])
        if kind == 1:
            for i in range(channels, stride):
                line[i] = (line[i] + line[i - channels]) & 0xFF
        elif kind == 2:
            line = bytearray((a + b) & 0xFF for a, b in zip(line, previous, strict=True))
        elif kind == 3:
            for i in range(stride):
                left = line[i - channels] if i >= channels else 0
                line[i] = (line[i] + ((left + previous[i]) >> 1)) & 0xFF
        elif kind == 4:
            for i in range(stride):
                a = line[i - channels] if i >= channels else 0
                b = previous[i]
                c = previous[i - channels] if i >= channels else 0
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                near = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                line[i] = (line[i] + near) & 0xFF
        counts.update(zip(line[0::channels], line[1::channels], line[2::channels], strict=True))
        previous = line
    return width, height, counts


def rgb(colour: str) -> tuple[int, int, int]:
    value = colour.lstrip("#")
    return int(value[0:2], 16), int(value[2:4], 16), int(value[4:6], 16)


def svg_of(page: str) -> ET.Element:
    """The first chart in an HTML page, as XML."""
    start, end = page.index("<svg"), page.index("</svg>") + len("</svg>")
    return ET.fromstring(page[start:end])


def check_chart(root: ET.Element) -> dict[str, object]:
    """Issue 20's bar, on the SVG's structure: time ticks, every mark inside the plot and its
    label inside the picture, a legend that names its colours. Returns what it found."""
    plots = [el for el in root.iter(SVG + "rect") if el.get("class") == "plot"]
    assert plots, "no plot"
    left = float(plots[0].get("x", 0))
    right = left + float(plots[0].get("width", 0))
    width = float(root.get("width", 0))
    ticks = [el.text for el in root.iter(SVG + "text") if el.get("class") == "tick"]
    assert len(ticks) >= 3, f"time ticks: {ticks}"
    marks = [el for el in root.iter(SVG + "g") if el.get("class") == "mark"]
    for mark in marks:
        at = float(mark.get("data-x", -1))
        assert left < at < right, f"mark {mark.get('data-kind')} at x={at} outside the plot ({left}, {right})"
        label = mark.find(SVG + "rect")
        assert label is not None
        x, w = float(label.get("x", -1)), float(label.get("width", 0))
        assert x >= 0
        assert x + w <= width, f"label of {mark.get('data-kind')} leaves the picture"
    legend = {
        el.get("data-name"): "".join(el.itertext())
        for el in root.iter(SVG + "g")
        if el.get("class") == "legend-item"
    }
    for name, written in legend.items():
        assert name == written, f"legend item {name!r} reads {written!r}"
    kinds = {mark.get("data-kind") for mark in marks}
    for kind in kinds:
        assert f"{kind} (mark)" in legend, f"the legend does not name the {kind} marks"
    return {"ticks": ticks, "kinds": kinds, "legend": set(legend)}
