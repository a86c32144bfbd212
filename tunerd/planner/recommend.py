"""Will it fit, and with which vLLM flags? The planner's decisions, pure.

:func:`evaluate` prices one setup (model, formats, settings, GPU, workload) with the four
bills of :mod:`tunerd.planner.bills` and sizes the pool vLLM would allocate for it.
:func:`make_plan` evaluates the operator's setup, answers the inverse questions and
recommends settings following the seed's logic: keep a safe slack outside vLLM's budget
(``gpu_memory_utilization`` ≤ 0.92 on 24 GiB cards), chunked prefill on, 2,048 batched tokens
on consumer cards, ``max_num_seqs`` twice the target concurrency, and quantize the KV cache
and then the weights only when the workload does not fit otherwise. The recommendation is
evaluated like the input, so it fits by construction or says that nothing does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tunerd.planner.bills import (
    BLOCK_SIZE,
    VLLM_KV_FLAG,
    VLLM_VERSION,
    Activation,
    KvPool,
    Runtime,
    WeightCount,
    activation_bytes,
    count_weights,
    kv_bytes_per_token,
    kv_pool,
    runtime_bytes,
    sequence_blocks,
)
from tunerd.planner.gpus import GpuProfile
from tunerd.planner.shapes import ModelShape, ShapeError
from tunerd.units import MIB, format_size

__all__ = [
    "MIN_SLACK_BYTES",
    "Plan",
    "PlanRequest",
    "Recommendation",
    "Scenario",
    "Settings",
    "evaluate",
    "make_plan",
    "safe_utilization",
]

#: Memory that must stay outside vLLM's budget: the engine's CUDA context (~0.4 GiB), a
#: desktop's display server or another small neighbour, and allocations the start-up profile
#: does not see (long ``prompt_logprobs``, cuBLAS/NCCL workspaces, fragmentation).
#: 1.8 GiB is what the seed's 0.92 leaves on a 24 GiB card.
MIN_SLACK_BYTES = 1843 * MIB
#: Never recommend more than this, however large the card.
MAX_RECOMMENDED_UTILIZATION = 0.95
#: Below this share of the GPU to spare in the pool, a fit is called tight.
COMFORT_SHARE = 0.10
#: The seed's consumer-card step size.
CONSUMER_BATCHED_TOKENS = 2048

_FOUR_BIT = {"awq", "gptq", "int4"}
_EIGHT_BIT = {"int8", "fp8"}
_SIXTEEN_BIT = {"bf16", "fp16"}


@dataclass(frozen=True)
class Settings:
    """The engine settings a scenario is priced at (vLLM's flags, tunerd's words)."""

    gpu_memory_utilization: float
    max_num_batched_tokens: int
    max_num_seqs: int
    tensor_parallel: int = 1
    enforce_eager: bool = False
    #: the vLLM whose profile run is modelled (the sampler's bytes, where the graphs live)
    vllm_version: tuple[int, int] = VLLM_VERSION


@dataclass(frozen=True)
class Scenario:
    """One setup, priced: the four bills, vLLM's pool and the verdict."""

    shape: ModelShape
    weights_format: str
    kv_dtype: str
    context: int
    concurrency: int
    max_model_len: int
    settings: Settings
    weights: WeightCount
    kv_bytes_per_token: int
    kv_bytes_total: int
    activation: Activation
    runtime: Runtime
    pool: KvPool
    gpu_bytes: int
    blocks_needed: int

    @property
    def total_bytes(self) -> int:
        return self.weights.bytes + self.kv_bytes_total + self.activation.bytes + self.runtime.bytes

    @property
    def headroom_bytes(self) -> int:
        return self.gpu_bytes - self.total_bytes

    @property
    def slack_bytes(self) -> int:
        """Memory outside vLLM's budget: the CUDA context and everything else lives here."""
        return self.gpu_bytes - self.pool.budget_bytes

    @property
    def safe_slack(self) -> bool:
        return self.slack_bytes >= MIN_SLACK_BYTES

    @property
    def spare_bytes(self) -> int:
        """Pool bytes left once the workload's sequences hold their blocks (negative: short)."""
        return self.pool.available_bytes - self.blocks_needed * BLOCK_SIZE * self.kv_bytes_per_token

    @property
    def pool_fits(self) -> bool:
        return self.pool.available_bytes > 0 and self.pool.num_blocks >= self.blocks_needed

    @property
    def fits(self) -> bool:
        return self.pool_fits and self.safe_slack

    @property
    def verdict(self) -> str:
        """``comfortable``, ``tight`` or ``does_not_fit``."""
        if not self.fits:
            return "does_not_fit"
        return "comfortable" if self.spare_bytes >= COMFORT_SHARE * self.gpu_bytes else "tight"

    @property
    def max_context_for_concurrency(self) -> int:
        """The longest context (block-aligned, ≤ the model's positions) this pool serves
        ``concurrency`` times at once; 0 when not even one block each fits."""
        return _max_context(
            self.shape,
            self.pool.num_blocks,
            self.concurrency,
            self.shape.max_position_embeddings,
            self.settings.max_num_batched_tokens,
        )

    @property
    def max_concurrency_for_context(self) -> int:
        """How many sequences of ``context`` tokens the pool holds at once."""
        per_sequence = sequence_blocks(self.shape, self.context, self.settings.max_num_batched_tokens)
        return self.pool.num_blocks // per_sequence


