"""Discord webhook (reference/integrations-facts.md §1.6).

One embed (title ≤ 256, description ≤ 4096, ≤ 25 fields of ≤ 1024). 204 (or 200) taken; 429
again after ``max(Retry-After, retry_after in the body)`` (reports differ on its unit); 5xx
again later; other 4xx refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tunerd.notify.alert import Alert, render_many
from tunerd.notify.sink import (
    Outcome,
    Rate,
    Request,
    Target,
    http_outcome,
    json_body,
    json_reply,
    retry_after_seconds,
    short,
    wait_seconds,
)

KIND = "discord"
RATE = Rate(5, 2.0)
_COLOURS = {"red": 0xE01E5A, "orange": 0xECB22E, "green": 0x2EB67D, "blue": 0x36C5F0}


def build(alerts: Sequence[Alert], target: Target, now: float) -> Request:
    rendered = render_many(list(alerts), target.language)
    fields = [{"name": k[:256], "value": v[:1024], "inline": True} for k, v in rendered.fields]
    if rendered.changes:
        fields.append(
            {"name": rendered.change_label, "value": "\n".join(f"`{c}`" for c in rendered.changes)[:1024]}
        )
    if rendered.undo:
        fields.append({"name": rendered.undo_label, "value": f"`{rendered.undo}`"[:1024]})
    embed = {
        "title": rendered.title[:256],
        # the evidence (or a digest's alerts) under the summary: a field holds only 1024
        "description": "\n".join(
            [
                rendered.summary,
                *([f"**{rendered.evidence_label}**", *rendered.evidence] if rendered.evidence else []),
            ]
        )[:4096],
        "color": _COLOURS[rendered.colour],
        "fields": fields[:25],
        "timestamp": alerts[0].to_dict()["time"],
    }
    return Request(target.url, json_body({"username": "tunerd", "embeds": [embed]}))


def classify(status: int, headers: Mapping[str, str], body: bytes) -> Outcome:
    if status == 429:
        reply = json_reply(body) or {}
        waits = [
            w for w in (retry_after_seconds(headers), wait_seconds(reply.get("retry_after"))) if w is not None
        ]
        return Outcome(
            "retry", f"HTTP 429 {short(reply.get('message', ''))}".strip(), max(waits, default=None)
        )
    return http_outcome(status, headers, body)
