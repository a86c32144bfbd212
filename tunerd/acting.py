"""Acting by mode: what the run loop does with a plan, a crash and a person's word.

- ``observe``: the plan is recorded (``skipped``) and alerted, nothing else;
- ``advise``: recorded as ``proposed`` with the exact flag diff and the command that applies it;
- ``act``: a restart with the new settings begins (:class:`~tunerd.engine.saga.Supervisor`),
  under the guards, after a quiet period when the policy asks for one, never beside another
  engine's restart on a shared GPU and never past the GPU's booking limit.

In every mode tunerd supervises: an engine that is not running is started, and a crashed one
is restarted with the *same* settings (in ``act``, with the settings the policies ask for
after the crash). observe and advise never stop or restart a healthy engine and never change
its settings; history records the mode in force. A person's word wins in every mode: their
``tunerd rollback`` is carried out, and settings they wrote in the config become the new base
(applied at once in ``act``; at the engine's next start in observe and advise).

Nothing here waits: a restart *begins* here and the loop advances it
(:meth:`Actor.finished` gets its end). What was done is a typed :class:`~tunerd.alerting.Acted`
that :mod:`tunerd.alerting` turns into alerts.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tunerd.alerting import Acted, Did, Outgoing, engine_alert, plan_alerts, saga_alerts
from tunerd.clock import Clock
from tunerd.config import Config, EngineConfig
from tunerd.detect import Plateau
from tunerd.diagnosis import LogDiagnosis
from tunerd.engine.args import engine_argv, settings_to_args
from tunerd.engine.guards import is_quiet, shared_gpu_refusal
from tunerd.engine.saga import Supervisor
from tunerd.gpu import GpuSample
from tunerd.notify.alert import Alert
from tunerd.outcomes import CrashResponse, Mode, SagaResult
from tunerd.planner.calibration import Observation
from tunerd.planner.rightsize import Workload
from tunerd.policy.engine import ActionPlan, PolicyState
from tunerd.recording import Tape
from tunerd.signals import EngineMemory, share_a_gpu
from tunerd.sources.engine_log import FileFollower
from tunerd.sources.vllm_metrics import MetricsClient, MetricsSnapshot
from tunerd.state import State
from tunerd.store import Store
from tunerd.tune import changes

__all__ = ["Actor", "EngineLoop"]


@dataclass
class EngineLoop:
    """One engine's part of the loop: its supervisor, scraper, policy states and what the loop
    keeps between ticks."""

    config: EngineConfig
    supervisor: Supervisor
    metrics: MetricsClient
    policy_states: dict[str, PolicyState]
    observed_since: float
    reconciled: bool = False  # reconcile has run (it waits while another engine restarts on the GPU)
    people_due: bool = False  # compare the config with the recorded one once no restart runs
    crash_reported: bool = False
    engine_pids: set[int] = field(default_factory=set)  # as last seen alive: the OOM text lists them too
    waiting: tuple[ActionPlan, float] | None = None  # a plan waiting (quiet period, busy GPU), since when
    crash_plan: ActionPlan | None = None  # what the policies asked at a crash still waiting for the GPU
    plans: dict[int, tuple[ActionPlan, bool]] = field(
        default_factory=dict
    )  # restart's action → (plan, fresh)
    snapshot: MetricsSnapshot | None = None  # the last /metrics page that parsed
    healthy: bool = False  # the last scrape answered
    memory: EngineMemory | None = None  # on its worst GPU, at the last tick
    figures: tuple[int, LogDiagnosis] | None = None  # (pid, its start-up figures from the log)
    log: FileFollower | None = None  # the engine's log from where it was when tunerd started
    notified: dict[str, Alert] = field(default_factory=dict)  # policy → its last firing alert
    #: what the running engine's start showed of the box (the latest observation), and the
    #: one last written to the state
    observation: Observation | None = None
    observation_saved: Observation | None = None
    #: the restart in flight's prediction: (its history record, the settings, the prediction)
    predicted: tuple[int, dict[str, Any], dict[str, Any]] | None = None
    #: the last start's KV pool against the prediction: (observed − predicted) / observed
    prediction_error: float | None = None
    #: a start refused for want of free memory: the (free, total) bytes vLLM saw
    free_at_start: tuple[int, int] | None = None
    #: what the engine served, from its request histograms at the last scrape (right-sizing)
    workload: Workload | None = None
    #: the right-sizing targets last posted in advise mode (knob → target)
    posted_recommendation: dict[str, Any] | None = None
    #: the engine's gate as it answered at the last tick (None: no gate; ``error``: no answer)
    gate: dict[str, Any] | None = None
    #: a restart holds new requests at the gate: the hold is lifted once the engine serves again
    gate_held: bool = False
    #: every tick's evaluation (context, policy states, decision): recordings and incidents
    tape: Tape = field(default_factory=Tape)
    #: the engine's memory rises of the last look-back, as of the last tick (status; None while
    #: its memory is not read), and the transient ones already reported (their starts, bounded)
    plateaus: list[Plateau] | None = None
    reported_transients: deque[float] = field(default_factory=lambda: deque(maxlen=64))

    @property
    def name(self) -> str:
        return self.config.name


class Actor:
    """Carries out, per mode, what the loop decided; records it; hands alerts to ``send``."""

    def __init__(
        self,
        *,
        config: Config,
        state: State,
        store: Store,
        clock: Clock,
        say: Callable[..., None],
        send: Callable[[Outgoing], None],
        host: str,
        engines: Sequence[EngineLoop],
        env_path: Callable[[EngineConfig], str],
        gpus: Callable[[], Sequence[GpuSample]] = tuple,
        retune_gate: Callable[[str, dict[str, Any]], str | None] = lambda engine, limits: (
            "no gate configured"
        ),
    ) -> None:
        self.config = config  # the daemon replaces it on reload
        self.state = state
        self.store = store
        self.clock = clock
        self.say = say
        self.send = send
        self.host = host
        self.engines = engines
        self.env_path = env_path
        self.gpus = gpus  # the latest GPU reading's samples: which engines share a GPU
        self.retune_gate = retune_gate  # the engine's gate takes new limits: None, or why not

    @property
    def mode(self) -> Mode:
        return Mode(self.config.mode)

    # -- what the loop asks -------------------------------------------------------------------
    def gpu_busy(self, loop: EngineLoop) -> str | None:
        """Another engine on one of ``loop``'s GPUs is being restarted: its name. Never two
        restarts on one GPU at once — a start sizes its pool from the memory it finds free."""
        gpus = self.gpus()
        for other in self.engines:
            if (
                other is not loop
                and other.supervisor.in_flight()
                and share_a_gpu(loop.config.gpus, other.config.gpus, gpus)
            ):
                return other.name
        return None

    def act(
        self, loop: EngineLoop, plan: ActionPlan | None, crash: Mapping[str, Any] | None, now: float
    ) -> Acted:
        """Carry out what the mode allows with ``plan`` (and a crash, if the engine died)."""
        if plan is not None and plan.mode > self.mode:
            plan = replace(plan, mode=self.mode)  # a plan made before a reload lowered the mode
        if crash is not None:
            return self._crashed(loop, plan)
        if plan is not None and plan.gate_changes and not plan.hold:
            gated = self._gate(loop, plan, now)  # live, before (and without) any restart
            if not plan.changes:
                return gated
        if plan is None or not plan.changes:
            return Acted(Did.NOTHING)
        if plan.hold:
            return Acted(Did.HELD)
        if plan.mode != Mode.ACT or plan.restart is None:
            self.propose(plan, now)
            return Acted(Did.PROPOSED if plan.mode == Mode.ADVISE else Did.OBSERVED)
        if (crowded := self._shared_gpu_refusal(loop, plan)) is not None:
            self.not_applied(plan, now, crowded)
            loop.waiting = None
            return Acted(Did.REFUSED, crowded)
        if plan.restart.quiet and (waited := self._wait_for_quiet(loop, plan, now)) is not None:
            return waited
        if (busy := self.gpu_busy(loop)) is not None:
            if loop.waiting is None or loop.waiting[0].after != plan.after:
                loop.waiting = (plan, now)
            return Acted(Did.WAITING, f"waiting for {busy}'s restart on a shared GPU")
        if plan.urgent and (settling := loop.supervisor.settling(now)) is not None:
            # memory near its ceiling does not go away by waiting: act once the new engine's
            # settle period is over rather than drop the plan (a crash meanwhile is acted on)
            if loop.waiting is None or loop.waiting[0].after != plan.after:
                loop.waiting = (plan, now)
            return Acted(Did.WAITING, f"waiting for the settle period ({settling})")
        loop.waiting = None
        evidence: dict[str, Any] = {"signals": dict(plan.evidence)}
        if plan.prediction is not None:
            evidence["prediction"] = dict(plan.prediction)
        skipped = loop.supervisor.begin_restart(
            plan.after,
            reason="; ".join(plan.reasons),
            policy=",".join(plan.policies),
            evidence=evidence,
        )
        if skipped is not None:
            self._tuned(loop, plan, skipped)
            return Acted(Did.FINISHED, result=skipped)
        self.say("engine_tuning", engine=loop.name, changes=plan.changes)
        return Acted(Did.RESTARTING)

    def _gate(self, loop: EngineLoop, plan: ActionPlan, now: float) -> Acted:
        """A plan's ``gate:`` changes: applied to the engine's gate at once in act (recorded
        as kind ``gate``, from and to its limits), recorded as proposed in advise, skipped in
        observe. A gate that does not answer fails the action and says why."""
        changes = plan.gate_changes
        before = {knob: old for knob, (old, _) in changes.items()}
        after = {knob: new for knob, (_, new) in changes.items()}
        words = ", ".join(f"{knob} {old} → {new}" for knob, (old, new) in changes.items())
        reason = "; ".join(plan.reasons)
        record = self.state.engine(loop.name)
        refusal = None
        if record is not None and record.pinned:
            refusal = "pinned (tunerd resume to continue)"
        elif record is not None and record.paused:
            refusal = f"tuning paused: {record.paused} (tunerd resume to continue)"
        if plan.mode != Mode.ACT:
            outcome = "proposed" if plan.mode == Mode.ADVISE else "skipped"
            did, detail = (Did.PROPOSED if plan.mode == Mode.ADVISE else Did.OBSERVED), ""
        elif refusal is not None:  # a person's word holds for the gate as for the settings
            outcome, did, detail = "skipped", Did.REFUSED, f"gate not changed: {refusal}"
            reason = f"{reason}; not applied: {refusal}"
        else:
            error = self.retune_gate(loop.name, after)
            outcome = "succeeded" if error is None else "failed"
            did, detail = Did.GATED, f"gate: {words}" if error is None else f"gate not changed: {error}"
            if error is not None:
                reason = f"{reason}; the gate did not take it: {error}"
        self.state.record_action(
            engine=plan.engine,
            kind="gate",
            mode=plan.mode,
            outcome=outcome,
            reason=reason,
            now=now,
            policy=",".join(plan.policies),
            from_settings=before,
            to_settings=after,
            evidence={"signals": dict(plan.evidence)},
        )
        self.say("gate_tuned", engine=plan.engine, mode=plan.mode, outcome=outcome, changes=words)
        if loop.gate is not None and outcome == "succeeded":  # until the next tick reads it
            loop.gate = {**loop.gate, "limits": {**loop.gate.get("limits", {}), **after}}
        return Acted(did, detail)

    def _crashed(self, loop: EngineLoop, plan: ActionPlan | None) -> Acted:
        """A dead engine: the same settings again (supervision, every mode), the policies'
        settings in act, or a hold; once no other engine on its GPU is restarting."""
        if (busy := self.gpu_busy(loop)) is not None:
            loop.crash_plan = plan or loop.crash_plan  # what the crash asked for waits with it
            return Acted(Did.WAITING, f"the engine is down; waiting for {busy}'s restart on a shared GPU")
        plan, loop.crash_plan = plan or loop.crash_plan, None
        act = plan is not None and plan.mode == Mode.ACT and bool(plan.changes) and not plan.hold
        if plan is not None and plan.changes and plan.mode != Mode.ACT:
            self.propose(plan, self.clock.now())
        evidence: dict[str, Any] | None = None
        if plan is not None:
            evidence = {"signals": dict(plan.evidence)}
            if act and plan.prediction is not None:
                evidence["prediction"] = dict(plan.prediction)
        handled = loop.supervisor.check(
            plan.after if act and plan is not None else None,
            reason="; ".join(plan.reasons) if plan else "",
            policy=",".join(plan.policies) if plan else None,
            evidence=evidence,
        )
        if handled is None:
            return Acted(Did.WAITING, "the engine is down; reading its last lines")
        self.say("engine_recovered", engine=loop.name, response=handled.response, outcome=handled.reason)
        if handled.response in (CrashResponse.RESTARTING, CrashResponse.TUNING):
            loop.crash_reported = False  # the saga watches the new engine from here
        if handled.response == CrashResponse.TUNING:
            return Acted(Did.RESTARTING, handled.reason)  # the plan's settings: its saga reports
        if handled.response == CrashResponse.RESTARTING:  # supervision: the same settings
            if plan is not None and plan.changes:
                why = (
                    "proposed, not applied"
                    if plan.mode != Mode.ACT
                    else "not applied (pinned, paused or held)"
                )
                return Acted(Did.RECOVERING, f"{handled.reason}; the policies' change: {why}")
            return Acted(Did.RECOVERING, handled.reason)
        return Acted(Did.WAITING, handled.reason)

    def finished(self, loop: EngineLoop, result: SagaResult) -> None:
        """A saga ended: say so; alert for the plan that began it (as it asked, or a page when
        the change did not take), or page for a start tunerd made on its own that failed."""
        self.say(
            "restart_finished",
            engine=loop.name,
            kind=result.kind,
            outcome=result.outcome,
            reason=result.reason,
        )
        plan, fresh = loop.plans.pop(result.action_id, (None, False))
        if plan is not None:
            self._tuned(loop, plan, result)
            acted = Acted(Did.FINISHED, result=result)
            if (fresh and plan.notify) or acted.pages:
                self.alert_plan(loop, plan, acted)
            return
        for outgoing in saga_alerts(loop.name, result, self.host, self.clock.now(), self.mode):
            self.send(outgoing)

    def _tuned(self, loop: EngineLoop, plan: ActionPlan, result: SagaResult) -> None:
        """The one log line of a plan's restart: how it ended, and what it changed."""
        self.say(
            "engine_tuned",
            engine=loop.name,
            outcome=result.outcome,
            reason=result.reason,
            changes=plan.changes,
        )

    def alert_plan(self, loop: EngineLoop, plan: ActionPlan, acted: Acted) -> None:
        for outgoing in plan_alerts(plan, acted, self.host, self.clock.now()):
            loop.notified[outgoing.alert.policy] = outgoing.alert
            self.send(outgoing)

    # -- the pieces of acting ---------------------------------------------------------------------
    def _shared_gpu_refusal(self, loop: EngineLoop, plan: ActionPlan) -> str | None:
        """A raise of utilization that would overbook a GPU this engine shares with others."""
        after = plan.after.get("gpu_memory_utilization")
        if after is None or after <= (plan.before.get("gpu_memory_utilization") or 0):
            return None
        utilizations = {}
        for other in self.engines:
            running = other.supervisor.running_settings() or dict(other.config.settings)
            if other is not loop and running.get("gpu_memory_utilization") is not None:
                utilizations[other.name] = float(running["gpu_memory_utilization"])
        gpus = {other.name: list(other.config.gpus) for other in self.engines}
        return shared_gpu_refusal(
            loop.name, float(after), gpus, utilizations, self.config.guards.shared_gpu_max
        )

    def _wait_for_quiet(self, loop: EngineLoop, plan: ActionPlan, now: float) -> Acted | None:
        """None when the engine is quiet (the restart may go ahead); else what was done: still
        waiting, or — after ``guards.quiet.within`` — given up (the alert says so)."""
        quiet = self.config.guards.quiet
        if loop.waiting is None or loop.waiting[0].after != plan.after:
            loop.waiting = (plan, now)
        # look back far enough to find the reading at or before `now - for` even when readings
        # are minutes apart in clock time (a long interval; the simulator's clock sped up)
        lookback = 2 * quiet.for_ + 600
        samples = [
            (sample.time, sample.value)
            for sample in self.store.window("num_requests_running", loop.name, now, lookback)
        ]
        if is_quiet(samples, now, quiet.max_running, quiet.for_):
            return None
        since = loop.waiting[1]
        if now - since < quiet.within:
            return Acted(Did.WAITING, "waiting for a quiet period")
        loop.waiting = None
        why = (
            f"no quiet period (≤ {quiet.max_running} running for {quiet.for_:g} s) within {quiet.within:g} s"
        )
        self.not_applied(plan, now, why)
        return Acted(Did.GAVE_UP, why)

    def not_applied(self, plan: ActionPlan, now: float, why: str) -> None:
        """Record a plan's change as skipped, with why it was not applied."""
        self.state.record_action(
            engine=plan.engine,
            kind="tune",
            mode=plan.mode,
            outcome="skipped",
            reason=f"{'; '.join(plan.reasons)}; not applied: {why}",
            now=now,
            policy=",".join(plan.policies),
            from_settings=plan.before,
            to_settings=plan.after,
            evidence={"signals": dict(plan.evidence)},
        )

    def propose(self, plan: ActionPlan, now: float) -> None:
        """observe: record; advise: record the exact flag diff and how to apply it."""
        diff = " ".join(settings_to_args({knob: after for knob, (_, after) in plan.changes.items()}))
        engine = next(e for e in self.config.engines if e.name == plan.engine)
        reason = "; ".join(plan.reasons)
        if plan.mode == Mode.ADVISE:
            flags = " ".join(engine_argv((), plan.after, engine.drain))
            apply = (
                f'TUNERD_ARGS="{flags}" in {self.env_path(engine)}, then systemctl restart {engine.unit}'
                if engine.control == "systemd"
                else " ".join([*engine.command, *settings_to_args(plan.after)])
            )
            reason = f"{reason}; proposed {diff}; to apply: {apply}"
        self.state.record_action(
            engine=plan.engine,
            kind="tune",
            mode=plan.mode,
            outcome="proposed" if plan.mode == Mode.ADVISE else "skipped",
            reason=reason,
            now=now,
            policy=",".join(plan.policies),
            from_settings=plan.before,
            to_settings=plan.after,
            evidence={"signals": dict(plan.evidence)},
        )
        self.say("tune_proposed", engine=plan.engine, mode=plan.mode, diff=diff)

    # -- people's word -------------------------------------------------------------------------------
    def rollback_asked(self, loop: EngineLoop) -> bool:
        """Carry out the newest ``tunerd rollback`` for this engine (older ones are
        superseded), in every mode: it is a person's word. True when a restart began (a
        rollback of the gate's limits is done at once and restarts nothing)."""
        self._gate_rollback_asked(loop)
        asked = self.state.requested_rollbacks(loop.name)
        if not asked or self.gpu_busy(loop) is not None:
            return False
        now = self.clock.now()
        for stale in asked[:-1]:
            self.state.update_action(
                stale["id"], "skipped", now, f"{stale['reason']}; superseded by a later rollback"
            )
        newest = asked[-1]
        result = loop.supervisor.begin_restart(
            newest["to_settings"], reason=newest["reason"], asked=newest["id"]
        )
        if result is not None:
            self.say("engine_rolled_back", engine=loop.name, outcome=result.outcome, reason=result.reason)
            return False
        self.say("engine_rolling_back", engine=loop.name, reason=newest["reason"])
        return True

    def _gate_rollback_asked(self, loop: EngineLoop) -> None:
        """A person's ``tunerd rollback`` of a gate change: the limits before it, set live."""
        asked = self.state.requested_rollbacks(loop.name, kind="gate")
        if not asked:
            return
        now = self.clock.now()
        for stale in asked[:-1]:
            self.state.update_action(
                stale["id"], "skipped", now, f"{stale['reason']}; superseded by a later rollback"
            )
        newest = asked[-1]
        limits = dict(newest["to_settings"])
        error = self.retune_gate(loop.name, limits)
        if error is None:
            self.state.update_action(newest["id"], "succeeded", now)
            if loop.gate is not None:  # until the next tick reads it
                loop.gate = {**loop.gate, "limits": {**loop.gate.get("limits", {}), **limits}}
        else:
            self.state.update_action(
                newest["id"], "failed", now, f"{newest['reason']}; the gate did not take it: {error}"
            )
        outcome = "succeeded" if error is None else "failed"
        self.say("gate_rolled_back", engine=loop.name, outcome=outcome, limits=limits, error=error)

    def people_win(self, loop: EngineLoop) -> None:
        """A person changed the engine's settings or command in the config since tunerd last
        applied the config. Found by comparing the config with the config tunerd recorded —
        never ``/proc``'s argv with the config's text: a console script, ``python -m``, a
        symlinked interpreter and a wrapper each show other text for the same engine.

        Theirs become the new base (an ``initial`` version with its command) and tuning
        pauses. In mode ``act`` the engine restarts with them through the saga; ``observe`` and
        ``advise`` never restart a healthy engine: the change is proposed, and takes effect
        when tunerd next starts the engine (or once the mode is ``act``). An alert says which."""
        name = loop.name
        record = self.state.engine(name)
        base = self.state.base(name)
        if record is None or base is None or record.running is None:
            return
        wanted, command = dict(loop.config.settings), list(loop.config.command)
        if base.command is None:  # recorded before tunerd kept the command: this one it was
            self.state.set_command(base.id, command)
            base = self.state.version(base.id)
        changed = changes(base.settings, wanted) + (["command"] if command != base.command else [])
        now = self.clock.now()
        if changed:
            self.state.add_version(name, wanted, "initial", now, command=command)
        pending = self.state.pending_base(name)
        if pending is None:
            return  # applied (or superseded, or it failed to start: said when it did)
        running = self.state.version(record.running)
        what = ", ".join(changed) if changed else ", ".join(changes(running.settings, pending.settings))
        why = f"the config was changed by a person ({what or 'the command'}): adopted as the new base"
        pause = f"{why}; tuning paused until `tunerd resume {name}`"
        evidence = {"asked_by": f"config {self.config.source_file}"}
        if self.mode != Mode.ACT:
            if not changed:
                return  # proposed when it was first seen
            self.state.record_action(
                engine=name,
                kind="adopt",
                mode=self.mode,
                outcome="proposed",
                reason=f"{why}; mode {self.mode} does not restart a healthy engine: the new settings take "
                "effect when tunerd next starts it (or in mode act)",
                now=now,
                from_settings=running.settings,
                to_settings=pending.settings,
                evidence=evidence,
            )
            self.state.set_flags(name, paused=pause)
            self.alert_adopted(
                loop,
                f"{why}; not applied: mode {self.mode} never restarts a healthy engine — "
                "they take effect at its next start",
            )
            return
        if self.gpu_busy(loop) is not None:
            loop.people_due = True  # once the GPU's other restart has ended
            return
        action = self.state.record_action(
            engine=name,
            kind="adopt",
            mode=self.mode,
            outcome="proposed",
            reason=why,
            now=now,
            from_settings=running.settings,
            to_settings=pending.settings,
            evidence=evidence,
        )
        self.state.set_flags(name, paused=pause)
        result = loop.supervisor.begin_restart(pending.settings, reason=why, asked=action, version=pending.id)
        self.alert_adopted(loop, f"{why}; " + ("restarting with them" if result is None else result.reason))

    def alert_adopted(self, loop: EngineLoop, why: str) -> None:
        self.say("engine_adopted", engine=loop.name, reason=why)
        self.send(
            engine_alert(
                loop.name,
                "people-win",
                severity="warning",
                title=f"{loop.name} changed by a person: tuning paused",
                summary=f"{why}; tuning paused",
                host=self.host,
                now=self.clock.now(),
                mode=self.mode,
            )
        )

    def page_held(self, engine: str, reason: str) -> None:
        """The engine is held (crash loop, spent budget): a critical alert to every sink."""
        summary = f"{reason}; last-known-good is restarted with backoff (tunerd resume when fixed)"
        self.send(
            engine_alert(
                engine,
                "hold",
                severity="critical",
                title=f"{engine} held: tuning stopped",
                summary=summary,
                host=self.host,
                now=self.clock.now(),
                mode=self.mode,
            )
        )
