"""The box, measured: an engine's four bills as one start of it showed them, what other
settings would give on the same box, and the moves computed from that. Pure.

An :class:`Observation` is what tunerd saw of one engine process at one settings version:

- from the engine's start-up log: the weights (``Model loading took``), the KV pool
  (``Available KV cache memory``, ``GPU KV cache size``), the CUDA graph estimate;
- from the GPU: the CUDA-visible total, the engine's memory when it first answered (before
  any load), the most it held since — the level its caching allocator's ratchet actually
  reached under load — and the most the other processes on its GPU held;
- from a CUDA OOM's text: what the engine held plus what it tried to allocate when it died.

:func:`calibrate` turns it into :class:`Calibration`, the bills of *this* box. vLLM sizes its
pool as ``ceil(total × utilization) − non-KV``, so the log gives the non-KV bill inside the
budget exactly (to the log's 0.01 GiB); weights and graphs are printed; the activation peak
vLLM profiled is the rest less non-torch memory (the planner's 64 MiB, the one prior left);
what the engine holds outside the budget (its CUDA context) is its first reading less the
weights, graphs, non-torch memory and the pool it allocated. The number that decides safety
is observed directly: ``over_budget_bytes``, the most the engine held above its budget (its
context plus the allocator's creep above the profiled peak), or what an OOM said it needed.

:func:`predict` says what other settings would give on the box: the pool moves byte for byte
with the budget; the activation peak and the creep above it scale with
``max_num_batched_tokens``; the KV bytes per token with the dtype; the graph pool with the
captured batch size. :func:`fits` computes the ``fit`` targets a ``tune`` may ask for:

- ``gpu_memory_utilization``: the highest (to 0.001) whose budget leaves the observed peak
  above it, the neighbours at their most, the allocator's further creep (``creep`` × the
  activation peak: the ratchet keeps growing as step shapes vary) and ``margin`` free;
- ``max_num_batched_tokens``: the largest power-of-two multiple of the current value within
  the bounds whose peak (and creep) fits the same room at the current utilization;
- ``max_num_seqs``: not computed yet (it needs the request lengths the engine serves).

Each target comes with the predicted pool, so the decision and its expected outcome are
recorded together; after the restart the log tells the real pool and the error is kept.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from tunerd.planner.bills import (
    BLOCK_SIZE,
    CUDA_GRAPH_FIXED_BYTES,
    CUDA_GRAPH_MAX_CAPTURE,
    KV_DTYPE_WORDS,
    NON_TORCH_BYTES,
    kv_dtype_bytes,
)
from tunerd.units import GIB, MIB

__all__ = [
    "DEFAULT_CREEP",
    "DEFAULT_MARGIN_BYTES",
    "FIT_TUNABLES",
    "Calibration",
    "Fit",
    "Observation",
    "Prediction",
    "calibrate",
    "calibrated_plan",
    "fits",
    "predict",
    "render_calibrated",
]

#: What a ``fit`` leaves free besides the observed peak and the neighbours.
DEFAULT_MARGIN_BYTES = 256 * MIB
#: The share of the activation peak kept free for the allocator's further creep.
DEFAULT_CREEP = 0.3
#: Neighbours an observation keeps by PID (the largest).
MAX_NEIGHBOURS = 16
#: The knobs a ``tune`` may set to ``fit``.
FIT_TUNABLES = ("gpu_memory_utilization", "max_num_batched_tokens", "max_num_seqs")
#: vLLM's defaults when the settings do not say (0.33, a 24 GiB card).
_DEFAULTS = {"gpu_memory_utilization": 0.92, "max_num_batched_tokens": 2048, "max_num_seqs": 256}


def _gib_bytes(gib: float | None) -> int | None:
    return None if gib is None else round(gib * GIB)


@dataclass(frozen=True)
class Observation:
    """What one engine process at one settings version showed (bytes; None: not seen)."""

    engine: str
    version: int
    pid: int
    settings: Mapping[str, Any]
    time: float
    cuda_total_bytes: int | None = None
    weights_bytes: int | None = None
    kv_available_bytes: int | None = None
    kv_cache_tokens: int | None = None
    cuda_graph_bytes: int | None = None
    start_bytes: int | None = None  # the least the engine held while it answered (its start)
    peak_bytes: int | None = None  # the most it held
    others_peak_bytes: int | None = None  # the most the other processes on its GPU held
    #: each neighbour at its most: PID (as text) → {"name", "peak_bytes"}, the largest kept
    neighbours: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    oom_need_bytes: int | None = None  # at a CUDA OOM: what it held plus what it tried to take
    predicted_kv_tokens: int | None = None  # what tunerd predicted before starting it
    #: the least outside-the-budget memory an earlier start of the engine showed: a start
    #: that met traffic at once never reads as bare as its context, so the box's figure carries
    outside_floor_bytes: int | None = None

    @classmethod
    def from_figures(
        cls,
        *,
        engine: str,
        version: int,
        pid: int,
        settings: Mapping[str, Any],
        time: float,
        cuda_total_bytes: int | None,
        weights_gib: float | None,
        kv_available_gib: float | None,
        kv_cache_tokens: int | None,
        cuda_graph_gib: float | None,
    ) -> Observation:
        return cls(
            engine=engine,
            version=version,
            pid=pid,
            settings=dict(settings),
            time=time,
            cuda_total_bytes=cuda_total_bytes,
            weights_bytes=_gib_bytes(weights_gib),
            kv_available_bytes=_gib_bytes(kv_available_gib),
            kv_cache_tokens=kv_cache_tokens,
            cuda_graph_bytes=_gib_bytes(cuda_graph_gib) or 0,
        )

    def seen(
        self,
        engine_bytes: int | None,
        others_bytes: int | None,
        now: float,
        neighbours: Mapping[int, tuple[str, int]] | None = None,
    ) -> Observation:
        """With one more GPU reading of the engine and its neighbours (``neighbours``: PID →
        (name, bytes) of each other process listed)."""
        changed: dict[str, Any] = {}
        if neighbours:
            merged = {pid: dict(item) for pid, item in self.neighbours.items()}
            for pid, (name, used) in neighbours.items():
                known = merged.get(str(pid))
                if known is None or used > int(known.get("peak_bytes", 0)):
                    merged[str(pid)] = {"name": name[:64], "peak_bytes": used}
            largest = sorted(merged.items(), key=lambda item: -int(item[1]["peak_bytes"]))[:MAX_NEIGHBOURS]
            if dict(largest) != self.neighbours:
                changed["neighbours"] = dict(largest)
        if engine_bytes is not None:
            if self.start_bytes is None or engine_bytes < self.start_bytes:
                changed["start_bytes"] = engine_bytes
            if self.peak_bytes is None or engine_bytes > self.peak_bytes:
                changed["peak_bytes"] = engine_bytes
        if others_bytes is not None and (
            self.others_peak_bytes is None or others_bytes > self.others_peak_bytes
        ):
            changed["others_peak_bytes"] = others_bytes
        return replace(self, time=now, **changed) if changed else self

    def died_of_oom(self, own_bytes: int | None, tried_bytes: int | None, now: float) -> Observation:
        """With what a CUDA OOM's text said the engine needed when it died."""
        if own_bytes is None or tried_bytes is None:
            return self
        need = own_bytes + tried_bytes
        if self.oom_need_bytes is not None and self.oom_need_bytes >= need:
            return self
        return replace(self, oom_need_bytes=need, time=now)

    def differs(self, other: Observation | None, by: int = 16 * MIB) -> bool:
        """Worth writing down again: new, or a peak or need moved by ``by`` or more."""
        if other is None or (other.version, other.pid) != (self.version, self.pid):
            return True
        if set(self.neighbours) != set(other.neighbours):
            return True
        for name in ("peak_bytes", "others_peak_bytes", "oom_need_bytes", "start_bytes"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if (mine is None) != (theirs is None) or (mine is not None and abs(mine - theirs) >= by):
                return True
        return self.predicted_kv_tokens != other.predicted_kv_tokens

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["settings"] = dict(self.settings)
        data["neighbours"] = {pid: dict(item) for pid, item in self.neighbours.items()}
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Observation | None:
        """An observation read back from the state; None when it is not one (an older or
        damaged record is skipped, never raised)."""
        try:
            known = {name: data[name] for name in cls.__dataclass_fields__ if name in data}
            observation = cls(**known)
        except (TypeError, KeyError):
            return None
        ints = (
            "cuda_total_bytes",
            "weights_bytes",
            "kv_available_bytes",
            "kv_cache_tokens",
            "cuda_graph_bytes",
            "start_bytes",
            "peak_bytes",
            "others_peak_bytes",
            "oom_need_bytes",
            "predicted_kv_tokens",
            "outside_floor_bytes",
        )
        for name in ints:
            value = getattr(observation, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                return None
        neighbours = observation.neighbours
        if not isinstance(neighbours, Mapping) or not all(
            isinstance(item, Mapping) and isinstance(item.get("peak_bytes"), int)
            for item in neighbours.values()
        ):
            return None
        return observation if isinstance(data.get("settings"), Mapping) else None


@dataclass(frozen=True)
class Calibration:
    """One box's bills for one engine at one settings version, in bytes."""

    settings: Mapping[str, Any]
    cuda_total_bytes: int
    budget_bytes: int
    weights_bytes: int
    kv_pool_bytes: int
    num_blocks: int
    block_bytes: int
    cuda_graph_bytes: int
    activation_bytes: int  # the peak vLLM profiled (the rest of the non-KV bill less non-torch)
    non_torch_bytes: int  # the planner's prior: not separable from the activations in the log
    outside_budget_bytes: int | None  # CUDA context and the like: the first reading's excess
    over_budget_bytes: int | None  # the most held above the budget (or an OOM's need)
    others_bytes: int  # the neighbours at their most
    observed_peak_bytes: int | None

    @property
    def creep_bytes(self) -> int | None:
        """The allocator's creep above the profiled peak seen so far."""
        if self.over_budget_bytes is None or self.outside_budget_bytes is None:
            return None
        return max(0, self.over_budget_bytes - self.outside_budget_bytes)

    @property
    def headroom_bytes(self) -> int | None:
        """What the GPU had left at the engine's and the neighbours' observed worst."""
        if self.over_budget_bytes is None:
            return None
        return self.cuda_total_bytes - self.budget_bytes - self.over_budget_bytes - self.others_bytes

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["settings"] = dict(self.settings)
        data["creep_bytes"] = self.creep_bytes
        data["headroom_bytes"] = self.headroom_bytes
        return data


def _utilization(settings: Mapping[str, Any]) -> float:
    return float(settings.get("gpu_memory_utilization", _DEFAULTS["gpu_memory_utilization"]))


def _int_setting(settings: Mapping[str, Any], knob: str) -> int:
    return int(settings.get(knob, _DEFAULTS[knob]))


def _kv_bytes(settings: Mapping[str, Any]) -> int:
    word = KV_DTYPE_WORDS.get(str(settings.get("kv_cache_dtype", "auto")), "auto")
    return kv_dtype_bytes(word)


def calibrate(observation: Observation) -> Calibration | None:
    """The bills of the box from one observation; None until the log and the GPU have said
    enough (the start-up figures, the CUDA total), or when the pool was sized in bytes."""
    o = observation
    if o.settings.get("kv_cache_memory_bytes") is not None:
        return None  # vLLM skipped the profile: the log's pool says nothing of the rest
    total, weights, available = o.cuda_total_bytes, o.weights_bytes, o.kv_available_bytes
    if total is None or weights is None or available is None or o.kv_cache_tokens is None:
        return None
    blocks = o.kv_cache_tokens // BLOCK_SIZE
    if blocks <= 0 or available <= 0:
        return None
    budget = math.ceil(total * _utilization(o.settings))
    graphs = o.cuda_graph_bytes or 0
    block_bytes = max(1, available // blocks)
    inside = budget - available - weights  # activations + non-torch + graphs
    activation = max(0, inside - graphs - NON_TORCH_BYTES)
    outside = None
    if o.start_bytes is not None:
        outside = max(0, o.start_bytes - weights - graphs - NON_TORCH_BYTES - blocks * block_bytes)
    if o.outside_floor_bytes is not None:
        outside = o.outside_floor_bytes if outside is None else min(outside, o.outside_floor_bytes)
    over = None
    if o.peak_bytes is not None:
        over = o.peak_bytes - budget
    if o.oom_need_bytes is not None:
        need = o.oom_need_bytes - budget
        over = need if over is None else max(over, need)
    return Calibration(
        settings=dict(o.settings),
        cuda_total_bytes=total,
        budget_bytes=budget,
        weights_bytes=weights,
        kv_pool_bytes=available,
        num_blocks=blocks,
        block_bytes=block_bytes,
        cuda_graph_bytes=graphs,
        activation_bytes=activation,
        non_torch_bytes=NON_TORCH_BYTES,
        outside_budget_bytes=outside,
        over_budget_bytes=over,
        others_bytes=o.others_peak_bytes or 0,
        observed_peak_bytes=o.peak_bytes,
    )


@dataclass(frozen=True)
class Prediction:
    """What ``settings`` would give on the calibrated box."""

    settings: Mapping[str, Any]
    budget_bytes: int
    kv_pool_bytes: int
    num_blocks: int
    kv_cache_tokens: int
    max_concurrency: float | None  # requests of max_model_len the pool holds
    activation_bytes: int
    over_budget_bytes: int | None  # the peak above the budget to expect (without more creep)
    headroom_bytes: int | None  # what the GPU keeps free at that peak, the neighbours at theirs

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["settings"] = dict(self.settings)
        return data


def _capture(max_num_seqs: int) -> int:
    return min(2 * max_num_seqs, CUDA_GRAPH_MAX_CAPTURE)


def predict(calibration: Calibration, settings: Mapping[str, Any]) -> Prediction | None:
    """The pool, the peak and the headroom ``settings`` would give on the calibrated box;
    None for a pool sized in bytes (``kv_cache_memory_bytes``)."""
    c = calibration
    if settings.get("kv_cache_memory_bytes") is not None:
        return None
    budget = math.ceil(c.cuda_total_bytes * _utilization(settings))
    tokens_now = _int_setting(c.settings, "max_num_batched_tokens")
    tokens_then = _int_setting(settings, "max_num_batched_tokens")
    scale = tokens_then / tokens_now if tokens_now > 0 else 1.0
    activation = round(c.activation_bytes * scale)
    graphs = c.cuda_graph_bytes
    seqs_now, seqs_then = _int_setting(c.settings, "max_num_seqs"), _int_setting(settings, "max_num_seqs")
    if graphs and seqs_now != seqs_then and _capture(seqs_now):
        fixed = min(graphs, CUDA_GRAPH_FIXED_BYTES)
        graphs = fixed + round((graphs - fixed) * _capture(seqs_then) / _capture(seqs_now))
    if settings.get("enforce_eager"):
        graphs = 0
    non_kv = c.weights_bytes + activation + c.non_torch_bytes + graphs
    available = budget - non_kv
    block_bytes = max(1, c.block_bytes * _kv_bytes(settings) // _kv_bytes(c.settings))
    blocks = max(0, available // block_bytes)
    max_len = settings.get("max_model_len")
    concurrency = None
    if isinstance(max_len, int) and max_len > 0:
        concurrency = blocks / math.ceil(max_len / BLOCK_SIZE)
    over = headroom = None
    if c.over_budget_bytes is not None:
        # Above the budget the engine holds its context and the allocator's creep above the
        # profiled peak; the creep grows with the step. Before the first large step the
        # engine sits below its budget (the profiled peak is not held yet): that is no peak.
        outside = c.outside_budget_bytes if c.outside_budget_bytes is not None else c.over_budget_bytes
        over = outside + round((c.creep_bytes or 0) * scale)
        headroom = c.cuda_total_bytes - budget - over - c.others_bytes
    return Prediction(
        settings=dict(settings),
        budget_bytes=budget,
        kv_pool_bytes=max(0, available),
        num_blocks=blocks,
        kv_cache_tokens=blocks * BLOCK_SIZE,
        max_concurrency=concurrency,
        activation_bytes=activation,
        over_budget_bytes=over,
        headroom_bytes=headroom,
    )


@dataclass(frozen=True)
class Fit:
    """A computed target for one knob: the value (None: none could be computed), why, and
    what it is predicted to give."""

    knob: str
    value: Any
    reason: str
    prediction: Prediction | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "knob": self.knob,
            "value": self.value,
            "reason": self.reason,
            "prediction": None if self.prediction is None else self.prediction.to_dict(),
        }


def _allowance(c: Calibration, prediction: Prediction, creep: float) -> int:
    """The creep still to come: up to ``creep`` × the activation peak in all, less what was
    seen already (it is in the predicted peak)."""
    seen = round((c.creep_bytes or 0) * prediction.activation_bytes / max(1, c.activation_bytes))
    return max(0, round(creep * prediction.activation_bytes) - seen)


def _room(c: Calibration, prediction: Prediction, creep: float, margin: int) -> int | None:
    """What the GPU keeps free at the predicted peak once the creep still to come and the
    margin are taken too (negative: it does not fit)."""
    if prediction.headroom_bytes is None:
        return None
    return prediction.headroom_bytes - _allowance(c, prediction, creep) - margin


def _fits_one_request(prediction: Prediction, settings: Mapping[str, Any]) -> bool:
    max_len = settings.get("max_model_len")
    if not isinstance(max_len, int) or max_len <= 0:
        return prediction.num_blocks > 0
    return prediction.num_blocks >= math.ceil(max_len / BLOCK_SIZE)


def _fit_utilization(
    c: Calibration, settings: Mapping[str, Any], bounds: Sequence[Any] | None, creep: float, margin: int
) -> Fit:
    knob = "gpu_memory_utilization"
    probe = predict(c, settings)
    if probe is None or probe.over_budget_bytes is None:
        return Fit(knob, None, "no peak observed under load yet: nothing to fit to")
    allowance = _allowance(c, probe, creep)
    need = probe.over_budget_bytes + allowance + margin + c.others_bytes
    milli = math.floor((c.cuda_total_bytes - need) / c.cuda_total_bytes * 1000)
    while milli > 0 and math.ceil(c.cuda_total_bytes * milli / 1000) + need > c.cuda_total_bytes:
        milli -= 1
    if bounds is not None and len(bounds) == 2:
        milli = max(min(milli, round(float(bounds[1]) * 1000)), round(float(bounds[0]) * 1000))
    if milli <= 0:
        return Fit(knob, None, "the observed peak leaves no utilization that fits")
    value = milli / 1000
    wanted = {**settings, knob: value}
    prediction = predict(c, wanted)
    assert prediction is not None
    if not _fits_one_request(prediction, wanted):
        return Fit(knob, None, f"at {value} the pool would not hold one max_model_len request", prediction)
    room = _room(c, prediction, creep, margin)
    why = (
        f"highest utilization leaving the observed peak ({_gib(probe.over_budget_bytes)} over budget), "
        f"the neighbours ({_gib(c.others_bytes)}), creep still to come ({_gib(allowance)}) and "
        f"{_gib(margin)} free: {value} → KV pool {prediction.kv_cache_tokens:,} tokens"
    )
    if room is not None and room < 0:
        why += f" (clamped to its bounds: {_gib(-room)} short)"
    return Fit(knob, value, why, prediction)


def _fit_batched_tokens(
    c: Calibration, settings: Mapping[str, Any], bounds: Sequence[Any] | None, creep: float, margin: int
) -> Fit:
    knob = "max_num_batched_tokens"
    current = _int_setting(settings, knob)
    if c.over_budget_bytes is None:
        return Fit(knob, None, "no peak observed under load yet: nothing to fit to")
    low, high = (int(bounds[0]), int(bounds[1])) if bounds is not None and len(bounds) == 2 else (1, current)
    candidates = sorted(
        {value for k in range(-8, 9) if low <= (value := int(current * 2.0**k)) <= high} | {low}, reverse=True
    )
    for value in candidates:
        wanted = {**settings, knob: value}
        prediction = predict(c, wanted)
        if prediction is None:
            return Fit(knob, None, "the pool is sized in bytes: nothing to fit")
        room = _room(c, prediction, creep, margin)
        if room is not None and room >= 0 and _fits_one_request(prediction, wanted):
            return Fit(
                knob,
                value,
                f"largest step whose activation peak ({_gib(prediction.activation_bytes)}) and creep fit "
                f"with {_gib(margin)} to spare: {value} → KV pool {prediction.kv_cache_tokens:,} tokens",
                prediction,
            )
    return Fit(knob, None, f"no step from {low} to {high} fits the room at this utilization")


def _fit_to_free(
    free_at_start: tuple[int, int],
    calibration: Calibration | None,
    bounds: Sequence[Any] | None,
    creep: float,
    margin: int,
) -> Fit:
    """The highest utilization whose budget the free memory a refused start saw would hold,
    with the creep to come (of the calibrated activation peak, if one was seen) and the margin
    left over: vLLM refuses a start when free memory is below ``ceil(total × utilization)``."""
    knob = "gpu_memory_utilization"
    free, total = free_at_start
    if calibration is not None:
        total = calibration.cuda_total_bytes
    if total <= 0:
        return Fit(knob, None, "the refused start gave no total")
    allowance = round(creep * calibration.activation_bytes) if calibration is not None else 0
    milli = math.floor((free - margin - allowance) / total * 1000)
    while milli > 0 and math.ceil(total * milli / 1000) + margin + allowance > free:
        milli -= 1
    if bounds is not None and len(bounds) == 2:
        milli = max(min(milli, round(float(bounds[1]) * 1000)), round(float(bounds[0]) * 1000))
    if milli <= 0:
        return Fit(knob, None, f"only {_gib(free)} was free at the start: no utilization fits")
    return Fit(
        knob,
        milli / 1000,
        f"the start found {_gib(free)} of {_gib(total)} free: {milli / 1000} leaves the creep to come "
        f"({_gib(allowance)}) and {_gib(margin)}",
    )


def fits(
    observation: Observation | None,
    settings: Mapping[str, Any],
    bounds: Mapping[str, Sequence[Any]],
    *,
    creep: float = DEFAULT_CREEP,
    margin: int = DEFAULT_MARGIN_BYTES,
    free_at_start: tuple[int, int] | None = None,
) -> dict[str, Fit]:
    """The ``fit`` target of each knob in :data:`FIT_TUNABLES` for an engine running
    ``settings``, from the latest observation of it (None: nothing calibrated yet) and, after
    a start refused for free memory, the (free, total) bytes it saw — the utilization fits the
    lower of the two."""
    calibration = calibrate(observation) if observation is not None else None
    start = None
    if free_at_start is not None:
        start = _fit_to_free(free_at_start, calibration, bounds.get("gpu_memory_utilization"), creep, margin)
    if calibration is None:
        why = "nothing calibrated yet (no start-up figures and GPU readings of this engine)"
        found = {knob: Fit(knob, None, why) for knob in FIT_TUNABLES}
        if start is not None:
            found["gpu_memory_utilization"] = start
        return found
    utilization = _fit_utilization(calibration, settings, bounds.get("gpu_memory_utilization"), creep, margin)
    if (
        start is not None
        and start.value is not None
        and (utilization.value is None or start.value < utilization.value)
    ):
        utilization = start
    return {
        "gpu_memory_utilization": utilization,
        "max_num_batched_tokens": _fit_batched_tokens(
            calibration, settings, bounds.get("max_num_batched_tokens"), creep, margin
        ),
        "max_num_seqs": Fit("max_num_seqs", None, "not computed yet: needs the request lengths served"),
    }


def _gib(value: int) -> str:
    return f"{value / GIB:.2f} GiB"


#: The utilizations `tunerd plan --calibrated` predicts when none is asked for.
PLAN_UTILIZATIONS = (0.80, 0.85, 0.88, 0.90, 0.92, 0.94, 0.96)


def calibrated_plan(
    observation: Observation,
    wanted: Sequence[Mapping[str, Any]],
    bounds: Mapping[str, Sequence[Any]],
    *,
    creep: float = DEFAULT_CREEP,
    margin: int = DEFAULT_MARGIN_BYTES,
) -> dict[str, Any] | None:
    """``tunerd plan --calibrated``: the box's bills from ``observation``, what each of the
    ``wanted`` settings would give on it, and the ``fit`` targets (None: not calibrated)."""
    calibration = calibrate(observation)
    if calibration is None:
        return None
    predictions = [predict(calibration, settings) for settings in wanted]
    return {
        "engine": observation.engine,
        "version": observation.version,
        "pid": observation.pid,
        "observed_at": observation.time,
        "bills": calibration.to_dict(),
        "predictions": [p.to_dict() for p in predictions if p is not None],
        "fits": {
            knob: fit.to_dict()
            for knob, fit in fits(
                observation, calibration.settings, bounds, creep=creep, margin=margin
            ).items()
        },
    }


def render_calibrated(plan: Mapping[str, Any]) -> str:
    """The calibrated plan for a person: the bills, the predictions table, the fits."""
    bills = plan["bills"]
    settings = bills["settings"]

    def size(value: int | None) -> str:
        return "?" if value is None else _gib(value)

    lines = [
        f"{plan['engine']}: the box as its start showed it (version {plan['version']}, pid {plan['pid']}), "
        f"at {', '.join(f'{k} {v}' for k, v in sorted(settings.items()))}",
        f"  GPU total {size(bills['cuda_total_bytes'])}; budget {size(bills['budget_bytes'])}",
        f"  weights {size(bills['weights_bytes'])} · KV pool {size(bills['kv_pool_bytes'])} "
        f"({bills['num_blocks'] * BLOCK_SIZE:,} tokens) · activations {size(bills['activation_bytes'])}",
        f"  CUDA graphs {size(bills['cuda_graph_bytes'])} · non-torch {size(bills['non_torch_bytes'])} "
        "(assumed)",
        f"  outside the budget {size(bills['outside_budget_bytes'])} · peak over the budget "
        f"{size(bills['over_budget_bytes'])} · neighbours {size(bills['others_bytes'])} · headroom at the "
        f"worst {size(bills['headroom_bytes'])}",
        "",
        f"  {'utilization':>11}  {'batched':>7}  {'KV pool (tokens)':>16}  {'concurrency':>11}  "
        "headroom at the peak",
    ]
    for prediction in plan["predictions"]:
        wanted = prediction["settings"]
        concurrency = prediction["max_concurrency"]
        times = "?" if concurrency is None else f"{concurrency:.2f}x"
        utilization = wanted.get("gpu_memory_utilization", "?")
        batched = wanted.get("max_num_batched_tokens", "?")
        lines.append(
            f"  {utilization:>11}  {batched:>7}  {prediction['kv_cache_tokens']:>16,}  {times:>11}  "
            f"{size(prediction['headroom_bytes'])}"
        )
    lines.append("")
    for knob, fit in plan["fits"].items():
        value = "no fit" if fit["value"] is None else fit["value"]
        lines.append(f"  fit {knob}: {value} — {fit['reason']}")
    return "\n".join(lines) + "\n"
