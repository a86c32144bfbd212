"""What ``tunerd demo`` says as the story unfolds, and when it is over. Pure.

The demo feeds :class:`Story` what it observes — the daemon's history records (each once it
has its outcome), the daemon's ``engine_crash`` log events, each new engine it sees serving
with the KV pool it reports, and GPU readings — with the simulated time of each. The story
answers with narration lines (one per event, in English or Chinese), keeps the marks the report
draws, and judges against the scenario: converged, or still going, or failed and why.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tunerd.demo.scenarios import Scenario
from tunerd.tune import changes
from tunerd.units import GIB, format_size

__all__ = ["TEXTS", "Mark", "Story", "Verdict", "clock_text", "settings_text"]

MIB = 1024**2

TEXTS: dict[str, dict[str, str]] = {
    "en": {
        "title": "tunerd demo · {scenario}: {what}",
        "world": "simulated {gpu} · {model} ({weights}) · time ×{scale:g} · policies: {policies}",
        "start": "tunerd starts vLLM (simulated): {settings}",
        "load": "load: {clients} clients × {prompt:,}-token prompts, {out} tokens out each",
        "no_load": "load: none (a quiet box)",
        "quiet": (
            "… {what}; {used} of {total} used on the GPU; {since} without a change "
            "(the story ends {quiet_for} after the last)"
        ),
        "quiet_serving": "serving",
        "quiet_down": "the engine is not serving yet",
        "serving": "serving: KV pool {tokens:,} tokens ({concurrency:.2f}× {length:,}-token requests)",
        "ratchet": "memory ratchet: engine {over} over its budget, {free} free → {policy}: {did}",
        "crash": "engine died: {words} ({kind})",
        "tuned": "tune ({policy}): {diff}",
        "tune_rolled_back": "tune ({policy}) {diff} did not hold ({why}) → back to the last good settings",
        "tune_failed": "tune ({policy}) {diff} failed: {why}",
        "tune_proposed": "advice ({policy}): {diff} — proposed, not applied",
        "tune_skipped": "not applied ({policy}): {diff}: {why}",
        "restarted_same": "restarted with the same settings (the engine was not at fault)",
        "restart_failed": "restart failed: {why}",
        "held_retry": "held: restarting last-known-good ({why})",
        "rollback": "rolled back: {why}",
        "hold": "HOLD ({why}): tuning stopped, a person is paged; tunerd resume when fixed",
        "alert": "alert ({severity}): {title}{where}",
        "resolved": "resolved: {title}",
        "stable": "stable for {minutes:g} simulated minutes",
        "deadline": "no end after {hours:g} simulated hours",
        "ended_held": "held: tuning stopped, a person is paged",
        "ended_alerted": "alerted ({policy}) and tuned nothing{held}",
        "and_held": "; held after the crash loop",
        "daemon_died": "tunerd exited ({code}); see {log}",
        "oom": "CUDA out of memory",
        "start_failure": "did not start",
        "other_crash": "crashed",
    },
    "zh": {
        "title": "tunerd 演示 · {scenario}：{what}",
        "world": "模拟 {gpu} · {model}（{weights}）· 时间 ×{scale:g} · 策略：{policies}",
        "start": "tunerd 启动 vLLM（模拟）：{settings}",
        "load": "负载：{clients} 个客户端 × {prompt:,} token 的提示，每个输出 {out} token",
        "no_load": "负载：无（空闲的机器）",
        "quiet": "…… {what}；GPU 已用 {used} / {total}；{since} 没有变化（最后一次变化 {quiet_for} 后结束）",
        "quiet_serving": "正在服务",
        "quiet_down": "引擎尚未开始服务",
        "serving": "开始服务：KV 池 {tokens:,} token（{concurrency:.2f} 倍的 {length:,} token 请求）",
        "ratchet": "显存棘轮：引擎超出预算 {over}，剩余 {free} → {policy}：{did}",
        "crash": "引擎退出：{words}（{kind}）",
        "tuned": "调参（{policy}）：{diff}",
        "tune_rolled_back": "调参（{policy}）{diff} 未能生效（{why}）→ 回到上一次能用的配置",
        "tune_failed": "调参（{policy}）{diff} 失败：{why}",
        "tune_proposed": "建议（{policy}）：{diff} —— 仅建议，未执行",
        "tune_skipped": "未执行（{policy}）：{diff}：{why}",
        "restarted_same": "以相同配置重启（不是引擎的问题）",
        "restart_failed": "重启失败：{why}",
        "held_retry": "保持：重启上一次能用的配置（{why}）",
        "rollback": "已回滚：{why}",
        "hold": "保持（HOLD，{why}）：停止调参并呼叫值班的人；修好后执行 tunerd resume",
        "alert": "告警（{severity}）：{title}{where}",
        "resolved": "已恢复：{title}",
        "stable": "已稳定 {minutes:g} 分钟（模拟时间）",
        "deadline": "模拟 {hours:g} 小时后仍未结束",
        "ended_held": "已保持：停止调参，已呼叫值班的人",
        "ended_alerted": "已告警（{policy}），没有调参{held}",
        "and_held": "；反复崩溃后保持",
        "daemon_died": "tunerd 退出（{code}）；见 {log}",
        "oom": "CUDA 显存不足",
        "start_failure": "启动失败",
        "other_crash": "崩溃",
    },
}

#: Without a tune to wait for (a box with hidden truth may start safe), a story is stable after
#: this long without a change or an alert: longer than the settle period (900 s) an action
#: the alert announced may wait out.
STABLE_UNTUNED_S = 960.0
#: History outcomes that are final (``applied`` is a restart still in flight).
FINAL = {"succeeded", "rolled_back", "failed", "skipped", "proposed"}
#: What counts as a restart tunerd caused (the §8 convergence bar counts them).
RESTART_KINDS = {"tune", "restart", "rollback"}


def clock_text(seconds: float) -> str:
    """Simulated time as ``h:mm:ss``."""
    whole = int(max(seconds, 0))
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


def _size(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.2f} GiB" if abs(num_bytes) >= GIB else f"{num_bytes / MIB:.0f} MiB"


def settings_text(settings: Mapping[str, Any]) -> str:
    return ", ".join(f"{knob} {value}" for knob, value in sorted(settings.items()))


def _diff(row: Mapping[str, Any]) -> str:
    before, after = row.get("from_settings") or {}, row.get("to_settings") or {}
    return ", ".join(changes(before, after)) or "—"


def _short(reason: str, limit: int = 160) -> str:
    """The part of a history reason worth a narration line: after the crash text, one line."""
    text = reason.rsplit("; ", maxsplit=1)[-1] if reason.startswith("engine crashed") else reason
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclass(frozen=True)
class Mark:
    """A moment the report marks on the memory curve."""

    time: float  # simulated seconds
    kind: str  # crash | tune | rollback | hold | ratchet | alert | serving
    label: str


@dataclass(frozen=True)
class Verdict:
    ok: bool
    why: str


@dataclass
class Story:
    scenario: Scenario
    language: str = "en"
    crashes: list[tuple[float, str]] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)  # every final history record seen
    marks: list[Mark] = field(default_factory=list)
    kv_tokens: list[tuple[float, int]] = field(default_factory=list)  # each start's pool
    settings: list[tuple[float, dict[str, Any]]] = field(default_factory=list)  # each start's
    last_change: float = 0.0
    serving: bool = False
    #: a "converged" story must have tuned something (the scenario's start is unsafe by the
    #: planner's own model); on a box with hidden truth the start may well be safe as it is —
    #: then stable means :data:`STABLE_UNTUNED_S` without a change or an alert
    tune_required: bool = True
    _seen: set[tuple[int, str]] = field(default_factory=set)
    _ratchets: set[Any] = field(default_factory=set)  # each ratchet is said once

    def say(self, key: str, **values: Any) -> str:
        return TEXTS[self.language][key].format(**values)

    # -- what the demo observes ---------------------------------------------------------------

    def on_row(self, row: Mapping[str, Any], now: float) -> list[str]:
        """One history record; narrated once, when its outcome is final."""
        began: list[str] = []
        key = row["id"]
        if (
            row["kind"] == "tune"
            and row["outcome"] in {"applied", "succeeded"}
            and (key, "applied") not in self._seen
        ):
            # a tuned restart is said when it begins; its end only when it did not take
            self._seen.add((key, "applied"))
            self.last_change = now
            self._mark(now, "tune", _diff(row))
            began.append(self.say("tuned", policy=row.get("policy") or "tunerd", diff=_diff(row)))
        if (key, "final") in self._seen or row["outcome"] not in FINAL:
            return began
        self._seen.add((key, "final"))
        return began + self._final(row, now)

    def _final(self, row: Mapping[str, Any], now: float) -> list[str]:
        kind, outcome, policy = row["kind"], row["outcome"], row.get("policy") or "tunerd"
        self.rows.append(dict(row))
        reason = row.get("reason") or ""
        if kind == "notify":
            return self._alert(row, now)
        if _first_start(row):
            return []  # said when it serves
        if kind in RESTART_KINDS and outcome in {"succeeded", "rolled_back", "failed"}:
            self.last_change = now
        if kind == "tune":
            diff = _diff(row)
            if outcome == "succeeded":
                return []
            if outcome == "rolled_back":
                self._mark(now, "rollback", diff)
                why = reason.split("rolled back: ", 1)[-1].split(": (", 1)[0]
                why = _short(why + (")" if why.count("(") > why.count(")") else ""), 120)
                return [self.say("tune_rolled_back", policy=policy, diff=diff, why=why)]
            if outcome == "failed":
                return [self.say("tune_failed", policy=policy, diff=diff, why=_short(reason))]
            if outcome == "proposed":
                return [self.say("tune_proposed", policy=policy, diff=diff)]
            return [
                self.say(
                    "tune_skipped", policy=policy, diff=diff, why=_short(reason.split("not applied: ")[-1])
                )
            ]
        if kind == "restart":
            if reason.startswith("held:"):
                return [
                    self.say(
                        "held_retry", why=reason.removeprefix("held: restarting last-known-good ").strip("()")
                    )
                ]
            if outcome == "succeeded":
                return [self.say("restarted_same")]
            if outcome == "failed":
                return [self.say("restart_failed", why=_short(reason))]
            return []  # skipped: the hold that follows says why
        if kind == "rollback":
            self._mark(now, "rollback", "rollback")
            return [self.say("rollback", why=_short(reason))]
        if kind == "hold":
            self.last_change = now
            self._mark(now, "hold", "hold")
            why = row.get("policy") or reason.split(":", 1)[0]  # the policy, or the saga's why
            return [self.say("hold", why=why)]
        return []

    def on_crash(self, kind: str | None, now: float) -> list[str]:
        """The daemon's ``engine_crash`` event."""
        kind = kind or "unknown"
        self.crashes.append((now, kind))
        self.last_change = now
        self.serving = False
        self._mark(now, "crash", kind)
        words = self.say("oom" if kind == "cuda_oom" else "other_crash")
        return [self.say("crash", words=words, kind=kind)]

    def on_serving(self, settings: Mapping[str, Any], tokens: int | None, now: float) -> list[str]:
        """A new engine answers; ``tokens`` is its KV pool (from vllm:cache_config_info)."""
        first = not self.settings
        self.serving = True
        self.settings.append((now, dict(settings)))
        lines = [self.say("start", settings=settings_text(settings))] if first else []
        if tokens is not None:
            self.kv_tokens.append((now, tokens))
            length = int(settings.get("max_model_len") or 0) or 1
            lines.append(self.say("serving", tokens=tokens, concurrency=tokens / length, length=length))
            self._mark(now, "serving", f"{tokens:,}")
        return lines

    # -- judgement --------------------------------------------------------------------------

    def tunes(self, outcome: str = "succeeded") -> list[dict[str, Any]]:
        return [row for row in self.rows if row["kind"] == "tune" and row["outcome"] == outcome]

    def restarts_used(self) -> int:
        """Restarts tunerd caused after the first start (tuned, after a crash, rollbacks)."""
        return sum(
            1
            for row in self.rows
            if row["kind"] in RESTART_KINDS
            and row["outcome"] in {"succeeded", "rolled_back", "failed"}
            and not _first_start(row)
        )

    def settled_at(self) -> float:
        """When the settings last changed (a tune or a rollback began): what "after converging"
        counts from. A crash restart with the same settings does not move it."""
        return max((mark.time for mark in self.marks if mark.kind in ("tune", "rollback")), default=0.0)

    def ooms_after(self, time: float) -> int:
        return sum(1 for at, kind in self.crashes if at > time and kind == "cuda_oom")

    def quiet_for(self) -> float:
        """How long the story waits, without a change, before it is over (simulated seconds)."""
        return (
            self.scenario.stable_for
            if self.tune_required
            else max(self.scenario.stable_for, STABLE_UNTUNED_S)
        )

    def quiet(self, now: float, used: int | None, total: int | None) -> str:
        """What is going on when nothing happened for a while: a line so that a long quiet
        stretch is not mistaken for a hang."""
        return self.say(
            "quiet",
            what=self.say("quiet_serving" if self.serving else "quiet_down"),
            used="?" if used is None else format_size(used),
            total="?" if total is None else format_size(total),
            since=clock_text(max(0.0, now - self.last_change)),
            quiet_for=clock_text(self.quiet_for()),
        )

    def verdict(self, now: float) -> Verdict | None:
        """None while the story goes on; else how it ended."""
        scenario = self.scenario
        quiet_for = self.quiet_for()
        stable = self.serving and now - self.last_change >= quiet_for
        held = any(row["kind"] == "hold" for row in self.rows)
        alerts = [row for row in self.rows if row["kind"] == "notify"]
        tuned = self.tunes()
        minutes = quiet_for / 60
        if scenario.expect == "held" and held:
            return Verdict(True, self.say("ended_held"))
        if held and scenario.expect in ("converged", "tuned_up", "rolled_back"):
            return Verdict(False, "held: " + next(r["reason"] for r in self.rows if r["kind"] == "hold"))
        alerted = [row for row in alerts if row.get("policy") == scenario.alert_policy]
        if scenario.expect == "alerted" and alerted and not tuned and (held or stable):
            said = self.say("and_held") if held else ""
            return Verdict(True, self.say("ended_alerted", policy=scenario.alert_policy, held=said))
        if stable:
            if scenario.expect == "converged" and (tuned or not self.tune_required):
                return Verdict(True, self.say("stable", minutes=minutes))
            if scenario.expect == "rolled_back" and self.tunes("rolled_back"):
                return Verdict(True, self.say("stable", minutes=minutes))
            if scenario.expect == "tuned_up" and any(_raised(row) for row in tuned):
                return Verdict(True, self.say("stable", minutes=minutes))
        if now >= scenario.deadline:
            return Verdict(False, self.say("deadline", hours=scenario.deadline / 3600))
        return None

    # -- helpers ------------------------------------------------------------------------------

    def _alert(self, row: Mapping[str, Any], now: float) -> list[str]:
        reason = row.get("reason") or ""
        title = reason.split(": ", 2)[1] if reason.count(": ") >= 2 else reason
        if reason.split(":", 1)[0].endswith("resolved"):
            return [self.say("resolved", title=title)]
        severity = reason.split(" ", 1)[0]
        lines = []
        signals = (row.get("evidence") or {}).get("signals") or {}
        for policy, found in signals.items():
            ratchet = found.get("memory_ratchet") if isinstance(found, Mapping) else None
            if (
                isinstance(ratchet, Mapping)
                and ratchet.get("over_budget_bytes") is not None
                and ratchet.get("at") not in self._ratchets
            ):
                self._ratchets.add(ratchet.get("at"))
                did = reason.split("what tunerd did: ", 1)[-1].split(" (", 1)[0]
                self._mark(now, "ratchet", _size(ratchet["over_budget_bytes"]))
                lines.append(
                    self.say(
                        "ratchet",
                        over=_size(ratchet["over_budget_bytes"]),
                        free=_size(ratchet.get("headroom_bytes") or 0),
                        policy=policy,
                        did=did,
                    )
                )
        self._mark(now, "alert", title)
        if not self.tune_required:
            self.last_change = now  # an alert may come before an action waiting out a guard
        sent = reason.rsplit("(sent to ", 1)
        where = f" → {sent[1].rstrip(')')}" if len(sent) == 2 else ""
        return [*lines, self.say("alert", severity=severity, title=title, where=where)]

    def _mark(self, now: float, kind: str, label: str) -> None:
        self.marks.append(Mark(now, kind, label))


def _first_start(row: Mapping[str, Any]) -> bool:
    return row["kind"] == "restart" and (row.get("reason") or "").startswith("first start")


def _raised(row: Mapping[str, Any]) -> bool:
    before, after = row.get("from_settings") or {}, row.get("to_settings") or {}
    return any(
        isinstance(after.get(knob), int | float)
        and isinstance(before.get(knob), int | float)
        and after[knob] > before[knob]
        for knob in after
    )