def _max_context(shape: ModelShape, blocks: int, concurrency: int, limit: int, step_tokens: int) -> int:
    if concurrency <= 0 or blocks <= 0:
        return 0
    low, high = 0, limit  # largest L in [0, limit] with concurrency × blocks(L) ≤ blocks
    while low < high:
        middle = (low + high + 1) // 2
        if concurrency * sequence_blocks(shape, middle, step_tokens) <= blocks:
            low = middle
        else:
            high = middle - 1
    return low if low == limit else (low // BLOCK_SIZE) * BLOCK_SIZE


def evaluate(
    shape: ModelShape,
    gpu: GpuProfile,
    *,
    weights_format: str,
    kv_dtype: str,
    context: int,
    concurrency: int,
    settings: Settings,
    max_model_len: int | None = None,
) -> Scenario:
    """Price one setup on one GPU (every byte per GPU under tensor parallelism)."""
    tp = settings.tensor_parallel
    weights = count_weights(shape, weights_format, tp)
    per_token = kv_bytes_per_token(shape, kv_dtype, tp)
    window = shape.sliding_window
    held_tokens = context if window is None else min(context, window)
    version = settings.vllm_version
    activation = activation_bytes(
        shape, settings.max_num_batched_tokens, settings.max_num_seqs, tp, vllm_version=version
    )
    runtime = runtime_bytes(
        shape, settings.max_num_seqs, settings.enforce_eager, tp, vllm_version=version, gpu_arch=gpu.arch
    )
    model_len = max_model_len if max_model_len is not None else context
    per_request = sequence_blocks(shape, model_len, settings.max_num_batched_tokens)
    pool = kv_pool(
        total_bytes=gpu.total_bytes,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        non_kv_bytes=weights.bytes + activation.bytes + runtime.inside_budget_bytes,
        bytes_per_token=per_token,
        blocks_per_request=per_request,
        max_model_len=model_len,
    )
    needed = concurrency * sequence_blocks(shape, context, settings.max_num_batched_tokens)
    return Scenario(
        shape=shape,
        weights_format=weights_format,
        kv_dtype=kv_dtype,
        context=context,
        concurrency=concurrency,
        max_model_len=model_len,
        settings=settings,
        weights=weights,
        kv_bytes_per_token=per_token,
        kv_bytes_total=per_token * held_tokens * concurrency,
        activation=activation,
        runtime=runtime,
        pool=pool,
        gpu_bytes=gpu.total_bytes,
        blocks_needed=needed,
    )


def safe_utilization(gpu: GpuProfile) -> float:
    """The highest ``gpu_memory_utilization`` (two decimals) that keeps the safe slack."""
    share = (gpu.total_bytes - MIN_SLACK_BYTES) / gpu.total_bytes
    return min(MAX_RECOMMENDED_UTILIZATION, math.floor(round(share * 100, 6)) / 100)


@dataclass(frozen=True)
class PlanRequest:
    """What the operator asked: the model, the formats, the card, the workload."""

    shape: ModelShape
    gpu: GpuProfile
    weights: str
    kv_dtype: str
    concurrency: int | None
    context: int | None
    gpu_memory_utilization: float | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    tensor_parallel: int = 1
    enforce_eager: bool = False
    quantization: str | None = None  # an explicit vLLM --quantization method, only if asked
    vllm_version: tuple[int, int] = VLLM_VERSION  # the vLLM whose start-up is modelled


@dataclass(frozen=True)
class Recommendation:
    """The settings to run, priced like the input (``scenario``), and why they changed."""

    scenario: Scenario
    reasons: tuple[str, ...]
    vllm_args: tuple[str, ...]

    @property
    def weights_format(self) -> str:
        return self.scenario.weights_format

    @property
    def kv_dtype(self) -> str:
        return self.scenario.kv_dtype

    @property
    def fits(self) -> bool:
        """Whether the workload fits; when nothing does, the flags still start vLLM."""
        return self.scenario.fits


@dataclass(frozen=True)
class Plan:
    request: PlanRequest
    scenario: Scenario  # the operator's setup
    context_asked: bool  # False when the context was derived (inverse question)
    concurrency_asked: bool
    recommendation: Recommendation
    warnings: tuple[str, ...] = field(default=())


def _recommended_batched_tokens(request: PlanRequest) -> int:
    gpu = request.gpu
    if request.max_num_batched_tokens is not None:
        if gpu.consumer:
            return min(request.max_num_batched_tokens, CONSUMER_BATCHED_TOKENS)
        return request.max_num_batched_tokens
    return CONSUMER_BATCHED_TOKENS if gpu.consumer else gpu.vllm_default_max_num_batched_tokens


def _recommended_seqs(concurrency: int) -> int:
    """The seed: 1.5–2 × the concurrency the service must hold (2× for small numbers)."""
    return 2 * concurrency if concurrency <= 8 else math.ceil(1.5 * concurrency)


def _candidates(weights: str, kv_dtype: str, fp8_kv: bool) -> list[tuple[str, str]]:
    """(weights, kv) in the order the seed would try them: fp8 KV is a flag, a quantized
    checkpoint is a new download; prefer 8-bit weights to 4-bit (quality first). fp8 KV only
    where the card does it natively (``fp8_kv``), unless it was asked for."""
    kv_options = [kv_dtype] + (["fp8"] if kv_dtype != "fp8" and fp8_kv else [])
    weight_options = [weights]
    if weights in _SIXTEEN_BIT:
        weight_options.append("int8")
    if weights not in _FOUR_BIT:
        weight_options.append("int4")
    return [(w, kv) for w in weight_options for kv in kv_options]


def _vllm_args(request: PlanRequest, scenario: Scenario) -> tuple[str, ...]:
    settings = scenario.settings
    args = [
        "--gpu-memory-utilization",
        f"{settings.gpu_memory_utilization:.2f}",
        "--max-model-len",
        str(scenario.max_model_len),
        "--max-num-seqs",
        str(settings.max_num_seqs),
        "--max-num-batched-tokens",
        str(settings.max_num_batched_tokens),
        "--enable-chunked-prefill",
        "--kv-cache-dtype",
        VLLM_KV_FLAG[scenario.kv_dtype],
    ]
    native = request.shape.native_weights
    weights = scenario.weights_format
    if weights in _SIXTEEN_BIT and native in _SIXTEEN_BIT and weights != native:
        args += ["--dtype", "float16" if weights == "fp16" else "bfloat16"]
    if settings.tensor_parallel > 1:
        args += ["--tensor-parallel-size", str(settings.tensor_parallel)]
    if settings.enforce_eager:
        args.append("--enforce-eager")
    if request.quantization:
        args += ["--quantization", request.quantization]
    return tuple(args)


def _recommend(request: PlanRequest, context: int, concurrency: int) -> Recommendation:
    shape, gpu = request.shape, request.gpu
    cap = safe_utilization(gpu)
    utilization = cap if request.gpu_memory_utilization is None else min(request.gpu_memory_utilization, cap)
    settings = Settings(
        gpu_memory_utilization=utilization,
        max_num_batched_tokens=_recommended_batched_tokens(request),
        max_num_seqs=_recommended_seqs(concurrency),
        tensor_parallel=request.tensor_parallel,
        enforce_eager=request.enforce_eager,
        vllm_version=request.vllm_version,
    )
    served_context = min(context, shape.max_position_embeddings)
    reasons: list[str] = []
    if request.gpu_memory_utilization is not None and request.gpu_memory_utilization > cap:
        reasons.append(
            f"gpu_memory_utilization {request.gpu_memory_utilization:.2f} → {cap:.2f}: keep "
            f"{format_size(MIN_SLACK_BYTES)} outside vLLM's budget for the CUDA context, "
            f"neighbours and allocations the profile misses"
        )
    if request.max_num_batched_tokens is not None and (
        settings.max_num_batched_tokens != request.max_num_batched_tokens
    ):
        reasons.append(
            f"max_num_batched_tokens {request.max_num_batched_tokens} → "
            f"{settings.max_num_batched_tokens}: on a consumer card the step's activations must "
            f"stay small (the seed's OOM came from a long prefill)"
        )
    chosen: Scenario | None = None
    fp8_kv = gpu.fp8_kv_native or gpu.arch == "unknown"
    for weights_format, kv_dtype in _candidates(request.weights, request.kv_dtype, fp8_kv):
        candidate = evaluate(
            shape,
            gpu,
            weights_format=weights_format,
            kv_dtype=kv_dtype,
            context=served_context,
            concurrency=concurrency,
            settings=settings,
        )
        chosen = candidate
        if candidate.fits:
            break
    assert chosen is not None
    if chosen.kv_dtype != request.kv_dtype:
        reasons.append(
            f"kv_cache_dtype {request.kv_dtype} → fp8: halves the KV cache "
            f"({format_size(chosen.kv_bytes_per_token)}/token)"
        )
    if chosen.weights_format != request.weights:
        label = "an AWQ or GPTQ 4-bit" if chosen.weights_format == "int4" else "an int8 (W8A8)"
        reasons.append(
            f"weights {request.weights} → {chosen.weights_format}: serve {label} checkpoint "
            f"({format_size(chosen.weights.bytes)} loaded)"
        )
    if not chosen.fits and chosen.pool.available_bytes > 0 and not chosen.pool.fits_one_request:
        # Nothing serves the workload; at least recommend flags vLLM will start with.
        longest = _max_context(
            shape, chosen.pool.num_blocks, 1, served_context, settings.max_num_batched_tokens
        )
        if longest > 0:
            chosen = evaluate(
                shape,
                gpu,
                weights_format=chosen.weights_format,
                kv_dtype=chosen.kv_dtype,
                context=served_context,
                concurrency=concurrency,
                settings=settings,
                max_model_len=longest,
            )
            reasons.append(
                f"max_model_len {served_context} → {longest}: the largest single request the "
                f"pool holds (vLLM refuses to start otherwise)"
            )
    return Recommendation(scenario=chosen, reasons=tuple(reasons), vllm_args=_vllm_args(request, chosen))


def _input_settings(request: PlanRequest, concurrency: int) -> Settings:
    return Settings(
        gpu_memory_utilization=(
            request.gpu_memory_utilization
            if request.gpu_memory_utilization is not None
            else safe_utilization(request.gpu)
        ),
        max_num_batched_tokens=(
            request.max_num_batched_tokens
            if request.max_num_batched_tokens is not None
            else _recommended_batched_tokens(request)
        ),
        max_num_seqs=(
            request.max_num_seqs if request.max_num_seqs is not None else _recommended_seqs(concurrency)
        ),
        tensor_parallel=request.tensor_parallel,
        enforce_eager=request.enforce_eager,
        vllm_version=request.vllm_version,
    )


def _warnings(request: PlanRequest, scenario: Scenario) -> list[str]:
    shape = request.shape
    notes = list(shape.notes)
    if scenario.context > shape.max_position_embeddings:
        notes.append(
            f"context {scenario.context:,} exceeds {shape.name}'s max_position_embeddings "
            f"{shape.max_position_embeddings:,}: vLLM refuses --max-model-len {scenario.context}; "
            f"the bills are planned as asked, the recommended flags at "
            f"{shape.max_position_embeddings:,}"
        )
    if not scenario.safe_slack:
        notes.append(
            f"gpu_memory_utilization {scenario.settings.gpu_memory_utilization:.2f} leaves "
            f"{format_size(scenario.slack_bytes)} outside vLLM's budget; the CUDA context "
            f"({format_size(scenario.runtime.outside_budget_bytes)}), neighbours and "
            f"allocations the profile misses need {format_size(MIN_SLACK_BYTES)}: expect CUDA OOM "
            f"under load"
        )
    quant = shape.quantization
    if (
        quant is not None
        and request.weights != quant.weights
        and not (request.weights in _FOUR_BIT and quant.weights == "int4")
    ):
        notes.append(
            f"the checkpoint's quantization_config says {quant.method} ({quant.weights}); "
            f"planned as --weights {request.weights}"
        )
    if shape.sliding_window is not None:
        notes.append(
            f"sliding window of {shape.sliding_window:,} tokens on every layer: a request holds at "
            f"most the window's KV, so kv_bytes_total counts min(context, window) per sequence"
        )
    if request.tensor_parallel > shape.num_key_value_heads:
        notes.append(
            f"tensor parallel {request.tensor_parallel} exceeds {shape.num_key_value_heads} KV heads: "
            f"each GPU keeps a full copy of one KV head"
        )
    return notes


def make_plan(request: PlanRequest) -> Plan:
    """Evaluate the operator's setup, answer the inverse questions and recommend flags."""
    shape = request.shape
    if request.concurrency is None and request.context is None:
        raise ValueError("give --concurrency, --context or both")
    tp = request.tensor_parallel
    if shape.num_attention_heads % tp:  # vLLM 0.32 config/model.py:1549 (verify_with_parallel_config)
        heads = shape.num_attention_heads
        divisors = ", ".join(str(n) for n in (1, 2, 4, 8) if heads % n == 0)
        raise ShapeError(
            f"--tensor-parallel {tp} does not divide {shape.name}'s {heads} attention heads: vLLM refuses "
            f'it ("Total number of attention heads ({heads}) must be divisible by tensor parallel size '
            f'({tp})"); try {divisors}'
        )
    concurrency_asked = request.concurrency is not None
    context_asked = request.context is not None

    def price(context: int, concurrency: int) -> Scenario:
        settings = _input_settings(request, concurrency)
        return evaluate(
            shape,
            request.gpu,
            weights_format=request.weights,
            kv_dtype=request.kv_dtype,
            context=context,
            concurrency=concurrency,
            settings=settings,
        )

    concurrency = request.concurrency if request.concurrency is not None else 1
    context = request.context if request.context is not None else shape.max_position_embeddings
    if not context_asked:
        context = max(price(context, concurrency).max_context_for_concurrency, BLOCK_SIZE)
    if not concurrency_asked:
        concurrency = max(price(context, concurrency).max_concurrency_for_context, 1)
    scenario = price(context, concurrency)
    # max_num_seqs follows the concurrency, and the sampler's share of the pool with it: step a
    # derived concurrency down until the pool really holds it.
    while not concurrency_asked and not scenario.pool_fits and concurrency > 1:
        concurrency -= 1
        scenario = price(context, concurrency)
    recommendation = _recommend(request, context, concurrency)
    warnings = _warnings(request, scenario)
    if recommendation.kv_dtype == "fp8" and not request.gpu.fp8_kv_native and request.gpu.arch != "unknown":
        warnings.append(
            f"fp8 KV cache on {request.gpu.name} ({request.gpu.arch}): no native fp8 on this "
            f"architecture; the seed found it unsupported on some older cards: check your vLLM "
            f"build's attention backend before relying on it"
        )
    if not recommendation.fits:
        warnings.append(
            f"nothing fits {concurrency} × {min(context, shape.max_position_embeddings):,} tokens on "
            f"one {request.gpu.name}: at the recommended settings the pool holds "
            f"{recommendation.scenario.max_concurrency_for_context} such requests, or "
            f"{recommendation.scenario.max_context_for_concurrency:,} tokens each for {concurrency}"
        )
    return Plan(
        request=request,
        scenario=scenario,
        context_asked=context_asked,
        concurrency_asked=concurrency_asked,
        recommendation=recommendation,
        warnings=tuple(warnings),
    )


def by_hand_weights_bytes(shape: ModelShape, weights_format: str) -> int:
    """The by-hand estimate the seed used: parameters × 2, 1 or 0.5 bytes, nothing else."""
    per_param = 2.0 if weights_format in _SIXTEEN_BIT else 1.0 if weights_format in _EIGHT_BIT else 0.5
    params = count_weights(shape, "bf16").params_total
    return int(params * per_param)
