"""A plan as JSON (the Contract of DESIGN §4.2) and as text for people, with the arithmetic."""

from __future__ import annotations

from typing import Any

from tunerd.planner import bills
from tunerd.planner.bills import BLOCK_SIZE, VLLM_KV_DTYPE, VLLM_KV_FLAG
from tunerd.planner.recommend import (
    COMFORT_SHARE,
    MIN_SLACK_BYTES,
    Plan,
    Scenario,
    by_hand_weights_bytes,
    safe_utilization,
)
from tunerd.units import GIB, KIB, format_size

__all__ = ["plan_to_dict", "render_explain", "render_text"]

_VERDICT_WORDS = {
    "comfortable": "fits comfortably",
    "tight": "fits, with little to spare",
    "does_not_fit": "does not fit",
}
_WEIGHT_WORDS = {
    "bf16": "bf16",
    "fp16": "fp16",
    "int8": "int8 (W8A8)",
    "fp8": "fp8",
    "awq": "AWQ int4",
    "gptq": "GPTQ int4",
    "int4": "int4 (AWQ/GPTQ)",
}


def _gib(num_bytes: int | float) -> float:
    return round(num_bytes / GIB, 2)


def _scenario_settings(scenario: Scenario) -> dict[str, Any]:
    settings = scenario.settings
    return {
        "gpu_memory_utilization": settings.gpu_memory_utilization,
        "max_model_len": scenario.max_model_len,
        "max_num_seqs": settings.max_num_seqs,
        "max_num_batched_tokens": settings.max_num_batched_tokens,
        "enable_chunked_prefill": True,
        "kv_cache_dtype": VLLM_KV_FLAG[scenario.kv_dtype],
    }


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """The ``--json`` object: DESIGN §4.2's keys first, then what else the plan knows."""
    scenario = plan.scenario
    recommendation = plan.recommendation
    chosen = recommendation.scenario
    request = plan.request
    shape = request.shape
    recommended = _scenario_settings(chosen)
    recommended.update(
        weights=recommendation.weights_format,
        tensor_parallel_size=chosen.settings.tensor_parallel,
        enforce_eager=chosen.settings.enforce_eager,
        fits=recommendation.fits,
        verdict=chosen.verdict,
        reasons=list(recommendation.reasons),
        kv_pool_bytes=max(chosen.pool.available_bytes, 0),
        max_context_for_concurrency=recommendation.scenario.max_context_for_concurrency,
        max_concurrency_for_context=recommendation.scenario.max_concurrency_for_context,
    )
    return {
        "kv_bytes_per_token": scenario.kv_bytes_per_token,
        "kv_bytes_total": scenario.kv_bytes_total,
        "weights_bytes": scenario.weights.bytes,
        "activation_bytes": scenario.activation.bytes,
        "runtime_bytes": scenario.runtime.bytes,
        "total_bytes": scenario.total_bytes,
        "gpu_bytes": scenario.gpu_bytes,
        "headroom_bytes": scenario.headroom_bytes,
        "fits": scenario.fits,
        "recommended": recommended,
        "vllm_args": list(recommendation.vllm_args),
        "predicted_kv_cache_tokens": chosen.pool.tokens,
        "predicted_max_concurrency": round(chosen.pool.max_concurrency, 2),
        "warnings": list(plan.warnings),
        # Beyond the contract:
        "verdict": scenario.verdict,
        "predicted_log": chosen.pool.log_line,
        "model": {
            "name": shape.name,
            "source": shape.source,
            "params": scenario.weights.params_total,
            "num_hidden_layers": shape.num_hidden_layers,
            "num_key_value_heads": shape.num_key_value_heads,
            "head_dim": shape.head_dim,
            "max_position_embeddings": shape.max_position_embeddings,
            "sliding_window": shape.sliding_window,
        },
        "gpu": {
            "name": request.gpu.name,
            "total_bytes": request.gpu.total_bytes,
            "nvidia_smi_total_mib": request.gpu.nvidia_smi_total_mib or None,
        },
        "workload": {
            "concurrency": scenario.concurrency,
            "context": scenario.context,
            "concurrency_derived": not plan.concurrency_asked,
            "context_derived": not plan.context_asked,
            "weights": scenario.weights_format,
            "kv_dtype": scenario.kv_dtype,
        },
        "settings": _scenario_settings(scenario),
        "weights": {
            "linear_bytes": scenario.weights.linear_bytes,
            "scale_bytes": scenario.weights.scale_bytes,
            "sixteen_bit_bytes": scenario.weights.sixteen_bit_bytes,
        },
        "activation": {
            "step_bytes": scenario.activation.step_bytes,
            "sampler_bytes": scenario.activation.sampler_bytes,
        },
        "runtime": {
            "cuda_context_bytes": scenario.runtime.cuda_context_bytes,
            "nccl_bytes": scenario.runtime.nccl_bytes,
            "non_torch_bytes": scenario.runtime.non_torch_bytes,
            "cuda_graph_bytes": scenario.runtime.cuda_graph_bytes,
        },
        "kv_pool": {
            "budget_bytes": scenario.pool.budget_bytes,
            "available_bytes": scenario.pool.available_bytes,
            "tokens": scenario.pool.tokens,
            "num_gpu_blocks": scenario.pool.num_blocks,
            "spare_bytes": scenario.spare_bytes,
            "slack_bytes": scenario.slack_bytes,
        },
        "max_context_for_concurrency": scenario.max_context_for_concurrency,
        "max_concurrency_for_context": scenario.max_concurrency_for_context,
    }


