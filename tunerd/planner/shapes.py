"""Model shapes: the numbers in a Hugging Face ``config.json`` that decide GPU memory.

A :class:`ModelShape` comes from the built-in registry (:data:`BUILTIN_MODELS`, transcribed
from each model's published ``config.json``; see ``docs/planner.md``) or from a user's
``config.json`` through :func:`shape_from_config`. Validation is strict: a missing or
nonsensical field raises :class:`ShapeError` naming the field, because a planner that guesses
a layer count plans the wrong card.

Attention layouts the planner cannot count exactly are refused, not approximated: mixed
sliding-window/full layers (Gemma 2/3, Qwen2 with ``use_sliding_window``), MLA (DeepSeek) and
linear-attention hybrids. Uniform sliding windows on every layer (Mistral-7B v0.1, Phi-3) are
counted as vLLM does: a request holds at most the window's worth of KV.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tunerd.errors import InputError

__all__ = [
    "BUILTIN_MODELS",
    "MODEL_ALIASES",
    "ModelShape",
    "Quantization",
    "ShapeError",
    "builtin_model",
    "load_model_config",
    "model_key",
    "shape_from_config",
]


class ShapeError(InputError):
    """A model shape that cannot be planned; the message names the field or the reason."""


@dataclass(frozen=True)
class Quantization:
    """How a checkpoint stores its linear layers, as its ``quantization_config`` says."""

    weights: str  # one of the planner's weight formats (a config's awq/gptq are int4; a name's stay awq/gptq)
    method: str  # the checkpoint's quant_method: awq, gptq, fp8, compressed-tensors, ...
    group_size: int | None = None  # int4: input columns per scale; None = per channel


@dataclass(frozen=True)
class ModelShape:
    """The shape of a decoder-only transformer, per the Hugging Face config field names."""

    name: str
    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    torch_dtype: str = "bfloat16"
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    sliding_window: int | None = None  # uniform window on every layer, tokens
    num_experts: int = 0  # mixture of experts: routed experts per MoE layer (0 = dense)
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    moe_layers: int = 0  # how many layers are MoE (the rest use intermediate_size)
    quantization: Quantization | None = None
    source: str = "built-in"
    notes: tuple[str, ...] = field(default=())

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def native_weights(self) -> str:
        """The weight format the checkpoint ships in, in the planner's words."""
        if self.quantization is not None:
            return self.quantization.weights
        return "fp16" if self.torch_dtype == "float16" else "bf16"


def _shape(name: str, **fields: Any) -> ModelShape:
    return ModelShape(name=name, **fields)


_LLAMA3_8B: dict[str, Any] = {
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
}
_QWEN2_BIAS: dict[str, Any] = {"attention_bias": True}

