"""What every sink module shares: the request it builds, the outcome it reads from the reply,
and the reply rules most services follow (reference/integrations-facts.md §1.0).

A sink module (``tunerd/notify/sinks/KIND.py``) is pure: ``build(alerts, target, now)`` makes
the HTTP request for one message — one alert, or several grouped into a digest when the
service's rate limit holds them back — signed when the service wants it; ``classify(status,
headers, body)`` says whether the service took it, wants it again later (and when), or refused
it for good. Sending, waiting and retrying are the dispatcher's (:mod:`tunerd.notify.dispatch`).

Every reply is read as hostile: a parser here never raises, whatever the status, headers or
body (a code of the wrong type, a number of a thousand digits, ``NaN``, nesting a thousand
deep, bytes that are not UTF-8) — an unknown reply is one more outcome, and every wait a
service asks for is clamped to ``[0, MAX_RETRY_AFTER_S]`` by :func:`wait_seconds`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from tunerd.notify.alert import Alert

__all__ = [
    "MAX_RETRY_AFTER_S",
    "Outcome",
    "Request",
    "SinkModule",
    "Target",
    "errcode_outcome",
    "http_outcome",
    "int_code",
    "json_body",
    "json_reply",
    "retry_after_seconds",
    "short",
    "unknown_reply",
    "utf8_cut",
    "wait_seconds",
]

MAX_RETRY_AFTER_S = 3600.0  # the longest a service may make a sink wait before its next try
_DETAIL = 200  # characters of a reply quoted in an outcome


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


def wait_seconds(value: object) -> float | None:
    """A wait a service asked for, in seconds, clamped to ``[0, MAX_RETRY_AFTER_S]``; None
    when it is not a number (a string of one is read; ``NaN``, a boolean, a list are not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        seconds = float(value)
    except (ValueError, OverflowError):  # "soon"; an int too large for a float: as long as it gets
        if not isinstance(value, int):
            return None
        seconds = math.inf if value > 0 else -math.inf
    if math.isnan(seconds):
        return None
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S)


def retry_after_seconds(headers: Mapping[str, str]) -> float | None:
    """``Retry-After`` in seconds, clamped (the HTTP-date form is not used by these services)."""
    value = next((v for k, v in headers.items() if k.lower() == "retry-after"), None)
    return None if value is None else wait_seconds(value.strip())


def _text(body: bytes, limit: int = _DETAIL) -> str:
    return body[:limit].decode("utf-8", "replace").strip()


def short(value: object) -> str:
    """``value`` for an outcome's detail: a string as it is, anything else as JSON, cut."""
    if isinstance(value, str):
        return value[:_DETAIL]
    try:
        return json.dumps(value, ensure_ascii=False, default=str)[:_DETAIL]
    except (ValueError, TypeError, RecursionError):
        return f"({type(value).__name__})"


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
    """The reply's JSON object; None for anything else (not JSON, not an object, nested past
    the parser's depth, a number past its digits)."""
    try:
        reply = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return reply if isinstance(reply, dict) else None


def int_code(reply: Mapping[str, Any] | None, *keys: str) -> int | None:
    """The first of ``keys`` in the reply that holds an integer (not a boolean), else None."""
    for key in keys:
        code = (reply or {}).get(key)
        if isinstance(code, int) and not isinstance(code, bool):
            return code
    return None


def unknown_reply(status: int, body: bytes) -> Outcome:
    """A reply of a shape the service does not send: tried again later."""
    return Outcome("retry", f"HTTP {status} with an unknown reply: {body[:100]!r}")


def errcode_outcome(
    status: int, headers: Mapping[str, str], body: bytes, retry: Mapping[int, float]
) -> Outcome:
    """The ``errcode`` replies of DingTalk and WeCom (always HTTP 200): 0 taken, a code in
    ``retry`` again after that many seconds, any other code refused, a reply of another shape
    (no ``errcode``, or one that is not an integer) tried again later."""
    if status != 200:
        return http_outcome(status, headers, body)
    reply = json_reply(body)
    code = int_code(reply, "errcode")
    if reply is None or code is None:
        return unknown_reply(status, body)
    if code == 0:
        return Outcome("ok", "errcode 0")
    detail = f"errcode {short(code)}: {short(reply.get('errmsg', ''))}"
    return (
        Outcome("retry", detail, wait_seconds(retry[code])) if code in retry else Outcome("permanent", detail)
    )


def utf8_cut(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` UTF-8 bytes, on a character boundary, marked."""
    data = text.encode()
    if len(data) <= limit:
        return text
    return data[: max(0, limit - 3)].decode("utf-8", "ignore") + "…"
