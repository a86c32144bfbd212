"""The four bills of a vLLM engine, and the KV pool vLLM 0.33 sizes from them. Pure arithmetic.

This module is tunerd's one memory model: the planner, the simulator and the daemon's live
"four bills" all call it. Each function takes a :class:`~tunerd.planner.shapes.ModelShape`
and settings and returns bytes (per GPU when tensor parallelism splits the model).

- **weights**: counted from the shapes, layer by layer (:func:`count_weights`);
- **KV cache**: ``2 × layers × kv_heads_per_gpu × head_dim × dtype bytes`` per token;
- **activations**: the working set vLLM profiles for one step of ``max_num_batched_tokens``
  tokens, or the sampler's logits for ``max_num_seqs`` requests, whichever is larger;
- **runtime**: the CUDA context (outside vLLM's budget), non-torch allocations and the CUDA
  graph estimate (inside it, since vLLM 0.21).

The constants below are assumptions, calibrated against the measurements quoted in
``docs/planner.md``; ``tunerd plan --explain`` prints each one where it is used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tunerd.planner.shapes import ModelShape
from tunerd.units import MIB

__all__ = [
    "BLOCK_SIZE",
    "CUDA_CONTEXT_BYTES",
    "KV_DTYPES",
    "KV_DTYPE_WORDS",
    "NON_TORCH_BYTES",
    "VLLM_VERSION",
    "WEIGHT_FORMATS",
    "Activation",
    "KvPool",
    "Runtime",
    "WeightCount",
    "activation_bytes",
    "count_weights",
    "kv_bytes_per_token",
    "kv_dtype_bytes",
    "kv_pool",
    "runtime_bytes",
    "sequence_blocks",
]

#: Tokens per KV block (vLLM's default ``--block-size``).
BLOCK_SIZE = 16
#: vLLM pads the vocabulary of embeddings and lm_head to a multiple of this (per TP rank).
VOCAB_PADDING = 64
#: The process's own CUDA context (and cuBLAS handles) exists before vLLM's memory snapshot,
#: so it sits outside the ``gpu_memory_utilization`` budget, in the slack.
CUDA_CONTEXT_BYTES = 400 * MIB
#: NCCL buffers with tensor parallelism, also allocated before the snapshot (outside).
NCCL_BYTES = 256 * MIB
#: What grows during vLLM's profile run outside the activation peak: kernel modules loaded
#: (cuBLAS, attention, Triton) and the cuBLAS workspace — inside the budget. With the profile
#: model below it leaves the 0.53–0.55 GiB vLLM 0.17 left between weights and KV for
#: Llama-3.1-8B at 256 sequences and 2,048 batched tokens (tests/data/vllm_startup_records.json).
NON_TORCH_BYTES = 64 * MIB
#: cuBLAS keeps a larger workspace on Hopper (32 MiB against 8 MiB), inside the budget.
HOPPER_WORKSPACE_BYTES = 24 * MIB
#: The version of vLLM the planner models unless told otherwise.
VLLM_VERSION = (0, 33)
#: The profile run's sampler pass (``_dummy_sampler_run``, vLLM 0.32
#: ``v1/worker/gpu_model_runner.py:5927``) holds, per (request, vocabulary entry), from 0.17 on:
#: the bf16 logits (2 B), their fp32 copy (4), the softmax probabilities (4) and the
#: exponential noise of the sampling (4); top-k/top-p run in place in Triton.
SAMPLER_BYTES_PER_LOGIT = 14
#: Before 0.17 top-k/top-p sorted the logits (``torch.sort``): bf16 2 + fp32 4 + sorted values 4
#: + int64 indices 8 + the reverse index 8 + CUB's double buffers ~12. Measured: 4.90 GiB
#: non-KV for Llama-3-8B at 1,024 sequences on an H200 (vLLM 0.11.2).
SORT_SAMPLER_BYTES_PER_LOGIT = 38
#: The Triton top-k/top-p kernel's scratch: 4 B × min(SMs, requests) × vocabulary (vLLM 0.32
#: ``v1/sample/ops/topk_topp_triton.py``); 132 SMs, an H100's, the most of the common cards.
TOPK_SCRATCH_ROWS = 132
#: CUDA graph estimate: a fixed part plus buffers per layer, captured batch size and hidden
#: unit. Calibrated on vLLM 0.19's "Estimated CUDA graph memory: 0.84 GiB" for an 8B Llama at
#: the largest capture size (512).
CUDA_GRAPH_FIXED_BYTES = 92 * MIB
CUDA_GRAPH_BYTES_PER_UNIT = 6 * 2
#: vLLM captures graphs up to min(2 × max_num_seqs, 512) sequences.
CUDA_GRAPH_MAX_CAPTURE = 512

#: Weight formats the planner knows, in its own words.
WEIGHT_FORMATS = ("bf16", "fp16", "int8", "fp8", "awq", "gptq", "int4")
#: KV cache dtypes the planner takes (vLLM spellings in :data:`VLLM_KV_DTYPE`).
KV_DTYPES = ("auto", "fp16", "bf16", "fp8")
VLLM_KV_DTYPE = {"auto": "auto", "fp16": "float16", "bf16": "bfloat16", "fp8": "fp8"}
#: What ``--kv-cache-dtype`` says for each: 16-bit KV is ``auto`` (the model's own dtype).
#: vLLM 0.33 refuses a 16-bit KV dtype that differs from the model's ("kv_cache_dtype=float16
#: is incompatible with dtype=bfloat16"), and both are two bytes a value.
VLLM_KV_FLAG = {"auto": "auto", "fp16": "auto", "bf16": "auto", "fp8": "fp8"}
#: vLLM's ``--kv-cache-dtype`` spellings (and ours) → the planner's word.
KV_DTYPE_WORDS = {
    "auto": "auto",
    "float16": "fp16",
    "fp16": "fp16",
    "bfloat16": "bf16",
    "bf16": "bf16",
    "fp8": "fp8",
    "fp8_e4m3": "fp8",
    "fp8_e5m2": "fp8",
}

_INT4_DEFAULT_GROUP = 128


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Linear:
    """One linear layer's weight matrix on one GPU: ``in_features × out_features``."""

    name: str
    in_features: int
    out_features: int
    count: int = 1  # identical copies (experts)

    @property
    def params(self) -> int:
        return self.in_features * self.out_features * self.count


