"""The alert every sink renders (DESIGN §4.8, Contract), and its text in Chinese and English.

Pure: no clock, no I/O. :func:`render` turns an alert into the parts every chat format is made
of — a title, a summary, labelled fields, the flag diff and the command that undoes it — and
each sink module lays those parts out in its own format. Every title begins with ``tunerd`` so
a Feishu or DingTalk robot with keyword security accepts firing and resolved messages alike
(reference/integrations-facts.md §1.2).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, Literal

__all__ = [
    "LANGUAGES",
    "SEVERITIES",
    "Action",
    "Alert",
    "Rendered",
    "Severity",
    "fingerprint",
    "flag_diff",
    "markdown",
    "render",
    "render_many",
    "severity_at_least",
]

SEVERITIES = ("info", "warning", "critical")
LANGUAGES = ("en", "zh")
Severity = Literal["info", "warning", "critical"]


def severity_at_least(severity: str, minimum: str) -> bool:
    return SEVERITIES.index(severity) >= SEVERITIES.index(minimum)


def fingerprint(engine: str, policy: str, condition: str = "") -> str:
    """Stable per engine + policy + condition: the same trouble repeating has the same one."""
    return hashlib.sha256(f"{engine}\0{policy}\0{condition}".encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Action:
    """What tunerd did (or proposes): ``kind`` as in history (tune, restart, rollback, hold…)."""

    kind: str
    from_settings: Mapping[str, Any] = field(default_factory=dict)
    to_settings: Mapping[str, Any] = field(default_factory=dict)
    outcome: str | None = None  # succeeded, rolled_back, proposed…


@dataclass(frozen=True)
class Alert:
    severity: Severity
    status: Literal["firing", "resolved"]
    title: str
    summary: str
    engine: str
    host: str
    time: float  # seconds since the epoch
    policy: str
    fingerprint: str
    evidence: Mapping[str, Any] = field(default_factory=dict)  # {signals: {...}, log_lines: [...]}
    action: Action | None = None
    undo: str | None = None  # the command that reverts it
    count: int = 1  # the same condition repeated this many times in the grouping window
    test: bool = False  # `tunerd notify test`
    since: float | None = None  # a resolve: when the condition began firing
    #: the incident's short post-mortem by language ("en", "zh"), with the command to see it all
    postmortem: Mapping[str, str] | None = None
    #: where a person can look at what raised it (tunerd's /metrics page, when it listens beyond
    #: this machine): Alertmanager's ``generatorURL``
    link: str | None = None

    def resolved(self, time: float, summary: str) -> Alert:
        return replace(self, status="resolved", time=time, summary=summary, count=1, since=self.time)

    def to_dict(self) -> dict[str, Any]:
        """The Contract's fields (JSON-ready; ``time`` as ISO 8601 UTC)."""
        return {
            "severity": self.severity,
            "status": self.status,
            "title": self.title,
            "summary": self.summary,
            "engine": self.engine,
            "host": self.host,
            "time": iso(self.time),
            "policy": self.policy,
            "evidence": dict(self.evidence),
            "action": None
            if self.action is None
            else {
                "kind": self.action.kind,
                "from_settings": dict(self.action.from_settings),
                "to_settings": dict(self.action.to_settings),
                "outcome": self.action.outcome,
            },
            "undo": self.undo,
            "fingerprint": self.fingerprint,
            "count": self.count,
            "test": self.test,
            "since": None if self.since is None else iso(self.since),
            "postmortem": None if self.postmortem is None else dict(self.postmortem),
            "link": self.link,
        }


def iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def flag_diff(action: Action | None) -> list[tuple[str, Any, Any]]:
    """(knob, before, after) for every knob the action changes, in a stable order."""
    if action is None:
        return []
    knobs = sorted(set(action.from_settings) | set(action.to_settings))
    return [
        (knob, action.from_settings.get(knob), action.to_settings.get(knob))
        for knob in knobs
        if action.from_settings.get(knob) != action.to_settings.get(knob)
    ]


_WORDS = {
    "en": {
        "info": "info",
        "warning": "warning",
        "critical": "CRITICAL",
        "firing": "firing",
        "resolved": "resolved",
        "engine": "Engine",
        "host": "Host",
        "policy": "Policy",
        "time": "Time",
        "action": "Action",
        "change": "Change",
        "evidence": "Evidence",
        "undo": "Undo",
        "repeated": "repeated {count} times",
        "test": "test alert",
        "digest": "{count} alerts held back by the chat's rate limit, together",
        "digest_summary": "The chat service allows only a few messages a minute; these came meanwhile.",
        "alerts": "Alerts",
    },
    "zh": {
        "info": "通知",
        "warning": "警告",
        "critical": "严重",
        "firing": "告警中",
        "resolved": "已恢复",
        "engine": "引擎",
        "host": "主机",
        "policy": "策略",
        "time": "时间",
        "action": "动作",
        "change": "参数变更",
        "evidence": "依据",
        "undo": "撤销",
        "repeated": "重复 {count} 次",
        "test": "测试告警",
        "digest": "{count} 条告警（受限流合并发送）",
        "digest_summary": "该群机器人每分钟只允许发送少量消息，以下为期间产生的告警。",
        "alerts": "告警",
    },
}