def _table(scenario: Scenario) -> list[str]:
    weights = scenario.weights
    runtime = scenario.runtime
    graphs = (
        f" + CUDA graphs {_gib(runtime.cuda_graph_bytes):.2f}"
        if runtime.cuda_graph_bytes
        else " (no graphs: --enforce-eager)"
    )
    tokens_held = scenario.kv_bytes_total // max(scenario.kv_bytes_per_token * scenario.concurrency, 1)
    rows = [
        (
            "weights",
            weights.bytes,
            f"{weights.params_total / 1e9:.2f}B params as {_WEIGHT_WORDS[scenario.weights_format]}",
        ),
        (
            "KV cache",
            scenario.kv_bytes_total,
            f"{_per_token(scenario.kv_bytes_per_token)}/token × {tokens_held:,} tokens × "
            f"{scenario.concurrency}",
        ),
        (
            "activations",
            scenario.activation.bytes,
            f"profiled peak: one step of {scenario.activation.tokens:,} tokens"
            if scenario.activation.step_bytes >= scenario.activation.sampler_bytes
            else f"profiled peak: sampler logits for {scenario.activation.requests} requests",
        ),
        (
            "CUDA runtime",
            runtime.bytes,
            f"context {_gib(runtime.outside_budget_bytes):.2f} + workspaces "
            f"{_gib(runtime.non_torch_bytes):.2f}{graphs}",
        ),
    ]
    lines = [f"  {'bill':<14}{'GiB':>8}   what"]
    for name, value, what in rows:
        lines.append(f"  {name:<14}{_gib(value):>8.2f}   {what}")
    lines.append(f"  {'total':<14}{_gib(scenario.total_bytes):>8.2f}")
    lines.append(f"  {'GPU':<14}{_gib(scenario.gpu_bytes):>8.2f}   visible to CUDA")
    lines.append(f"  {'headroom':<14}{_gib(scenario.headroom_bytes):>8.2f}")
    return lines


def _per_token(num_bytes: int) -> str:
    return f"{num_bytes // KIB} KiB" if num_bytes % KIB == 0 else f"{num_bytes:,} B"


def _verdict_lines(plan: Plan) -> list[str]:
    scenario = plan.scenario
    pool = scenario.pool
    util = scenario.settings.gpu_memory_utilization
    need = scenario.blocks_needed * BLOCK_SIZE * scenario.kv_bytes_per_token
    lines = [f"Verdict: {_VERDICT_WORDS[scenario.verdict]}."]
    if pool.available_bytes <= 0:
        lines.append(
            f"  At gpu_memory_utilization {util:.2f} the budget is {format_size(pool.budget_bytes)}; "
            f"weights, activations and runtime already take {format_size(pool.non_kv_bytes)}: "
            f"vLLM would fail with 'No available memory for the cache blocks'."
        )
    else:
        lines.append(
            f"  At gpu_memory_utilization {util:.2f} vLLM's KV pool is "
            f"{format_size(pool.available_bytes)} ({pool.tokens:,} tokens); "
            f"{scenario.concurrency} × {scenario.context:,} tokens need {format_size(need)}."
        )
    if not scenario.safe_slack:
        lines.append(
            f"  Only {format_size(scenario.slack_bytes)} stays outside the budget "
            f"(safe: {format_size(MIN_SLACK_BYTES)}): a neighbour or an unprofiled allocation "
            f"will end in CUDA OOM."
        )
    limit = plan.request.shape.max_position_embeddings
    capped = " (the model's max_position_embeddings)" if scenario.max_context_for_concurrency == limit else ""
    lines.append(
        f"  Largest context for {scenario.concurrency} requests: "
        f"{scenario.max_context_for_concurrency:,} tokens{capped}. Requests of {scenario.context:,} "
        f"tokens at once: {scenario.max_concurrency_for_context}."
    )
    return lines


