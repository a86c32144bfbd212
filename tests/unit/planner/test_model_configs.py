"""Real Hugging Face config.json files (tests/data/model_configs, see its PROVENANCE.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tunerd.planner.bills import count_weights, kv_bytes_per_token, sequence_blocks
from tunerd.planner.shapes import ModelShape, ShapeError, builtin_model, load_model_config, shape_from_config

CONFIGS = Path(__file__).parents[2] / "data" / "model_configs"
SHAPE_FIELDS = (
    "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings", "attention_bias",
    "qk_norm", "sliding_window", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
    "moe_layers",
)  # fmt: skip


def load(name: str) -> ModelShape:
    path = CONFIGS / name
    return shape_from_config(load_model_config(path), name=str(path))


@pytest.mark.parametrize(
    ("file", "builtin"),
    [
        ("qwen3-8b.json", "qwen3-8b"),
        ("qwen3-8b-resaved-tf4.57.json", "qwen3-8b"),
        ("llama-3.1-8b.json", "llama-3.1-8b"),
        ("qwen2.5-7b.json", "qwen2.5-7b"),
        ("llama-2-13b.json", "llama-2-13b"),
        ("mixtral-8x7b.json", "mixtral-8x7b"),
    ],
)
def test_config_matches_builtin_shape(file: str, builtin: str) -> None:
    """The registry was transcribed from these files: every field that costs memory agrees,
    and so do the weights and KV they price."""
    from_file = load(file)
    expected = builtin_model(builtin)
    for field in SHAPE_FIELDS:
        assert getattr(from_file, field) == getattr(expected, field), field
    parameters = [count_weights(shape, "bf16") for shape in (from_file, expected)]
    assert len({count.bytes - count.buffer_bytes for count in parameters}) == 1  # the rope cache
    # follows max_position_embeddings, where a checkpoint's own config may say more
    assert kv_bytes_per_token(from_file, "fp16") == kv_bytes_per_token(expected, "fp16")


def test_config_qwen3_explicit_head_dim_kv() -> None:
    assert kv_bytes_per_token(load("qwen3-8b.json"), "fp16") == 147_456


def test_config_not_builtin_command_r_kv() -> None:
    """Cohere Command-R v01 is not built in: 40 layers × 64 KV heads × (8192 / 64) × 2 × 2 B."""
    shape = load("command-r-v01.json")
    assert shape.head_dim == 128
    assert kv_bytes_per_token(shape, "fp16") == 1_310_720
    assert kv_bytes_per_token(shape, "fp8") == 655_360


def test_config_mistral_v01_uniform_window() -> None:
    """Mistral-7B v0.1 slides a 4,096-token window on every layer: a request holds at most
    the window plus one step."""
    shape = load("mistral-7b-v0.1.json")
    assert shape.sliding_window == 4096
    assert sequence_blocks(shape, 8192, 2048) == (4095 + 2048 + 15) // 16 + 1


def test_config_mistral_window_key_absent_is_planned_as_full_attention() -> None:
    """No "sliding_window" key (issue 17): transformers' MistralConfig would default it to a
    4,096-token window, but a file that does not say so is planned with full attention — the
    larger KV, so never an optimistic plan — and the plan says why."""
    shape = load("mistral-7b-instruct-v0.1.json")
    assert shape.sliding_window is None
    assert [note for note in shape.notes if "no sliding_window" in note]
    assert sequence_blocks(shape, 8192, 2048) == 8192 // 16


def test_config_gemma2_mixed_attention_refused() -> None:
    with pytest.raises(ShapeError, match="gemma2 interleaves sliding-window and full attention"):
        load("gemma-2-9b-it.json")


@pytest.mark.parametrize("file", ["deepseek-v3.1-nvfp4.json", "kimi-k2-instruct.json"])
def test_config_mla_refused(file: str) -> None:
    with pytest.raises(ShapeError, match="multi-head latent attention"):
        load(file)
