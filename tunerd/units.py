"""Sizes and durations as people write them: parse at the edges, integers and floats inside.

Everything inside tunerd counts bytes (``int``) and seconds (``float``). Only this module
turns ``"24GiB"``, ``"512MiB"``, ``"10m"`` or ``"1h30m"`` into numbers and back, so that a bad
value is reported the same way everywhere, quoting the text the user wrote.

Sizes accept IEC binary units (``KiB MiB GiB TiB``, also vLLM/Kubernetes-style ``Ki Mi Gi Ti``),
SI decimal units (``kB KB MB GB TB``) and plain bytes (``B`` or no unit). Durations accept
``ms s m h d`` and compounds in descending order (``1h30m``, ``2m30s``).
"""

from __future__ import annotations

import math
import re

from tunerd.errors import InputError

__all__ = [
    "GIB",
    "KIB",
    "MIB",
    "TIB",
    "UnitError",
    "format_duration",
    "format_size",
    "parse_duration",
    "parse_size",
    "parse_token_count",
]

KIB = 1024
MIB = 1024**2
GIB = 1024**3
TIB = 1024**4

_SIZE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kib": KIB,
    "ki": KIB,
    "mib": MIB,
    "mi": MIB,
    "gib": GIB,
    "gi": GIB,
    "tib": TIB,
    "ti": TIB,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
}
_SIZE_UNITS_HELP = "B, KiB, MiB, GiB, TiB (binary) or kB, MB, GB, TB (decimal)"
_SIZE_RE = re.compile(r"^\s*(?P<number>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(?P<unit>[A-Za-z]*)\s*$")

_DURATION_UNITS: dict[str, float] = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION_ORDER = ["d", "h", "m", "s", "ms"]
_DURATION_PART_RE = re.compile(r"(?P<number>[0-9]+(?:\.[0-9]+)?)(?P<unit>ms|s|m|h|d)")


class UnitError(InputError):
    """A size or duration that cannot be read; the message quotes the offending text."""


def parse_size(text: str | int) -> int:
    """Bytes in ``text`` ("24GiB", "1.5 GiB", "512MiB", "8GB", "4096").

    Fractions are allowed and rounded down to whole bytes. Negative sizes are refused.
    """
    if isinstance(text, bool):
        raise UnitError(f"invalid size {text!r}: expected a number with a unit such as '24GiB'")
    if isinstance(text, int):
        if text < 0:
            raise UnitError(f"invalid size '{text}': sizes cannot be negative")
        return text
    match = _SIZE_RE.match(text)
    if match is None:
        if text.strip().startswith("-"):
            raise UnitError(f"invalid size '{text}': sizes cannot be negative")
        raise UnitError(f"invalid size '{text}': expected a number and a unit, e.g. '24GiB' or '512MiB'")
    unit = match.group("unit")
    factor = _SIZE_UNITS.get(unit.lower())
    # "mb" and "Mb" would be millibytes and megabits to a pedant; accept what people mean
    # but keep IEC units case-exact where the case carries the meaning ("GiB" not "gib" is fine
    # either way, so lower() is enough).
    if factor is None:
        raise UnitError(f"invalid size '{text}': unknown unit '{unit}' (use {_SIZE_UNITS_HELP})")
    value = float(match.group("number")) * factor
    return math.floor(value)


def format_size(num_bytes: int | float, precision: int = 2) -> str:
    """``14.96 GiB``: the largest binary unit that keeps the number at or above one."""
    sign = "-" if num_bytes < 0 else ""
    value = abs(float(num_bytes))
    for unit, factor in (("TiB", TIB), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if value >= factor:
            return f"{sign}{value / factor:.{precision}f} {unit}"
    return f"{sign}{int(value)} B"


def parse_duration(text: str | int | float) -> float:
    """Seconds in ``text`` ("500ms", "5s", "10m", "1h30m", "2d"); a bare number is seconds."""
    if isinstance(text, bool):
        raise UnitError(f"invalid duration {text!r}: expected e.g. '10m'")
    if isinstance(text, int | float):
        if text < 0:
            raise UnitError(f"invalid duration '{text}': durations cannot be negative")
        return float(text)
    stripped = text.strip()
    if not stripped:
        raise UnitError("invalid duration '': expected e.g. '500ms', '5s', '10m', '1h30m'")
    if re.fullmatch(r"[0-9]+(?:\.[0-9]+)?", stripped):
        return float(stripped)
    position = 0
    total = 0.0
    last_rank = -1
    while position < len(stripped):
        match = _DURATION_PART_RE.match(stripped, position)
        if match is None:
            raise UnitError(
                f"invalid duration '{text}': expected e.g. '500ms', '5s', '10m', '1h30m' "
                f"(units ms, s, m, h, d)"
            )
        unit = match.group("unit")
        rank = _DURATION_ORDER.index(unit)
        if rank <= last_rank:
            raise UnitError(f"invalid duration '{text}': units must go from largest to smallest, once each")
        last_rank = rank
        total += float(match.group("number")) * _DURATION_UNITS[unit]
        position = match.end()
    return total


def format_duration(seconds: float) -> str:
    """``1h30m``, ``10m``, ``2.5s``, ``500ms``: the inverse of :func:`parse_duration`."""
    if seconds < 0:
        return "-" + format_duration(-seconds)
    if seconds == 0:
        return "0s"
    if seconds < 1:
        return f"{round(seconds * 1000):d}ms"
    whole = int(seconds)
    fraction = seconds - whole
    parts: list[str] = []
    for unit in ("d", "h", "m"):
        size = int(_DURATION_UNITS[unit])
        count, whole = divmod(whole, size)
        if count:
            parts.append(f"{count}{unit}")
    if whole or fraction:
        rest = whole + fraction
        parts.append(f"{rest:g}s" if fraction else f"{whole}s")
    return "".join(parts)


_TOKEN_SUFFIXES = {"k": 1000, "m": 1000**2, "g": 1000**3, "K": 1024, "M": 1024**2, "G": 1024**3}


def parse_token_count(text: str | int) -> int:
    """A token count as vLLM's ``--max-model-len`` reads it: ``32768``, ``32K`` (× 1024),
    ``32k`` (× 1000), ``25.6k``. Must be positive."""
    if isinstance(text, bool):
        raise UnitError(f"invalid token count {text!r}")
    if isinstance(text, int):
        value = text
    else:
        match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgKMG]?)\s*", text)
        if match is None:
            raise UnitError(f"invalid token count '{text}': expected a whole number such as '32768' or '32K'")
        number, suffix = match.groups()
        scaled = float(number) * _TOKEN_SUFFIXES.get(suffix, 1)
        if not scaled.is_integer():
            raise UnitError(f"invalid token count '{text}': not a whole number of tokens")
        value = int(scaled)
    if value <= 0:
        raise UnitError(f"invalid token count '{text}': must be at least 1")
    return value
