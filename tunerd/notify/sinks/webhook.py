"""Generic JSON webhook: tunerd's own documented schema (docs/notify.md).

``POST`` of ``{"version": 1, "source": "tunerd", "text": …, "alerts": [Alert…]}`` — each alert
DESIGN §4.8's fields. With a secret, ``X-Tunerd-Timestamp`` (Unix seconds) and
``X-Tunerd-Signature: sha256=<hex HMAC-SHA256(secret, "{timestamp}." + body)>`` let the receiver
check the sender and refuse replays. 2xx taken; 408, 429 and 5xx again later (``Retry-After``
honoured); other statuses refused.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping, Sequence

from tunerd.notify.alert import Alert, render_many
from tunerd.notify.sink import Outcome, Rate, Request, Target, http_outcome, json_body

KIND = "webhook"
RATE = Rate(10, 1.0)
SCHEMA_VERSION = 1


def signature(secret: str, timestamp: int, body: bytes) -> str:
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256)
    return f"sha256={mac.hexdigest()}"


def build(alerts: Sequence[Alert], target: Target, now: float) -> Request:
    rendered = render_many(list(alerts), target.language)
    body = json_body(
        {
            "version": SCHEMA_VERSION,
            "source": "tunerd",
            "text": f"{rendered.title}: {rendered.summary}",
            "alerts": [alert.to_dict() for alert in alerts],
        }
    )
    headers = {"Content-Type": "application/json", "User-Agent": "tunerd"}
    if target.secret:
        timestamp = int(now)
        headers["X-Tunerd-Timestamp"] = str(timestamp)
        headers["X-Tunerd-Signature"] = signature(target.secret, timestamp, body)
    return Request(target.url, body, headers)


def classify(status: int, headers: Mapping[str, str], body: bytes) -> Outcome:
    return http_outcome(status, headers, body)
