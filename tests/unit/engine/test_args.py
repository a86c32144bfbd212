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


# vLLM 0.32's parser (FlexibleArgumentParser, allow_abbrev on) read these as the flags tunerd
# owns: `_` becomes `-` in a flag's name, and an unambiguous prefix is the whole flag.
@pytest.mark.parametrize(
    ("arg", "problem"),
    [
        (
            "--gpu_memory_utilization",
            "--gpu_memory_utilization (vLLM reads it as --gpu-memory-utilization) is tuned by tunerd: set gpu_memory_utilization under the engine's settings, not in command",
        ),
        (
            "--max_num_seqs=7",
            "--max_num_seqs (vLLM reads it as --max-num-seqs) is tuned by tunerd: set max_num_seqs under the engine's settings, not in command",
        ),
        (
            "--disable_log_stats",
            "--disable_log_stats (vLLM reads it as --disable-log-stats) is not allowed in command: it removes every vllm: metric tunerd reads",
        ),
        (
            "--swap_space",
            "--swap_space (vLLM reads it as --swap-space) is not allowed in command: removed in vLLM 0.18",
        ),
        (
            "--max-num-seq",
            "--max-num-seq (an abbreviation of --max-num-seqs) is tuned by tunerd: set max_num_seqs under the engine's settings, not in command",
        ),
        (
            "--gpu-mem=0.5",
            "--gpu-mem (an abbreviation of --gpu-memory-utilization) is tuned by tunerd: set gpu_memory_utilization under the engine's settings, not in command",
        ),
        (
            "--no-enable-prefix",
            "--no-enable-prefix (an abbreviation of --no-enable-prefix-caching) is tuned by tunerd: set enable_prefix_caching under the engine's settings, not in command",
        ),
        (
            "--disable-log-stat",
            "--disable-log-stat (an abbreviation of --disable-log-stats) is not allowed in command: it removes every vllm: metric tunerd reads",
        ),
        (
            "--shutdown_time",
            "--shutdown_time (an abbreviation of --shutdown-timeout) is set by tunerd from the restart's drain time",
        ),
        (
            "--max_num",
            "--max_num is an abbreviation vLLM reads as one of --max-num-seqs, --max-num-batched-tokens, --max-num-queued-reqs, --max-num-queued-tokens (or refuses as ambiguous): tunerd sets those; write the whole name of the flag you mean",
        ),
    ],
)
def test_every_spelling_vllm_reads_as_a_flag_tunerd_owns_is_refused(arg: str, problem: str) -> None:
    assert command_problems(["vllm", "serve", "m", arg]) == [problem]
    with pytest.raises(ArgsError):
        engine_argv(["vllm", "serve", "m", arg], SEED, 60)


def test_vllms_other_flags_and_values_are_left_alone() -> None:
    """Flags of vLLM 0.32 that start like the ones tunerd owns, short flags, values, `--`."""
    command = [
        "vllm", "serve", "/srv/models/max_num_seqs", "--kv-cache-dtype-skip-layers", "0",
        "--max-num-partial-prefills", "2", "--enable-prompt-embeds", "--no-enable-log-requests",
        "--gpu-memory-utilizations-are-not-a-flag", "-tp", "2", "--", "-O3", "--served-model-name=max",
    ]  # fmt: skip
    assert command_problems(command) == []


def test_spellings_vllm_reads_are_read_back_and_set_aside() -> None:
    argv = ["vllm", "serve", "m", "--max_num_seqs", "12", "--gpu-mem=0.85", "--no-enforce-eag", "--port", "1"]
    assert settings_from_argv(argv) == {
        "max_num_seqs": 12,
        "gpu_memory_utilization": 0.85,
        "enforce_eager": False,
    }
    assert settings_from_argv(["--max-num", "4"]) == {}  # ambiguous: neither of them
    assert without_tunables([*argv, "--shutdown_timeout", "30"]) == ("vllm", "serve", "m", "--port", "1")
