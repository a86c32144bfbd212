"""Model shapes: the built-in registry and config.json, validated field by field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tunerd.planner.bills import kv_bytes_per_token
from tunerd.planner.shapes import (
    BUILTIN_MODELS,
    ShapeError,
    builtin_model,
    load_model_config,
    shape_from_config,
)

LLAMA31_CONFIG: dict[str, Any] = {  # the fields of meta-llama/Llama-3.1-8B-Instruct's config.json
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}


def _config(**changes: Any) -> dict[str, Any]:
    config = dict(LLAMA31_CONFIG)
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    return config


class TestRegistry:
    def test_builtin_model_required_names(self) -> None:
        for name in ("llama-2-7b", "llama-3-8b", "llama-3.1-8b", "mistral-7b", "qwen2.5-7b"):
            assert builtin_model(name).num_hidden_layers > 0

    def test_builtin_model_case_and_org_prefix_ignored(self) -> None:
        assert builtin_model("Meta-Llama/Llama-3.1-8B") == builtin_model("llama-3.1-8b")

    def test_builtin_model_mistral_has_no_sliding_window(self) -> None:
        """v0.2 and v0.3 dropped v0.1's 4,096-token window."""
        assert builtin_model("mistral-7b").sliding_window is None
        assert builtin_model("mistral-7b-v0.2").vocab_size == 32000

    def test_builtin_model_positions(self) -> None:
        assert builtin_model("llama-3-8b").max_position_embeddings == 8192
        assert builtin_model("llama-3.1-8b").max_position_embeddings == 131072

    def test_builtin_model_unknown_lists_known(self) -> None:
        with pytest.raises(ShapeError) as caught:
            builtin_model("gpt-5")
        assert "unknown model 'gpt-5'" in str(caught.value)
        assert "llama-3.1-8b" in str(caught.value)
        assert "--model-config" in str(caught.value)

    def test_builtin_registry_shapes_consistent(self) -> None:
        for shape in BUILTIN_MODELS.values():
            assert shape.num_attention_heads % shape.num_key_value_heads == 0, shape.name
            assert shape.head_dim in {64, 128}, shape.name


