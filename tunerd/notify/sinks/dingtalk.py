"""DingTalk custom robot (reference/integrations-facts.md §1.3).

Markdown. With a signing secret (``SEC…``) the URL gets ``&timestamp=`` (Unix milliseconds) and
``&sign=`` = url-quoted base64(HMAC-SHA256 keyed by the *secret* over ``"{timestamp}\\n{secret}"``).
Every reply is HTTP 200 with ``errcode``: 0 taken, 130101 sent too fast (again later; DingTalk
then throttles the robot for 10 minutes), 310000 security (keyword, signature, timestamp, IP)
and anything else refused; a reply of another shape is tried again later. 20 messages a minute.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Mapping, Sequence
from urllib.parse import quote_plus

from tunerd.notify.alert import Alert, markdown, render_many
from tunerd.notify.sink import Outcome, Rate, Request, Target, errcode_outcome, json_body, utf8_cut

KIND = "dingtalk"
RATE = Rate(20, 60.0)
MAX_BYTES = 20_000


def sign(timestamp_ms: int, secret: str) -> str:
    message = f"{timestamp_ms}\n{secret}".encode()
    digest = hmac.new(secret.encode(), message, hashlib.sha256).digest()
    return quote_plus(base64.b64encode(digest).decode())


def build(alerts: Sequence[Alert], target: Target, now: float) -> Request:
    rendered = render_many(list(alerts), target.language)
    payload = {
        "msgtype": "markdown",
        "markdown": {"title": rendered.title, "text": utf8_cut(markdown(rendered), MAX_BYTES - 1_000)},
        "at": {"atMobiles": [], "isAtAll": False},
    }
    url = target.url
    if target.secret:
        timestamp_ms = int(now * 1000)
        url += (
            f"{'&' if '?' in url else '?'}timestamp={timestamp_ms}&sign={sign(timestamp_ms, target.secret)}"
        )
    return Request(url, json_body(payload), {"Content-Type": "application/json;charset=utf-8"})


def classify(status: int, headers: Mapping[str, str], body: bytes) -> Outcome:
    return errcode_outcome(status, headers, body, {130101: 60.0})
