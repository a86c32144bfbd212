"""Settings ↔ vLLM flags: spellings, booleans, forbidden flags, reading settings back."""

from __future__ import annotations

import pytest

from tunerd.engine.args import (
    ArgsError,
    command_problems,
    engine_argv,
    settings_from_argv,
    settings_from_cache_config,
    settings_to_args,
    without_tunables,
)

SEED = {
    "gpu_memory_utilization": 0.92,
    "max_model_len": 32768,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 2048,
    "kv_cache_dtype": "fp8",
    "enable_chunked_prefill": True,
}


def test_settings_to_args_vllm_spellings_in_fixed_order() -> None:
    assert settings_to_args(SEED) == [
        "--gpu-memory-utilization",
        "0.92",
        "--max-model-len",
        "32768",
        "--max-num-seqs",
        "8",
        "--max-num-batched-tokens",
        "2048",
        "--kv-cache-dtype",
        "fp8",
        "--enable-chunked-prefill",
    ]


def test_booleans_are_flag_or_no_flag() -> None:
    assert settings_to_args({"enable_prefix_caching": False, "enforce_eager": True}) == [
        "--no-enable-prefix-caching",
        "--enforce-eager",
    ]


def test_two_decimal_utilization_printed_plainly() -> None:
    assert settings_to_args({"gpu_memory_utilization": 0.92 - 0.03}) == ["--gpu-memory-utilization", "0.89"]


@pytest.mark.parametrize(
    ("settings", "fragment"),
    [
        ({"swap_space": 4}, "not tunables: swap_space"),
        ({"max_num_seqs": 0}, "positive whole number"),
        ({"kv_cache_dtype": "int3"}, "kv_cache_dtype takes"),
    ],
)
def test_bad_settings_refused(settings: dict[str, object], fragment: str) -> None:
    with pytest.raises(ArgsError, match=fragment):
        settings_to_args(settings)


@pytest.mark.parametrize(
    ("command", "fragment"),
    [
        (["vllm", "serve", "m", "--max-num-seqs", "8"], "--max-num-seqs is tuned by tunerd"),
        (["vllm", "serve", "m", "--max-num-seqs=8"], "--max-num-seqs is tuned by tunerd"),
        (
            ["vllm", "serve", "m", "--no-enable-prefix-caching"],
            "--no-enable-prefix-caching is tuned by tunerd",
        ),
        (["vllm", "serve", "m", "--disable-log-stats"], "removes every vllm: metric"),
        (["vllm", "serve", "m", "--swap-space", "4"], "removed in vLLM 0.18"),
        (["vllm", "serve", "m", "--shutdown-timeout", "5"], "set by tunerd"),
    ],
)
def test_command_problems(command: list[str], fragment: str) -> None:
    problems = command_problems(command)
    assert problems
    assert fragment in problems[0]
    with pytest.raises(ArgsError):
        engine_argv(command, SEED, 60)


def test_engine_argv_appends_settings_and_drain() -> None:
    argv = engine_argv(["vllm", "serve", "/srv/m", "--port", "8000"], SEED, 60)
    assert argv[:5] == ["vllm", "serve", "/srv/m", "--port", "8000"]
    assert argv[-2:] == ["--shutdown-timeout", "60"]
    assert command_problems(["vllm", "serve", "/srv/m", "--served-model-name", "x"]) == []


def test_settings_from_argv_round_trip_and_spellings() -> None:
    argv = engine_argv(["vllm", "serve", "m"], {**SEED, "enforce_eager": False}, 30)
    assert settings_from_argv(argv) == {**SEED, "enforce_eager": False}
    assert settings_from_argv(
        ["--max-num-seqs=12", "--max-num-seqs", "16", "--no-enable-chunked-prefill"]
    ) == {"max_num_seqs": 16, "enable_chunked_prefill": False}
    assert settings_from_argv(["--max-num-seqs", "lots"]) == {}


def test_settings_from_cache_config_labels() -> None:
    labels = {
        "gpu_memory_utilization": "0.92",
        "cache_dtype": "fp8",
        "kv_cache_memory_bytes": "None",
        "enable_prefix_caching": "True",
        "block_size": "16",
    }
    assert settings_from_cache_config(labels) == {
        "gpu_memory_utilization": 0.92,
        "kv_cache_dtype": "fp8",
        "enable_prefix_caching": True,
    }


def test_without_tunables_leaves_the_program_and_the_model() -> None:
    """What tells two engines' commands apart once the flags tunerd owns are set aside."""
    seen = [
        "/venv/bin/python", "/venv/bin/vllm", "serve", "/srv/models/llama", "--max-num-seqs", "8",
        "--gpu-memory-utilization=0.92", "--enable-chunked-prefill", "--no-enable-prefix-caching",
        "--shutdown-timeout", "30", "--port", "8000",
    ]  # fmt: skip
    assert without_tunables(seen) == (
        "/venv/bin/python", "/venv/bin/vllm", "serve", "/srv/models/llama", "--port", "8000",
    )  # fmt: skip
    assert without_tunables(engine_argv(["vllm", "serve", "m"], SEED, 30)) == ("vllm", "serve", "m")