class TestConfig:
    def test_shape_from_config_llama31_matches_builtin_kv(self) -> None:
        shape = shape_from_config(LLAMA31_CONFIG)
        assert kv_bytes_per_token(shape, "fp16") == 131072
        assert shape.head_dim == 128  # hidden_size / num_attention_heads

    def test_shape_from_config_explicit_head_dim_wins(self) -> None:
        """Qwen3 and Gemma set head_dim apart from hidden / heads; the explicit one counts."""
        shape = shape_from_config(_config(head_dim=256))
        assert shape.head_dim == 256
        assert kv_bytes_per_token(shape, "fp16") == 2 * 32 * 8 * 256 * 2

    def test_shape_from_config_missing_kv_heads_is_mha(self) -> None:
        shape = shape_from_config(_config(num_key_value_heads=None))
        assert shape.num_key_value_heads == 32
        assert any("multi-head" in note for note in shape.notes)

    @pytest.mark.parametrize(
        ("changes", "fragment"),
        [
            ({"num_hidden_layers": None}, "field 'num_hidden_layers' is missing"),
            ({"num_hidden_layers": 0}, "field 'num_hidden_layers' must be a positive integer, got 0"),
            ({"num_attention_heads": -4}, "field 'num_attention_heads' must be a positive integer"),
            ({"hidden_size": "4096"}, "field 'hidden_size' must be a positive integer, got '4096'"),
            ({"num_key_value_heads": 64}, "field 'num_key_value_heads' (64) exceeds"),
            ({"num_attention_heads": 30}, "field 'head_dim' is missing and hidden_size 4096"),
            ({"vocab_size": None}, "field 'vocab_size' is missing"),
            ({"torch_dtype": "float8"}, "field 'torch_dtype' 'float8' is not a known dtype"),
            ({"tie_word_embeddings": "no"}, "field 'tie_word_embeddings' must be true or false"),
        ],
    )
    def test_shape_from_config_bad_field_named(self, changes: dict[str, Any], fragment: str) -> None:
        with pytest.raises(ShapeError) as caught:
            shape_from_config(_config(**changes), name="x/config.json")
        assert str(caught.value).startswith("x/config.json: ")
        assert fragment in str(caught.value)

    def test_shape_from_config_mixed_attention_refused(self) -> None:
        config = _config(
            model_type="gemma3_text",
            sliding_window=1024,
            layer_types=["sliding_attention"] * 5 + ["full_attention"],
        )
        with pytest.raises(ShapeError, match="mixed attention layers"):
            shape_from_config(config)

    def test_shape_from_config_gemma2_window_refused(self) -> None:
        with pytest.raises(ShapeError, match="interleaves sliding-window and full"):
            shape_from_config(_config(model_type="gemma2", sliding_window=4096))

    def test_shape_from_config_unknown_window_refused(self) -> None:
        with pytest.raises(ShapeError, match="cannot tell whether every layer slides"):
            shape_from_config(_config(model_type="somenewarch", sliding_window=4096))

    def test_shape_from_config_uniform_window_kept(self) -> None:
        shape = shape_from_config(_config(model_type="mistral", sliding_window=4096))
        assert shape.sliding_window == 4096

    def test_shape_from_config_qwen2_window_unused_is_full(self) -> None:
        shape = shape_from_config(
            _config(model_type="qwen2", sliding_window=131072, use_sliding_window=False)
        )
        assert shape.sliding_window is None
        assert shape.attention_bias  # Qwen2 has q/k/v bias

    def test_shape_from_config_mla_refused(self) -> None:
        with pytest.raises(ShapeError, match="multi-head latent attention"):
            shape_from_config(_config(model_type="deepseek_v2", kv_lora_rank=512))

    @pytest.mark.parametrize(
        ("quantization", "weights", "group"),
        [
            ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}, "int4", 128),
            ({"quant_method": "gptq", "bits": 4, "group_size": 32}, "int4", 32),
            ({"quant_method": "gptq", "bits": 4, "group_size": -1}, "int4", None),
            ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "fp8", None),
            (
                {
                    "quant_method": "compressed-tensors",
                    "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "int"}}},
                },
                "int8",
                None,
            ),
        ],
    )
    def test_shape_from_config_quantization(
        self, quantization: dict[str, Any], weights: str, group: int | None
    ) -> None:
        shape = shape_from_config(_config(quantization_config=quantization))
        assert shape.quantization is not None
        assert shape.native_weights == weights
        assert shape.quantization.group_size == group

    def test_shape_from_config_unknown_quantization_named(self) -> None:
        with pytest.raises(ShapeError, match="quant_method 'hqq' is not understood"):
            shape_from_config(_config(quantization_config={"quant_method": "hqq"}))

    def test_shape_from_config_text_config_nested(self) -> None:
        config = {"model_type": "llava", "text_config": dict(LLAMA31_CONFIG)}
        shape = shape_from_config(config)
        assert shape.num_hidden_layers == 32
        assert any("vision tower" in note for note in shape.notes)

    def test_shape_from_config_moe(self) -> None:
        config = _config(
            model_type="qwen3_moe",
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=768,
            decoder_sparse_step=1,
            mlp_only_layers=[0, 1],
        )
        shape = shape_from_config(config)
        assert shape.is_moe
        assert shape.moe_layers == 30


class TestLoadConfig:
    def test_load_model_config_malformed_json_line_and_column(self, tmp_path: Path) -> None:
        path = tmp_path / "config.json"
        path.write_text('{\n  "num_hidden_layers": 32,\n  "hidden_size" 4096\n}\n')
        with pytest.raises(ShapeError) as caught:
            load_model_config(path)
        assert str(caught.value).startswith(f"{path}:3:17: invalid JSON")

    def test_load_model_config_missing_file(self, tmp_path: Path) -> None:
        with pytest.raises(ShapeError, match="no such file"):
            load_model_config(tmp_path / "nope.json")

    def test_load_model_config_not_an_object(self, tmp_path: Path) -> None:
        path = tmp_path / "config.json"
        path.write_text(json.dumps([1, 2]))
        with pytest.raises(ShapeError, match="expected a JSON object"):
            load_model_config(path)