def _recommendation_lines(plan: Plan) -> list[str]:
    recommendation = plan.recommendation
    chosen = recommendation.scenario
    status = _VERDICT_WORDS[chosen.verdict] if recommendation.fits else "still does not fit"
    workload = f"{chosen.concurrency} × {chosen.max_model_len:,} tokens"
    lines = [
        f"Recommended for {workload}: {_WEIGHT_WORDS[recommendation.weights_format]} weights, "
        f"{VLLM_KV_DTYPE[recommendation.kv_dtype]} KV cache — {status}."
    ]
    lines += [f"  - {reason}" for reason in recommendation.reasons]
    lines.append("  vllm serve MODEL " + " ".join(recommendation.vllm_args))
    lines.append(f"  vLLM should log: {chosen.pool.log_line}")
    return lines


def render_text(plan: Plan, explain: bool = False) -> str:
    """The four-bill table, the verdict in plain words and the recommendation.

    Warnings are not part of it: the command line prints them on stderr.
    """
    scenario = plan.scenario
    request = plan.request
    derived = []
    if not plan.context_asked:
        derived.append("context derived: the longest that fits")
    if not plan.concurrency_asked:
        derived.append("concurrency derived: the most that fit")
    header = (
        f"{request.shape.name} · {_WEIGHT_WORDS[scenario.weights_format]} weights · "
        f"{VLLM_KV_DTYPE[scenario.kv_dtype]} KV · {request.gpu.name} "
        f"({format_size(request.gpu.total_bytes)} visible to CUDA) · "
        f"{scenario.concurrency} × {scenario.context:,} tokens"
    )
    if request.tensor_parallel > 1:
        header += f" · tensor parallel {request.tensor_parallel} (bytes per GPU)"
    lines = [header]
    if derived:
        lines.append("(" + "; ".join(derived) + ")")
    lines.append("")
    lines += _table(scenario)
    lines.append("")
    lines += _verdict_lines(plan)
    lines.append("")
    lines += _recommendation_lines(plan)
    if explain:
        lines.append("")
        lines += render_explain(plan)
    return "\n".join(lines) + "\n"