@dataclass(frozen=True)
class WeightCount:
    """Parameters and bytes of a model's weights on one GPU."""

    format: str
    params_total: int  # the whole model (all GPUs), as a model card would say
    linear_params: int  # per GPU, stored in ``format``
    embedding_params: int  # per GPU, 16-bit
    lm_head_params: int  # per GPU, 16-bit (0 when tied to the embeddings)
    other_params: int  # per GPU: norms, biases, routers; 16-bit
    linear_bytes: int
    scale_bytes: int  # quantization scales, zeros and indexes
    sixteen_bit_bytes: int  # embeddings + lm_head + other
    #: buffers the model allocates as it loads: the rotary embedding's cos/sin cache
    #: (max_position_embeddings × head_dim, 16-bit), counted by vLLM's "Model loading took"
    buffer_bytes: int = 0

    @property
    def bytes(self) -> int:
        return self.linear_bytes + self.scale_bytes + self.sixteen_bit_bytes + self.buffer_bytes


def _padded_vocab(vocab: int, tp: int) -> int:
    return _cdiv(vocab, VOCAB_PADDING * tp) * VOCAB_PADDING * tp


def kv_heads_per_gpu(shape: ModelShape, tp: int = 1) -> int:
    """KV heads each GPU stores: split across ranks, replicated when there are fewer than ranks."""
    return max(1, shape.num_key_value_heads // tp)


def _layer_linears(shape: ModelShape, tp: int) -> tuple[list[Linear], list[Linear]]:
    """Linear layers of one dense layer and of one MoE layer, per GPU."""
    h, hd = shape.hidden_size, shape.head_dim
    q_out = _cdiv(shape.num_attention_heads, tp) * hd
    kv_out = kv_heads_per_gpu(shape, tp) * hd
    attention = [
        Linear("q_proj", h, q_out),
        Linear("k_proj", h, kv_out),
        Linear("v_proj", h, kv_out),
        Linear("o_proj", q_out, h),
    ]
    inter = _cdiv(shape.intermediate_size, tp)
    dense = [
        *attention,
        Linear("gate_proj", h, inter),
        Linear("up_proj", h, inter),
        Linear("down_proj", inter, h),
    ]
    moe = list(attention)
    if shape.is_moe:
        expert = _cdiv(shape.moe_intermediate_size, tp)
        experts = shape.num_experts
        moe += [
            Linear("experts.gate_proj", h, expert, experts),
            Linear("experts.up_proj", h, expert, experts),
            Linear("experts.down_proj", expert, h, experts),
        ]
        if shape.shared_expert_intermediate_size:
            shared = _cdiv(shape.shared_expert_intermediate_size, tp)
            moe += [
                Linear("shared_expert.gate_proj", h, shared),
                Linear("shared_expert.up_proj", h, shared),
                Linear("shared_expert.down_proj", shared, h),
            ]
    return dense, moe


def _other_params(shape: ModelShape, tp: int) -> int:
    """Per-layer 16-bit parameters: norms, q/k/v biases, q/k norms, MoE routers."""
    h = shape.hidden_size
    per_layer = 2 * h  # input and post-attention RMSNorm
    if shape.attention_bias:
        per_layer += (_cdiv(shape.num_attention_heads, tp) + 2 * kv_heads_per_gpu(shape, tp)) * (
            shape.head_dim
        )
    if shape.qk_norm:
        per_layer += 2 * shape.head_dim
    total = per_layer * shape.num_hidden_layers + h  # + final norm
    if shape.is_moe:
        router = h * shape.num_experts + (h if shape.shared_expert_intermediate_size else 0)
        total += router * shape.moe_layers
    return total


def _linear_storage(linear: Linear, fmt: str, group: int | None) -> tuple[int, int]:
    """(weight bytes, scale/zero/index bytes) for one linear layer stored in ``fmt``."""
    params = linear.params
    if fmt in {"bf16", "fp16"}:
        return 2 * params, 0
    if fmt == "int8":  # W8A8: int8 weights, one fp32 scale per output channel
        return params, 4 * linear.out_features * linear.count
    if fmt == "fp8":  # fp8 weights, fp32 weight and input scales per tensor
        return params, 8 * linear.count
    # 4-bit (AWQ/GPTQ/int4): packed nibbles; per group an fp16 scale and a 4-bit zero point.
    groups_per_column = 1 if group is None else _cdiv(linear.in_features, group)
    scales = groups_per_column * linear.out_features * linear.count * 2
    zeros = _cdiv(groups_per_column * linear.out_features * linear.count, 2)
    index = 4 * linear.in_features * linear.count if fmt == "gptq" else 0  # g_idx (int32)
    return _cdiv(params, 2), scales + zeros + index


def count_weights(shape: ModelShape, fmt: str, tp: int = 1, group_size: int | None = None) -> WeightCount:
    """Weights of ``shape`` stored as ``fmt`` on one of ``tp`` GPUs.

    Embeddings and lm_head stay 16-bit in every format (that is how vLLM loads AWQ, GPTQ,
    int8 and fp8 checkpoints); norms, biases and MoE routers stay 16-bit too.
    """
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format '{fmt}' (known: {', '.join(WEIGHT_FORMATS)})")
    if fmt in {"awq", "gptq", "int4"} and group_size is None:
        quant = shape.quantization
        group_size = (
            quant.group_size if quant is not None and quant.weights == "int4" else (_INT4_DEFAULT_GROUP)
        )
    dense, moe = _layer_linears(shape, tp)
    moe_layers = shape.moe_layers if shape.is_moe else 0
    dense_layers = shape.num_hidden_layers - moe_layers
    linear_params = linear_bytes = scale_bytes = 0
    for linears, layers in ((dense, dense_layers), (moe, moe_layers)):
        for linear in linears:
            weight, scales = _linear_storage(linear, fmt, group_size)
            linear_params += linear.params * layers
            linear_bytes += weight * layers
            scale_bytes += scales * layers
    vocab_per_gpu = _padded_vocab(shape.vocab_size, tp) // tp
    embedding = vocab_per_gpu * shape.hidden_size
    lm_head = 0 if shape.tie_word_embeddings else embedding
    other = _other_params(shape, tp)
    params_total = _count_total_params(shape)
    return WeightCount(
        format=fmt,
        params_total=params_total,
        linear_params=linear_params,
        embedding_params=embedding,
        lm_head_params=lm_head,
        other_params=other,
        linear_bytes=linear_bytes,
        scale_bytes=scale_bytes,
        sixteen_bit_bytes=2 * (embedding + lm_head + other),
        buffer_bytes=2 * shape.max_position_embeddings * shape.head_dim,
    )


def _count_total_params(shape: ModelShape) -> int:
    """The model's parameter count as published (unpadded vocabulary, one GPU)."""
    dense, moe = _layer_linears(shape, 1)
    moe_layers = shape.moe_layers if shape.is_moe else 0
    linear = sum(item.params for item in dense) * (shape.num_hidden_layers - moe_layers)
    linear += sum(item.params for item in moe) * moe_layers
    embedding = shape.vocab_size * shape.hidden_size
    lm_head = 0 if shape.tie_word_embeddings else embedding
    return linear + embedding + lm_head + _other_params(shape, 1)


def kv_dtype_bytes(kv_dtype: str) -> int:
    """Bytes per KV element: ``fp8`` is 1; ``auto`` follows the 16-bit model dtype (2)."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"unknown KV cache dtype '{kv_dtype}' (known: {', '.join(KV_DTYPES)})")
    return 1 if kv_dtype == "fp8" else 2


def kv_bytes_per_token(shape: ModelShape, kv_dtype: str, tp: int = 1) -> int:
    """``2 × layers × kv_heads × head_dim × dtype bytes``; per GPU with ``tp`` ranks."""
    return (
        2 * shape.num_hidden_layers * kv_heads_per_gpu(shape, tp) * shape.head_dim * kv_dtype_bytes(kv_dtype)
    )


def sequence_blocks(shape: ModelShape, max_model_len: int, max_num_batched_tokens: int) -> int:
    """KV blocks one request of ``max_model_len`` tokens may hold, as vLLM counts them.

    Full attention keeps every token. A uniform sliding window keeps the window plus one
    step's tokens (vLLM's ``SlidingWindowSpec.max_memory_usage_bytes``), plus one block.
    """
    if shape.sliding_window is None:
        return _cdiv(max_model_len, BLOCK_SIZE)
    tokens = min(shape.sliding_window - 1 + max_num_batched_tokens, max_model_len)
    return _cdiv(tokens, BLOCK_SIZE) + 1


@dataclass(frozen=True)
class Activation:
    """The profiled activation peak and its two candidates."""

    step_bytes: int  # one forward step of max_num_batched_tokens tokens
    sampler_bytes: int  # the sampler's logits for min(max_num_seqs, tokens) requests
    tokens: int
    requests: int
    persistent_bytes: int = 0  # the model runner's input buffers (inputs_embeds)
    bytes_per_logit: int = SAMPLER_BYTES_PER_LOGIT

    @property
    def bytes(self) -> int:
        return max(self.step_bytes, self.sampler_bytes) + self.persistent_bytes


def activation_bytes(
    shape: ModelShape,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    tp: int = 1,
    *,
    vllm_version: tuple[int, int] = VLLM_VERSION,
) -> Activation:
    """The activation peak vLLM's profile run sees (model dtype, 2 B per element).

    vLLM 0.32's ``profile_run`` (``v1/worker/gpu_model_runner.py:6133``) runs one eager forward
    pass of T = ``max_num_batched_tokens`` tokens over B = ``min(max_num_seqs, T)`` requests,
    then the sampler on B rows; the peak is the larger of the two:

    - the step holds about four hidden-sized tensors (residual, normed input, attention and MLP
      outputs) and the MLP's ``gate_up`` output plus its activation (3 × intermediate, split by
      TP); MoE layers route each token to ``num_experts_per_tok`` experts. Attention tiles over
      the paged cache, so context length does not enter;
    - the sampler holds ``bytes_per_logit`` per (request, vocabulary entry)
      (:data:`SAMPLER_BYTES_PER_LOGIT`, or :data:`SORT_SAMPLER_BYTES_PER_LOGIT` before 0.17),
      the Triton top-k/top-p scratch (0.17+), the step's hidden states and the rows it samples.

    The runner's ``inputs_embeds`` buffer (T × hidden) is there all along.
    """
    tokens = max_num_batched_tokens
    hidden = shape.hidden_size
    inter = shape.intermediate_size
    if shape.is_moe:
        routed = shape.num_experts_per_tok * shape.moe_intermediate_size
        routed += shape.shared_expert_intermediate_size
        dense_layers = shape.moe_layers < shape.num_hidden_layers
        inter = max(routed, inter) if dense_layers else routed
    step = tokens * 2 * (4 * hidden + 3 * _cdiv(inter, tp))
    requests = min(max_num_seqs, tokens)
    vocab = _padded_vocab(shape.vocab_size, 1)
    sort_path = vllm_version < (0, 17)
    per_logit = SORT_SAMPLER_BYTES_PER_LOGIT if sort_path else SAMPLER_BYTES_PER_LOGIT
    sampler = requests * vocab * per_logit
    if not sort_path:
        sampler += 4 * min(requests, TOPK_SCRATCH_ROWS) * vocab
    sampler += tokens * hidden * 2 + requests * hidden * 4  # the step's hidden states; the rows sampled
    return Activation(
        step_bytes=step,
        sampler_bytes=sampler,
        tokens=tokens,
        requests=requests,
        persistent_bytes=tokens * hidden * 2,
        bytes_per_logit=per_logit,
    )


@dataclass(frozen=True)
class Runtime:
    """The runtime bill, split by where it sits relative to vLLM's budget."""

    cuda_context_bytes: int  # outside the budget
    nccl_bytes: int  # outside the budget (tensor parallel only)
    non_torch_bytes: int  # inside
    cuda_graph_bytes: int  # 0 with --enforce-eager
    capture_size: int  # largest batch captured in a graph (0 with --enforce-eager)
    #: vLLM 0.21+ takes the graphs' estimate out of the budget; before, they lived in the slack
    graphs_in_budget: bool = True

    @property
    def bytes(self) -> int:
        return self.outside_budget_bytes + self.inside_budget_bytes

    @property
    def outside_budget_bytes(self) -> int:
        graphs = 0 if self.graphs_in_budget else self.cuda_graph_bytes
        return self.cuda_context_bytes + self.nccl_bytes + graphs

    @property
    def inside_budget_bytes(self) -> int:
        return self.non_torch_bytes + (self.cuda_graph_bytes if self.graphs_in_budget else 0)


