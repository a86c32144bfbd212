"""Right-sizing from the workload: what each of vLLM's sizing flags should be, from what the
engine served (its request histograms) and what the box showed (calibration). Pure.

Like a vertical pod autoscaler's recommendation, each knob gets a ``target``, a ``lower`` and an
``upper`` bound, the ``reason`` and the KV pool the target is predicted to give:

- ``max_model_len``: no lower than the longest request served (prompt + generated, to the
  histograms' bucket bounds), the target the 99.9th percentile rounded up to 1,024 tokens,
  never above the current value (a longer one only costs pool);
- ``max_num_seqs``: the requests the pool holds at once — the upper bound at the mean
  request's length (the histograms' sums are exact), the target at the 90th percentile's, the
  lower bound at the 95th's (none of them preempted); when requests were preempted the target
  is the lower bound;
- ``gpu_memory_utilization`` and ``max_num_batched_tokens``: their computed fits on the
  calibrated box (:mod:`tunerd.planner.calibration`), the current value kept when nothing is
  calibrated;
- ``kv_cache_dtype``: ``fp8`` when the 16-bit pool would not hold the target number of
  95th-percentile requests (fp8 halves the bytes a token; vLLM 0.33 takes it on every card,
  natively on Ada and Hopper).

Quantiles are the upper bounds of the buckets that hold them, so a recommendation is never
sized below what was served. With fewer than :data:`MIN_REQUESTS` requests seen the sizes are
not recommended (too little to go on) and say so.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tunerd.planner.bills import BLOCK_SIZE
from tunerd.planner.calibration import (
    DEFAULT_CREEP,
    DEFAULT_MARGIN_BYTES,
    Fit,
    Observation,
    calibrate,
    fits,
    predict,
)

__all__ = [
    "MIN_REQUESTS",
    "Advice",
    "Workload",
    "advice_to_dict",
    "advise",
    "materially_different",
    "render_advice",
    "seqs_fit",
]

#: Requests seen before the request-length knobs are recommended.
MIN_REQUESTS = 20
#: ``max_model_len`` targets are rounded up to this many tokens.
MODEL_LEN_STEP = 1024


@dataclass(frozen=True)
class Workload:
    """What the engine served, as quantiles (tokens; None: not seen)."""

    requests: float
    prompt: Mapping[float, float | None]  # quantile → tokens
    generation: Mapping[float, float | None]
    preempted_requests: float = 0.0  # preemptions of finished requests (at most one a request)
    queue_p95_seconds: float | None = None
    #: the mean request's tokens, prompt + generated (the histograms' sums are exact)
    mean_length: int | None = None

    @classmethod
    def from_histograms(cls, found: Mapping[str, Any]) -> Workload:
        """From :func:`tunerd.sources.vllm_metrics.histograms`' families."""
        prompt = found.get("vllm:request_prompt_tokens")
        generation = found.get("vllm:request_generation_tokens")
        preemptions = found.get("vllm:request_num_preemptions")
        queue = found.get("vllm:request_queue_time_seconds")
        quantiles = (0.5, 0.9, 0.95, 0.999, 1.0)
        # vLLM's first bucket is le=1, so the sum says it: preemptions of the finished requests
        preempted = min(preemptions.total, preemptions.count) if preemptions is not None else 0.0
        mean = None
        if (
            prompt is not None
            and generation is not None
            and min(prompt.count, generation.count) > 0 < prompt.total
        ):
            mean = round(prompt.total / prompt.count + generation.total / generation.count)
        return cls(
            mean_length=mean,
            requests=prompt.count if prompt is not None else 0.0,
            prompt={q: prompt.quantile(q) if prompt is not None else None for q in quantiles},
            generation={q: generation.quantile(q) if generation is not None else None for q in quantiles},
            preempted_requests=preempted,
            queue_p95_seconds=queue.quantile(0.95) if queue is not None else None,
        )

    def length(self, q: float) -> int | None:
        """A request's tokens (prompt + generated) at quantile ``q``; None when unknown or past
        the histograms' last bound."""
        prompt, generated = self.prompt.get(q), self.generation.get(q)
        if prompt is None or generated is None or math.isinf(prompt) or math.isinf(generated):
            return None
        return int(prompt + generated)


@dataclass(frozen=True)
class Advice:
    knob: str
    current: Any
    target: Any
    lower: Any
    upper: Any
    reason: str
    predicted_kv_cache_tokens: int | None = None


