"""Slack incoming webhook (reference/integrations-facts.md §1.1).

Blocks (header, section, fields, context) with ``text`` as the notification fallback. Replies
are plain text: 200 ``ok``; 429 with ``Retry-After``; 5xx again later; ``invalid_payload``,
``channel_not_found``, ``channel_is_archived``, ``no_service``… refused. About one message a
second.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tunerd.notify.alert import Alert, render_many
from tunerd.notify.sink import Outcome, Rate, Request, Target, http_outcome, json_body

KIND = "slack"
RATE = Rate(1, 1.0)


def build(alerts: Sequence[Alert], target: Target, now: float) -> Request:
    rendered = render_many(list(alerts), target.language)
    blocks: list[dict[str, Any]] = [
        {"type": "header", "text": {"type": "plain_text", "text": rendered.title[:150]}},
        {"type": "section", "text": {"type": "mrkdwn", "text": rendered.summary[:3000] or " "}},
    ]
    if rendered.fields:
        blocks.append(
            {
                "type": "section",
                "fields": [{"type": "mrkdwn", "text": f"*{k}*\n{v}"} for k, v in rendered.fields][:10],
            }
        )
    if rendered.changes:
        changes = "\n".join(f"`{change}`" for change in rendered.changes)
        blocks.append(
            {"type": "section", "text": {"type": "mrkdwn", "text": f"*{rendered.change_label}*\n{changes}"}}
        )
    if rendered.evidence:
        lines = "\n".join(f"• {line}" for line in rendered.evidence)[:3000]
        blocks.append(
            {"type": "section", "text": {"type": "mrkdwn", "text": f"*{rendered.evidence_label}*\n{lines}"}}
        )
    if rendered.undo:
        blocks.append(
            {
                "type": "context",
                "elements": [{"type": "mrkdwn", "text": f"{rendered.undo_label}: `{rendered.undo}`"}],
            }
        )
    return Request(target.url, json_body({"text": f"{rendered.title}: {rendered.summary}", "blocks": blocks}))


def classify(status: int, headers: Mapping[str, str], body: bytes) -> Outcome:
    return http_outcome(status, headers, body)