# fmt: off
#: Built-in shapes, transcribed from each model's ``config.json`` on the Hugging Face Hub
#: (the ``*-Instruct`` and base checkpoints share shapes unless noted).
BUILTIN_MODELS: dict[str, ModelShape] = {
    shape.name: shape
    for shape in (
        # meta-llama/Llama-2-7b-hf, Llama-2-13b-hf: multi-head attention (kv heads = heads).
        _shape("llama-2-7b", num_hidden_layers=32, hidden_size=4096, intermediate_size=11008,
               num_attention_heads=32, num_key_value_heads=32, head_dim=128, vocab_size=32000,
               max_position_embeddings=4096, torch_dtype="float16"),
        _shape("llama-2-13b", num_hidden_layers=40, hidden_size=5120, intermediate_size=13824,
               num_attention_heads=40, num_key_value_heads=40, head_dim=128, vocab_size=32000,
               max_position_embeddings=4096, torch_dtype="float16"),
        # meta-llama/Meta-Llama-3-8B: 8,192 positions. Llama-3.1-8B: same shapes, 131,072.
        _shape("llama-3-8b", max_position_embeddings=8192, **_LLAMA3_8B),
        _shape("llama-3.1-8b", max_position_embeddings=131072, **_LLAMA3_8B),
        _shape("llama-3.1-70b", num_hidden_layers=80, hidden_size=8192, intermediate_size=28672,
               num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=128256,
               max_position_embeddings=131072),
        _shape("llama-3.2-1b", num_hidden_layers=16, hidden_size=2048, intermediate_size=8192,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
               max_position_embeddings=131072, tie_word_embeddings=True),
        _shape("llama-3.2-3b", num_hidden_layers=28, hidden_size=3072, intermediate_size=8192,
               num_attention_heads=24, num_key_value_heads=8, head_dim=128, vocab_size=128256,
               max_position_embeddings=131072, tie_word_embeddings=True),
        # mistralai/Mistral-7B-Instruct-v0.3 (v0.2: vocab 32000); sliding_window null since v0.2.
        _shape("mistral-7b-v0.3", max_position_embeddings=32768,
               **{**_LLAMA3_8B, "vocab_size": 32768}),
        _shape("mistral-7b-v0.2", max_position_embeddings=32768,
               **{**_LLAMA3_8B, "vocab_size": 32000}),
        # mistralai/Mixtral-8x7B-Instruct-v0.1: 8 experts, 2 per token, every layer MoE.
        _shape("mixtral-8x7b", num_hidden_layers=32, hidden_size=4096, intermediate_size=14336,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=32000,
               max_position_embeddings=32768, num_experts=8, num_experts_per_tok=2,
               moe_intermediate_size=14336, moe_layers=32),
        # Qwen/Qwen2.5-*-Instruct: q/k/v bias; sliding_window present but use_sliding_window false.
        _shape("qwen2.5-0.5b", num_hidden_layers=24, hidden_size=896, intermediate_size=4864,
               num_attention_heads=14, num_key_value_heads=2, head_dim=64, vocab_size=151936,
               max_position_embeddings=32768, tie_word_embeddings=True, **_QWEN2_BIAS),
        _shape("qwen2.5-1.5b", num_hidden_layers=28, hidden_size=1536, intermediate_size=8960,
               num_attention_heads=12, num_key_value_heads=2, head_dim=128, vocab_size=151936,
               max_position_embeddings=32768, tie_word_embeddings=True, **_QWEN2_BIAS),
        _shape("qwen2.5-3b", num_hidden_layers=36, hidden_size=2048, intermediate_size=11008,
               num_attention_heads=16, num_key_value_heads=2, head_dim=128, vocab_size=151936,
               max_position_embeddings=32768, tie_word_embeddings=True, **_QWEN2_BIAS),
        _shape("qwen2.5-7b", num_hidden_layers=28, hidden_size=3584, intermediate_size=18944,
               num_attention_heads=28, num_key_value_heads=4, head_dim=128, vocab_size=152064,
               max_position_embeddings=32768, **_QWEN2_BIAS),
        _shape("qwen2.5-14b", num_hidden_layers=48, hidden_size=5120, intermediate_size=13824,
               num_attention_heads=40, num_key_value_heads=8, head_dim=128, vocab_size=152064,
               max_position_embeddings=32768, **_QWEN2_BIAS),
        _shape("qwen2.5-32b", num_hidden_layers=64, hidden_size=5120, intermediate_size=27648,
               num_attention_heads=40, num_key_value_heads=8, head_dim=128, vocab_size=152064,
               max_position_embeddings=32768, **_QWEN2_BIAS),
        _shape("qwen2.5-72b", num_hidden_layers=80, hidden_size=8192, intermediate_size=29568,
               num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=152064,
               max_position_embeddings=32768, **_QWEN2_BIAS),
        # Qwen/Qwen3-*: explicit head_dim 128, q/k RMSNorm, no bias, 40,960 positions.
        _shape("qwen3-0.6b", num_hidden_layers=28, hidden_size=1024, intermediate_size=3072,
               num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
               max_position_embeddings=40960, tie_word_embeddings=True, qk_norm=True),
        _shape("qwen3-1.7b", num_hidden_layers=28, hidden_size=2048, intermediate_size=6144,
               num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
               max_position_embeddings=40960, tie_word_embeddings=True, qk_norm=True),
        _shape("qwen3-4b", num_hidden_layers=36, hidden_size=2560, intermediate_size=9728,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
               max_position_embeddings=40960, tie_word_embeddings=True, qk_norm=True),
        _shape("qwen3-8b", num_hidden_layers=36, hidden_size=4096, intermediate_size=12288,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
               max_position_embeddings=40960, qk_norm=True),
        _shape("qwen3-14b", num_hidden_layers=40, hidden_size=5120, intermediate_size=17408,
               num_attention_heads=40, num_key_value_heads=8, head_dim=128, vocab_size=151936,
               max_position_embeddings=40960, qk_norm=True),
        _shape("qwen3-32b", num_hidden_layers=64, hidden_size=5120, intermediate_size=25600,
               num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=151936,
               max_position_embeddings=40960, qk_norm=True),
        # Qwen/Qwen3-30B-A3B: 128 experts, 8 per token, every layer MoE.
        _shape("qwen3-30b-a3b", num_hidden_layers=48, hidden_size=2048, intermediate_size=6144,
               num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
               max_position_embeddings=40960, qk_norm=True, num_experts=128,
               num_experts_per_tok=8, moe_intermediate_size=768, moe_layers=48),
    )
}
# fmt: on

