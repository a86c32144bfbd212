"""The session's secret canaries (tests/conftest.py) are set and the search finds a leak."""

from __future__ import annotations

import io
import os
from pathlib import Path

from tests.conftest import CANARIES, files_holding
from tunerd import logs


def test_the_canaries_are_in_the_environment_of_every_test() -> None:
    for key, value in CANARIES.items():
        assert os.environ[key] == value
    assert set(CANARIES.values()) <= set(logs.secret_values(os.environ))  # tunerd counts them as secrets


def test_the_search_finds_a_secret_in_any_file_below(tmp_path: Path) -> None:
    (tmp_path / "state" / "engines").mkdir(parents=True)
    (tmp_path / "state" / "engines" / "main.log").write_text("INFO ok\n")
    assert files_holding(tmp_path, list(CANARIES.values())) == []
    leak = tmp_path / "state" / "engines" / "main.hooks.log"
    leak.write_bytes(b"\x00binary " + CANARIES["TUNERD_CANARY_SECRET"].encode() + b"\n")
    assert files_holding(tmp_path, list(CANARIES.values())) == [f"{leak}: {CANARIES['TUNERD_CANARY_SECRET']}"]
    leak.unlink()  # the session's own search runs over this folder too


def test_tunerds_log_replaces_them() -> None:
    out = io.StringIO()
    logs.configure(out, console=False, environ=os.environ)
    try:
        logs.say(
            "hook_failed",
            url=CANARIES["TUNERD_CANARY_URL"],
            output=f"token={CANARIES['TUNERD_CANARY_SECRET']}",
        )
    finally:
        logs.configure(io.StringIO(), console=False, environ={})
    text = out.getvalue()
    assert "[redacted]" in text
    assert not [value for value in CANARIES.values() if value in text]
