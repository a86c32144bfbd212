"""Which alerts to send, from what happened. Pure: a plan and what the loop did with it, a
saga's result, tunerd's own states of an engine in; :class:`Outgoing` alerts out — the daemon
sends them (:mod:`tunerd.notify.dispatch`) and writes each into history.

- A plan whose policies ask to ``notify`` alerts once, with what tunerd did: proposed in
  advise, observed in observe, refused, waiting for a quiet period — or, when it restarted
  the engine, once the restart has ended (its outcome, and the undo command when it took).
- A change that did not take (rolled back, failed, no quiet period in time) pages a person
  (critical), whether or not the policy asked for an alert.
- A start tunerd made on its own — a restart after a crash, a first start, a recovery — that
  failed pages a person too.
- tunerd's own states of an engine (held, adopted a person's change) page every sink.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from tunerd.notify.alert import Action, Alert, Severity, fingerprint
from tunerd.outcomes import Mode, Outcome, SagaKind, SagaResult
from tunerd.policy.engine import ActionPlan, NotifyRequest
from tunerd.units import format_size

__all__ = ["Acted", "Did", "Outgoing", "engine_alert", "plan_alerts", "saga_alerts"]


class Did(StrEnum):
    """What the loop did with a plan at one tick."""

    NOTHING = "nothing"  # no change asked for
    HELD = "held"  # the plan holds the engine: nothing changed
    OBSERVED = "observed"  # mode observe: recorded
    PROPOSED = "proposed"  # mode advise: recorded with the flag diff and how to apply it
    REFUSED = "refused"  # not applied (the shared GPU's booking limit)
    WAITING = "waiting"  # for a quiet period, or for another engine's restart on the GPU
    GAVE_UP = "gave_up"  # no quiet period came in time
    RESTARTING = "restarting"  # a saga began for the plan; its result comes later
    RECOVERING = "recovering"  # the engine died: it starts again with the same settings (the
    # plan's own change, if any, is proposed or refused — not what starts)
    FINISHED = "finished"  # a saga ended (``result``)
    GATED = "gated"  # the engine's gate took new limits, live (``detail`` says which)


@dataclass(frozen=True)
class Acted:
    """What the loop did with a plan (or, later, how the restart it began ended)."""

    did: Did
    detail: str = ""
    result: SagaResult | None = None

    @property
    def pages(self) -> bool:
        """A change that did not take: a person must look."""
        return self.did is Did.GAVE_UP or (self.result is not None and self.result.pages)

    @property
    def outcome(self) -> str | None:
        """The alert's action outcome, in history's words."""
        if self.result is not None:
            return str(self.result.outcome)
        return {
            Did.PROPOSED: "proposed",
            Did.OBSERVED: "skipped",
            Did.REFUSED: "skipped",
            Did.GAVE_UP: "skipped",
            Did.WAITING: "waiting",
            Did.RESTARTING: "applied",
            Did.RECOVERING: "skipped",
            Did.GATED: "succeeded",
        }.get(self.did)

    def text(self) -> str:
        """What tunerd did, in a few words for people."""
        if self.result is not None:
            return self.result.text()
        words = {
            Did.NOTHING: "nothing to change",
            Did.HELD: "held: nothing changed",
            Did.OBSERVED: "observed, not applied",
            Did.PROPOSED: "proposed, not applied",
            Did.REFUSED: f"not applied: {self.detail}",
            Did.WAITING: self.detail or "waiting",
            Did.GAVE_UP: f"not applied: {self.detail}",
            Did.RESTARTING: "restarting",
            Did.RECOVERING: self.detail,
            Did.GATED: self.detail,
        }
        return words.get(self.did, self.detail)


@dataclass(frozen=True)
class Outgoing:
    """One alert to send: to ``sinks`` (None: every sink), recorded in history under
    ``mode``."""

    alert: Alert
    sinks: tuple[str, ...] | None
    mode: Mode


def plan_alerts(plan: ActionPlan, acted: Acted, host: str, now: float) -> list[Outgoing]:
    """One alert per notifying policy of ``plan``, saying what tunerd did; a change that did
    not take pages (critical), from every policy of the plan when none asked for an alert."""
    asked = list(plan.notify) or [NotifyRequest(policy, "critical") for policy in plan.policies]
    summary = "; ".join(plan.reasons) or ", ".join(plan.policies)
    ratchet = plan.evidence.get("memory_ratchet")
    if isinstance(ratchet, Mapping) and isinstance(ratchet.get("height_bytes"), int):
        # the user's word for it: what nvidia-smi showed the seed as a "prefill plateau"
        summary = (
            f"the engine's memory stepped up {format_size(ratchet['height_bytes'])} at a prefill and "
            "stayed (the 'prefill plateau' of nvidia-smi: the caching allocator keeps what a long "
            f"prefill took); {summary}"
        )
    action = Action("tune", dict(plan.before), dict(plan.after), acted.outcome) if plan.changes else None
    applied = plan.mode == Mode.ACT and acted.result is not None and acted.result.outcome is Outcome.SUCCEEDED
    return [
        Outgoing(
            Alert(
                severity="critical" if acted.pages else request.severity,  # type: ignore[arg-type]
                status="firing",
                title=_title(plan, request.policy, acted),
                summary=f"{summary}; what tunerd did: {acted.text()}",
                engine=plan.engine,
                host=host,
                time=now,
                policy=request.policy,
                fingerprint=fingerprint(plan.engine, request.policy),
                evidence={"signals": dict(plan.evidence)},
                action=action,
                undo=f"tunerd rollback {plan.engine}" if applied else None,
            ),
            request.sinks,
            plan.mode,
        )
        for request in asked
    ]


def _title(plan: ActionPlan, policy: str, acted: Acted) -> str:
    """An alert's title: the policy, or — for a change that did not take — what became of it,
    so that the page for a rollback does not read as the alarm that asked for the change."""
    if not acted.pages:
        return f"{policy} on {plan.engine}"
    if acted.result is not None and acted.result.outcome is Outcome.ROLLED_BACK:
        started = "did not start; rolled back to the last good settings"
        return f"{plan.engine}: the change {policy} asked for {started}"
    return f"{plan.engine}: the change {policy} asked for did not take ({acted.outcome or 'not applied'})"


_STARTS = {
    SagaKind.FIRST_START: "first start",
    SagaKind.RESTART: "restart",
    SagaKind.ROLLBACK: "rollback",
    SagaKind.RECOVER: "restart",
}


def saga_alerts(engine: str, result: SagaResult, host: str, now: float, mode: Mode) -> list[Outgoing]:
    """A start tunerd made on its own (no policy's plan behind it) that did not take: a page.
    A restart after a crash that fails must reach a person, however it failed."""
    if not result.pages:
        return []
    what = _STARTS[result.kind] + (f" after {result.crash}" if result.crash else "")
    title = f"{engine}: {what} {str(result.outcome).replace('_', ' ')}"
    event = f"{result.kind}-{result.outcome}"
    return [
        engine_alert(
            engine,
            event,
            severity="critical",
            title=title,
            summary=result.reason,
            host=host,
            now=now,
            mode=mode,
            undo=None,
        )
    ]


def engine_alert(
    engine: str,
    event: str,
    *,
    severity: Severity,
    title: str,
    summary: str,
    host: str,
    now: float,
    mode: Mode,
    undo: str | None = "",
) -> Outgoing:
    """An alert about tunerd's own state of an engine (not a policy's): to every sink, with
    ``tunerd resume`` as the undo unless ``undo`` says otherwise (None: none)."""
    alert = Alert(
        severity=severity,
        status="firing",
        title=title,
        summary=summary,
        engine=engine,
        host=host,
        time=now,
        policy=event,
        fingerprint=fingerprint(engine, event),
        undo=f"tunerd resume {engine}" if undo == "" else undo,
    )
    return Outgoing(alert, None, mode)
