"""tunerd's log lines: one JSON object each, levels, and no secret ever written."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator

import pytest
import structlog

from tunerd import logs


@pytest.fixture(autouse=True)
def _unconfigure() -> Iterator[None]:
    yield
    structlog.reset_defaults()  # the next test's daemon logs where structlog would by default


def _said(environ: dict[str, str], *events: tuple[str, dict[str, object]], console: bool = False) -> str:
    out = io.StringIO()
    logs.configure(out, console=console, environ=environ)
    for event, fields in events:
        logs.say(event, **fields)
    return out.getvalue()


def test_one_json_object_a_line_with_level_and_time() -> None:
    text = _said(
        {},
        ("engine_reconciled", {"engine": "main", "outcome": "adopted pid 42"}),
        ("engine_crash", {"engine": "main"}),
    )
    first, second = (json.loads(line) for line in text.splitlines())
    assert first["event"] == "engine_reconciled"
    assert (first["engine"], first["outcome"], first["level"]) == ("main", "adopted pid 42", "info")
    assert first["timestamp"].endswith("Z")
    assert second["level"] == "warning"


def test_a_configured_secret_never_reaches_the_log() -> None:
    url = "https://open.feishu.cn/open-apis/bot/v2/hook/3f1c2a9e-77aa-4c1b-9c4d-secret"
    environ = {"TUNERD_FEISHU_URL": url, "TUNERD_FEISHU_SECRET": "s3cr3t-sign-key", "TUNERD_MODE": "act"}
    text = _said(
        environ,
        ("notify_failed", {"sink": "ops", "error": f"POST {url} answered 500", "detail": {"tried": [url]}}),
        ("signing", {"with": "s3cr3t-sign-key"}),
    )
    assert url not in text
    assert "s3cr3t-sign-key" not in text
    assert text.count("[redacted]") == 3
    assert "act" not in logs.secret_values(environ)  # only secret-holding names, never e.g. a mode


def test_the_console_format_for_a_person_at_a_terminal() -> None:
    text = _said({"NO_COLOR": "1"}, ("engine_reconciled", {"engine": "main"}), console=True)
    assert "engine_reconciled" in text
    assert "engine=main" in text
    assert "\033[" not in text