def render_explain(plan: Plan) -> list[str]:
    """The arithmetic behind every number, and where it departs from a by-hand estimate."""
    scenario = plan.scenario
    request = plan.request
    shape = request.shape
    weights = scenario.weights
    tp = scenario.settings.tensor_parallel
    kv_heads = bills.kv_heads_per_gpu(shape, tp)
    dtype_bytes = bills.kv_dtype_bytes(scenario.kv_dtype)
    lines = ["How these numbers were computed:", ""]
    lines.append(
        f"Weights ({shape.name}: {shape.num_hidden_layers} layers, hidden {shape.hidden_size}, "
        f"intermediate {shape.intermediate_size}, {shape.num_attention_heads} heads / "
        f"{shape.num_key_value_heads} KV heads × head_dim {shape.head_dim}, vocab "
        f"{shape.vocab_size:,}, tie_word_embeddings {str(shape.tie_word_embeddings).lower()}):"
    )
    lines.append(
        f"  {weights.params_total:,} parameters; per GPU {weights.linear_params:,} in linear "
        f"layers stored as {scenario.weights_format}, {weights.embedding_params:,} embedding + "
        f"{weights.lm_head_params:,} lm_head + {weights.other_params:,} norms/biases kept 16-bit"
    )
    lines.append(
        f"  linear {format_size(weights.linear_bytes)} + scales/zeros "
        f"{format_size(weights.scale_bytes)} + 16-bit {format_size(weights.sixteen_bit_bytes)} "
        f"= {format_size(weights.bytes)}"
    )
    by_hand = by_hand_weights_bytes(shape, scenario.weights_format)
    if scenario.weights_format not in {"bf16", "fp16"}:
        lines.append(
            f"  by hand, params × {by_hand / weights.params_total:.1f} B = {format_size(by_hand)}: "
            f"that misses the 16-bit embeddings and lm_head "
            f"({format_size(2 * (weights.embedding_params + weights.lm_head_params))}) and the "
            f"quantization scales; vLLM loads the larger figure"
        )
    lines.append("")
    lines.append(
        f"KV cache: 2 (K and V) × {shape.num_hidden_layers} layers × {kv_heads} KV heads"
        f"{f' per GPU (of {shape.num_key_value_heads}, TP {tp})' if tp > 1 else ''} × "
        f"{shape.head_dim} head_dim × {dtype_bytes} B ({VLLM_KV_DTYPE[scenario.kv_dtype]}) = "
        f"{scenario.kv_bytes_per_token:,} B/token"
    )
    lines.append(
        f"  × {scenario.kv_bytes_total // max(scenario.kv_bytes_per_token * scenario.concurrency, 1):,} "
        f"tokens × {scenario.concurrency} sequences = {scenario.kv_bytes_total:,} B "
        f"({format_size(scenario.kv_bytes_total)})"
    )
    lines.append("")
    activation = scenario.activation
    lines.append(
        f"Activations (assumption, calibrated in docs/planner.md): vLLM profiles one step of "
        f"max_num_batched_tokens = {activation.tokens:,} tokens:"
    )
    lines.append(
        f"  step: {activation.tokens:,} × 2 B × (4 × hidden + 3 × intermediate) = "
        f"{format_size(activation.step_bytes)} (context length does not enter: attention tiles "
        f"over the paged cache)"
    )
    what = (
        "bf16 logits, their fp32 copy, probabilities, sampling noise; Triton top-k/top-p scratch"
        if activation.bytes_per_logit == bills.SAMPLER_BYTES_PER_LOGIT
        else "logits, fp32 copy and the sort top-k/top-p did before vLLM 0.17"
    )
    lines.append(
        f"  sampler: {activation.requests} requests × {shape.vocab_size:,} vocab × "
        f"{activation.bytes_per_logit} B ({what}) = {format_size(activation.sampler_bytes)}; "
        f"the peak is the larger, plus the runner's input buffer "
        f"({format_size(activation.persistent_bytes)}): {format_size(activation.bytes)}"
    )
    runtime = scenario.runtime
    lines.append("")
    lines.append("Runtime (assumptions):")
    lines.append(
        f"  CUDA context {format_size(runtime.cuda_context_bytes)}"
        + (f" + NCCL {format_size(runtime.nccl_bytes)}" if runtime.nccl_bytes else "")
        + ": created before vLLM's memory snapshot, so it lives outside the budget"
    )
    lines.append(f"  non-torch workspaces {format_size(runtime.non_torch_bytes)} (inside the budget)")
    if runtime.capture_size:
        lines.append(
            f"  CUDA graph estimate {format_size(runtime.cuda_graph_bytes)} for batch sizes up to "
            f"{runtime.capture_size} (2 × max_num_seqs, at most 512); subtracted from the budget "
            f"since vLLM 0.21; --enforce-eager drops it"
        )
    else:
        lines.append("  no CUDA graphs (--enforce-eager)")
    pool = scenario.pool
    settings = scenario.settings
    lines.append("")
    lines.append(
        f"vLLM's pool: ceil({format_size(scenario.gpu_bytes)} × {settings.gpu_memory_utilization:.2f}) "
        f"= {format_size(pool.budget_bytes)} budget − weights − activation peak − workspaces − "
        f"graphs ({format_size(pool.non_kv_bytes)}) = {format_size(pool.available_bytes)}"
    )
    lines.append(
        f"  → {pool.num_blocks:,} blocks of {BLOCK_SIZE} tokens = {pool.tokens:,} tokens; the "
        f"workload needs {scenario.blocks_needed:,} blocks"
    )
    lines.append(
        f"  outside the budget: {format_size(scenario.slack_bytes)} (needs ≥ "
        f"{format_size(MIN_SLACK_BYTES)}; this card's safe utilization is "
        f"{safe_utilization(request.gpu):.2f})"
    )
    lines.append(
        f"  verdict rule: fits when the pool holds every sequence and the slack is safe; "
        f"comfortable when ≥ {COMFORT_SHARE:.0%} of the GPU stays spare in the pool "
        f"(spare: {format_size(scenario.spare_bytes)})"
    )
    lines += _by_hand_verdict(plan, by_hand)
    return lines


def _by_hand_verdict(plan: Plan, by_hand_weights: int) -> list[str]:
    """Where a by-hand sum (the seed's table) would call this differently, say why."""
    scenario = plan.scenario
    gpu = plan.request.gpu
    nominal = gpu.nvidia_smi_total_mib * 1024**2 if gpu.nvidia_smi_total_mib else gpu.total_bytes
    by_hand_total = by_hand_weights + scenario.kv_bytes_total
    by_hand_fits = by_hand_total <= nominal
    if by_hand_fits == scenario.fits:
        return []
    lines = ["", "Why this differs from a by-hand sum:"]
    lines.append(
        f"  by hand: weights {format_size(by_hand_weights)} + KV {format_size(scenario.kv_bytes_total)} "
        f"= {format_size(by_hand_total)} against the card's {format_size(nominal)}: "
        f"{'fits' if by_hand_fits else 'does not fit'}"
    )
    if by_hand_fits:
        lines.append(
            f"  counted: weights load at {format_size(scenario.weights.bytes)}; CUDA sees "
            f"{format_size(scenario.gpu_bytes)}, of which vLLM may use "
            f"{scenario.settings.gpu_memory_utilization:.2f}; activations, workspaces and graphs "
            f"take {format_size(scenario.activation.bytes + scenario.runtime.inside_budget_bytes)} "
            f"of that — the pool comes out {format_size(-scenario.spare_bytes)} short"
        )
    else:
        lines.append("  counted: the pool is sized from the real budget and the workload fits it")
    return lines
