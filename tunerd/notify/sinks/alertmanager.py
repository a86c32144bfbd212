"""Alertmanager: tunerd posts its alerts to ``URL/api/v2/alerts`` and rides Alertmanager's
routing, grouping, silences and inhibition (reference/integrations-facts.md §1.7).

Each alert becomes ``{labels, annotations, startsAt, endsAt, generatorURL}``: labels
``alertname`` (the policy), ``engine``, ``host``, ``severity``, ``source: tunerd`` (and
``test: "true"`` for ``tunerd notify test``'s); annotations the title, summary, flag diff and
undo command; ``generatorURL`` tunerd's ``/metrics`` page when it listens beyond this
machine. A firing alert's ``endsAt`` lies :data:`HOLD_S` ahead and the dispatcher re-sends it
every :data:`RESEND_S` while it fires, so Alertmanager resolves it by itself if tunerd goes
away; a resolve sends ``endsAt`` = the time it cleared. 2xx taken, 5xx again later, other
statuses refused (Alertmanager's own retry contract).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tunerd.notify.alert import Alert, flag_diff, iso
from tunerd.notify.sink import Outcome, Rate, Request, Target, http_outcome, json_body

KIND = "alertmanager"
RATE = Rate(20, 1.0)
RESEND_S = 60.0
HOLD_S = 4 * RESEND_S


def build(alerts: Sequence[Alert], target: Target, now: float) -> Request:
    posted = []
    for alert in alerts:
        annotations = {"title": alert.title, "summary": alert.summary}
        if changes := flag_diff(alert.action):
            annotations["change"] = "; ".join(f"{knob} {before} → {after}" for knob, before, after in changes)
        if alert.undo:
            annotations["undo"] = alert.undo
        labels = {
            "alertname": alert.policy or "tunerd",
            "engine": alert.engine,
            "host": alert.host,
            "severity": alert.severity,
            "source": "tunerd",
        }
        if alert.test:  # so that a route or a silence can tell it from a real one
            labels["test"] = "true"
        item: dict[str, object] = {
            "labels": labels,
            "annotations": annotations,
            "startsAt": iso(alert.since if alert.since is not None else alert.time),
            "endsAt": iso(alert.time if alert.status == "resolved" else now + HOLD_S),
        }
        if alert.link:
            item["generatorURL"] = alert.link
        posted.append(item)
    return Request(target.url.rstrip("/") + "/api/v2/alerts", json_body(posted))


def classify(status: int, headers: Mapping[str, str], body: bytes) -> Outcome:
    outcome = http_outcome(status, headers, body)
    if outcome.kind == "retry" and status < 500:  # Alertmanager retries only 5xx
        return Outcome("permanent", outcome.detail)
    return outcome