def advice_to_dict(advice: Sequence[Advice]) -> dict[str, dict[str, Any]]:
    """``tunerd advise --json``'s per-knob block (DESIGN §9.2: target, lower, upper, reason and
    the predicted pool)."""
    return {
        item.knob: {
            "current": item.current,
            "target": item.target,
            "lower": item.lower,
            "upper": item.upper,
            "reason": item.reason,
            "predicted_kv_cache_tokens": item.predicted_kv_cache_tokens,
        }
        for item in advice
    }


def _requests(count: int) -> str:
    return f"{count} request" if count == 1 else f"{count} requests"


def _round_up(tokens: int, step: int = MODEL_LEN_STEP) -> int:
    return -(-tokens // step) * step


def advise(
    settings: Mapping[str, Any],
    workload: Workload,
    *,
    pool_tokens: int | None,
    observation: Observation | None = None,
    bounds: Mapping[str, Sequence[Any]] | None = None,
    creep: float = DEFAULT_CREEP,
    margin: int = DEFAULT_MARGIN_BYTES,
    min_requests: int = MIN_REQUESTS,
    block_size: int = BLOCK_SIZE,
) -> list[Advice]:
    """The recommendation for each sizing knob of an engine running ``settings`` whose pool
    holds ``pool_tokens`` (None: unknown) in blocks of ``block_size`` and served ``workload``."""
    bounds = bounds or {}
    calibration = calibrate(observation) if observation is not None else None
    found = fits(observation, settings, bounds, creep=creep, margin=margin)
    advice: list[Advice] = []
    enough = workload.requests >= min_requests
    few = f"only {workload.requests:.0f} requests seen (at least {min_requests} before sizing to them)"

    def pool_at(changed: Mapping[str, Any]) -> int | None:
        if calibration is None:
            return None
        prediction = predict(calibration, {**settings, **changed})
        return None if prediction is None else prediction.kv_cache_tokens

    # -- utilization and the step: the calibrated box's fits -------------------------------
    for knob in ("gpu_memory_utilization", "max_num_batched_tokens"):
        current = settings.get(knob)
        fit = found[knob]
        if fit.value is None:
            advice.append(
                Advice(knob, current, current, current, current, f"kept: {fit.reason}", pool_at({}))
            )
            continue
        if knob == "gpu_memory_utilization":
            lower = round(max(0.05, fit.value - 0.02), 3)
        else:
            lower = min(fit.value, 2048)
        advice.append(
            Advice(knob, current, fit.value, lower, fit.value, fit.reason, pool_at({knob: fit.value}))
        )
    target_utilization = advice[0].target
    pool = pool_at({"gpu_memory_utilization": target_utilization}) or pool_tokens

    # -- max_model_len: what was served ----------------------------------------------------
    current_len = settings.get("max_model_len")
    cap = current_len if isinstance(current_len, int) and current_len > 0 else None

    def length(q: float) -> int | None:
        """At quantile ``q``, no longer than max_model_len (the buckets' bounds overshoot)."""
        found = workload.length(q)
        return found if found is None or cap is None else min(found, cap)

    longest, tail = length(1.0), length(0.999)
    if not enough or longest is None or tail is None:
        why = few if not enough else "request lengths past the histograms' last bound: not sized"
        advice.append(
            Advice("max_model_len", current_len, current_len, current_len, current_len, f"kept: {why}")
        )
    else:
        target = _round_up(max(tail, longest))
        upper = current_len if isinstance(current_len, int) else target
        target = min(target, upper)
        changed = {"max_model_len": target}
        advice.append(
            Advice(
                "max_model_len",
                current_len,
                target,
                min(longest, target),
                upper,
                f"the longest request served held at most {longest:,} tokens (99.9 %: {tail:,}; the "
                f"histograms' bucket bounds); a longer max_model_len only makes the pool hold fewer",
                pool_at(changed),
            )
        )

    # -- max_num_seqs: what the pool holds ---------------------------------------------------
    current_seqs = settings.get("max_num_seqs")
    p90, p95 = length(0.9), length(0.95)
    median = workload.mean_length if workload.mean_length is not None else length(0.5)
    if median is not None and cap is not None:
        median = min(median, cap)
    if not enough or pool is None or None in (median, p90, p95):
        why = few if not enough else "the pool or the request lengths are unknown"
        advice.append(
            Advice("max_num_seqs", current_seqs, current_seqs, current_seqs, current_seqs, f"kept: {why}")
        )
    else:
        assert median is not None
        assert p90 is not None
        assert p95 is not None

        usable = pool - block_size  # vLLM keeps one block of the pool back (the null block)

        def held(length: int) -> int:
            return max(1, usable // (math.ceil(max(1, length) / block_size) * block_size))

        lower, target, upper = held(p95), held(p90), held(median)
        why = (
            f"the pool ({pool:,} tokens) holds {_requests(upper)} of the mean length ({median:,} tokens), "
            f"{target} of the 90th percentile's ({p90:,}), {lower} of the 95th's ({p95:,})"
        )
        if workload.preempted_requests > 0:
            target = lower
            why += f"; requests were preempted ({workload.preempted_requests:.0f}): the 95th's"
        advice.append(Advice("max_num_seqs", current_seqs, target, lower, upper, why, pool))

    # -- the KV dtype: does the 16-bit pool hold the target concurrency? ---------------------
    dtype = str(settings.get("kv_cache_dtype", "auto"))
    seqs = advice[-1].target if isinstance(advice[-1].target, int) else None
    if dtype.startswith("fp8"):
        advice.append(Advice("kv_cache_dtype", dtype, dtype, dtype, dtype, "kept: already 8-bit", pool))
    elif not enough or pool is None or p95 is None or seqs is None:
        advice.append(
            Advice(
                "kv_cache_dtype", dtype, dtype, dtype, dtype, f"kept: {few if not enough else 'unknown pool'}"
            )
        )
    elif pool < seqs * p95:
        doubled = pool_at({"gpu_memory_utilization": target_utilization, "kv_cache_dtype": "fp8"}) or 2 * pool
        advice.append(
            Advice(
                "kv_cache_dtype",
                dtype,
                "fp8",
                "fp8",
                dtype,
                f"the 16-bit pool ({pool:,} tokens) holds fewer than {_requests(seqs)} of {p95:,} tokens; "
                f"fp8 halves the bytes a token",
                doubled,
            )
        )
    else:
        advice.append(
            Advice(
                "kv_cache_dtype",
                dtype,
                dtype,
                "fp8",
                dtype,
                f"the pool holds {_requests(seqs)} of {p95:,} tokens as it is: 16-bit KV kept "
                "(fp8 if more are wanted)",
                pool,
            )
        )
    return advice


def seqs_fit(
    settings: Mapping[str, Any],
    workload: Workload | None,
    *,
    pool_tokens: int | None,
    block_size: int = BLOCK_SIZE,
    min_requests: int = MIN_REQUESTS,
) -> Fit:
    """``max_num_seqs: fit``: the requests of the served lengths the pool holds (the
    right-sizing target), or no fit with the reason."""
    if workload is None:
        return Fit("max_num_seqs", None, "no request histograms read yet")
    advice = advise(
        settings, workload, pool_tokens=pool_tokens, block_size=block_size, min_requests=min_requests
    )
    item = next(entry for entry in advice if entry.knob == "max_num_seqs")
    if item.reason.startswith("kept: "):
        return Fit("max_num_seqs", None, item.reason.removeprefix("kept: "))
    return Fit("max_num_seqs", item.target, item.reason)


#: How far a recommendation must move before advise mode posts it again.
MATERIAL = {"gpu_memory_utilization": 0.02, "ratio": 0.25}


def materially_different(before: Mapping[str, Any] | None, after: Mapping[str, Any]) -> list[str]:
    """The knobs whose recommended target moved materially from ``before`` (None: never posted)
    and differ from their current value: utilization by 0.02, a count by a quarter, a dtype at
    all."""
    moved = []
    for knob, item in after.items():
        if not isinstance(item, Mapping) or item.get("target") == item.get("current"):
            continue
        target, last = item.get("target"), (before or {}).get(knob)
        if last is None:
            moved.append(knob)
        elif isinstance(target, float) and isinstance(last, int | float):
            if abs(target - last) >= MATERIAL["gpu_memory_utilization"]:
                moved.append(knob)
        elif isinstance(target, int) and isinstance(last, int):
            if abs(target - last) >= max(1.0, MATERIAL["ratio"] * max(abs(last), 1)):
                moved.append(knob)
        elif target != last:
            moved.append(knob)
    return moved


def render_advice(engine: str, advice: Sequence[Advice], workload: Workload) -> str:
    """``tunerd advise``'s text: one line per knob, then its reason."""
    lines = [
        f"{engine}: right-sizing from {workload.requests:.0f} requests served",
        f"  {'knob':<24}{'current':>10}{'target':>10}{'lower':>10}{'upper':>10}  predicted KV pool",
    ]
    for item in advice:
        pool = "?" if item.predicted_kv_cache_tokens is None else f"{item.predicted_kv_cache_tokens:,} tokens"
        values = "".join(
            f"{'default' if value is None else value!s:>10}"
            for value in (item.current, item.target, item.lower, item.upper)
        )
        lines.append(f"  {item.knob:<24}{values}  {pool}")
    lines.append("")
    lines += [f"  {item.knob}: {item.reason}" for item in advice]
    return "\n".join(lines) + "\n"