#: Short names people type, and the checkpoint names they paste.
MODEL_ALIASES: dict[str, str] = {
    "mistral-7b": "mistral-7b-v0.3",
    "meta-llama-3-8b": "llama-3-8b",
    "meta-llama-3.1-8b": "llama-3.1-8b",
    "llama-3.1-8b-instruct": "llama-3.1-8b",
    "llama-3-8b-instruct": "llama-3-8b",
    "qwen2.5-7b-instruct": "qwen2.5-7b",
}


#: Words of a checkpoint's name that do not change its shapes (the tuned or converted
#: variants of a base model), and those that say how its weights are stored.
#: The group size of the common 4-bit checkpoints (AWQ, GPTQ): 128 input columns a scale.
_INT4_GROUP = 128
_VARIANT_WORDS = {"instruct", "chat", "hf", "it", "base", "dynamic", "2507"}
_EIGHT_BIT = {"int8", "8bit", "w8a8"}
_FOUR_BIT_WORDS = {"int4", "4bit", "w4a16"}
_METHOD_WORDS = {"awq", "gptq", "fp8", "bnb"}


def _weights_named(words: list[str]) -> str | None:
    """The weight format a checkpoint's name says: its bit width first (``-GPTQ-Int8`` is
    8-bit, not AWQ/GPTQ's usual 4; ``-bnb-8bit`` too), then its method (4-bit AWQ/GPTQ)."""
    if "fp8" in words:
        return "fp8"
    if _EIGHT_BIT & set(words):
        return "int8"
    for method in ("awq", "gptq"):
        if method in words:
            return method
    if (_FOUR_BIT_WORDS | {"bnb"}) & set(words):
        return "int4"
    return None


def model_key(name: str) -> tuple[str, str | None]:
    """The built-in key ``name`` means, and the weight format its name says (or None).

    ``org/`` is dropped and case ignored; so are the words of a tuned or converted variant
    (``-Instruct``, ``-chat-hf``, a leading ``Meta-``) and those of its quantization, which
    come back as the format: ``Qwen/Qwen2.5-72B-Instruct-AWQ`` → (``qwen2.5-72b``, ``awq``),
    ``Qwen/Qwen2.5-7B-Instruct-GPTQ-Int8`` → (``qwen2.5-7b``, ``int8``),
    ``mistralai/Mistral-7B-Instruct-v0.3`` → (``mistral-7b-v0.3``, None)."""
    key = name.strip().lower().split("/")[-1]
    if key in MODEL_ALIASES or key in BUILTIN_MODELS:
        return MODEL_ALIASES.get(key, key), None
    words = key.split("-")
    if words and words[0] == "meta":
        words = words[1:]
    weights = _weights_named(words)
    quantized = _EIGHT_BIT | _FOUR_BIT_WORDS | _METHOD_WORDS
    key = "-".join(word for word in words if word not in _VARIANT_WORDS and word not in quantized)
    return MODEL_ALIASES.get(key, key), weights