@dataclass(frozen=True)
class Rendered:
    """An alert's text in one language, before a sink lays it out."""

    title: str  # one line, always beginning with "tunerd"
    summary: str
    fields: tuple[tuple[str, str], ...]  # (label, value): engine, host, policy, time, action
    changes: tuple[str, ...]  # "max_num_seqs 16 → 12"
    evidence: tuple[str, ...]  # "kv_cache_usage = 0.97", log lines
    undo: str | None
    undo_label: str
    change_label: str
    evidence_label: str
    colour: Literal["red", "orange", "green", "blue"]


def _value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False, sort_keys=True)
    return str(value)


def render(alert: Alert, language: str = "en", max_evidence: int = 8) -> Rendered:
    words = _WORDS["zh" if language == "zh" else "en"]
    status = words[alert.status]
    label = words[alert.severity] if alert.status == "firing" else status
    prefix = f"tunerd [{words['test']}]" if alert.test else "tunerd"
    title = f"{prefix} {label}: {alert.title}"
    if alert.count > 1:
        title += f" ({words['repeated'].format(count=alert.count)})"
    fields = [
        (words["engine"], alert.engine),
        (words["host"], alert.host),
        (words["policy"], alert.policy),
        (words["time"], iso(alert.time)),
    ]
    if alert.action is not None:
        done = alert.action.kind + (f" ({alert.action.outcome})" if alert.action.outcome else "")
        fields.append((words["action"], done))
    changes = tuple(
        f"{knob} {_value(before)} → {_value(after)}" for knob, before, after in flag_diff(alert.action)
    )
    evidence: list[str] = []
    signals = alert.evidence.get("signals") if isinstance(alert.evidence, Mapping) else None
    if isinstance(signals, Mapping):
        evidence += [f"{name} = {_value(value)}" for name, value in sorted(signals.items())]
    lines = alert.evidence.get("log_lines") if isinstance(alert.evidence, Mapping) else None
    if isinstance(lines, list):
        evidence += [str(line) for line in lines[-3:]]
    colour: Literal["red", "orange", "green", "blue"]
    if alert.status == "resolved":
        colour = "green"
    else:
        colour = {"critical": "red", "warning": "orange"}.get(alert.severity, "blue")  # type: ignore[assignment]
    summary = alert.summary
    if alert.postmortem and alert.status == "firing":
        summary += "\n" + alert.postmortem.get(language, alert.postmortem.get("en", ""))
    return Rendered(
        title=title,
        summary=summary.rstrip(),
        fields=tuple(fields),
        changes=changes,
        evidence=tuple(evidence[:max_evidence]),
        undo=alert.undo,
        undo_label=words["undo"],
        change_label=words["change"],
        evidence_label=words["evidence"],
        colour=colour,
    )


def markdown(rendered: Rendered, heading: str = "### ") -> str:
    """The common markdown body (DingTalk, WeCom, Teams, Discord, Slack's mrkdwn differs)."""
    parts = [f"{heading}{rendered.title}", rendered.summary, ""]
    parts += [f"**{label}**: {value}" for label, value in rendered.fields]
    if rendered.changes:
        parts += ["", f"**{rendered.change_label}**:"] + [f"- `{change}`" for change in rendered.changes]
    if rendered.evidence:
        parts += ["", f"**{rendered.evidence_label}**:"] + [f"- {line}" for line in rendered.evidence]
    if rendered.undo:
        parts += ["", f"**{rendered.undo_label}**: `{rendered.undo}`"]
    return "\n".join(parts)


def render_many(alerts: list[Alert] | tuple[Alert, ...], language: str = "en") -> Rendered:
    """One alert rendered, or several as one digest message (what a rate-limited sink sends
    instead of dropping): the worst severity's colour, a line per alert."""
    if len(alerts) == 1:
        return render(alerts[0], language)
    words = _WORDS["zh" if language == "zh" else "en"]
    worst = max(alerts, key=lambda alert: (alert.status == "firing", SEVERITIES.index(alert.severity)))
    head = render(worst, language)
    total = sum(alert.count for alert in alerts)
    title = f"tunerd {words['digest'].format(count=total)}"
    lines = []
    for alert in alerts:
        label = words[alert.severity] if alert.status == "firing" else words[alert.status]
        repeated = f" ({words['repeated'].format(count=alert.count)})" if alert.count > 1 else ""
        lines.append(f"[{label}] {alert.engine}: {alert.title}{repeated}")
    return replace(
        head,
        title=title,
        summary=words["digest_summary"],
        fields=(),
        changes=(),
        evidence=tuple(lines),
        undo=None,
        evidence_label=words["alerts"],
    )
