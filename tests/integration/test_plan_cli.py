"""`tunerd plan` as a user runs it: a real process, its stdout, stderr and exit status."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tunerd.state import State

GIB = 1024**3


def tunerd(*args: str, check: bool = False) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, "-m", "tunerd", *args], capture_output=True, text=True, timeout=60, check=False
    )
    if check:
        assert result.returncode == 0, result.stderr
    return result


def plan_json(*args: str) -> dict[str, Any]:
    result = tunerd("plan", *args, "--json", check=True)
    data: dict[str, Any] = json.loads(result.stdout)
    return data


SEED = ("--gpu", "rtx4090", "--concurrency", "4", "--context", "32768")


class TestSeedTable:
    @pytest.mark.parametrize(
        ("model", "per_token", "total_gib"),
        [
            ("llama-2-7b", 524288, 64),
            ("llama-3-8b", 131072, 16),
            ("llama-3.1-8b", 131072, 16),
            ("mistral-7b", 131072, 16),
            ("qwen2.5-7b", 57344, 7),
        ],
    )
    def test_plan_json_reproduces_seed_kv_table(self, model: str, per_token: int, total_gib: int) -> None:
        """The must-show: bf16 weights, fp16 KV, 4 × 32K on a 4090, for every seed model."""
        fp16 = plan_json("--model", model, "--weights", "bf16", "--kv-dtype", "fp16", *SEED)
        assert fp16["kv_bytes_per_token"] == per_token
        assert fp16["kv_bytes_total"] == total_gib * GIB
        fp8 = plan_json("--model", model, "--weights", "bf16", "--kv-dtype", "fp8", *SEED)
        assert fp8["kv_bytes_per_token"] * 2 == per_token
        assert fp8["kv_bytes_total"] * 2 == total_gib * GIB

    def test_plan_context_above_positions_warns_on_stderr(self) -> None:
        result = tunerd(
            "plan", "--model", "llama-3-8b", "--weights", "bf16", "--kv-dtype", "fp16", *SEED, "--json"
        )
        assert result.returncode == 0
        assert "exceeds llama-3-8b's max_position_embeddings 8,192" in result.stderr
        assert json.loads(result.stdout)["warnings"]
        quiet = tunerd(
            "plan", "--model", "llama-3.1-8b", "--weights", "bf16", "--kv-dtype", "fp16", *SEED, "--json"
        )
        assert quiet.stderr == ""

    @pytest.mark.parametrize(
        ("weights", "kv", "fits"),
        [
            ("bf16", "fp16", False),
            ("int8", "fp16", False),
            ("int4", "fp16", False),
            ("int4", "fp8", True),
            ("int8", "fp8", True),
        ],
    )
    def test_plan_seed_five_combinations(self, weights: str, kv: str, fits: bool) -> None:
        result = plan_json("--model", "llama-3.1-8b", "--weights", weights, "--kv-dtype", kv, *SEED)
        assert result["fits"] is fits
        assert result["verdict"] == ("comfortable" if fits else "does_not_fit")
        assert result["recommended"]["fits"] is True

    def test_plan_weights_in_json(self) -> None:
        bf16 = plan_json("--model", "llama-3-8b", "--weights", "bf16", *SEED)
        assert bf16["model"]["params"] == 8_030_261_248
        assert bf16["weights_bytes"] / GIB == pytest.approx(14.96, abs=0.01)
        awq = plan_json("--model", "llama-3-8b", "--weights", "awq", *SEED)
        assert awq["weights_bytes"] / GIB == pytest.approx(5.33, abs=0.02)


class TestExitStatus:
    def test_plan_check_exits_1_when_not_fitting(self) -> None:
        no = tunerd(
            "plan", "--model", "llama-3.1-8b", "--weights", "bf16", "--kv-dtype", "fp16", *SEED, "--check"
        )
        assert no.returncode == 1
        assert "Verdict: does not fit." in no.stdout
        yes = tunerd(
            "plan", "--model", "llama-3.1-8b", "--weights", "awq", "--kv-dtype", "fp8", *SEED, "--check"
        )
        assert yes.returncode == 0

    def test_plan_without_check_exits_0_either_way(self) -> None:
        result = tunerd("plan", "--model", "llama-3.1-8b", "--weights", "bf16", "--kv-dtype", "fp16", *SEED)
        assert result.returncode == 0

    @pytest.mark.parametrize(
        ("args", "fragment"),
        [
            (("--model", "gpt-5", *SEED), "unknown model 'gpt-5'"),
            (
                ("--model", "llama-3.1-8b", "--gpu", "rtx4090", "--concurrency", "-4"),
                "argument --concurrency: must be a positive whole number, got -4",
            ),
            (
                ("--model", "llama-3.1-8b", "--gpu-mem", "24XB", "--context", "4096"),
                "argument --gpu-mem: invalid size '24XB': unknown unit 'XB'",
            ),
            (("--model", "llama-3.1-8b", "--gpu", "rtx5090", "--context", "4096"), "unknown GPU 'rtx5090'"),
            (("--model", "llama-3.1-8b", "--gpu", "rtx4090"), "give --concurrency N, --context TOKENS"),
            (("--gpu", "rtx4090", "--context", "4096"), "give --model NAME or --model-config PATH"),
            (("--model", "llama-3.1-8b", *SEED, "--weights", "int3"), "argument --weights: invalid choice"),
            (
                ("--model", "llama-3.1-8b", *SEED, "--gpu-memory-utilization", "1.2"),
                "argument --gpu-memory-utilization: must be in (0, 1]",
            ),
            (
                ("--model", "llama-3.1-8b", "--gpu", "rtx4090", "--context", "lots"),
                "invalid token count 'lots'",
            ),
        ],
    )
    def test_plan_bad_input_one_line_exit_2(self, args: tuple[str, ...], fragment: str) -> None:
        result = tunerd("plan", *args)
        assert result.returncode == 2
        assert result.stdout == ""
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, result.stderr
        assert lines[0].startswith("tunerd plan: error: ")
        assert fragment in lines[0]

    def test_plan_malformed_config_json_exit_2(self, tmp_path: Path) -> None:
        config = tmp_path / "config.json"
        config.write_text('{"num_hidden_layers": 32,,}')
        result = tunerd("plan", "--model-config", str(config), "--gpu", "rtx4090", "--context", "4096")
        assert result.returncode == 2
        expected = f"tunerd plan: error: {config}:1:26: invalid JSON: Expecting property name"
        assert result.stderr.startswith(expected)
        assert result.stderr.count("\n") == 1

    def test_plan_config_missing_field_exit_2(self, tmp_path: Path) -> None:
        config = tmp_path / "config.json"
        config.write_text(json.dumps({"num_hidden_layers": 32, "hidden_size": 4096}))
        result = tunerd("plan", "--model-config", str(config), "--gpu", "rtx4090", "--context", "4096")
        assert result.returncode == 2
        assert "field 'num_attention_heads' is missing" in result.stderr


class TestOutputs:
    def test_plan_help_teaches(self) -> None:
        result = tunerd("plan", "--help", check=True)
        for fragment in ("--model-config", "--gpu-mem", "--explain", "--check", "examples:", "exit status"):
            assert fragment in result.stdout

    def test_plan_list_shows_models_and_gpus(self) -> None:
        result = tunerd("plan", "--list", check=True)
        assert "qwen3-8b" in result.stdout
        assert "rtx4090" in result.stdout
        assert "0.92" in result.stdout

    def test_plan_explain_shows_arithmetic(self) -> None:
        result = tunerd(
            "plan",
            "--model",
            "llama-3.1-8b",
            "--weights",
            "awq",
            "--kv-dtype",
            "fp8",
            *SEED,
            "--explain",
            check=True,
        )
        assert "2 (K and V) × 32 layers × 8 KV heads × 128 head_dim × 1 B (fp8) = 65,536 B/token" in (
            result.stdout
        )
        assert "ceil(23.52 GiB × 0.92)" in result.stdout

    def test_plan_inverse_context(self) -> None:
        result = plan_json(
            "--model", "qwen2.5-7b", "--weights", "bf16", "--gpu", "rtx4090", "--concurrency", "8"
        )
        assert result["workload"]["context_derived"] is True
        assert result["fits"] is True
        assert result["max_context_for_concurrency"] == result["workload"]["context"]

    def test_plan_inverse_concurrency(self) -> None:
        result = plan_json(
            "--model",
            "llama-3.1-8b",
            "--weights",
            "awq",
            "--kv-dtype",
            "fp8",
            "--gpu",
            "rtx4090",
            "--context",
            "32K",
        )
        assert result["workload"]["concurrency_derived"] is True
        assert result["workload"]["concurrency"] == result["max_concurrency_for_context"] == 7

    def test_plan_gpu_mem_custom_card(self) -> None:
        result = plan_json(
            "--model",
            "llama-3.1-8b",
            "--weights",
            "awq",
            "--kv-dtype",
            "fp8",
            "--gpu-mem",
            "23.52GiB",
            "--concurrency",
            "4",
            "--context",
            "32768",
        )
        assert result["gpu"]["name"] == "custom"
        assert result["fits"] is True

    def test_plan_console_script_installed(self) -> None:
        script = Path(sys.executable).parent / "tunerd"
        result = subprocess.run(
            [str(script), "--version"], capture_output=True, text=True, timeout=30, check=False
        )
        assert result.returncode == 0
        assert result.stdout.startswith("tunerd ")


class TestModelConfigFiles:
    CONFIGS = Path(__file__).parents[1] / "data" / "model_configs"

    def test_plan_model_config_not_builtin_kv_bytes(self) -> None:
        """A real config.json of a model with no built-in shape (Cohere Command-R v01)."""
        result = plan_json(
            "--model-config",
            str(self.CONFIGS / "command-r-v01.json"),
            "--gpu",
            "h100-80g",
            "--concurrency",
            "2",
            "--context",
            "8192",
        )
        assert result["kv_bytes_per_token"] == 1_310_720
        assert result["kv_bytes_total"] == 1_310_720 * 8192 * 2
        assert result["model"]["head_dim"] == 128

    def test_plan_model_config_mixed_attention_exit_2(self) -> None:
        path = self.CONFIGS / "gemma-2-9b-it.json"
        result = tunerd("plan", "--model-config", str(path), "--gpu", "rtx4090", "--context", "4096")
        assert result.returncode == 2
        assert result.stderr.startswith(f"tunerd plan: error: {path}: gemma2 interleaves")


class TestRefusesWhatVllmRefuses:
    """Issue 17: what vLLM refuses, or a person surely mistyped, is exit 2 with one line."""

    def test_a_gpu_size_without_a_unit_is_refused(self) -> None:
        """``--gpu-mem 24`` planned a 24-byte GPU and exited 0."""
        result = tunerd("plan", "--model", "llama-3.1-8b", "--gpu-mem", "24", "--concurrency", "1")
        assert result.returncode == 2
        assert "give a unit, e.g. '24GiB'" in result.stderr
        assert (
            tunerd("plan", "--model", "llama-3.1-8b", "--gpu-mem", "24GiB", "--concurrency", "1").returncode
            == 0
        )

    def test_a_tensor_parallel_size_that_does_not_divide_the_heads_is_refused(self) -> None:
        result = tunerd(
            "plan", "--model", "llama-3.1-8b", "--gpu", "h100", "--concurrency", "1", "--tensor-parallel", "3"
        )
        assert result.returncode == 2
        assert "must be divisible by tensor parallel size (3)" in result.stderr
        assert "try 1, 2, 4, 8" in result.stderr

    @pytest.mark.parametrize(
        ("name", "model", "weights"),
        [
            ("meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b", "bf16"),
            ("meta-llama/Meta-Llama-3.1-8B-Instruct", "llama-3.1-8b", "bf16"),
            ("hugging-quants/Meta-Llama-3.1-8B-Instruct-AWQ-INT4", "llama-3.1-8b", "awq"),
            ("Qwen/Qwen2.5-72B-Instruct-AWQ", "qwen2.5-72b", "awq"),
            ("Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4", "qwen2.5-7b", "gptq"),
            ("Qwen/Qwen2.5-7B-Instruct-GPTQ-Int8", "qwen2.5-7b", "int8"),  # 8-bit, not GPTQ's usual 4
            ("unsloth/llama-3-8b-bnb-8bit", "llama-3-8b", "int8"),
            ("Qwen/Qwen3-8B-FP8", "qwen3-8b", "fp8"),
            ("mistralai/Mistral-7B-Instruct-v0.3", "mistral-7b-v0.3", "bf16"),
            ("meta-llama/Llama-2-7b-chat-hf", "llama-2-7b", "fp16"),
        ],
    )
    def test_hub_names_resolve_alike_and_say_their_weights(self, name: str, model: str, weights: str) -> None:
        """``Qwen/Qwen2.5-72B-Instruct-AWQ`` was 'unknown' while Llama's Hub name resolved; the
        quantization its name says is the weights planned (unless --weights says otherwise)."""
        plan = plan_json("--model", name, "--gpu", "h100", "--concurrency", "1", "--context", "4K")
        assert plan["model"]["name"] == model
        assert plan["workload"]["weights"] == weights


class TestCalibrated:
    """`tunerd plan --calibrated ENGINE`: the planner on what the engine's start showed (a
    state written as the daemon writes it; the observation is the seed's 4090 as the log and
    NVML showed it: tests/data/vllm/startup-ok-0.32.log's line format, the simulator's box)."""

    OBSERVATION: dict[str, Any] = {  # noqa: RUF012
        "engine": "main",
        "version": 2,
        "pid": 4242,
        "settings": {"gpu_memory_utilization": 0.92, "max_model_len": 32768, "max_num_seqs": 8,
                     "max_num_batched_tokens": 2048, "kv_cache_dtype": "fp8"},
        "time": 100.0,
        "cuda_total_bytes": 24084 * 1024**2,
        "weights_bytes": round(5.37 * GIB),
        "kv_available_bytes": round(15.85 * GIB),
        "kv_cache_tokens": 259_744,
        "cuda_graph_bytes": round(0.08 * GIB),
        "start_bytes": round(21.8 * GIB),
        "peak_bytes": round(22.15 * GIB),
        "others_peak_bytes": 300 * 1024**2,
    }  # fmt: skip

    def _state(self, tmp_path: Path) -> Path:
        state = State.open(tmp_path)
        state.save_observation("main", 2, 4242, self.OBSERVATION, 100.0)
        state.close()
        return tmp_path

    def test_what_other_utilizations_would_give_on_this_box(self, tmp_path: Path) -> None:
        directory = self._state(tmp_path)
        done = tunerd("plan", "--calibrated", "main", "--state-dir", str(directory), check=True)
        assert "main: the box as its start showed it (version 2, pid 4242)" in done.stdout
        assert "KV pool 15.85 GiB (259,744 tokens)" in done.stdout
        assert "fit gpu_memory_utilization: 0.9" in done.stdout
        data = json.loads(
            tunerd("plan", "--calibrated", "main", "--state-dir", str(directory), "--gpu-memory-utilization",
                   "0.90", "--json", check=True).stdout
        )  # fmt: skip
        (prediction,) = data["predictions"]
        assert prediction["settings"]["gpu_memory_utilization"] == 0.9
        # 0.02 of 23.52 GiB less budget, at 64 KiB a token (fp8): about 7,700 tokens fewer
        assert 250_000 < prediction["kv_cache_tokens"] < 259_744
        assert data["bills"]["headroom_bytes"] is not None

    def test_an_engine_never_seen_is_a_clear_error(self, tmp_path: Path) -> None:
        done = tunerd("plan", "--calibrated", "other", "--state-dir", str(self._state(tmp_path)))
        assert done.returncode == 2
        assert "nothing calibrated for engine 'other'" in done.stderr
