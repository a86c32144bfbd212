"""Verdicts and recommendations: the seed's five combinations, the inverse questions, flags."""

from __future__ import annotations

import pytest

from tunerd.planner.bills import BLOCK_SIZE
from tunerd.planner.gpus import GPU_PROFILES, gpu_profile
from tunerd.planner.recommend import MIN_SLACK_BYTES, Plan, PlanRequest, make_plan, safe_utilization
from tunerd.planner.report import plan_to_dict, render_explain, render_text
from tunerd.planner.shapes import builtin_model

# Flags `vllm serve` 0.33 accepts (reference/vllm-facts.md §4) among those the planner emits.
VLLM_FLAGS = {
    "--gpu-memory-utilization",
    "--max-model-len",
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--enable-chunked-prefill",
    "--kv-cache-dtype",
    "--dtype",
    "--tensor-parallel-size",
    "--enforce-eager",
    "--quantization",
}
VLLM_KV_VALUES = {"auto", "float16", "bfloat16", "fp8"}


def _plan(
    *,
    model: str = "llama-3.1-8b",
    weights: str = "bf16",
    kv: str = "fp16",
    gpu: str = "rtx4090",
    concurrency: int | None = 4,
    context: int | None = 32768,
    **settings: object,
) -> Plan:
    return make_plan(
        PlanRequest(
            shape=builtin_model(model),
            gpu=gpu_profile(gpu),
            weights=weights,
            kv_dtype=kv,
            concurrency=concurrency,
            context=context,
            **settings,
        )
    )  # type: ignore[arg-type]


class TestSeedCombinations:
    """The seed's table for Llama-3-8B, 4 × 32K on a 24 GiB card, planned on Llama-3.1-8B."""

    @pytest.mark.parametrize(
        ("weights", "kv", "verdict"),
        [
            ("bf16", "fp16", "does_not_fit"),  # seed: 32 GB, not feasible
            ("int8", "fp16", "does_not_fit"),  # seed: 24 GB, "at the limit, almost no margin"
            ("awq", "fp16", "does_not_fit"),  # seed: feasible; counted: 0.2 GiB short (see below)
            ("awq", "fp8", "comfortable"),  # seed: very comfortable, recommended
            ("int8", "fp8", "comfortable"),  # seed: feasible, best quality
        ],
    )
    def test_make_plan_seed_verdicts(self, weights: str, kv: str, verdict: str) -> None:
        plan = _plan(weights=weights, kv=kv)
        assert plan.scenario.verdict == verdict
        assert plan.scenario.fits is (verdict != "does_not_fit")

    def test_make_plan_int4_fp16_explains_changed_verdict(self) -> None:
        """By hand (params × 0.5 B + 16 GiB KV = 19.7 GiB on a 24 GiB card) it fits; counted,
        it is short, and --explain says why: 16-bit embeddings, CUDA's smaller total, the
        budget and the runtime."""
        plan = _plan(weights="awq", kv="fp16")
        assert -0.5 * 1024**3 < plan.scenario.spare_bytes < 0
        explain = "\n".join(render_explain(plan))
        assert "Why this differs from a by-hand sum" in explain
        assert "16-bit embeddings and lm_head" in explain
        assert "CUDA sees 23.52 GiB" in explain

    def test_make_plan_agreeing_verdict_has_no_difference_note(self) -> None:
        explain = "\n".join(render_explain(_plan(weights="awq", kv="fp8")))
        assert "Why this differs" not in explain

    def test_make_plan_seed_working_config_recommended(self) -> None:
        """The seed's final config is what the planner recommends for its scenario."""
        plan = _plan(weights="awq", kv="fp8")
        recommended = plan_to_dict(plan)["recommended"]
        assert {
            key: recommended[key]
            for key in (
                "gpu_memory_utilization",
                "max_model_len",
                "max_num_seqs",
                "max_num_batched_tokens",
                "enable_chunked_prefill",
                "kv_cache_dtype",
            )
        } == {
            "gpu_memory_utilization": 0.92,
            "max_model_len": 32768,
            "max_num_seqs": 8,
            "max_num_batched_tokens": 2048,
            "enable_chunked_prefill": True,
            "kv_cache_dtype": "fp8",
        }
        assert plan.recommendation.vllm_args == (
            "--gpu-memory-utilization",
            "0.92",
            "--max-model-len",
            "32768",
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "2048",
            "--enable-chunked-prefill",
            "--kv-cache-dtype",
            "fp8",
        )


