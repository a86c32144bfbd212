"""The knobs tunerd may turn, and how a ``tune`` action turns them. Pure.

Only the allowlisted tunables (:data:`TUNABLES`) can change. Each ``tune`` names a knob and an
operation — ``step_down``/``step_up`` (the knob's ladder), ``halve``/``double``, a signed delta
(``-0.03``), or an absolute value — and the result is clamped to the engine's bounds. A knob
without bounds is never tuned; a tune that cannot move (already at its bound, or the ladder's
end) changes nothing and says why. Default notches follow DESIGN §4.5:

- ``max_num_seqs``: down ``max(1, min(v − 1, ⌊0.75 v⌋))``, up ``max(v + 1, ⌊1.25 v⌋)``
  (8 → 6 → 4 → 3; 8 → 10);
- ``max_num_batched_tokens``, ``kv_cache_memory_bytes``, ``max_model_len``: halve / double;
- ``max_num_queued_reqs`` (requests in flight, waiting or running, before vLLM answers 503) as
  ``max_num_seqs``; ``max_num_queued_tokens`` (prompt tokens in prefill before it answers 503)
  halve / double — vLLM 0.32+'s in-engine admission control: a policy can cap the queue
  instead of shrinking the pool;
- ``gpu_memory_utilization``: ∓0.03 in two-decimal arithmetic (0.92 → 0.89, never
  0.8900000000000001);
- ``kv_cache_dtype``: down ``auto`` → ``fp8``, up ``fp8`` → ``auto``;
- booleans (``enable_chunked_prefill``, ``enable_prefix_caching``, ``enforce_eager``): absolute
  values only;
- ``fit`` (``gpu_memory_utilization``, ``max_num_batched_tokens``, ``max_num_seqs``): the target
  computed from the calibrated box (:mod:`tunerd.planner.calibration`), a utilization to
  three decimals; nothing calibrated, nothing moves (a ``first_of`` falls back to the notches).

An engine's ``ladders: {knob: [rungs...]}`` replaces the default notches of that knob: a step
goes to the next rung below (or above) the current value.

Every value a knob may take lies in its range (:data:`MIN_VALUES` … :data:`MAX_VALUES`): a
token count fits vLLM's 32-bit token indices, ``max_num_seqs`` the batch any engine can hold,
``kv_cache_memory_bytes`` one GPU's memory (1 TiB), ``gpu_memory_utilization`` (0, 1]. A bool is
never a number, and a whole-number knob takes whole numbers only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "BOOLEAN_TUNABLES",
    "FIT_HYSTERESIS",
    "FIT_TUNABLES",
    "INTEGER_TUNABLES",
    "KV_CACHE_DTYPES",
    "MAX_VALUES",
    "MIN_VALUES",
    "NUMERIC_TUNABLES",
    "OPERATIONS",
    "TUNABLES",
    "TuneResult",
    "apply_tune",
    "bounds_problem",
    "changes",
    "settings_diff",
    "tune_problem",
    "validate_value",
]

NUMERIC_TUNABLES = (
    "gpu_memory_utilization",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "kv_cache_memory_bytes",
    "max_num_queued_reqs",
    "max_num_queued_tokens",
)
BOOLEAN_TUNABLES = ("enable_chunked_prefill", "enable_prefix_caching", "enforce_eager")
TUNABLES = (*NUMERIC_TUNABLES, "kv_cache_dtype", *BOOLEAN_TUNABLES)
KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
OPERATIONS = ("step_down", "step_up", "halve", "double")
#: The knobs whose ``fit`` is computed from the calibrated box (:mod:`tunerd.planner.calibration`).
FIT_TUNABLES = ("gpu_memory_utilization", "max_num_batched_tokens", "max_num_seqs")
#: A ``fit`` of the utilization that moves it less than this changes nothing (down: the margin
#: covers it; up: not worth an outage).
FIT_HYSTERESIS = {"down": 0.005, "up": 0.02}
#: The knobs that take whole numbers: every numeric one but the utilization share.
INTEGER_TUNABLES = frozenset(NUMERIC_TUNABLES) - {"gpu_memory_utilization"}
_HALVING = {"max_num_batched_tokens", "kv_cache_memory_bytes", "max_model_len", "max_num_queued_tokens"}
_COUNTING = {"max_num_seqs", "max_num_queued_reqs"}  # 8 → 6 → 4 → 3; 8 → 10
_TOKENS = 2**31 - 1  # vLLM indexes tokens with 32-bit integers
#: The least value of each numeric knob (``gpu_memory_utilization``: more than this).
MIN_VALUES: dict[str, float] = {
    "gpu_memory_utilization": 0.0,
    "max_model_len": 1,
    "max_num_seqs": 1,
    "max_num_batched_tokens": 1,
    "kv_cache_memory_bytes": 1,
    "max_num_queued_reqs": 1,  # vLLM takes 0 (every request refused): never a setting to tune to
    "max_num_queued_tokens": 1,
}
#: The greatest value of each numeric knob.
MAX_VALUES: dict[str, float] = {
    "gpu_memory_utilization": 1.0,
    "max_model_len": _TOKENS,
    "max_num_seqs": 1 << 20,
    "max_num_batched_tokens": _TOKENS,
    "kv_cache_memory_bytes": 1 << 40,  # per GPU: 1 TiB, more than any GPU has
    "max_num_queued_reqs": 1 << 24,
    "max_num_queued_tokens": _TOKENS,
}


@dataclass(frozen=True)
class TuneResult:
    """One knob's tune: the value before and after, and why it did or did not move."""

    knob: str
    before: Any
    after: Any
    reason: str
    forbidden: tuple[Any, ...] = field(default=())
    #: a ``fit``'s prediction of what the new value gives (the pool, the peak, the headroom)
    prediction: Mapping[str, Any] | None = None
    #: a computed ``fit`` found the current value good enough: the answer, though nothing moves
    #: (a ``first_of`` stops here instead of trying its notches)
    settled: bool = False

    @property
    def changed(self) -> bool:
        return bool(self.after != self.before)


