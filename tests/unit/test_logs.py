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


def test_a_secret_the_config_names_is_redacted_whatever_its_name() -> None:
    """``url_env``/``secret_env`` may name any variable (``DINGTALK_SECRET``): its value is
    kept out of the log like a ``TUNERD_*`` one; a reload naming another adds it."""
    environ = {
        "DINGTALK_SECRET": "SECdingtalk-sign-0123456789",
        "OPS_WEBHOOK_VAR": "https://hooks.example/services/T000/B000/xyz123",
        "HF_TOKEN": "hf_not-tunerds-to-redact",
    }
    out = io.StringIO()
    logs.configure(out, console=False, environ=environ, secret_names={"DINGTALK_SECRET"})
    logs.say("notify_failed", error=f"signing with {environ['DINGTALK_SECRET']} failed")
    logs.say("notify_failed", error=f"POST {environ['OPS_WEBHOOK_VAR']} refused")
    logs.redact_also({"OPS_WEBHOOK_VAR"}, environ)  # SIGHUP: a config with a new sink
    logs.say("notify_failed", error=f"POST {environ['OPS_WEBHOOK_VAR']} refused", hf=environ["HF_TOKEN"])
    logs.say("signing", with_=environ["DINGTALK_SECRET"])
    first, second, third, fourth = (json.loads(line) for line in out.getvalue().splitlines())
    assert first["error"] == "signing with [redacted] failed"
    assert environ["OPS_WEBHOOK_VAR"] in second["error"]  # not named yet: not a secret
    assert third["error"] == "POST [redacted] refused"
    assert third["hf"] == environ["HF_TOKEN"]  # an engine's variable: not tunerd's secret
    assert fourth["with_"] == "[redacted]"  # the first names stay redacted after the reload
