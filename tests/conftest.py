"""Shared test helpers. Fixtures for recorded data live beside it in ``tests/data``.

Secret canaries: for the whole session the environment holds two secret-shaped variables with
values unique to the run (``TUNERD_CANARY_URL``, ``TUNERD_CANARY_SECRET``), so every tunerd
the suite starts — in-process or as a child — has them. At the end every file the session
wrote under pytest's base temp folder (engine logs, hook logs, state, the output of every
``tunerd`` command run through ``tests/integration/cli.py``) is searched for them: a secret
anywhere there fails the session (DESIGN §4.8: secrets never appear in logs, status, history
or chat).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"
CANARIES = {
    "TUNERD_CANARY_URL": f"https://hooks.invalid/webhook/canary-{secrets.token_hex(8)}",
    "TUNERD_CANARY_SECRET": f"canary-secret-{secrets.token_hex(8)}",
}


@pytest.fixture
def data_dir() -> Path:
    """``tests/data``: recorded inputs, each listed in its PROVENANCE.md."""
    return DATA


def files_holding(root: Path, needles: list[str]) -> list[str]:
    """``path: needle`` for every file under ``root`` that contains one of ``needles``."""
    found = []
    wanted = [needle.encode() for needle in needles]
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink():
            try:
                data = path.read_bytes()
            except OSError:
                continue
            found += [f"{path}: {needle.decode()}" for needle in wanted if needle in data]
    return found


@pytest.fixture(scope="session", autouse=True)
def secret_canaries(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    base = tmp_path_factory.getbasetemp()
    output = base / "tunerd-output"
    output.mkdir(exist_ok=True)
    saved = {key: os.environ.get(key) for key in [*CANARIES, "TUNERD_TEST_OUTPUT"]}
    os.environ.update({**CANARIES, "TUNERD_TEST_OUTPUT": str(output)})
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    leaked = files_holding(base, list(CANARIES.values()))
    assert not leaked, "a secret reached a file the suite wrote:\n" + "\n".join(leaked)