def runtime_bytes(
    shape: ModelShape,
    max_num_seqs: int,
    enforce_eager: bool,
    tp: int = 1,
    *,
    vllm_version: tuple[int, int] = VLLM_VERSION,
    gpu_arch: str | None = None,
) -> Runtime:
    """CUDA context, workspaces and the CUDA graph estimate for one GPU (``gpu_arch``:
    ``hopper`` keeps a larger cuBLAS workspace)."""
    capture = 0 if enforce_eager else min(2 * max_num_seqs, CUDA_GRAPH_MAX_CAPTURE)
    graphs = 0
    if capture:
        graphs = CUDA_GRAPH_FIXED_BYTES + (
            CUDA_GRAPH_BYTES_PER_UNIT * shape.num_hidden_layers * capture * shape.hidden_size
        )
    return Runtime(
        cuda_context_bytes=CUDA_CONTEXT_BYTES,
        nccl_bytes=NCCL_BYTES if tp > 1 else 0,
        non_torch_bytes=NON_TORCH_BYTES + (HOPPER_WORKSPACE_BYTES if gpu_arch == "hopper" else 0),
        cuda_graph_bytes=graphs,
        capture_size=capture,
        graphs_in_budget=vllm_version >= (0, 21),
    )


@dataclass(frozen=True)
class KvPool:
    """The pool vLLM 0.33 allocates at start-up, and what it logs about it."""

    budget_bytes: int  # ceil(total × gpu_memory_utilization)
    non_kv_bytes: int  # weights + activation peak + non-torch + CUDA graph estimate
    available_bytes: int  # budget − non-KV (may be negative: start-up fails)
    num_blocks: int
    tokens: int  # "GPU KV cache size: N tokens"
    max_model_len: int
    blocks_per_request: int
    max_concurrency: float  # "Maximum concurrency for L tokens per request: X.XXx"

    @property
    def fits_one_request(self) -> bool:
        return self.num_blocks >= self.blocks_per_request > 0

    @property
    def log_line(self) -> str:
        return (
            f"GPU KV cache size: {self.tokens:,} tokens, Maximum concurrency for "
            f"{self.max_model_len:,} tokens per request: {self.max_concurrency:.2f}x"
        )


def kv_pool(
    *,
    total_bytes: int,
    gpu_memory_utilization: float,
    non_kv_bytes: int,
    bytes_per_token: int,
    blocks_per_request: int,
    max_model_len: int,
) -> KvPool:
    """Size the pool the way vLLM 0.33's ``determine_available_memory`` does.

    ``available = ceil(total × utilization) − non_kv``; ``num_blocks = available //
    (block_size × bytes_per_token)``; the concurrency is ``num_blocks / blocks_per_request``.
    """
    budget = math.ceil(total_bytes * gpu_memory_utilization)
    available = budget - non_kv_bytes
    block_bytes = BLOCK_SIZE * bytes_per_token
    blocks = max(0, available // block_bytes)
    concurrency = blocks / blocks_per_request if blocks_per_request else 0.0
    return KvPool(
        budget_bytes=budget,
        non_kv_bytes=non_kv_bytes,
        available_bytes=available,
        num_blocks=blocks,
        tokens=blocks * BLOCK_SIZE,
        max_model_len=max_model_len,
        blocks_per_request=blocks_per_request,
        max_concurrency=concurrency,
    )
