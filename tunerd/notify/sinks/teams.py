"""Microsoft Teams through a Workflows (Power Automate) URL (reference/integrations-facts.md §1.5).

An Adaptive Card inside the message envelope (a bare card is refused); the flow accepts the POST
(2xx) and fails later on its own if the card is over 28 KB, so the card is kept under that here.
429 and 5xx again later. Retired ``*.webhook.office.com`` connector URLs are refused at config
time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tunerd.notify.alert import Alert, render_many
from tunerd.notify.sink import Outcome, Rate, Request, Target, http_outcome, json_body

KIND = "teams"
RATE = Rate(4, 1.0)
MAX_BYTES = 28_000


def _card(alerts: Sequence[Alert], target: Target, evidence: int) -> dict[str, Any]:
    rendered = render_many(list(alerts), target.language)
    colour = {"red": "Attention", "orange": "Warning", "green": "Good", "blue": "Accent"}[rendered.colour]
    body: list[dict[str, Any]] = [
        {
            "type": "TextBlock",
            "text": rendered.title,
            "weight": "Bolder",
            "size": "Medium",
            "color": colour,
            "wrap": True,
        },
        {"type": "TextBlock", "text": rendered.summary, "wrap": True},
    ]
    if rendered.fields:
        body.append({"type": "FactSet", "facts": [{"title": k, "value": v} for k, v in rendered.fields]})
    if rendered.changes:
        body.append(
            {
                "type": "TextBlock",
                "text": f"**{rendered.change_label}**: " + "; ".join(rendered.changes),
                "wrap": True,
            }
        )
    for line in rendered.evidence[:evidence]:
        body.append({"type": "TextBlock", "text": line, "wrap": True, "isSubtle": True, "spacing": "None"})
    if rendered.undo:
        body.append(
            {
                "type": "TextBlock",
                "text": f"{rendered.undo_label}: {rendered.undo}",
                "wrap": True,
                "fontType": "Monospace",
            }
        )
    return {
        "type": "message",
        "attachments": [
            {
                "contentType": "application/vnd.microsoft.card.adaptive",
                "contentUrl": None,
                "content": {
                    "$schema": "http://adaptivecards.io/schemas/adaptive-card.json",
                    "type": "AdaptiveCard",
                    "version": "1.2",
                    "msteams": {"width": "full"},
                    "body": body,
                },
            }
        ],
    }


def build(alerts: Sequence[Alert], target: Target, now: float) -> Request:
    evidence = 50
    body = json_body(_card(alerts, target, evidence))
    while len(body) > MAX_BYTES and evidence > 0:  # drop evidence lines until it fits
        evidence //= 2
        body = json_body(_card(alerts, target, evidence))
    return Request(target.url, body)


def classify(status: int, headers: Mapping[str, str], body: bytes) -> Outcome:
    return http_outcome(status, headers, body)
