"""Feishu / Lark custom bot (reference/integrations-facts.md §1.2).

An interactive card (header coloured by severity, ``lark_md`` body). With a signing secret the
body carries ``timestamp`` (Unix seconds) and ``sign`` = base64(HMAC-SHA256 keyed by
``"{timestamp}\\n{secret}"`` over an *empty* message) — the key/message order is the opposite
of DingTalk's. Every reply is HTTP 200; ``code`` in the body says: 0 taken, 11232 rate limited
(again later), anything else (bad signature 19021, IP 19022, keyword 19024, bad body 9499…)
refused. Body ≤ 20 KB; 100 messages a minute and 5 a second per bot.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Mapping, Sequence

from tunerd.notify.alert import Alert, markdown, render_many
from tunerd.notify.sink import (
    Outcome,
    Rate,
    Request,
    Target,
    http_outcome,
    int_code,
    json_body,
    json_reply,
    short,
    unknown_reply,
    utf8_cut,
)

KIND = "feishu"
RATE = Rate(5, 1.0)  # and 100 a minute: 5 a second is the one a burst meets first
MAX_BYTES = 20_000
_RETRY_CODES = {11232}  # rate limited
_COLOURS = {"red": "red", "orange": "orange", "green": "green", "blue": "blue"}


def sign(timestamp: int, secret: str) -> str:
    key = f"{timestamp}\n{secret}".encode()
    return base64.b64encode(hmac.new(key, b"", hashlib.sha256).digest()).decode()


def build(alerts: Sequence[Alert], target: Target, now: float) -> Request:
    rendered = render_many(list(alerts), target.language)
    text = utf8_cut(markdown(rendered, heading="")[len(rendered.title) :].strip(), MAX_BYTES - 2_000)
    payload: dict[str, object] = {
        "msg_type": "interactive",
        "card": {
            "header": {
                "template": _COLOURS[rendered.colour],
                "title": {"tag": "plain_text", "content": rendered.title},
            },
            "elements": [{"tag": "div", "text": {"tag": "lark_md", "content": text}}],
        },
    }
    if target.secret:
        timestamp = int(now)
        payload = {"timestamp": str(timestamp), "sign": sign(timestamp, target.secret), **payload}
    return Request(target.url, json_body(payload))


def classify(status: int, headers: Mapping[str, str], body: bytes) -> Outcome:
    if status != 200:
        return http_outcome(status, headers, body)
    reply = json_reply(body)
    code = int_code(reply, "code", "StatusCode")
    if reply is None or code is None:
        return unknown_reply(status, body)
    if code == 0:
        return Outcome("ok", "code 0")
    detail = f"code {short(code)}: {short(reply.get('msg', ''))}"
    if code in _RETRY_CODES:
        return Outcome("retry", detail, 1.0)
    return Outcome("permanent", detail)
