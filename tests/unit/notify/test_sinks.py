"""Each sink's payload, signature and reading of replies (pure; reference/integrations-facts.md §1).

Signatures are checked against values computed independently here — with Python's hmac written
out step by step, and with the ``openssl`` command where it is installed — never against the
module's own output alone. The classic mistake (DingTalk's key/message order used for Feishu,
or the reverse) must give a different value."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import shutil
import subprocess
from urllib.parse import parse_qs, quote_plus, urlsplit

import pytest

from tunerd.notify.alert import Action, Alert, fingerprint
from tunerd.notify.sink import Target
from tunerd.notify.sinks import (
    KINDS,
    alertmanager,
    dingtalk,
    discord,
    feishu,
    module,
    slack,
    teams,
    webhook,
    wecom,
)

NOW = 1_764_400_000.5  # 2025-11-29T07:06:40.5Z
SECRET = "SEC0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcd"


def alert(**changes: object) -> Alert:
    base = Alert(
        severity="warning",
        status="firing",
        title="kv-pool-saturated on llama31-8b",
        summary="KV pool 97 % used, 3 requests waiting: max_num_seqs 16 → 12, restarted",
        engine="llama31-8b",
        host="gpu-box-1",
        time=NOW,
        policy="kv-pool-saturated",
        fingerprint=fingerprint("llama31-8b", "kv-pool-saturated"),
        evidence={"signals": {"kv_cache_usage": 0.97, "num_requests_waiting": 3.0}, "log_lines": ["INFO x"]},
        action=Action("tune", {"max_num_seqs": 16}, {"max_num_seqs": 12}, "succeeded"),
        undo="tunerd rollback llama31-8b",
    )
    return Alert(**{**base.__dict__, **changes})  # type: ignore[arg-type]


def _openssl_hmac_b64(key: bytes, message: bytes) -> str | None:
    if shutil.which("openssl") is None:
        return None
    done = subprocess.run(
        ["openssl", "dgst", "-sha256", "-hmac", key.decode(), "-binary"],
        input=message,
        capture_output=True,
        check=True,
    )
    return base64.b64encode(done.stdout).decode()


class TestFeishu:
    def test_signature_is_keyed_by_timestamp_and_secret_over_an_empty_message(self) -> None:
        timestamp = 1_764_400_000
        string_to_sign = f"{timestamp}\n{SECRET}".encode()
        expected = base64.b64encode(hmac.new(string_to_sign, b"", hashlib.sha256).digest()).decode()
        assert feishu.sign(timestamp, SECRET) == expected
        if (oracle := _openssl_hmac_b64(string_to_sign, b"")) is not None:
            assert feishu.sign(timestamp, SECRET) == oracle
        swapped = base64.b64encode(
            hmac.new(SECRET.encode(), string_to_sign, hashlib.sha256).digest()
        ).decode()
        assert feishu.sign(timestamp, SECRET) != swapped  # DingTalk's order: Feishu answers 19021

    def test_card_with_timestamp_and_sign_in_the_body(self) -> None:
        request = feishu.build(
            [alert()], Target("ops", "feishu", "https://open.feishu.cn/x", SECRET, "zh"), NOW
        )
        body = json.loads(request.body)
        assert body["timestamp"] == "1764400000"
        assert body["sign"] == feishu.sign(1_764_400_000, SECRET)
        assert body["msg_type"] == "interactive"
        header = body["card"]["header"]
        assert header["template"] == "orange"
        assert header["title"]["content"].startswith("tunerd 警告: ")  # one fixed keyword
        text = body["card"]["elements"][0]["text"]["content"]
        assert "max_num_seqs 16 → 12" in text
        assert "tunerd rollback llama31-8b" in text
        assert len(request.body) <= 20_000
        unsigned = json.loads(feishu.build([alert()], Target("ops", "feishu", "https://x"), NOW).body)
        assert "sign" not in unsigned

    @pytest.mark.parametrize(
        ("status", "reply", "kind"),
        [
            (200, {"code": 0, "msg": "success", "StatusCode": 0}, "ok"),
            (200, {"code": 11232, "msg": "frequency limited"}, "retry"),
            (200, {"code": 19021, "msg": "sign match fail or timestamp is not within one hour"}, "permanent"),
            (200, {"code": 19024, "msg": "Key Words Not Found"}, "permanent"),
            (200, {"code": 9499, "msg": "Bad Request"}, "permanent"),
            (200, {"unexpected": True}, "retry"),
            (500, {}, "retry"),
            (404, {}, "permanent"),
        ],
    )
    def test_replies(self, status: int, reply: dict[str, object], kind: str) -> None:
        assert feishu.classify(status, {}, json.dumps(reply).encode()).kind == kind


class TestDingTalk:
    def test_signature_is_keyed_by_the_secret_and_url_quoted(self) -> None:
        timestamp_ms = 1_764_400_000_500
        string_to_sign = f"{timestamp_ms}\n{SECRET}".encode()
        raw = base64.b64encode(hmac.new(SECRET.encode(), string_to_sign, hashlib.sha256).digest()).decode()
        assert dingtalk.sign(timestamp_ms, SECRET) == quote_plus(raw)
        if (oracle := _openssl_hmac_b64(SECRET.encode(), string_to_sign)) is not None:
            assert dingtalk.sign(timestamp_ms, SECRET) == quote_plus(oracle)
        feishu_order = base64.b64encode(hmac.new(string_to_sign, b"", hashlib.sha256).digest()).decode()
        assert dingtalk.sign(timestamp_ms, SECRET) != quote_plus(feishu_order)

    def test_markdown_with_the_signature_on_the_url(self) -> None:
        url = "https://oapi.dingtalk.com/robot/send?access_token=abc"
        request = dingtalk.build([alert()], Target("ding", "dingtalk", url, SECRET), NOW)
        query = parse_qs(urlsplit(request.url).query)
        assert query["access_token"] == ["abc"]
        assert query["timestamp"] == ["1764400000500"]
        assert quote_plus(query["sign"][0]) == dingtalk.sign(1_764_400_000_500, SECRET)
        body = json.loads(request.body)
        assert body["msgtype"] == "markdown"
        assert body["markdown"]["title"].startswith("tunerd warning: ")
        assert "**Undo**: `tunerd rollback llama31-8b`" in body["markdown"]["text"]
        assert request.headers["Content-Type"] == "application/json;charset=utf-8"

    @pytest.mark.parametrize(
        ("reply", "kind", "after"),
        [
            ({"errcode": 0, "errmsg": "ok"}, "ok", None),
            ({"errcode": 130101, "errmsg": "send too fast, exceed 20 times per minute"}, "retry", 60.0),
            ({"errcode": 310000, "errmsg": "keywords not in content"}, "permanent", None),
            ({"errcode": 300001, "errmsg": "token is not exist"}, "permanent", None),
            ({"what": "else"}, "retry", None),
        ],
    )
    def test_replies(self, reply: dict[str, object], kind: str, after: float | None) -> None:
        outcome = dingtalk.classify(200, {}, json.dumps(reply).encode())
        assert (outcome.kind, outcome.retry_after) == (kind, after)


def test_wecom_markdown_fits_4096_bytes_and_reads_errcode() -> None:
    long = alert(evidence={"log_lines": ["行" * 3000]}, summary="摘要" * 1500)
    request = wecom.build(
        [long], Target("wc", "wecom", "https://qyapi.weixin.qq.com/x?key=k", language="zh"), NOW
    )
    body = json.loads(request.body)
    assert body["msgtype"] == "markdown"
    assert len(body["markdown"]["content"].encode()) <= 4096
    assert wecom.classify(200, {}, b'{"errcode":0,"errmsg":"ok"}').kind == "ok"
    assert wecom.classify(200, {}, b'{"errcode":45009,"errmsg":"api freq out of limit"}').kind == "retry"
    assert wecom.classify(200, {}, b'{"errcode":93000,"errmsg":"invalid webhook url"}').kind == "permanent"


def test_slack_blocks_with_a_text_fallback_and_plain_text_errors() -> None:
    body = json.loads(slack.build([alert()], Target("s", "slack", "https://hooks.slack.com/x"), NOW).body)
    assert body["text"].startswith("tunerd warning: kv-pool-saturated")
    assert body["blocks"][0]["type"] == "header"
    assert any("max_num_seqs 16 → 12" in str(block) for block in body["blocks"])
    assert slack.classify(200, {}, b"ok").kind == "ok"
    limited = slack.classify(429, {"Retry-After": "7"}, b"rate_limited")
    assert (limited.kind, limited.retry_after) == ("retry", 7.0)
    assert slack.classify(404, {}, b"channel_not_found").kind == "permanent"
    assert "channel_not_found" in slack.classify(404, {}, b"channel_not_found").detail
    assert slack.classify(410, {}, b"channel_is_archived").kind == "permanent"
    assert slack.classify(500, {}, b"rollup_error").kind == "retry"


def test_teams_adaptive_card_in_the_envelope_under_28_kb() -> None:
    many = alert(evidence={"signals": {f"s{i}": float(i) for i in range(2000)}})
    body = json.loads(teams.build([many], Target("t", "teams", "https://x.powerplatform.com/x"), NOW).body)
    assert body["type"] == "message"
    attachment = body["attachments"][0]
    assert attachment["contentType"] == "application/vnd.microsoft.card.adaptive"
    assert attachment["content"]["type"] == "AdaptiveCard"
    assert len(json.dumps(body).encode()) <= 28_000
    assert teams.classify(202, {}, b"").kind == "ok"
    assert teams.classify(429, {"retry-after": "3"}, b"").retry_after == 3.0


def test_discord_embed_and_the_larger_of_two_retry_hints() -> None:
    body = json.loads(
        discord.build([alert(severity="critical")], Target("d", "discord", "https://d/x"), NOW).body
    )
    embed = body["embeds"][0]
    assert embed["color"] == 0xE01E5A
    assert len(embed["title"]) <= 256
    assert embed["timestamp"] == "2025-11-29T07:06:40Z"
    assert discord.classify(204, {}, b"").kind == "ok"
    reply = b'{"message":"You are being rate limited.","retry_after":0.729,"global":false}'
    assert discord.classify(429, {"Retry-After": "2"}, reply).retry_after == 2.0
    assert discord.classify(429, {}, reply).retry_after == 0.729
    assert discord.classify(401, {}, b"{}").kind == "permanent"


def test_generic_webhook_schema_and_hmac_header() -> None:
    request = webhook.build([alert()], Target("w", "webhook", "https://hook/x", "s3cret-value"), NOW)
    body = json.loads(request.body)
    assert (body["version"], body["source"]) == (1, "tunerd")
    [sent] = body["alerts"]
    assert set(sent) >= {
        "severity", "status", "title", "summary", "engine", "host", "time", "policy", "evidence", "action",
        "undo", "fingerprint",
    }  # fmt: skip
    assert sent["action"] == {
        "kind": "tune",
        "from_settings": {"max_num_seqs": 16},
        "to_settings": {"max_num_seqs": 12},
        "outcome": "succeeded",
    }
    timestamp = request.headers["X-Tunerd-Timestamp"]
    mac = hmac.new(b"s3cret-value", timestamp.encode() + b"." + request.body, hashlib.sha256).hexdigest()
    assert request.headers["X-Tunerd-Signature"] == f"sha256={mac}"
    assert (
        "X-Tunerd-Signature"
        not in webhook.build([alert()], Target("w", "webhook", "https://hook/x"), NOW).headers
    )


def test_alertmanager_posts_v2_alerts_that_end_on_resolve() -> None:
    target = Target("am", "alertmanager", "http://am:9093/")
    firing = alertmanager.build([alert()], target, NOW)
    assert firing.url == "http://am:9093/api/v2/alerts"
    [posted] = json.loads(firing.body)
    assert posted["labels"] == {
        "alertname": "kv-pool-saturated",
        "engine": "llama31-8b",
        "host": "gpu-box-1",
        "severity": "warning",
        "source": "tunerd",
    }
    assert posted["annotations"]["undo"] == "tunerd rollback llama31-8b"
    assert posted["startsAt"] == "2025-11-29T07:06:40Z"
    assert posted["endsAt"] > posted["startsAt"]  # held a while ahead, re-sent while firing
    resolved = alert().resolved(NOW + 600, "cleared")
    [ended] = json.loads(alertmanager.build([resolved], target, NOW + 600).body)
    assert ended["endsAt"] == "2025-11-29T07:16:40Z"
    assert ended["startsAt"] == "2025-11-29T07:06:40Z"  # when it began, as Alertmanager knows it
    assert alertmanager.classify(200, {}, b"").kind == "ok"
    assert alertmanager.classify(503, {}, b"").kind == "retry"
    assert alertmanager.classify(429, {}, b"").kind == "permanent"  # Alertmanager's contract: only 5xx


def test_every_kind_has_a_module_and_a_digest_of_many_alerts() -> None:
    assert set(KINDS) == {
        "feishu",
        "dingtalk",
        "wecom",
        "slack",
        "teams",
        "discord",
        "webhook",
        "alertmanager",
    }
    alerts = [alert(title=f"trouble {i}", count=i + 1) for i in range(30)]
    for kind in KINDS:
        request = module(kind).build(alerts, Target("x", kind, "https://example.invalid/hook"), NOW)
        text = request.body.decode()
        assert "trouble 29" in text, kind
    with pytest.raises(ValueError, match="unknown notify kind 'pager'"):
        module("pager")