def validate_value(knob: str, value: Any) -> str | None:
    """Why ``value`` is not a valid setting of ``knob`` (None when it is)."""
    if knob not in TUNABLES:
        return f"'{knob}' is not a tunable (tunables: {', '.join(TUNABLES)})"
    if knob in BOOLEAN_TUNABLES:
        return None if isinstance(value, bool) else f"{knob} takes true or false, got {value!r}"
    if knob == "kv_cache_dtype":
        return (
            None
            if isinstance(value, str) and value in KV_CACHE_DTYPES
            else f"kv_cache_dtype takes {', '.join(KV_CACHE_DTYPES)}, got {value!r}"
        )
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"{knob} takes a number, got {value!r}"
    low, high = MIN_VALUES[knob], MAX_VALUES[knob]
    if knob == "gpu_memory_utilization":
        return None if low < value <= high else f"gpu_memory_utilization must be in (0, 1], got {value}"
    if (isinstance(value, float) and not value.is_integer()) or value < low:  # also inf and nan
        return f"{knob} takes a positive whole number, got {value}"
    if value > high:
        return f"{knob} must be at most {high:,}, got {value}"
    return None


def bounds_problem(knob: str, bounds: Any) -> str | None:
    """Why ``bounds`` are not bounds of ``knob`` (None when they are): a numeric knob takes
    ``[low, high]`` with low ≤ high, any other knob a non-empty list of the values it may take;
    every value valid for the knob."""
    if knob not in TUNABLES:
        return f"'{knob}' is not a tunable (tunables: {', '.join(TUNABLES)})"
    numeric = knob in NUMERIC_TUNABLES
    if not isinstance(bounds, list) or not bounds or (numeric and len(bounds) != 2):
        expected = "[low, high]" if numeric else "a list of the values it may take"
        return f"{knob} bounds are {expected}, got {bounds!r}"
    for value in bounds:
        if (why := validate_value(knob, value)) is not None:
            return why
    if numeric and bounds[0] > bounds[1]:
        return f"{knob} bounds are [low, high], got [{bounds[0]}, {bounds[1]}]: the low one first"
    return None


def tune_problem(knob: str, operation: Any) -> str | None:
    """Why ``operation`` cannot be a ``tune`` of ``knob`` (None when it can): what a policy
    file is checked against before anything runs."""
    if knob not in TUNABLES:
        return f"'{knob}' is not a tunable"
    numeric = knob in NUMERIC_TUNABLES
    if operation == "fit":
        return None if knob in FIT_TUNABLES else f"{knob} has no fit (fit: {', '.join(FIT_TUNABLES)})"
    if operation in OPERATIONS:
        if operation in ("halve", "double") and not numeric:
            return f"{knob} cannot be {operation}d"
        if knob in BOOLEAN_TUNABLES:
            return f"{knob} takes true or false, not {operation}"
        return None
    delta = _delta(operation)
    if delta is not None:
        if not numeric:
            return f"{knob} takes no delta"
        if not math.isfinite(delta):
            return f"a delta must be a finite number, got {operation!r}"
        return None
    problem = validate_value(knob, operation)
    return (
        None
        if problem is None
        else f"{problem} (or one of: {', '.join(OPERATIONS)}, fit, a delta like -0.03)"
    )


