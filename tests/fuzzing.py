"""Shared pieces of the fuzz tier (issue 16): one ``settings`` profile and structural mutations
of recorded real inputs.

``make test`` runs a small sample of every property (``TUNERD_FUZZ_EXAMPLES`` unset: 100 cases
each); ``make fuzz`` runs the slow tier with ``TUNERD_FUZZ_EXAMPLES=10000``. Hypothesis keeps
its example database under ``.hypothesis/`` (git-ignored), so a failure found once is replayed
first the next time.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

DEFAULT_EXAMPLES = 100


def examples() -> int:
    """Cases per property: ``TUNERD_FUZZ_EXAMPLES`` or :data:`DEFAULT_EXAMPLES`."""
    raw = os.environ.get("TUNERD_FUZZ_EXAMPLES", "")
    return int(raw) if raw.isdigit() and int(raw) > 0 else DEFAULT_EXAMPLES


def fuzz_settings(scale: float = 1.0) -> settings:
    """The profile every fuzz property uses; ``scale`` trims costly properties (each case starts
    something heavier than a parser) to a fraction of the count, never below 10."""
    return settings(
        max_examples=max(10, int(examples() * scale)),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
        derandomize=False,
    )


# Text that trips number parsers, encodings and line splitting: the shapes the adversarial pass
# used (``1.2.3``, ``1e400``, superscript digits, NUL, a lone surrogate-free oddity, huge runs).
# fmt: off
NASTY = [
    "1.2.3", ".", ",", "-", "+", "1e400", "-1e400", "nan", "NaN", "inf", "-inf", "²", "٣", "１",
    "\x00", "\r", "\t", "\u2028", "\ufeff", "9" * 400, "0x1F", "1_000", "1,234,567", "−5", "",
    "'", '"', "{", "}", "[", "]", "#", ":", "&a", "*a", "!!python/object", "%", "\\",
]
# fmt: on


@st.composite
def mutated(draw: st.DrawFn, corpus: Sequence[str]) -> str:
    """A recorded text with lines dropped, duplicated, cut, swapped, or with a number swapped
    for a nasty token, or junk inserted: structure kept mostly intact so the parser gets deep."""
    lines = draw(st.sampled_from(list(corpus))).splitlines()
    for _ in range(draw(st.integers(0, 8))):
        if not lines:
            break
        index = draw(st.integers(0, len(lines) - 1))
        line = lines[index]
        action = draw(st.sampled_from(["drop", "dup", "cut", "junk", "swap", "nasty", "number"]))
        if action == "drop":
            del lines[index]
        elif action == "dup":
            lines.insert(index, line)
        elif action == "cut":
            lines[index] = line[: draw(st.integers(0, len(line)))]
        elif action == "junk":
            position = draw(st.integers(0, len(line)))
            lines[index] = line[:position] + draw(st.text(max_size=12)) + line[position:]
        elif action == "swap":
            other = draw(st.integers(0, len(lines) - 1))
            lines[index], lines[other] = lines[other], lines[index]
        else:
            lines[index] = _replace_a_number(draw, line, action == "nasty")
    return "\n".join(lines)


def _replace_a_number(draw: st.DrawFn, line: str, nasty: bool) -> str:
    """``line`` with one run of digits replaced by a nasty token or a random number."""
    spans: list[tuple[int, int]] = []
    start = None
    for position, char in enumerate(line + " "):
        if char.isdigit() or (start is not None and char in ".e+-"):
            start = position if start is None else start
        elif start is not None:
            spans.append((start, position))
            start = None
    if not spans:
        return line
    begin, end = draw(st.sampled_from(spans))
    if nasty:
        token = draw(st.sampled_from(NASTY))
    else:
        token = str(
            draw(st.one_of(st.integers(-(10**30), 10**30), st.floats(allow_nan=True, allow_infinity=True)))
        )
    return line[:begin] + token + line[end:]
