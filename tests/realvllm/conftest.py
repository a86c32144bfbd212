"""Fixtures of the real-engine tier: the vLLM Python and the tiny model, built once a session."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.realvllm import vllm_python

HERE = Path(__file__).parent


@pytest.fixture(scope="session")
def vllm() -> str:
    """The Python of vLLM's CPU build; asked for by name, it must exist."""
    python = vllm_python()
    if python is None:
        pytest.skip("no vLLM CPU build (make test installs it; or set TUNERD_VLLM_PYTHON)")
    if not Path(python).exists():
        pytest.fail(f"TUNERD_VLLM_PYTHON={python} does not exist")
    return python


@pytest.fixture(scope="session")
def tiny_model(vllm: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama of tests/realvllm/tiny_model.py, built offline into a temp folder."""
    out = tmp_path_factory.mktemp("tiny-llama")
    done = subprocess.run(
        [vllm, str(HERE / "tiny_model.py"), str(out)],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "config.json").exists()
    assert (out / "tokenizer.json").exists()
    return out
