"""The house's layers are checked, not hoped for: `make lint` runs import-linter with the
contracts in pyproject.toml. Here it passes on the tree as it is, and fails — naming the
contract and the import — on a copy where the pure core imports engine control."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.integration.cli import VENV_BIN

ROOT = Path(__file__).parents[2]
LINT = VENV_BIN / "lint-imports"

pytestmark = pytest.mark.skipif(
    not LINT.exists(), reason="import-linter is a dev dependency (make test installs it)"
)


def _lint(tree: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT), "--no-cache", str(ROOT / "pyproject.toml")],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_tree_keeps_every_contract() -> None:
    done = _lint(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


def test_a_forbidden_import_breaks_the_lint(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "tunerd", tmp_path / "tunerd", ignore=shutil.ignore_patterns("__pycache__"))
    store = tmp_path / "tunerd" / "store.py"
    store.write_text(store.read_text() + "\nimport tunerd.engine.saga  # a shortcut someone took\n")
    done = _lint(tmp_path)
    assert done.returncode != 0
    assert "the core imports no I/O" in done.stdout
    assert "BROKEN" in done.stdout
    assert "tunerd.store -> tunerd.engine.saga" in done.stdout
