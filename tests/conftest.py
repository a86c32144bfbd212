"""Shared test helpers. Fixtures for recorded data live beside it in ``tests/data``."""

from __future__ import annotations

from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"


@pytest.fixture
def data_dir() -> Path:
    """``tests/data``: recorded inputs, each listed in its PROVENANCE.md."""
    return DATA