def _delta(operation: Any) -> float | None:
    """The signed delta an operation means, if it is one: a negative number or "+N"/"-N"."""
    if isinstance(operation, bool):
        return None
    if isinstance(operation, int | float) and operation < 0:
        return float(operation)
    if isinstance(operation, str) and operation[:1] in "+-":
        try:
            return float(operation)
        except (ValueError, OverflowError):
            return None
    return None


def _two_decimals(value: float) -> float:
    return round(value * 100) / 100


def _default_step(knob: str, value: Any, direction: int) -> Any:
    if knob in _COUNTING:
        return (
            max(1, min(value - 1, math.floor(0.75 * value)))
            if direction < 0
            else max(value + 1, math.floor(1.25 * value))
        )
    if knob in _HALVING:
        return max(1, value // 2) if direction < 0 else value * 2
    if knob == "gpu_memory_utilization":
        return _two_decimals((round(value * 100) + 3 * direction) / 100)
    if knob == "kv_cache_dtype":
        if direction < 0:
            return "fp8" if value in {"auto", "float16", "bfloat16"} else value
        return "auto" if value.startswith("fp8") else value
    return value  # booleans have no notches


def _ladder_step(ladder: Sequence[Any], value: Any, direction: int) -> Any:
    rungs = sorted(ladder)
    if direction < 0:
        lower = [rung for rung in rungs if rung < value]
        return lower[-1] if lower else value
    higher = [rung for rung in rungs if rung > value]
    return higher[0] if higher else value


def apply_tune(
    knob: str,
    operation: str | int | float | bool,
    current: Any,
    bounds: Sequence[Any] | None,
    *,
    ladder: Sequence[Any] | None = None,
    failed: Sequence[Any] = (),
    fit: tuple[Any, str, Mapping[str, Any] | None] | None = None,
    fit_up: bool = True,
) -> TuneResult:
    """The value ``knob`` takes when ``operation`` is applied to ``current``.

    ``operation`` is one of :data:`OPERATIONS`, a signed delta (a negative number, or a string
    with its sign: ``-0.03``, ``"+2"`` — YAML drops the ``+`` of an unquoted number), or an
    absolute value. ``bounds`` is ``[low, high]`` (None: the knob is never
    tuned; booleans and ``kv_cache_dtype`` take a list of allowed values). ``failed`` lists
    values that failed recently: a step up never lands on one.

    ``fit`` is the computed target of the knob — (value or None, why, the prediction) — that
    the operation ``fit`` moves to: down whenever it is below the current value, up only with
    ``fit_up`` (memory and crash policies only lower), and for the utilization only past
    :data:`FIT_HYSTERESIS`. Without a target (nothing calibrated) it changes nothing and says
    why, so a ``first_of`` goes on to its notches.
    """
    if knob not in TUNABLES:
        return TuneResult(knob, current, current, f"'{knob}' is not a tunable")
    if bounds is None:
        return TuneResult(knob, current, current, f"{knob} has no bounds for this engine: never tuned")
    if current is None:
        return TuneResult(knob, current, current, f"{knob} has no current value")
    direction = 0
    prediction = None
    if operation == "fit":
        if knob not in FIT_TUNABLES:
            return TuneResult(knob, current, current, f"{knob} has no fit")
        value, why, prediction = fit if fit is not None else (None, "nothing calibrated yet", None)
        if value is None or isinstance(current, bool) or not isinstance(current, int | float):
            return TuneResult(knob, current, current, f"{knob}: no fit ({why})")
        direction = -1 if value < current else 1
        if value == current:
            return TuneResult(knob, current, current, f"{knob} {current} is its fit: {why}", settled=True)
        if direction > 0 and not fit_up:
            return TuneResult(
                knob, current, current, f"{knob} {current} is within its fit ({value}): {why}", settled=True
            )
        if knob == "gpu_memory_utilization":
            gap = abs(value - current)
            if gap < FIT_HYSTERESIS["down" if direction < 0 else "up"]:
                return TuneResult(
                    knob,
                    current,
                    current,
                    f"{knob} {current} is close enough to its fit ({value}): {why}",
                    settled=True,
                )
        wanted = value
    elif operation in ("step_down", "step_up"):
        direction = -1 if operation == "step_down" else 1
        wanted = (
            _ladder_step(ladder, current, direction) if ladder else _default_step(knob, current, direction)
        )
    elif operation in ("halve", "double"):
        if knob not in NUMERIC_TUNABLES:
            return TuneResult(knob, current, current, f"{knob} cannot be {operation}d")
        direction = -1 if operation == "halve" else 1
        wanted = current / 2 if operation == "halve" else current * 2
        wanted = max(1, int(wanted)) if knob in INTEGER_TUNABLES else _two_decimals(wanted)
    elif (delta := _delta(operation)) is not None:
        if knob not in NUMERIC_TUNABLES or not math.isfinite(delta):
            return TuneResult(knob, current, current, f"{knob} takes no delta {operation!r}")
        direction = -1 if delta < 0 else 1
        if knob == "gpu_memory_utilization":
            wanted = _two_decimals((round(current * 100) + round(delta * 100)) / 100)
        else:
            wanted = int(current + delta)
    else:
        wanted = operation
        if (
            isinstance(wanted, int | float)
            and not isinstance(wanted, bool)
            and isinstance(current, int | float)
        ):
            direction = -1 if wanted < current else 1
    raw = wanted
    if knob in NUMERIC_TUNABLES and isinstance(wanted, int | float) and not isinstance(wanted, bool):
        if not math.isfinite(wanted):
            return TuneResult(knob, current, current, f"{knob} {wanted!r} is not a finite number")
        raw = wanted
        wanted = _clamp(knob, wanted, bounds)  # clamp first: -8 from 8 is the lower bound
    problem = validate_value(knob, wanted)
    if problem is not None:
        return TuneResult(knob, current, current, problem)
    if knob not in NUMERIC_TUNABLES and wanted not in bounds:
        return TuneResult(
            knob, current, current, f"{knob} {wanted!r} is not among its allowed values {list(bounds)}"
        )
    after = _clamp(knob, wanted, bounds)
    numeric = knob in NUMERIC_TUNABLES
    if numeric and ((direction > 0 and after < current) or (direction < 0 and after > current)):
        # The engine runs outside its bounds (a person set it): a step never goes the other way.
        return TuneResult(
            knob,
            current,
            current,
            f"{knob} {current} is outside its bounds {list(bounds)}: "
            f"a step {'up' if direction > 0 else 'down'} would move it the other way",
        )
    if direction > 0 and after in failed:
        return TuneResult(
            knob,
            current,
            current,
            f"{knob} {after} failed recently: not stepped up to again",
            forbidden=(after,),
        )
    if after == current:
        edge = (
            "bound"
            if raw != after
            else ("ladder's end" if operation in ("step_down", "step_up") else "value")
        )
        return TuneResult(
            knob, current, current, f"{knob} is already at its {edge} ({current}): nothing to change"
        )
    clamped = " (clamped to its bounds)" if after != wanted else ""
    if operation == "fit" and raw != after and not (isinstance(raw, float) and round(raw, 3) == after):
        clamped = " (clamped to its bounds)"  # a fit's target lies outside them
    computed = f" (fit: {fit[1]})" if operation == "fit" and fit is not None else ""
    return TuneResult(
        knob,
        current,
        after,
        f"{knob} {current} → {after}{clamped}{computed}",
        prediction=prediction if not clamped else None,  # it was made for the unclamped value
    )


def _clamp(knob: str, value: Any, bounds: Sequence[Any]) -> Any:
    if knob not in NUMERIC_TUNABLES:
        return value  # checked against the allowed values already
    low, high = bounds[0], bounds[1]
    clamped = min(max(value, low), high)
    if knob in INTEGER_TUNABLES:
        return int(clamped)
    return round(clamped, 3)  # a fit's thousandths; the notches' hundredths stay as they are


def settings_diff(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{knob: (before, after)} for the knobs that differ."""
    return {
        knob: (before.get(knob), after.get(knob)) for knob in TUNABLES if before.get(knob) != after.get(knob)
    }


def shown(value: Any) -> str:
    """A knob's value for people: one left unset is vLLM's default, never ``None``."""
    return "default" if value is None else str(value)


def changes(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    """What differs, for people: ``["max_num_seqs 8→4", …]``, knobs sorted by name (an unset
    knob reads ``default``)."""
    return [
        f"{knob} {shown(before.get(knob))}→{shown(after.get(knob))}"
        for knob in sorted(set(before) | set(after))
        if before.get(knob) != after.get(knob)
    ]
