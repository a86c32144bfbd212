"""One module per service: ``build`` (payload, signature) and ``classify`` (the reply)."""

from __future__ import annotations

from tunerd.notify.sink import SinkModule
from tunerd.notify.sinks import alertmanager, dingtalk, discord, feishu, slack, teams, webhook, wecom

__all__ = ["KINDS", "module"]

_MODULES: dict[str, SinkModule] = {
    m.KIND: m for m in (feishu, dingtalk, wecom, slack, teams, discord, webhook, alertmanager)
}
KINDS = tuple(_MODULES)


def module(kind: str) -> SinkModule:
    try:
        return _MODULES[kind]
    except KeyError:
        raise ValueError(f"unknown notify kind '{kind}' (choose from {', '.join(KINDS)})") from None
