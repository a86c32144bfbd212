"""WeCom (企业微信) group robot (reference/integrations-facts.md §1.4).

Markdown ≤ 4096 bytes; the ``key`` in the URL is the only credential (no signature). Replies
carry ``errcode``: 0 taken, 45009 too frequent (again later), anything else refused.
20 messages a minute.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tunerd.notify.alert import Alert, markdown, render_many
from tunerd.notify.sink import Outcome, Rate, Request, Target, errcode_outcome, json_body, utf8_cut

KIND = "wecom"
RATE = Rate(20, 60.0)
MAX_BYTES = 4096


def build(alerts: Sequence[Alert], target: Target, now: float) -> Request:
    rendered = render_many(list(alerts), target.language)
    text = utf8_cut(markdown(rendered, heading="## "), MAX_BYTES)
    return Request(target.url, json_body({"msgtype": "markdown", "markdown": {"content": text}}))


def classify(status: int, headers: Mapping[str, str], body: bytes) -> Outcome:
    return errcode_outcome(status, headers, body, {45009: 60.0})
