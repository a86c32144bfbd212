"""Talking to a running ``tunerd gate`` over its control socket: hold, release, retune, status.

Used by the daemon (a restart holds new requests at the gate; a policy's ``gate:`` action
retunes it) and by ``tunerd gate status``. Every call has a total deadline and a size cap
(:func:`tunerd.sources.http.exchange`); a gate that is not running, or does not answer in
time, is an answer too (:class:`GateReply` with ``ok`` false and why) — never an exception
that could stop a restart or a tick.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tunerd.sources.http import DeadlineExceeded, ResponseTooLarge, exchange

__all__ = ["CONTROL_DEADLINE_S", "GateClient", "GateReply"]

CONTROL_DEADLINE_S = 1.0  # a gate is local: one that takes longer is treated as absent
STATUS_MAX_BYTES = 1 << 20


@dataclass(frozen=True)
class GateReply:
    ok: bool
    data: dict[str, Any]
    error: str = ""


class GateClient:
    """The control socket at ``path``."""

    def __init__(self, path: Path, deadline: float = CONTROL_DEADLINE_S) -> None:
        self.path = path
        self.deadline = deadline

    def _call(self, method: str, route: str, body: dict[str, Any] | None = None) -> GateReply:
        if not self.path.exists():
            return GateReply(False, {}, f"no gate control socket at {self.path}")
        try:
            reply = exchange(
                method,
                f"http://gate{route}",
                deadline=self.deadline,
                max_bytes=STATUS_MAX_BYTES,
                content=None if body is None else json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
                transport=httpx.HTTPTransport(uds=str(self.path)),
            )
        except DeadlineExceeded:
            return GateReply(False, {}, f"the gate did not answer within {self.deadline:g} s")
        except (httpx.HTTPError, OSError, ResponseTooLarge) as error:
            return GateReply(False, {}, f"the gate did not answer: {type(error).__name__}: {error}")
        try:
            data = json.loads(reply.body)
        except (ValueError, RecursionError):
            data = None
        if not isinstance(data, dict):
            return GateReply(False, {}, f"the gate answered {reply.status} with something that is not JSON")
        if reply.status != 200:
            return GateReply(False, data, str(data.get("error", f"the gate answered {reply.status}"))[:300])
        return GateReply(True, data)

    def hold(self, engine: str, seconds: float | None, reason: str) -> GateReply:
        return self._call("POST", f"/engines/{engine}/hold", {"seconds": seconds, "reason": reason})

    def release(self, engine: str) -> GateReply:
        return self._call("POST", f"/engines/{engine}/release", {})

    def retune(self, engine: str, changes: dict[str, Any]) -> GateReply:
        return self._call("POST", f"/engines/{engine}/limits", changes)

    def status(self) -> GateReply:
        return self._call("GET", "/status")