def builtin_model(name: str) -> ModelShape:
    """The built-in shape ``name`` means (:func:`model_key`: a Hub id such as
    ``meta-llama/Llama-3.1-8B-Instruct`` is fine). A quantized checkpoint's name makes its
    weights the shape's own (``native_weights``), as its ``quantization_config`` would."""
    key, weights = model_key(name)
    shape = BUILTIN_MODELS.get(key)
    if shape is None:
        known = ", ".join(sorted(BUILTIN_MODELS))
        raise ShapeError(
            f"unknown model '{name}' (built-in: {known}; or pass --model-config path/to/config.json)"
        )
    if weights is None:
        return shape
    group = _INT4_GROUP if weights in {"awq", "gptq", "int4"} else None
    return replace(shape, quantization=Quantization(weights, weights, group))


# ---------------------------------------------------------------------------------------------
# config.json


def load_model_config(path: str | Path) -> dict[str, Any]:
    """Read a ``config.json``; a JSON syntax error is reported with its line and column."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ShapeError(f"{file}: no such file") from None
    except OSError as error:
        raise ShapeError(f"{file}: cannot read: {error.strerror}") from None
    except UnicodeDecodeError:
        raise ShapeError(f"{file}: not a UTF-8 text file") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ShapeError(f"{file}:{error.lineno}:{error.colno}: invalid JSON: {error.msg}") from None
    if not isinstance(data, dict):
        raise ShapeError(f"{file}: expected a JSON object at the top level, got {type(data).__name__}")
    return data


# Hybrid and exotic attention the planner refuses rather than miscount.
_MIXED_ATTENTION_TYPES = {"gemma2", "gemma3", "gemma3_text", "cohere2", "gpt_oss", "llama4", "llama4_text"}
_UNIFORM_WINDOW_TYPES = {"mistral", "mixtral", "phi3", "starcoder2"}
_DTYPES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
}


def _positive_int(config: dict[str, Any], key: str, where: str) -> int:
    if key not in config or config[key] is None:
        raise ShapeError(f"{where}: field '{key}' is missing")
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ShapeError(f"{where}: field '{key}' must be a positive integer, got {value!r}")
    if value <= 0:
        raise ShapeError(f"{where}: field '{key}' must be a positive integer, got {value}")
    return value


def _optional_int(config: dict[str, Any], key: str, where: str) -> int | None:
    if config.get(key) is None:
        return None
    return _positive_int(config, key, where)


def _bool(config: dict[str, Any], key: str, where: str, default: bool) -> bool:
    value = config.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ShapeError(f"{where}: field '{key}' must be true or false, got {value!r}")
    return value


def _quantization(config: dict[str, Any], where: str) -> Quantization | None:
    raw = config.get("quantization_config")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ShapeError(f"{where}: field 'quantization_config' must be an object")
    method = str(raw.get("quant_method", "")).lower()
    if method in {"awq", "gptq", "awq_marlin", "gptq_marlin"}:
        bits = raw.get("bits", raw.get("w_bit", 4))
        if bits != 4:
            raise ShapeError(
                f"{where}: quantization_config.bits {bits!r} for {method} is not planned "
                f"(4-bit only); pass --weights to say how the weights are stored"
            )
        group = raw.get("group_size", raw.get("q_group_size", 128))
        if not isinstance(group, int) or isinstance(group, bool) or (group <= 0 and group != -1):
            raise ShapeError(f"{where}: quantization_config.group_size must be a positive integer or -1")
        return Quantization("int4", method, None if group == -1 else group)
    if method == "fp8":
        return Quantization("fp8", method)
    if method == "compressed-tensors":
        return _compressed_tensors(raw, where)
    if method == "bitsandbytes":
        if raw.get("load_in_4bit"):
            return Quantization("int4", method, 64)
        if raw.get("load_in_8bit"):
            return Quantization("int8", method)
    raise ShapeError(
        f"{where}: quantization_config.quant_method {method or '(none)'!r} is not understood; "
        f"pass --weights int4|int8|fp8 to say how the weights are stored"
    )


def _compressed_tensors(raw: dict[str, Any], where: str) -> Quantization:
    groups = raw.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ShapeError(f"{where}: quantization_config.config_groups is missing")
    first = next(iter(groups.values()))
    weights = first.get("weights") if isinstance(first, dict) else None
    if not isinstance(weights, dict):
        raise ShapeError(f"{where}: quantization_config.config_groups.*.weights is missing")
    bits = weights.get("num_bits")
    kind = weights.get("type", "int")
    if bits == 8 and kind == "float":
        return Quantization("fp8", "compressed-tensors")
    if bits == 8:
        return Quantization("int8", "compressed-tensors")
    if bits == 4:
        group = weights.get("group_size")
        return Quantization("int4", "compressed-tensors", group if isinstance(group, int) else None)
    raise ShapeError(
        f"{where}: quantization_config weights of {bits!r} bits ({kind}) are not planned; "
        f"pass --weights to say how the weights are stored"
    )


def _check_attention_layout(config: dict[str, Any], model_type: str, where: str) -> int | None:
    """The uniform sliding window (tokens) or None for full attention; refuse the rest."""
    if config.get("kv_lora_rank") is not None:
        raise ShapeError(
            f"{where}: multi-head latent attention (kv_lora_rank, DeepSeek-style) is not planned: "
            f"its KV cache is not 2 x kv_heads x head_dim per layer"
        )
    layer_types = config.get("layer_types")
    if isinstance(layer_types, list) and layer_types:
        kinds = set(layer_types)
        if kinds == {"full_attention"}:
            return None
        if kinds == {"sliding_attention"}:
            return _positive_int(config, "sliding_window", where)
        raise ShapeError(
            f"{where}: mixed attention layers ({', '.join(sorted(str(k) for k in kinds))} in "
            f"layer_types) are not planned: vLLM sizes such pools per layer group"
        )
    if model_type in _MIXED_ATTENTION_TYPES:
        raise ShapeError(
            f"{where}: {model_type} interleaves sliding-window and full attention layers; "
            f"mixed layouts are not planned"
        )
    if model_type in {"qwen2", "qwen2_moe", "qwen3", "qwen3_moe"}:
        if config.get("use_sliding_window"):
            raise ShapeError(
                f"{where}: use_sliding_window is true with max_window_layers "
                f"{config.get('max_window_layers')!r}: mixed sliding/full layers are not planned"
            )
        return None
    # An absent key is full attention: the larger KV, never an optimistic plan (transformers'
    # MistralConfig would default it to 4096; shape_from_config says so)
    window = config.get("sliding_window")
    if window is None:
        return None
    if model_type in _UNIFORM_WINDOW_TYPES:
        if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
            raise ShapeError(f"{where}: field 'sliding_window' must be a positive integer or null")
        return window
    raise ShapeError(
        f"{where}: sliding_window {window!r} on model_type {model_type or '(none)'!r}: cannot tell "
        f'whether every layer slides; add "layer_types" to the config to say which layers do'
    )


def shape_from_config(config: dict[str, Any], name: str = "config.json") -> ModelShape:
    """A :class:`ModelShape` from a parsed ``config.json``; ``name`` prefixes every error."""
    where = name
    notes: list[str] = []
    if isinstance(config.get("text_config"), dict):
        # Vision-language configs nest the decoder; plan the decoder (the vision tower is small
        # next to it, and is counted nowhere: say so).
        quant = config.get("quantization_config")
        config = {**config["text_config"]}
        if quant is not None and "quantization_config" not in config:
            config["quantization_config"] = quant
        where = f"{name}: text_config"
        notes.append("planned the text decoder from text_config; a vision tower is not counted")
    model_type = str(config.get("model_type", "")).lower()
    layers = _positive_int(config, "num_hidden_layers", where)
    hidden = _positive_int(config, "hidden_size", where)
    heads = _positive_int(config, "num_attention_heads", where)
    kv_heads = _optional_int(config, "num_key_value_heads", where)
    if kv_heads is None:
        kv_heads = heads
        notes.append("num_key_value_heads absent: multi-head attention assumed (kv heads = heads)")
    if kv_heads > heads:
        raise ShapeError(
            f"{where}: field 'num_key_value_heads' ({kv_heads}) exceeds num_attention_heads ({heads})"
        )
    head_dim = _optional_int(config, "head_dim", where)
    if head_dim is None:
        if hidden % heads:
            raise ShapeError(
                f"{where}: field 'head_dim' is missing and hidden_size {hidden} is not divisible "
                f"by num_attention_heads {heads}"
            )
        head_dim = hidden // heads
    vocab = _positive_int(config, "vocab_size", where)
    positions = _positive_int(config, "max_position_embeddings", where)
    raw_dtype = config.get("torch_dtype", config.get("dtype", "bfloat16"))
    dtype = _DTYPES.get(str(raw_dtype).lower())
    if dtype is None:
        raise ShapeError(f"{where}: field 'torch_dtype' {raw_dtype!r} is not a known dtype")
    if dtype == "float32":
        notes.append("float32 checkpoint: vLLM's --dtype auto serves it in 16-bit")
        dtype = "bfloat16"
    window = _check_attention_layout(config, model_type, where)
    if model_type in _UNIFORM_WINDOW_TYPES and "sliding_window" not in config:
        notes.append(
            "config.json has no sliding_window: planned as full attention (the larger KV cache); "
            "transformers would default a mistral config to a 4,096-token window — add the key to say"
        )
    if window is not None and window >= positions:
        window = None  # a window as long as the context is full attention
    num_experts = config.get("num_local_experts") or config.get("num_experts") or 0
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 0:
        raise ShapeError(f"{where}: field 'num_experts' must be a non-negative integer")
    intermediate = _positive_int(config, "intermediate_size", where)
    moe_fields: dict[str, int] = {}
    if num_experts:
        per_token = _positive_int(config, "num_experts_per_tok", where)
        moe_inter = _optional_int(config, "moe_intermediate_size", where) or intermediate
        shared = _optional_int(config, "shared_expert_intermediate_size", where) or 0
        step = _optional_int(config, "decoder_sparse_step", where) or 1
        dense_only = config.get("mlp_only_layers") or []
        if not isinstance(dense_only, list):
            raise ShapeError(f"{where}: field 'mlp_only_layers' must be a list of layer indexes")
        moe_layers = sum(1 for index in range(layers) if (index + 1) % step == 0 and index not in dense_only)
        moe_fields = {
            "num_experts": num_experts,
            "num_experts_per_tok": per_token,
            "moe_intermediate_size": moe_inter,
            "shared_expert_intermediate_size": shared,
            "moe_layers": moe_layers,
        }
    return ModelShape(
        name=str(config.get("_name_or_path") or name),
        num_hidden_layers=layers,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        max_position_embeddings=positions,
        tie_word_embeddings=_bool(config, "tie_word_embeddings", where, False),
        torch_dtype=dtype,
        attention_bias=_bool(config, "attention_bias", where, model_type in {"qwen2", "qwen2_moe"}),
        qk_norm=model_type in {"qwen3", "qwen3_moe"},
        sliding_window=window,
        quantization=_quantization(config, where),
        source=name,
        notes=tuple(notes),
        **moe_fields,
    )


def with_name(shape: ModelShape, name: str) -> ModelShape:
    """The same shape under another display name."""
    return replace(shape, name=name)
