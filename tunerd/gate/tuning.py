"""How a policy's ``gate:`` action turns the gate's limits (DESIGN §9.1). Pure.

``gate: {KNOB: VALUE | step_down | step_up}`` for the four live limits, and
``target_fraction: fit``:

- ``target_fraction``: an absolute share of the pool in (0, 1]; steps of 0.05 in two-decimal
  arithmetic, never below 0.50 (a gate holding back half the pool has said what it can);
- ``long_threshold``: tokens ≥ 1; halve (not below 1,024) / double;
- ``long_lane``: ≥ 1; one fewer (not below 1) / one more;
- ``max_concurrency``: ≥ 0 (0: bounded by the pool only); down from 0 starts at the engine's
  ``max_num_seqs`` (vLLM's 256 when unset), then ``max(1, min(v − 1, ⌊0.75 v⌋))`` as the
  sequence notch does; up ``max(v + 1, ⌊1.25 v⌋)``, and 0 stays 0 (already unbounded).

``fit`` computes ``target_fraction`` from what the box shows (:func:`fit_fraction`): the KV
the engine really holds per token of need the gate admitted, scaled to the pool's ceiling.

A change that cannot move says why, as a tune does; nothing here talks to the gate.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tunerd.gate.admission import GATE_KNOBS

__all__ = ["FIT_CEILING", "GATE_OPERATIONS", "GateResult", "apply_gate", "fit_fraction", "gate_problem"]

GATE_OPERATIONS = ("step_down", "step_up", "fit")
#: the pool's usage a fitted gate aims at: the seed's line ("cache_usage over 0.85 for long:
#: lower max_num_seqs one notch") and the shipped saturation policy's threshold
FIT_CEILING = 0.85
FRACTION_STEP = 0.05
FRACTION_FLOOR = 0.50
THRESHOLD_FLOOR = 1024
VLLM_DEFAULT_MAX_NUM_SEQS = 256
_MAX_TOKENS = 2**31 - 1


@dataclass(frozen=True)
class GateResult:
    knob: str
    before: Any
    after: Any
    reason: str

    @property
    def changed(self) -> bool:
        return bool(self.after != self.before)


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def gate_problem(knob: str, operation: Any) -> str | None:
    """Why ``operation`` is not a valid ``gate:`` value for ``knob`` (None when it is)."""
    if knob not in GATE_KNOBS:
        return f"'{knob}' is not a gate limit (limits: {', '.join(GATE_KNOBS)})"
    if isinstance(operation, str):
        if operation == "fit" and knob != "target_fraction":
            return f"fit is computed for target_fraction only; {knob} takes a value, step_down or step_up"
        return (
            None
            if operation in GATE_OPERATIONS
            else f"expected a value, step_down, step_up or fit, got {operation!r}"
        )
    if knob == "target_fraction":
        numeric = isinstance(operation, int | float) and not isinstance(operation, bool)
        if not numeric or not 0 < operation <= 1 or math.isnan(operation):
            return f"target_fraction must be in (0, 1], got {operation!r}"
        return None
    if not _whole(operation):
        return f"{knob} takes whole numbers, got {operation!r}"
    low = 0 if knob == "max_concurrency" else 1
    if not low <= operation <= _MAX_TOKENS:
        return f"{knob} must be from {low} to {_MAX_TOKENS:,}, got {operation:,}"
    return None


def fit_fraction(
    in_flight_tokens: int | None,
    pool_tokens: int | None,
    kv_cache_usage: float | None,
    ceiling: float = FIT_CEILING,
) -> tuple[float | None, str]:
    """The ``target_fraction`` at which the pool's usage would sit at ``ceiling``, and why.

    The gate admits by need (prompt + ``max_tokens``); the engine holds what the requests
    really have (answers stop early; clients that bypass the gate add theirs). Their ratio —
    ``kv_cache_usage`` over the admitted need's share of the pool — is what the box shows;
    the fit is ``ceiling`` over it, in whole hundredths, from 0.50 (the step floor) to 1.0.
    None, with why, when nothing admitted or read gives the ratio."""
    if not pool_tokens or pool_tokens <= 0 or kv_cache_usage is None or not 0 < kv_cache_usage <= 1.5:
        return None, "no reading of the pool's usage to fit by"
    if not in_flight_tokens or in_flight_tokens <= 0:
        return None, "nothing admitted through the gate to fit by"
    need = in_flight_tokens / pool_tokens
    held_per_need = kv_cache_usage / need
    fitted = math.floor(ceiling / held_per_need * 100 + 1e-9) / 100
    fitted = min(1.0, max(FRACTION_FLOOR, fitted))
    why = (
        f"the pool {kv_cache_usage:.0%} used for {need:.0%} of it admitted: {ceiling:.0%} used at "
        f"{fitted:.2f}"
    )
    return fitted, why


def apply_gate(
    knob: str,
    operation: Any,
    current: Any,
    settings: Mapping[str, Any],
    fit: tuple[Any, str] | None = None,
) -> GateResult:
    """The limit ``knob`` after ``operation`` from ``current`` (the gate's live value);
    ``settings`` are the engine's (``max_num_seqs`` seeds a first concurrency cap); ``fit``
    is the computed value and why (:func:`fit_fraction`), for ``operation`` ``fit``."""
    if current is None:
        return GateResult(
            knob, None, None, f"gate {knob}: the gate's current value is not known (is it running?)"
        )
    if operation == "fit":
        value, why = fit if fit is not None else (None, "nothing to fit by")
        if value is None:
            return GateResult(knob, current, current, f"gate {knob} stays {current} ({why})")
        if value == current:
            return GateResult(knob, current, current, f"gate {knob} stays {current} (fit: {why})")
        return GateResult(knob, current, value, f"gate {knob} {current} → {value} (fit: {why})")
    if operation == "step_down":
        after = _down(knob, current, settings)
    elif operation == "step_up":
        after = _up(knob, current)
    else:
        after = operation
    if after == current:
        where = (
            "its floor"
            if operation == "step_down"
            else "its ceiling"
            if operation == "step_up"
            else "it already"
        )
        return GateResult(knob, current, current, f"gate {knob} stays {current} ({where})")
    return GateResult(knob, current, after, f"gate {knob} {current} → {after}")


def _down(knob: str, value: Any, settings: Mapping[str, Any]) -> Any:
    if knob == "target_fraction":
        return max(FRACTION_FLOOR, round(value - FRACTION_STEP, 2)) if value > FRACTION_FLOOR else value
    if knob == "long_threshold":
        return max(THRESHOLD_FLOOR, value // 2) if value > THRESHOLD_FLOOR else value
    if knob == "long_lane":
        return max(1, value - 1)
    if value == 0:
        seqs = settings.get("max_num_seqs")
        value = (
            seqs
            if isinstance(seqs, int) and not isinstance(seqs, bool) and seqs > 0
            else VLLM_DEFAULT_MAX_NUM_SEQS
        )
    return max(1, min(value - 1, math.floor(0.75 * value)))


def _up(knob: str, value: Any) -> Any:
    if knob == "target_fraction":
        return min(1.0, round(value + FRACTION_STEP, 2))
    if knob == "long_threshold":
        return min(_MAX_TOKENS, value * 2)
    if knob == "long_lane":
        return value + 1
    return 0 if value == 0 else max(value + 1, math.floor(1.25 * value))
