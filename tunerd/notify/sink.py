"""What every sink module shares: the request it builds, the outcome it reads from the reply,
and the reply rules most services follow (reference/integrations-facts.md §1.0).

A sink module (``tunerd/notify/sinks/KIND.py``) is pure: ``build(alerts, target, now)`` makes
the HTTP request for one message — one alert, or several grouped into a digest when the
service's rate limit holds them back — signed when the service wants it; ``classify(status,
headers, body)`` says whether the service took it, wants it again later (and when), or refused
it for good. Sending, waiting and retrying are the dispatcher's (:mod:`tunerd.notify.dispatch`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from tunerd.notify.alert import Alert

__all__ = [
    "Outcome",
    "Request",
    "SinkModule",
    "Target",
    "errcode_outcome",
    "http_outcome",
    "json_body",
    "retry_after_seconds",
    "utf8_cut",
]


@dataclass(frozen=True)
class Target:
    """One configured sink as its module needs it: where, the signing secret, the language."""

    name: str
    kind: str
    url: str
    secret: str | None = None
    language: str = "en"
    min_severity: str = "info"


@dataclass(frozen=True)
class Request:
    url: str
    body: bytes
    headers: Mapping[str, str] = field(default_factory=lambda: {"Content-Type": "application/json"})


@dataclass(frozen=True)
class Outcome:
    kind: Literal["ok", "retry", "permanent"]
    detail: str
    retry_after: float | None = None  # seconds, when the service said

    @property
    def ok(self) -> bool:
        return self.kind == "ok"


@dataclass(frozen=True)
class Rate:
    """At most ``messages`` per ``seconds`` (the service's documented limit)."""

    messages: int
    seconds: float


class SinkModule(Protocol):
    KIND: str
    RATE: Rate

    def build(self, alerts: Sequence[Alert], target: Target, now: float) -> Request: ...
    def classify(self, status: int, headers: Mapping[str, str], body: bytes) -> Outcome: ...


def json_body(payload: Any) -> bytes:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()


def retry_after_seconds(headers: Mapping[str, str]) -> float | None:
    """``Retry-After`` in seconds (the HTTP-date form is not used by these services)."""
    value = next((v for k, v in headers.items() if k.lower() == "retry-after"), None)
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


def _text(body: bytes, limit: int = 200) -> str:
    return body[:limit].decode("utf-8", "replace").strip()


def http_outcome(status: int, headers: Mapping[str, str], body: bytes) -> Outcome:
    """The plain HTTP rules: 2xx taken; 429, 408 and 5xx again later (``Retry-After`` when
    given); any other status refused for good (a wrong URL, a revoked hook, a bad payload)."""
    if 200 <= status < 300:
        return Outcome("ok", f"HTTP {status}")
    detail = f"HTTP {status} {_text(body)}".strip()
    if status in (408, 429) or status >= 500:
        return Outcome("retry", detail, retry_after_seconds(headers))
    return Outcome("permanent", detail)


def json_reply(body: bytes) -> dict[str, Any] | None:
    try:
        reply = json.loads(body)
    except ValueError:
        return None
    return reply if isinstance(reply, dict) else None


def errcode_outcome(
    status: int, headers: Mapping[str, str], body: bytes, retry: Mapping[int, float]
) -> Outcome:
    """The ``errcode`` replies of DingTalk and WeCom (always HTTP 200): 0 taken, a code in
    ``retry`` again after that many seconds, any other code refused, a reply of another shape
    tried again later."""
    if status != 200:
        return http_outcome(status, headers, body)
    reply = json_reply(body)
    if reply is None or "errcode" not in reply:
        return Outcome("retry", f"HTTP 200 with an unknown reply: {body[:100]!r}")
    code = reply["errcode"]
    if code == 0:
        return Outcome("ok", "errcode 0")
    detail = f"errcode {code}: {reply.get('errmsg', '')}"
    return Outcome("retry", detail, retry[code]) if code in retry else Outcome("permanent", detail)


def utf8_cut(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` UTF-8 bytes, on a character boundary, marked."""
    data = text.encode()
    if len(data) <= limit:
        return text
    return data[: max(0, limit - 3)].decode("utf-8", "ignore") + "…"