class TestRecommendations:
    @pytest.mark.parametrize("weights", ["bf16", "int8", "awq"])
    @pytest.mark.parametrize("kv", ["fp16", "fp8", "auto"])
    @pytest.mark.parametrize("gpu", sorted(GPU_PROFILES))
    def test_recommendation_fits_when_it_says_so(self, weights: str, kv: str, gpu: str) -> None:
        """A recommendation that claims to fit is re-priced and its pool holds the workload."""
        plan = _plan(weights=weights, kv=kv, gpu=gpu)
        chosen = plan.recommendation.scenario
        if plan.recommendation.fits:
            assert chosen.fits
            assert chosen.pool.num_blocks >= 4 * (32768 // BLOCK_SIZE)
            assert chosen.slack_bytes >= MIN_SLACK_BYTES
        assert chosen.pool.fits_one_request  # vLLM starts with these flags either way

    def test_recommendation_quantizes_kv_before_weights(self) -> None:
        plan = _plan(model="qwen2.5-7b", weights="bf16", kv="fp16")
        assert plan.recommendation.weights_format == "bf16"
        assert plan.recommendation.kv_dtype == "fp8"

    def test_recommendation_keeps_input_when_it_fits(self) -> None:
        plan = _plan(model="qwen2.5-7b", weights="awq", kv="fp16")
        assert plan.scenario.fits
        assert (plan.recommendation.weights_format, plan.recommendation.kv_dtype) == ("awq", "fp16")
        assert plan.recommendation.reasons == ()

    def test_recommendation_nothing_fits_still_startable(self) -> None:
        """Llama-2-7B (MHA) needs 32 GiB of fp8 KV for 4 × 32K: nothing fits a 24 GiB card,
        and the recommended flags shrink max_model_len to what vLLM will start with."""
        plan = _plan(model="llama-2-7b", context=4096, concurrency=64)
        assert not plan.recommendation.fits
        assert any("nothing fits" in warning for warning in plan.warnings)

    def test_recommendation_unsafe_utilization_lowered(self) -> None:
        """0.97 on a 4090 leaves 0.7 GiB beside the budget: the plan fails and says why."""
        plan = _plan(weights="awq", kv="fp8", gpu_memory_utilization=0.97, max_num_batched_tokens=8192)
        assert not plan.scenario.fits
        assert plan.scenario.pool_fits
        assert not plan.scenario.safe_slack
        assert any("expect CUDA OOM" in warning for warning in plan.warnings)
        recommended = plan_to_dict(plan)["recommended"]
        assert recommended["gpu_memory_utilization"] == 0.92
        assert recommended["max_num_batched_tokens"] == 2048
        assert len(plan.recommendation.reasons) == 2

    def test_recommendation_lower_utilization_respected(self) -> None:
        """An operator sharing the card asks for less; the plan never raises it."""
        plan = _plan(weights="awq", kv="fp8", gpu_memory_utilization=0.6)
        assert plan.recommendation.scenario.settings.gpu_memory_utilization == 0.6

    @pytest.mark.parametrize("gpu", sorted(GPU_PROFILES))
    def test_vllm_args_are_vllm_spellings(self, gpu: str) -> None:
        plan = _plan(weights="awq", kv="fp16", gpu=gpu, tensor_parallel=2, enforce_eager=True)
        args = plan.recommendation.vllm_args
        flags = [arg for arg in args if arg.startswith("--")]
        assert set(flags) <= VLLM_FLAGS
        assert "--quantization" not in flags  # AWQ is auto-detected: never forced unless asked
        assert args[args.index("--kv-cache-dtype") + 1] in VLLM_KV_VALUES
        assert args[args.index("--tensor-parallel-size") + 1] == "2"

    def test_vllm_args_quantization_only_when_asked(self) -> None:
        plan = _plan(weights="fp8", kv="fp8", quantization="fp8")
        args = plan.recommendation.vllm_args
        assert args[args.index("--quantization") + 1] == "fp8"

    def test_vllm_args_dtype_when_overriding_checkpoint(self) -> None:
        """Llama-2 ships fp16; asking for bf16 needs --dtype bfloat16."""
        plan = _plan(model="llama-2-7b", weights="bf16", kv="fp8", context=4096, concurrency=4)
        args = plan.recommendation.vllm_args
        assert args[args.index("--dtype") + 1] == "bfloat16"
        assert "--dtype" not in _plan(weights="bf16", kv="fp8").recommendation.vllm_args

    @pytest.mark.parametrize(
        ("gpu", "utilization"),
        [
            ("rtx4090", 0.92),
            ("rtx3090", 0.92),
            ("l40s", 0.95),
            ("a100-40g", 0.95),
            ("h100-80g", 0.95),
            ("h200", 0.95),
        ],
    )
    def test_safe_utilization_per_card(self, gpu: str, utilization: float) -> None:
        assert safe_utilization(gpu_profile(gpu)) == utilization

    def test_fp8_kv_on_ampere_warns(self) -> None:
        plan = _plan(weights="awq", kv="fp8", gpu="rtx3090")
        assert any("no native fp8" in warning for warning in plan.warnings)
        assert not any("no native fp8" in warning for warning in _plan(weights="awq", kv="fp8").warnings)


class TestInverseQuestions:
    def test_make_plan_context_derived_is_largest_that_fits(self) -> None:
        plan = _plan(weights="awq", kv="fp16", context=None)
        context = plan.scenario.context
        assert plan.scenario.fits
        assert context % BLOCK_SIZE == 0
        longer = _plan(weights="awq", kv="fp16", context=context + BLOCK_SIZE)
        assert not longer.scenario.pool_fits

    def test_make_plan_context_derived_capped_at_positions(self) -> None:
        plan = _plan(model="llama-3-8b", weights="awq", kv="fp8", context=None)
        assert plan.scenario.context == 8192

    def test_make_plan_concurrency_derived_is_most_that_fit(self) -> None:
        plan = _plan(weights="awq", kv="fp16", concurrency=None)
        assert plan.scenario.concurrency == 3
        assert plan.scenario.fits
        assert not _plan(weights="awq", kv="fp16", concurrency=4).scenario.fits

    def test_make_plan_inverse_answers_always_present(self) -> None:
        plan = _plan(weights="bf16", kv="fp16")
        assert plan.scenario.max_concurrency_for_context == 1
        assert 0 < plan.scenario.max_context_for_concurrency < 32768

    def test_make_plan_needs_concurrency_or_context(self) -> None:
        with pytest.raises(ValueError, match="give --concurrency, --context or both"):
            _plan(concurrency=None, context=None)


class TestWarningsAndText:
    def test_make_plan_context_above_positions_warned_and_planned(self) -> None:
        plan = _plan(model="llama-3-8b")
        assert plan.scenario.kv_bytes_total == 16 * 1024**3  # planned as asked
        assert any("exceeds llama-3-8b's max_position_embeddings 8,192" in w for w in plan.warnings)
        assert plan.recommendation.scenario.max_model_len == 8192
        assert not any("max_position" in w for w in _plan(model="llama-3.1-8b").warnings)

    def test_render_text_table_and_verdict(self) -> None:
        text = render_text(_plan(weights="awq", kv="fp8"))
        for fragment in (
            "weights",
            "KV cache",
            "activations",
            "CUDA runtime",
            "headroom",
            "Verdict: fits comfortably.",
            "vllm serve MODEL --gpu-memory-utilization 0.92",
            "vLLM should log: GPU KV cache size:",
        ):
            assert fragment in text

    def test_plan_to_dict_contract_keys(self) -> None:
        """DESIGN §4.2's keys, all present; bytes are integers."""
        result = plan_to_dict(_plan())
        for key in (
            "kv_bytes_per_token",
            "kv_bytes_total",
            "weights_bytes",
            "activation_bytes",
            "runtime_bytes",
            "total_bytes",
            "gpu_bytes",
            "headroom_bytes",
        ):
            assert isinstance(result[key], int), key
        assert isinstance(result["fits"], bool)
        assert set(result["recommended"]) >= {
            "gpu_memory_utilization",
            "max_model_len",
            "max_num_seqs",
            "max_num_batched_tokens",
            "enable_chunked_prefill",
            "kv_cache_dtype",
        }
        assert isinstance(result["vllm_args"], list)
        assert isinstance(result["predicted_kv_cache_tokens"], int)
        assert isinstance(result["predicted_max_concurrency"], float)
        assert isinstance(result["warnings"], list)
        assert result["headroom_bytes"] == result["gpu_bytes"] - result["total_bytes"]
        assert result["total_bytes"] == (
            result["weights_bytes"]
            + result["kv_bytes_total"]
            + result["activation_bytes"]
            + result["runtime_bytes"]
        )

    def test_plan_tensor_parallel_per_gpu(self) -> None:
        one = _plan(model="llama-3.1-70b", weights="bf16", kv="fp16", gpu="h100-80g", concurrency=8)
        four = _plan(
            model="llama-3.1-70b", weights="bf16", kv="fp16", gpu="h100-80g", concurrency=8, tensor_parallel=4
        )
        assert not one.scenario.fits
        assert four.scenario.fits
        assert four.scenario.kv_bytes_per_token * 4 == one.scenario.kv_bytes_per_token


class TestWhatVllmAccepts:
    """Issue 17: what the planner hands to vLLM 0.33 is what it accepts."""

    @pytest.mark.parametrize("kv", ["fp16", "bf16", "auto"])
    @pytest.mark.parametrize("weights", ["bf16", "fp16", "awq"])
    def test_sixteen_bit_kv_is_auto_whatever_the_weights(self, weights: str, kv: str) -> None:
        """0.33 refuses a 16-bit KV dtype other than the model's ("kv_cache_dtype=float16 is
        incompatible with dtype=bfloat16"); ``auto`` keeps it in the model's, 2 B a value."""
        plan = _plan(weights=weights, kv=kv, concurrency=1, context=8192)
        args = list(plan.recommendation.vllm_args)
        assert args[args.index("--kv-cache-dtype") + 1] in {"auto", "fp8"}
        recommended = plan_to_dict(plan)["recommended"]["kv_cache_dtype"]
        assert recommended == args[args.index("--kv-cache-dtype") + 1]
        if plan.recommendation.kv_dtype != "fp8":
            assert recommended == "auto"

    def test_fp8_kv_is_never_recommended_where_it_is_warned_about(self) -> None:
        """An RTX 3090 (Ampere: no native fp8) short of KV room: the planner reaches for
        smaller weights, not for the fp8 KV it would warn about."""
        plan = _plan(gpu="rtx3090", weights="bf16", kv="fp16", concurrency=4, context=32768)
        assert plan.recommendation.kv_dtype != "fp8"
        assert not [w for w in plan.warnings if "fp8" in w]
        on_ada = _plan(gpu="rtx4090", weights="bf16", kv="fp16", concurrency=4, context=32768)
        assert on_ada.recommendation.kv_dtype == "fp8"  # Ada does it natively: the seed's move

    def test_fp8_kv_asked_for_on_ampere_is_planned_and_warned(self) -> None:
        plan = _plan(gpu="rtx3090", weights="awq", kv="fp8", concurrency=4, context=32768)
        assert plan.recommendation.kv_dtype == "fp8"
        assert [w for w in plan.warnings if "no native fp8" in w]


@pytest.mark.parametrize(
    ("name", "gib", "arch"),
    [
        ("rtx4080", 15.67, "ada"),
        ("4070ti", 11.73, "ada"),
        ("a10g", 21.98, "ampere"),
        ("l4", 22.03, "ada"),
        ("h100-pcie", 79.11, "hopper"),
        ("h100-sxm", 79.11, "hopper"),
    ],
)
def test_the_common_cards_are_profiled_at_the_total_cuda_reports(name: str, gib: float, arch: str) -> None:
    """Issue 17's cards, at the smallest recent CUDA total found for each (docs/planner.md)."""
    profile = gpu_profile(name)
    assert round(profile.total_bytes / 2**30, 2) == gib
    assert profile.arch == arch
    assert profile.total_bytes < profile.nvidia_smi_total_mib * 2**20  # the driver keeps some
