"""The restart saga of DESIGN §4.9: a durable state machine the daemon's loop advances.

Every start of an engine tunerd makes is one *saga* — the first start, a restart with new
settings, the rollback after a restart failed, a restart after a crash or of a held engine's
last-known-good — and every saga is an *intent* row in the state database: its
:class:`~tunerd.outcomes.SagaKind`, the :class:`~tunerd.outcomes.Step` it has reached, the
versions and the history record it moves. A step is written before it is taken.

:meth:`Supervisor.advance` does what the current step allows *now* and returns at once: it
sends the SIGTERM and, at later calls, looks whether the engine has drained; it spawns and
then looks for ``/health`` and the KV-size line; it starts a hook and looks whether it has
exited. Nothing here sleeps. So the loop that calls it keeps sampling, scraping, evaluating
the other engines' policies and answering ``tunerd status`` (which shows the step and its
deadline: :meth:`Supervisor.progress`) while a restart of minutes runs, and a SIGTERM of
tunerd stops it between two calls — nothing new is spawned once ``stopping()`` says so —
leaving the intent for the next tunerd. What each kind goes through:

=============  ==================================================  ===========================
kind           steps                                               ends
=============  ==================================================  ===========================
first_start    starting, verifying                                 last-known-good
restart        intent (pre_stop), stopping, starting, verifying    promoted; a failure turns
               (post_start), probation                             it into its rollback
rollback       stopping, starting, verifying                       ``rolled_back``; a failure
                                                                   holds the engine
recover        stopping (what is left of it), starting, verifying  the same settings serve
=============  ==================================================  ===========================

What the next tunerd does with an intent it finds (:meth:`Supervisor.reconcile`):

=============  =============================================  ===============================
step reached   what may have happened                         the next tunerd
=============  =============================================  ===============================
``intent``     nothing yet: the old engine serves              cancels (``skipped``)
``stopping``   SIGTERM sent, the old engine may still drain    stops it, goes on
``starting``   the new engine may have been spawned            finds it (what exec made of its
                                                               argv, :func:`~tunerd.engine.
                                                               process.runs_as`) or spawns it
``verifying``  the new engine is up or starting                verifies it again
``probation``  the new engine passed start-up                  finishes probation, promotes
=============  =============================================  ===============================

Verification is ``/health`` 200 *and* vLLM's KV-size log line. Each action is one history
record, moved from ``applied`` to its outcome; nothing is recorded twice, and each start the
saga makes is listed in its record (``evidence.starts``). Writes that belong together are one
transaction (a kill -9 between them is no different from one before them); a write the state
refuses (a full disk) leaves the step *stuck* — retried with backoff, shown by
:meth:`Supervisor.progress` — never failed. How a saga ended
reaches the daemon typed (:class:`~tunerd.outcomes.SagaResult`), as does what was done about
a crash (:class:`CrashHandled`). Before each spawn (supervise mode) the start waits, within
``gpu_wait_seconds``, until the engine's GPUs have the free memory the new settings need, as
vLLM checks at start-up. Time comes from the injected :class:`~tunerd.clock.Clock`:
deadlines on its ``monotonic()``, records on its ``now()``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from tunerd.clock import SYSTEM_CLOCK, Clock
from tunerd.diagnosis import LogDiagnoser, LogDiagnosis
from tunerd.engine.args import engine_argv, settings_from_argv, without_tunables
from tunerd.engine.guards import (
    EngineFacts,
    GuardConfig,
    backoff_seconds,
    budget,
    is_crash_loop,
    may_change,
)
from tunerd.engine.process import HookResult, HookRun, Identity, ProcessError, ProcessRunner, Successor
from tunerd.outcomes import CrashResponse, Mode, Outcome, Progress, SagaKind, SagaResult, Step
from tunerd.sources.vllm_metrics import MetricsClient
from tunerd.state import Intent, State, StateError, StateTrouble
from tunerd.tune import changes

__all__ = [
    "FLOWS",
    "CrashHandled",
    "Engine",
    "EngineSpec",
    "Launch",
    "Reconciled",
    "Runner",
    "Supervisor",
]

#: the steps each kind of saga goes through, in order
FLOWS: dict[SagaKind, tuple[Step, ...]] = {
    SagaKind.FIRST_START: (Step.STARTING, Step.VERIFYING),
    SagaKind.RESTART: (Step.INTENT, Step.STOPPING, Step.STARTING, Step.VERIFYING, Step.PROBATION),
    SagaKind.ROLLBACK: (Step.STOPPING, Step.STARTING, Step.VERIFYING),
    SagaKind.RECOVER: (Step.STOPPING, Step.STARTING, Step.VERIFYING),
}
_POLL_S = 0.2  # between steps when a caller drives a saga to its end (run_to_end)
_STOP_GRACE_S = 30.0  # beyond the drain, before the engine's group is killed
_GROUP_GRACE_S = 5.0  # the engine's children, after its main process has exited
_KILL_WAIT_S = 10.0  # for the kernel to take a killed group down
# After the engine's main process is gone its log may still grow for a moment: systemd mode
# copies it from the journal (journald, then ``journalctl -f``, each a hop behind), and in
# supervise mode the engine's own children can outlive it by a few lines. Unless the engine
# says no writer is left (supervise mode: its process group is empty), the diagnosis waits
# until the log has been still this long, at most _LOG_SETTLE_S.
_LOG_STILL_S = 0.5
_LOG_SETTLE_S = 3.0


class Engine(Protocol):
    """One run of the engine: a supervised process (:class:`~tunerd.engine.process.EngineProcess`)
    or a unit's main process (:class:`~tunerd.engine.unit.UnitEngine`)."""

    identity: Identity
    log_path: Path  # its output, where the log diagnosis reads it

    @property
    def pid(self) -> int: ...
    @property
    def returncode(self) -> int | None: ...
    def alive(self) -> bool: ...
    def log_settled(self) -> bool: ...  # nothing more will be written to log_path
    def terminate(self) -> None: ...  # SIGTERM to the main process (systemd mode: nothing)
    def kill_group(self) -> None: ...  # SIGKILL to what is left (systemd mode: nothing)
    def members(self) -> list[int]: ...  # live processes of the engine tunerd must wait for
    def close(self) -> None: ...


class Launch(Protocol):
    """A start under way: :meth:`poll` is None until the engine runs, then the engine;
    :class:`~tunerd.engine.process.ProcessError` when it could not be started."""

    def poll(self) -> Engine | None: ...
    def detail(self) -> str: ...


class Runner(Protocol):
    """How engines are started and found again: supervise mode's
    :class:`~tunerd.engine.process.ProcessRunner` or systemd mode's
    :class:`~tunerd.engine.unit.SystemdRunner`. ``argv`` is what :meth:`EngineSpec.argv` gives:
    the whole command in supervise mode, the flags alone in systemd mode (the unit has the
    command)."""

    waits_for_room: bool  # wait for the GPU memory between the stop and the start
    stops_in_start: bool  # the start stops the old engine itself (systemctl restart)

    def start(self, argv: Sequence[str]) -> Launch: ...
    def successor(self, engine: Any) -> Successor: ...
    def adopt(self, identity: Identity) -> Engine | None: ...
    def find_new(self, argv: Sequence[str]) -> Engine | None: ...
    def listener(self, port: int) -> Engine | None: ...


@dataclass(frozen=True)
class EngineSpec:
    """One supervised engine, as the config describes it."""

    name: str
    command: tuple[str, ...]
    url: str  # where its API answers, e.g. http://127.0.0.1:8000
    log_path: Path
    env: Mapping[str, str] = field(default_factory=dict)
    drain_seconds: float = 120.0  # --shutdown-timeout: vLLM's own drain of in-flight requests
    startup_timeout: float = 900.0  # until a start time has been measured for the settings
    probation_seconds: float = 300.0
    gpu_wait_seconds: float = 120.0  # after a stop: for the GPU memory the new settings need
    hooks: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # pre_stop / post_start argv
    hook_timeout_seconds: float = 60.0

    def argv(self, settings: Mapping[str, Any]) -> list[str]:
        return engine_argv(self.command, settings, self.drain_seconds)


@dataclass(frozen=True)
class CrashHandled:
    """What :meth:`Supervisor.check` did about a dead engine."""

    response: CrashResponse
    reason: str  # for the log and the alert


@dataclass(frozen=True)
class Reconciled:
    """What :meth:`Supervisor.reconcile` found when tunerd started."""

    what: str  # no_engine | adopted | by_hand | resumed | cancelled | recovering
    text: str
    result: SagaResult | None = None  # a saga a killed tunerd left, ended here


class _StepFailed(Exception):
    """The step cannot succeed; the message says why (vLLM's own words where it gave some)."""


class _Abort(Exception):
    """Nothing was stopped: the restart ends as failed, the old engine serves on."""


@dataclass
class _Phase:
    """What the step in progress has done so far (not durable: a resumed step starts afresh)."""

    step: Step
    detail: str = ""
    deadline: float | None = None  # on the clock's monotonic()
    hook: HookRun | None = None
    hooks_done: tuple[str, ...] = ()
    signalled: bool = False
    main_gone_at: float | None = None
    killed_at: float | None = None
    launch: Launch | None = None
    argv: list[str] | None = None
    engine: Engine | None = None  # what the launch gave, kept until it is recorded (one per start)
    verified: bool = False
    note: str | None = None  # for the action's reason, written with the step's end (post_start's failure)


@dataclass
class _Settle:
    """Watching a dead engine's log until it is still (see _LOG_STILL_S)."""

    pid: int
    since: float
    size: int
    still_since: float


def _log_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1


def diagnosis_tail(process: Engine, lines: int = 20) -> list[str]:
    """The last lines of the engine's log: the evidence a person reads first."""
    try:
        return process.log_path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


def _set(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The knobs that are set (None means vLLM's default: no flag)."""
    return {knob: value for knob, value in settings.items() if value is not None}


class Supervisor:
    """Starts, restarts, verifies and rolls back one engine; every step durable in ``state``.

    ``on_step(step)`` is called after each step is recorded (and with ``"spawned"`` right after
    a spawn, before its identity is recorded): the daemon logs it and publishes its status, the
    fault-injection tests kill tunerd there. ``on_held(reason)`` is called when the engine
    becomes held (a crash loop, a spent restart budget): the daemon pages a person.
    ``stopping()`` is true once tunerd is shutting down: no engine is spawned after that.
    """

    def __init__(
        self,
        spec: EngineSpec,
        state: State,
        clock: Clock = SYSTEM_CLOCK,
        *,
        on_step: Callable[[str], None] | None = None,
        guards: GuardConfig | None = None,
        client: MetricsClient | None = None,
        room: Callable[[Mapping[str, Any]], str | None] | None = None,
        runner: Runner | None = None,
        on_held: Callable[[str], None] | None = None,
        stopping: Callable[[], bool] | None = None,
    ) -> None:
        self.guards = guards or GuardConfig()
        self.on_held = on_held or (lambda reason: None)
        self._owns_client = client is None
        self.client = client or MetricsClient(spec.url)  # /health (and, for the daemon, /metrics)
        self.spec = spec
        self.state = state
        self.clock = clock
        self.on_step = on_step or (lambda step: None)
        self.room = room or (lambda settings: None)  # why the GPU lacks memory for settings
        self.runner: Runner = runner or ProcessRunner(spec.log_path, spec.env, clock)
        self.stopping = stopping or (lambda: False)
        self.process: Engine | None = None
        self._crash: dict[str, Any] | None = None  # the dead process's diagnosis, once
        self._settle: _Settle | None = None
        self._phase: _Phase | None = None
        self._spawned_at: float | None = None  # monotonic, this tunerd's spawn of the saga's engine
        self._startup: float | None = None  # seconds from that spawn to verified
        self.next_restart_at: float | None = None  # a held engine's backoff, on the clock's now()
        self._restart_due: float | None = None  # the same on its monotonic(): what decides
        self._held_attempts = 0
        self.adopted_by_hand: str | None = None  # why, when reconcile found a person's engine
        self._busy = state.intent(spec.name) is not None  # a saga in flight (the intent row)
        self._down: str | None = None  # why nothing runs after a start failed before a spawn
        #: writes of the saga in flight that the state refused (a full disk…): the step is
        #: stuck and tried again with backoff; None while the state takes them
        self.trouble: StateTrouble | None = None
        self._doing = ""  # the write in progress, for the trouble's text
        # how a step ended that could not be written yet: (action, kind, step), abort | failed, why
        self._ending: tuple[tuple[int, str, str], str, str] | None = None
        #: the mode in force (the daemon keeps it current): what history records for the
        #: supervision tunerd does in every mode — first starts, crash restarts
        self.mode: Mode = Mode.ACT
        self._secret_names: frozenset[str] = frozenset()

    @property
    def secret_names(self) -> frozenset[str]:
        """The variables the config names as secrets (the daemon keeps them current): kept out
        of the hooks' environment and, in supervise mode, of the engine's."""
        return self._secret_names

    @secret_names.setter
    def secret_names(self, names: frozenset[str]) -> None:
        self._secret_names = frozenset(names)
        if isinstance(self.runner, ProcessRunner):
            self.runner.secret_names = self._secret_names

    # -- queries ---------------------------------------------------------------------------
    def running_settings(self) -> dict[str, Any] | None:
        record = self.state.engine(self.spec.name)
        if record is None or record.running is None:
            return None
        return self.state.version(record.running).settings

    def healthy(self) -> bool:
        return self.client.health() == 200

    def settling(self, now: float) -> str | None:
        """Why a restart must wait when only the settle period stands in its way (None when
        it may go, or when something else refuses it: the restart's own refusal says that)."""
        facts = self.facts()
        if may_change(facts, self.guards, now, settle=False) is not None:
            return None
        refusal = may_change(facts, self.guards, now)
        return None if refusal is None else refusal.reason

    def in_flight(self) -> bool:
        """A saga of this engine is under way (its intent is recorded). Kept in memory — only
        this supervisor writes its intent — so other threads (the sampler's look for a dead
        engine) may ask without touching the database."""
        return self._busy

    def progress(self) -> Progress | None:
        """The saga in flight, its step, what it waits for and until when."""
        intent = self.state.intent(self.spec.name)
        if intent is None:
            return None
        phase = self._phase if self._phase is not None and self._phase.step == intent.step else None
        deadline = None
        if phase is not None and phase.deadline is not None:
            deadline = self.clock.now() + (phase.deadline - self.clock.monotonic())
        detail = phase.detail if phase is not None else ""
        if self.trouble is not None:
            trouble = self.trouble
            wait = max(0.0, trouble.next_try - self.clock.monotonic())
            detail = f"stuck: {trouble.what}: {trouble.error} (try {trouble.attempts}; again in {wait:.0f} s)"
        return Progress(
            kind=SagaKind(intent.kind),
            step=Step(intent.step),
            action_id=intent.action_id,
            detail=detail,
            deadline=deadline,
            started=intent.started,
        )

    def take_adopted_by_hand(self) -> str | None:
        """Why the engine was just adopted as a person's (once; None when it was not)."""
        why, self.adopted_by_hand = self.adopted_by_hand, None
        return why

    def close(self) -> None:
        """Let go of what this tunerd holds (a hook in flight is killed: the next tunerd runs
        it again); the engine itself keeps running."""
        if self._phase is not None and self._phase.hook is not None:
            self._phase.hook.kill()
        self._drop_phase()
        if self.process is not None:
            self.process.close()
        if self._owns_client:
            self.client.close()

    # -- beginning a saga -------------------------------------------------------------------
    @contextlib.contextmanager
    def _write(self, doing: str) -> Iterator[None]:
        """One transaction of writes that belong together; ``doing`` says what it was for if
        the state refuses it (:attr:`trouble`). What must follow only a durable write — a
        callback, a log line, a swap of the process handle, a backoff — follows the block."""
        self._doing = doing
        with self.state.transaction():
            yield

    def _intent(
        self,
        kind: SagaKind,
        action: int,
        *,
        to_version: int,
        from_version: int | None,
        first: Step | None = None,
    ) -> Step:
        """Write the saga's intent in the caller's transaction — the one that records its action,
        so the next tunerd finds both or neither (a restart recorded without its intent was
        never ended, and counted against the budget for good); :meth:`_began` once committed."""
        step = first or FLOWS[kind][0]
        self.state.begin_intent(
            self.spec.name,
            action,
            str(step),
            self.clock.now(),
            from_version=from_version,
            to_version=to_version,
            kind=str(kind),
        )
        return step

    def _began(self, step: Step) -> None:
        self._busy = True
        self._drop_phase()
        self._spawned_at = None
        self._ending = None
        self.on_step(str(step))

    def start_initial(self, settings: Mapping[str, Any]) -> SagaResult:
        """The first start, driven to its end (scripts and tests; the daemon begins it and
        advances it from its loop)."""
        return self.run_to_end(self.begin_first_start(settings))

    def begin_first_start(self, settings: Mapping[str, Any]) -> SagaResult | None:
        """Start the engine with the configured settings, to become last-known-good."""
        now = self.clock.now()
        with self._write("beginning the first start"):
            version = self.state.add_version(
                self.spec.name, settings, "initial", now, command=list(self.spec.command)
            )
            action = self.state.record_action(
                engine=self.spec.name,
                kind="restart",
                mode=self.mode,
                outcome="applied",
                reason="first start under tunerd",
                now=now,
                to_settings=settings,
            )
            step = self._intent(SagaKind.FIRST_START, action, to_version=version, from_version=None)
        self._began(step)
        return None

    def restart(self, settings: Mapping[str, Any], **asked: Any) -> SagaResult:
        """:meth:`begin_restart`, driven to its end (scripts and tests)."""
        return self.run_to_end(self.begin_restart(settings, **asked))

    def begin_restart(
        self,
        settings: Mapping[str, Any],
        *,
        reason: str,
        policy: str | None = None,
        evidence: Mapping[str, Any] | None = None,
        after_crash: bool = False,
        asked: int | None = None,
        source: str = "rollback",
        version: int | None = None,
    ) -> SagaResult | None:
        """Begin a restart with ``settings`` if the guards allow; None when it began, else the
        ``SKIPPED`` result saying why not. ``after_crash``: the engine is already down, so the
        settle period does not apply (the crash is the observation it waits for).
        ``asked``: the history record of a person's ``tunerd rollback`` or config edit — a
        person is not held to pins, pauses, holds, settle periods or budgets, only a restart
        already in flight waits. ``version``: restart with that recorded version (a person's
        config, recorded as the new base) instead of a new one."""
        record = self.state.engine(self.spec.name)
        if record is None or record.running is None:
            raise ProcessError(f"engine {self.spec.name} was never started under tunerd")
        now = self.clock.now()
        old = self.state.version(record.running)
        facts = self.facts()
        if asked is not None:
            if facts.in_flight:
                return SagaResult(
                    SagaKind.RESTART, Outcome.SKIPPED, asked, old.id, "a restart is already in flight"
                )
            with self._write("beginning a restart a person asked for"):
                if version is None:
                    version = self.state.add_version(self.spec.name, settings, source, now)
                self.state.update_action(asked, "applied", now)
                step = self._intent(SagaKind.RESTART, asked, to_version=version, from_version=old.id)
            self._began(step)
            return None
        refusal = may_change(facts, self.guards, now, settle=not after_crash)
        if refusal is not None:
            hold = refusal.hold and not record.held
            with self._write("recording a refused restart"):
                action = self.state.record_action(
                    engine=self.spec.name,
                    kind="tune",
                    mode=self.mode,
                    outcome="skipped",
                    reason=f"{reason}; not applied: {refusal.reason}",
                    now=now,
                    policy=policy,
                    from_settings=old.settings,
                    to_settings=settings,
                    evidence=evidence,
                )
                if hold:
                    self.state.set_flags(self.spec.name, held=True)
            if hold:
                self.on_held(f"{refusal.reason}: tuning stopped")
            return SagaResult(SagaKind.RESTART, Outcome.SKIPPED, action, old.id, refusal.reason)
        # after a crash there is nothing to take out of rotation or to drain: what is left of
        # the dead engine goes, and the new settings start (a failing pre_stop must not keep
        # a dead engine down)
        first = Step.STOPPING if after_crash else None
        with self._write("beginning a restart"):
            version = self.state.add_version(self.spec.name, settings, "tune", now)
            action = self.state.record_action(
                engine=self.spec.name,
                kind="tune",
                mode=self.mode,
                outcome="applied",
                reason=reason,
                now=now,
                policy=policy,
                from_settings=old.settings,
                to_settings=settings,
                evidence=evidence,
            )
            step = self._intent(
                SagaKind.RESTART, action, to_version=version, from_version=old.id, first=first
            )
        self._began(step)
        return None

    def _begin_recover(self, version: int, reason: str, evidence: Mapping[str, Any] | None = None) -> int:
        """Start ``version`` again on a dead engine (a crash, found down, held); the action."""
        record = self.state.engine(self.spec.name)
        running = record.running if record else None
        settings = self.state.version(version).settings
        with self._write("beginning a restart of a down engine"):
            action = self.state.record_action(
                engine=self.spec.name,
                kind="restart",
                mode=self.mode,
                outcome="applied",
                reason=reason,
                now=self.clock.now(),
                from_settings=self.state.version(running).settings if running else None,
                to_settings=settings,
                evidence=evidence,
            )
            step = self._intent(SagaKind.RECOVER, action, to_version=version, from_version=running)
        self._began(step)
        return action

    def run_to_end(self, begun: SagaResult | None = None) -> SagaResult:
        """Drive the saga in flight to its end, sleeping between steps — for scripts and
        tests; the daemon advances sagas from its loop instead. ``begun``: what a begin_*
        call answered (a result when the saga never began)."""
        if begun is not None:
            return begun
        while True:
            result = self.advance()
            if result is not None:
                return result
            if not self.in_flight():
                raise ProcessError(f"no saga in flight for {self.spec.name}")
            self.clock.sleep(_POLL_S)

    # -- advancing --------------------------------------------------------------------------
    def advance(self) -> SagaResult | None:
        """Do what the saga in flight allows now; its result once it has ended, else None
        (also when there is no saga). Steps that need no waiting follow one another in one
        call.

        A write the state refuses (:class:`~tunerd.state.StateError`: the disk is full, the
        file read-only) ends nothing: the step is *stuck* — :attr:`trouble` says on what and
        why, :meth:`progress` shows it — and is tried again at a later call, with backoff on
        the monotonic clock, until the state takes the write; then the saga goes on from
        where it was. What failed is never taken for the engine's failure: only the state's
        errors are; any other error in a step fails the step, as before."""
        trouble = self.trouble
        if trouble is not None and not trouble.due(self.clock.monotonic()):
            return None
        commits = self.state.commits
        try:
            result = self._advance()
        except StateError as error:
            self._refused(error, afresh=self.state.commits > commits)
            return None
        if self.trouble is not None and self.state.commits > commits:
            self.trouble = None  # the state takes writes again
        return result

    def _refused(self, error: StateError, afresh: bool) -> None:
        """The state refused the write in progress: the step is stuck until a retry goes
        through (``afresh``: an earlier write of this call went through — a new trouble)."""
        phase = self._phase
        what = f"step {phase.step if phase is not None else '?'}: {self._doing}"
        monotonic = self.clock.monotonic()
        if self.trouble is None or afresh:
            self.trouble = StateTrouble.first(what, error, self.clock.now(), monotonic)
        else:
            self.trouble.again(what, error, monotonic)

    def _advance(self) -> SagaResult | None:
        for _ in range(len(Step) + 1):
            self._doing = "reading the state"
            intent = self.state.intent(self.spec.name)
            if intent is None:
                return None
            kind, step = SagaKind(intent.kind), Step(intent.step)
            if self._phase is None or self._phase.step != step:
                self._drop_phase()
                self._phase = _Phase(step)
            key = (intent.action_id, intent.kind, intent.step)
            ending = self._ending[1:] if self._ending is not None and self._ending[0] == key else None
            if ending is None:
                try:
                    try:
                        done = self._work(step, intent)
                    except (_Abort, _StepFailed, StateError):
                        raise  # the state's errors: the step is stuck, not failed (advance)
                    except Exception as error:  # a bug, systemctl gone: a failed step
                        raise _StepFailed(f"{step} failed: {type(error).__name__}: {error}") from error
                except _Abort as abort:
                    ending = ("abort", str(abort))
                except _StepFailed as failure:
                    ending = ("failed", str(failure))
                if ending is not None:  # kept until written: a retry writes it, never redoes the step
                    self._ending = (key, ending[0], ending[1])
            if ending is not None:
                how, why = ending
                if how == "abort":
                    alive = self.process is not None and self.process.alive()
                    why = f"{why}: " + ("the old engine still serves" if alive else "the engine stays down")
                    return self._end(intent, Outcome.FAILED, why, serving=alive)
                result = self._failed(intent, why)
                if result is not None:
                    return result
                continue  # a failed restart turned into its rollback
            if not done:
                return None
            flow = FLOWS[kind]
            index = flow.index(step)
            if index + 1 == len(flow):
                return self._succeeded(intent)
            self._step(intent, flow[index + 1])
        return None

    def _step(self, intent: Intent, step: Step) -> None:
        note = self._phase.note if self._phase is not None else None
        with self._write(f"moving to step {step}"):
            if note is not None:
                self.state.note_action(intent.action_id, note)
            self.state.advance_intent(self.spec.name, str(step), self.clock.now())
        self._drop_phase()
        self._phase = _Phase(step)
        self.on_step(str(step))

    def _drop_phase(self) -> None:
        """Forget the step in progress; an engine its launch gave that was never recorded is
        let go (systemd mode: its journal copy stops)."""
        phase, self._phase = self._phase, None
        if phase is not None and phase.engine is not None and phase.engine is not self.process:
            phase.engine.close()

    def _wait(self, seconds: float) -> float:
        """The current step's deadline, set at its first look (``seconds`` from then)."""
        assert self._phase is not None
        if self._phase.deadline is None:
            self._phase.deadline = self.clock.monotonic() + seconds
        return self._phase.deadline

    def _hook(self, hook: str) -> HookResult | None:
        """Run the engine's ``hook`` once per step: its result (a pass when there is none),
        None while it runs. Its output goes to ``NAME.hooks.log`` beside the engine's log."""
        phase = self._phase
        assert phase is not None
        argv = self.spec.hooks.get(hook)
        if not argv or hook in phase.hooks_done:
            return HookResult(True, "none")
        if phase.hook is None:
            phase.hook = HookRun(
                hook,
                argv,
                timeout=self.spec.hook_timeout_seconds,
                log_path=self.spec.log_path.with_name(f"{self.spec.name}.hooks.log"),
                env={
                    "TUNERD_ENGINE": self.spec.name,
                    "TUNERD_ENGINE_URL": self.spec.url,
                    "TUNERD_HOOK": hook,
                },
                clock=self.clock,
                secret_names=self.secret_names,  # with TUNERD_*: never in a hook's environment
            )
            phase.detail = f"{hook} hook running"
        result = phase.hook.poll()
        if result is None:
            return None
        phase.hook = None
        phase.hooks_done += (hook,)
        self.on_step(f"{hook} {result.summary}")
        return result

    def _do_intent(self, intent: Intent) -> bool:
        """The old engine still serves; take it out of rotation (``pre_stop``)."""
        result = self._hook("pre_stop")
        if result is None:
            return False
        if not result.ok:
            raise _Abort(f"pre_stop hook failed ({result.summary})")
        return True

    def _do_stopping(self, intent: Intent) -> bool:
        """SIGTERM to the main process only (vLLM drains), SIGKILL of the group when it
        outlives the drain, done once no process of the old engine is left. systemd mode: the
        unit's ``systemctl restart`` stops it."""
        phase = self._phase
        assert phase is not None
        process = self.process or self._adopt_recorded()
        if process is None or self.runner.stops_in_start:
            if process is not None:
                process.close()
            self.process = None
            return True
        now = self.clock.monotonic()
        if not phase.signalled:
            phase.signalled = True
            if process.alive():
                process.terminate()
                phase.deadline = now + self.spec.drain_seconds + _STOP_GRACE_S
                phase.detail = f"draining pid {process.pid} (SIGTERM sent)"
            else:  # it had died: what is left of it goes at once
                phase.main_gone_at = now - _GROUP_GRACE_S
        if process.alive():
            assert phase.deadline is not None
            if now < phase.deadline:
                return False
            if phase.killed_at is None:
                process.kill_group()
                phase.killed_at = now
                phase.detail = f"pid {process.pid} outlived the drain: group killed"
            if now - phase.killed_at < _KILL_WAIT_S:
                return False
            raise _StepFailed(f"the engine's main process {process.pid} outlived SIGKILL")
        left = process.members()
        if not left:
            process.close()
            self.process = None
            return True
        if phase.main_gone_at is None:
            phase.main_gone_at = now
            phase.detail = f"pid {process.pid} exited; waiting for {len(left)} process(es) of its group"
        if phase.killed_at is None:
            if now - phase.main_gone_at < _GROUP_GRACE_S:
                return False
            process.kill_group()
            phase.killed_at = now
            return False
        if now - phase.killed_at < _KILL_WAIT_S:
            return False
        raise _StepFailed(f"engine group {process.pid} still has processes {left} after SIGKILL")

    def _do_starting(self, intent: Intent) -> bool:
        """The GPU memory the settings need (supervise mode), then the spawn."""
        phase = self._phase
        version = intent.to_version
        assert phase is not None
        assert version is not None
        if phase.launch is None:
            settings = self.state.version(version).settings
            if self.runner.waits_for_room:
                deadline = self._wait(self.spec.gpu_wait_seconds)
                short = self.room(settings)
                if short is not None:
                    if self.clock.monotonic() >= deadline:
                        raise _StepFailed(
                            f"GPU memory still short after {self.spec.gpu_wait_seconds:g} s: {short}"
                        )
                    phase.detail = f"waiting for GPU memory: {short}"
                    return False
            if self.stopping():
                phase.detail = "tunerd is stopping: nothing is spawned"
                return False
            phase.argv = self.spec.argv(settings)
            try:
                phase.launch = self.runner.start(phase.argv)
            except ProcessError as error:
                raise _StepFailed(str(error)) from None
            self._spawned_at = self.clock.monotonic()
        if phase.engine is None:  # once: a retry must not follow (systemd: journalctl -f) it twice
            try:
                engine = phase.launch.poll()
            except ProcessError as error:
                raise _StepFailed(str(error)) from None
            if engine is None:
                phase.detail = phase.launch.detail()
                return False
            phase.engine = engine
            self.on_step("spawned")
        if self.process is not phase.engine:  # not yet recorded (a retry after a refused write)
            with self._write("recording the new engine"):
                self._write_running(phase.engine, version, intent.action_id, "spawned", spawned=phase.argv)
            self._take(phase.engine)
        return True

    def _do_verifying(self, intent: Intent) -> bool:
        """``/health`` 200 and the KV-size line before the start-up timeout; then
        ``post_start``."""
        phase = self._phase
        assert phase is not None
        assert intent.to_version is not None
        process = self.process
        if process is None:
            raise _StepFailed("the new engine is gone")
        if not phase.verified:
            timeout = self._timeout(intent.to_version)
            deadline = self._wait(timeout)
            if not process.alive():
                exited = self._settled_diagnosis(process)
                if exited is None:
                    phase.detail = "the engine exited: reading its last lines"
                    return False
                crash = exited.crash
                detail = f"{crash.kind}: {crash.message}" if crash else "no failure text in the log"
                raise _StepFailed(f"the engine exited during start-up ({detail})")
            if self._diagnose(process).kv_cache_size_tokens is None or not self.healthy():
                if self.clock.monotonic() >= deadline:
                    raise _StepFailed(f"not healthy after {timeout:g} s")
                phase.detail = f"pid {process.pid} starting: waiting for /health and the KV-size line"
                return False
            phase.verified = True
            if self._spawned_at is not None:
                self._startup = self.clock.monotonic() - self._spawned_at
        result = self._hook("post_start")  # the engine serves again: back into rotation
        if result is None:
            return False
        if not result.ok:  # written with the step's end, so that a retry cannot lose it
            phase.note = f"post_start hook failed ({result.summary}); it may be out of rotation"
        return True

    def _do_probation(self, intent: Intent) -> bool:
        """The new engine stays up for ``probation``."""
        phase = self._phase
        assert phase is not None
        process = self.process
        if process is None:
            raise _StepFailed("the new engine is gone")
        deadline = self._wait(self.spec.probation_seconds)
        if not process.alive():
            exited = self._settled_diagnosis(process)
            if exited is None:
                return False
            crash = exited.crash
            raise _StepFailed(f"crashed in probation ({crash.kind if crash else 'no failure text'})")
        phase.detail = f"pid {process.pid} serving"
        return self.clock.monotonic() >= deadline

    def _work(self, step: Step, intent: Intent) -> bool:
        """Do ``step``'s work as far as it goes now; True once the step is done."""
        if step is Step.INTENT:
            return self._do_intent(intent)
        if step is Step.STOPPING:
            return self._do_stopping(intent)
        if step is Step.STARTING:
            return self._do_starting(intent)
        if step is Step.VERIFYING:
            return self._do_verifying(intent)
        return self._do_probation(intent)

    # -- endings ----------------------------------------------------------------------------------
    def _end(
        self,
        intent: Intent,
        outcome: Outcome,
        reason: str,
        serving: bool = True,
        also: Callable[[], None] | None = None,
    ) -> SagaResult:
        """Write the action's outcome and clear the intent — with ``also``'s writes, in one
        transaction: the end of a saga is never half written — then hand the result over.
        ``serving``: an engine runs afterwards (the recorded version)."""
        note = self._phase.note if self._phase is not None else None
        if note is not None:
            reason = f"{reason}; {note}"
        with self._write(f"ending the saga ({outcome})"):
            if also is not None:
                also()
            self.state.update_action(intent.action_id, str(outcome), self.clock.now(), reason)
            self.state.clear_intent(self.spec.name)
        self._busy = False
        self._ending = None
        self._startup = None
        self._drop_phase()
        record = self.state.engine(self.spec.name)
        action = self.state.action(intent.action_id)
        crash = action["evidence"].get("crash") if action is not None else None
        return SagaResult(
            SagaKind(intent.kind),
            outcome,
            intent.action_id,
            record.running if serving and record else None,
            reason,
            crash=str(crash.get("kind", "unknown")) if isinstance(crash, dict) else None,
        )

    def _succeeded(self, intent: Intent) -> SagaResult:
        kind = SagaKind(intent.kind)
        version = intent.to_version
        assert version is not None
        name, startup = self.spec.name, self._startup

        def promote() -> None:
            self.state.promote(name, version, startup)

        if kind is SagaKind.ROLLBACK:
            return self._end(
                intent, Outcome.ROLLED_BACK, f"rolled back: {intent.note or 'the restart failed'}"
            )
        if kind is SagaKind.RECOVER:
            record = self.state.engine(name)
            if record is not None and record.held:
                result = self._end(intent, Outcome.SUCCEEDED, "last-known-good restarted (still held)")
                self.next_restart_at = self._restart_due = None
                return result
            pending = self.state.pending_base(name)
            also = promote if pending is not None and pending.id == version else None
            return self._end(intent, Outcome.SUCCEEDED, self._reason(intent, "started again"), also=also)
        if kind is SagaKind.FIRST_START:
            return self._end(intent, Outcome.SUCCEEDED, self._reason(intent, "started"), also=promote)
        return self._end(
            intent, Outcome.SUCCEEDED, self._reason(intent, "passed start-up and probation"), also=promote
        )

    def _reason(self, intent: Intent, done: str) -> str:
        """The action's own reason, then what became of it."""
        action = self.state.action(intent.action_id)
        said = action["reason"] if action else ""
        return f"{said}; {done}" if said else done

    def _failed(self, intent: Intent, why: str) -> SagaResult | None:
        """A step that cannot succeed: a restart turns into its rollback (None: go on), the
        other kinds end here — and an engine left without a process (the start failed before
        its spawn) is *down*: :meth:`crashed` reports it, so :meth:`check` restarts it, holds
        it, or backs off, as for any dead engine."""
        result = self._fail(intent, why)
        if result is not None and result.version is None:
            self._crash, self._settle = None, None  # what is dead now is this start
            if self.process is None:
                self._down = why
        return result

    def _fail(self, intent: Intent, why: str) -> SagaResult | None:
        """Write how the saga failed (each ending one transaction); what follows from it in
        memory — a backoff, the callback — only once it is written."""
        kind = SagaKind(intent.kind)
        now = self.clock.now()
        name = self.spec.name
        if self._phase is not None and self._phase.hook is not None:
            self._phase.hook.kill()
            self._phase.hook = None
        failed: list[int] = []  # versions marked failed with the end

        def mark_failed() -> None:
            for version in failed:
                self.state.mark_failed(version, now)

        if kind is SagaKind.RESTART and intent.to_version is not None:
            failed.append(intent.to_version)
            record = self.state.engine(name)
            good = record.last_known_good if record and record.last_known_good else intent.from_version
            if good is not None:
                with self._write("turning the restart into its rollback"):
                    mark_failed()
                    self.state.retarget_intent(
                        name,
                        kind=str(SagaKind.ROLLBACK),
                        step=str(FLOWS[SagaKind.ROLLBACK][0]),
                        to_version=good,
                        note=why,
                        now=now,
                    )
                self._startup = None
                self._ending = None
                self._drop_phase()
                self.on_step(f"rolling back: {why}")
                return None
        if kind is SagaKind.ROLLBACK:
            return self._end(
                intent,
                Outcome.FAILED,
                f"{intent.note}; and last-known-good failed too: {why}",
                serving=False,
                also=lambda: self.state.set_flags(name, held=True),
            )
        if kind is SagaKind.FIRST_START and intent.to_version is not None:
            failed.append(intent.to_version)
            return self._end(
                intent, Outcome.FAILED, f"first start failed: {why}", serving=False, also=mark_failed
            )
        record = self.state.engine(name)
        if record is not None and record.held:  # last-known-good of a held engine: back off
            attempts = self._held_attempts + 1
            next_at = now + backoff_seconds(attempts, self.guards)
            result = self._end(
                intent,
                Outcome.FAILED,
                f"last-known-good failed to start ({why}); next try at {next_at:.0f}",
                serving=False,
                also=mark_failed,
            )
            self._held_attempts, self.next_restart_at = attempts, next_at
            self._restart_due = self.clock.monotonic() + (next_at - now)
            return result
        pending = self.state.pending_base(name)
        if pending is not None and pending.id == intent.to_version:
            failed.append(pending.id)
        return self._end(
            intent,
            Outcome.FAILED,
            self._reason(intent, f"the start failed: {why}"),
            serving=False,
            also=mark_failed,
        )

    # -- the pieces ----------------------------------------------------------------------------
    def _write_running(
        self,
        process: Engine,
        version: int,
        action: int | None,
        how: str,
        spawned: Sequence[str] | None = None,
    ) -> None:
        """Record that ``process`` runs ``version`` now — a new generation of the engine — and,
        for a start made for ``action``, the start in that action's history record (so every
        start is in history: a rollback's, a resumed one's). In the caller's transaction;
        :meth:`_take` once it is written. ``spawned``: the argv tunerd gave exec (None for an
        engine tunerd found rather than started); ``how``: how it came to run."""
        identity = process.identity
        generation = self.state.set_running(
            self.spec.name,
            version,
            pid=identity.pid,
            pid_start=identity.start_ticks,
            argv=list(identity.argv),
            spawned_argv=None if spawned is None else list(spawned),
        )
        if action is not None:
            start = {"generation": generation, "pid": identity.pid, "version": version, "how": how}
            self.state.add_start(action, {**start, "at": self.clock.now()})

    def _take(self, process: Engine) -> None:
        """``process`` is the engine now (its record written)."""
        if self.process is not None and self.process is not process:
            self.process.close()
        self.process = process
        self._crash = None
        self._settle = None
        self._down = None

    def _timeout(self, version: int) -> float:
        measured = self.state.version(version).startup_seconds
        if measured is None:
            return self.spec.startup_timeout
        return max(60.0, math.ceil(3 * measured))  # a known start, with room for a slow disk

    def diagnose(self) -> LogDiagnosis | None:
        """What the running engine's log says (start-up figures, a crash), or None."""
        return None if self.process is None else self._diagnose(self.process)

    def _diagnose(self, process: Engine) -> LogDiagnosis:
        try:
            lines = process.log_path.read_text(errors="replace").splitlines()
        except OSError:
            lines = []
        return LogDiagnoser().feed_many(lines).result(exit_code=process.returncode)

    def _settled_diagnosis(self, process: Engine) -> LogDiagnosis | None:
        """The diagnosis of an engine whose main process is gone, once its log has caught up
        (read too early, the failure text is not there yet: "nothing recognised"); None while
        it may still grow."""
        if process.log_settled():
            return self._diagnose(process)  # no writer left: nothing to wait for
        now, size = self.clock.monotonic(), _log_size(process.log_path)
        watch = self._settle
        if watch is None or watch.pid != process.pid:
            self._settle = watch = _Settle(process.pid, now, size, now)
        elif size != watch.size:
            watch.size, watch.still_since = size, now
        if now - watch.still_since >= _LOG_STILL_S or now - watch.since >= _LOG_SETTLE_S:
            return self._diagnose(process)
        return None

    def _adopt_recorded(self) -> Engine | None:
        record = self.state.engine(self.spec.name)
        if record is None or record.pid is None or record.pid_start is None:
            return None
        identity = Identity(record.pid, int(record.pid_start), tuple(record.argv or ()))
        return self.runner.adopt(identity)

    # -- guards and crashes ---------------------------------------------------------------------
    def facts(self) -> EngineFacts:
        record = self.state.engine(self.spec.name)
        now = self.clock.now()
        return EngineFacts(
            restarts=self.state.restart_times(self.spec.name, now - self.guards.window),
            in_flight=self.in_flight(),
            held=bool(record and record.held),
            pinned=bool(record and record.pinned),
            paused=record.paused if record else None,
        )

    def crashed(self) -> dict[str, Any] | None:
        """The engine's crash (kind, phase, message… from its log) once its process is gone and
        its log has caught up, else None; never while a saga (which watches its own engine) is
        in flight. The run loop turns it into an ``engine_crash`` event before the policies
        run."""
        if self.in_flight():
            return None
        if self.process is None:
            if self._down is None:
                return None
            if self._crash is None:
                self._crash = {
                    "kind": "unknown",
                    "phase": "startup",
                    "message": f"the engine is not running: {self._down}",
                    "exit_code": None,
                }
            return self._crash
        if self.process.alive():
            return None
        if self._crash is None:
            successor = self.runner.successor(self.process)
            if successor.pending:
                return None  # systemd is still stopping or starting the unit
            if successor.engine is not None:
                self._restarted_by_person(successor.engine)
                return None
            diagnosis = self._settled_diagnosis(self.process)
            if diagnosis is None:
                return None
            self._crash = (
                diagnosis.crash.to_dict()
                if diagnosis.crash
                else {"kind": "unknown", "phase": "runtime", "message": "the engine exited"}
            )
            self._crash["exit_code"] = self.process.returncode
        return self._crash

    def _restarted_by_person(self, engine: Engine) -> None:
        """A person restarted the engine through its manager (``systemctl restart``): not a
        crash, and not tunerd's restart — it counts toward neither the crash loops nor the
        budget. Flags they changed (the unit's environment file) become the new base and
        tuning pauses, as for any change of theirs."""
        record = self.state.engine(self.spec.name)
        old = self.process
        if record is None or record.running is None or old is None:
            return
        now = self.clock.now()
        running = self.state.version(record.running).settings
        theirs = settings_from_argv(engine.identity.argv)
        how = f"pid {old.pid} → {engine.pid}"
        if theirs != _set(running):
            changed = ", ".join(changes(running, theirs))
            why = (
                f"the engine was restarted by a person with other flags ({how}; {changed}): "
                "adopted as the new base"
            )
            self._adopt_persons(engine, running, theirs, why, "the engine's manager (systemctl restart)")
            self.on_step(f"restarted by a person with other flags ({how})")
            return
        try:
            with self._write("recording a restart by a person"):
                action = self.state.record_action(
                    engine=self.spec.name,
                    kind="adopt",
                    mode=self.mode,
                    outcome="succeeded",
                    reason=f"restarted by a person through its manager ({how}): not a crash; "
                    "the same settings",
                    now=now,
                    from_settings=running,
                    to_settings=running,
                    evidence={
                        "asked_by": "the engine's manager (systemctl restart)",
                        "argv": list(engine.identity.argv),
                    },
                )
                self._write_running(engine, record.running, action, "restarted by a person")
        except StateError:
            engine.close()  # the next look finds it again (systemd mode: one journal copy at a time)
            raise
        self._take(engine)
        self.on_step(f"restarted by a person ({how})")

    def _adopt_persons(
        self, engine: Engine, before: Mapping[str, Any], theirs: Mapping[str, Any], why: str, asked_by: str
    ) -> None:
        """An engine a person started with flags of theirs: they become the new base (a
        ``source: adopt`` version, last-known-good — it serves), tuning pauses, and
        :attr:`adopted_by_hand` says why for the alert."""
        now = self.clock.now()
        try:
            with self._write("adopting a person's engine"):
                version = self.state.add_version(self.spec.name, theirs, "adopt", now)
                action = self.state.record_action(
                    engine=self.spec.name,
                    kind="adopt",
                    mode=self.mode,
                    outcome="succeeded",
                    reason=why,
                    now=now,
                    from_settings=before,
                    to_settings=theirs,
                    evidence={"asked_by": asked_by, "argv": list(engine.identity.argv)},
                )
                self._write_running(engine, version, action, f"started by a person ({asked_by})")
                self.state.promote(self.spec.name, version)
                self.state.set_flags(
                    self.spec.name, paused=f"{why}; tuning paused until `tunerd resume {self.spec.name}`"
                )
        except StateError:
            engine.close()  # found again at the next look
            raise
        self._take(engine)
        self.adopted_by_hand = why

    def check(
        self,
        tuned: Mapping[str, Any] | None = None,
        *,
        reason: str = "",
        policy: str | None = None,
        evidence: Mapping[str, Any] | None = None,
    ) -> CrashHandled | None:
        """Deal with a dead engine (the run loop calls this each tick); None when it is not
        dead (or not yet diagnosed).

        The crash is recorded with its diagnosis and log tail. With ``tuned`` settings (what
        the policies asked for after seeing the crash, in mode act) a restart with them
        begins; without, the same settings start again — supervision, in every mode. A crash
        loop or a spent budget holds the engine instead: tuning stops and last-known-good is
        restarted with backoff.
        """
        crash = self.crashed()
        if crash is None:
            return None
        now = self.clock.now()
        if self.next_restart_at is not None:
            # the backoff is counted on the monotonic clock: a wall clock stepped back an hour
            # must not keep a held engine down an hour longer (nor one stepped ahead skip it)
            if self._restart_due is not None and self.clock.monotonic() < self._restart_due:
                return CrashHandled(CrashResponse.WAITING, f"held: next try at {self.next_restart_at:.0f}")
            return self._restart_held()
        record = self.state.engine(self.spec.name)
        if record is None or record.running is None:
            return CrashHandled(CrashResponse.NOT_OURS, "never started under tunerd")
        crashed = self.state.version(record.running).settings
        since = now - self.guards.window
        rolled_back_to = (
            self.state.version(record.last_known_good).settings
            if record.last_known_good
            and self.state.last_outcome(self.spec.name, "tune", since) == "rolled_back"
            else None
        )
        loop = is_crash_loop(crashed, self.state.crashes(self.spec.name, since), rolled_back_to)
        spent = budget(EngineFacts(self.state.restart_times(self.spec.name, since)), self.guards, now)[1] == 0
        crashed_because = f"engine crashed ({crash['kind']}): {crash['message']}"
        tail = diagnosis_tail(self.process) if self.process is not None else []
        may_tune = may_change(self.facts(), self.guards, now, settle=False) is None  # pinned, paused…
        if tuned is not None and dict(tuned) != crashed and may_tune and not (loop or spent):
            self.begin_restart(
                tuned,
                reason=f"{crashed_because}; {reason}".rstrip("; "),
                policy=policy,
                evidence={**dict(evidence or {}), "crash": crash, "log_lines": tail},
                after_crash=True,
            )
            return CrashHandled(CrashResponse.TUNING, f"restarting with tuned settings after {crash['kind']}")
        if loop or spent or record.held:
            why = "crash loop" if loop else ("restart budget spent" if spent else "engine is held")
            with self._write("holding a crashed engine"):
                self.state.record_action(
                    engine=self.spec.name,
                    kind="restart",
                    mode=self.mode,
                    outcome="skipped",
                    reason=f"{crashed_because}; {why}: holding, last-known-good restarts with backoff",
                    now=now,
                    from_settings=crashed,
                    to_settings=crashed,
                    evidence={"crash": crash, "log_lines": tail},
                )
                if not record.held:
                    self.state.set_flags(self.spec.name, held=True)
                    self.state.record_action(
                        engine=self.spec.name,
                        kind="hold",
                        mode=self.mode,
                        outcome="succeeded",
                        reason=f"{why} after {crash['kind']}: tuning stopped, a person is paged",
                        now=now,
                        evidence={"crash": crash},
                    )
            if not record.held:
                self.on_held(f"{why} after {crash['kind']} ({crash['message']}): tuning stopped")
            self._held_attempts += 1
            backoff = backoff_seconds(self._held_attempts, self.guards)
            self.next_restart_at, self._restart_due = now + backoff, self.clock.monotonic() + backoff
            return CrashHandled(
                CrashResponse.HELD, f"held ({why}); restarting last-known-good at {self.next_restart_at:.0f}"
            )
        self._begin_recover(record.running, crashed_because, {"crash": crash, "log_lines": tail})
        return CrashHandled(
            CrashResponse.RESTARTING, f"restarting after {crash['kind']} with the same settings"
        )

    def _restart_held(self) -> CrashHandled:
        record = self.state.engine(self.spec.name)
        assert record is not None
        good = record.last_known_good or record.running
        assert good is not None
        self._begin_recover(good, f"held: restarting last-known-good (attempt {self._held_attempts})")
        return CrashHandled(CrashResponse.RESTARTING, "held: restarting last-known-good")

    # -- after tunerd starts ------------------------------------------------------------------------
    def reconcile(self) -> Reconciled:
        """Make reality and state agree after tunerd (re)starts: resume the saga in flight,
        adopt the engine that serves, or begin a start. Nothing here waits. A restart left
        ``applied`` with no intent to carry it (an older tunerd wrote the two apart and was
        killed between them) is ended: it never began. When the state refuses a write
        (:class:`~tunerd.state.StateError`) nothing is half done: reconcile again later."""
        intent = self.state.intent(self.spec.name)
        self._end_orphans(intent)
        if intent is not None and intent.to_version is not None:
            return self._resume(intent)
        record = self.state.engine(self.spec.name)
        if record is None or record.running is None:
            return Reconciled("no_engine", "no engine recorded")
        adopted = self._adopt_recorded()
        if adopted is not None:
            self._take(adopted)
            return Reconciled("adopted", f"adopted pid {adopted.pid}")
        self._let_go()
        by_hand = self._adopt_by_hand()
        if by_hand is not None:
            return by_hand
        pending = self.state.pending_base(self.spec.name)  # a person's config not yet applied
        if pending is not None:
            self._begin_recover(
                pending.id, "the engine was down: starting it with the settings a person wrote"
            )
            return Reconciled("recovering", "engine was down; starting it with the settings a person wrote")
        self._begin_recover(record.running, "the engine was down when tunerd started")
        return Reconciled("recovering", "engine was down; starting it with its recorded settings")

    def _end_orphans(self, intent: Intent | None) -> None:
        """Restarts still ``applied`` that no intent carries: ended as skipped (they never
        began, and must not count against the restart budget for good)."""
        keep = intent.action_id if intent is not None else None
        orphans = [action for action in self.state.unfinished_actions(self.spec.name) if action != keep]
        if not orphans:
            return
        now = self.clock.now()
        with self._write("ending restarts left without an intent"):
            for action in orphans:
                record = self.state.action(action)
                said = record["reason"] if record else ""
                why = "never begun: the tunerd that recorded it stopped before writing its intent (no intent)"
                self.state.update_action(action, "skipped", now, f"{said}; {why}" if said else why)

    def _let_go(self) -> None:
        if self.process is not None:
            self.process.close()
        self.process = None

    def _adopt_by_hand(self) -> Reconciled | None:
        """tunerd's engine is gone and another process listens on its port: a person started
        one by hand. Unless its tunables and command (tunables aside) are the recorded ones,
        its flags become the new base (:meth:`_adopt_persons`)."""
        record = self.state.engine(self.spec.name)
        port = urlsplit(self.spec.url).port
        if record is None or record.running is None or port is None:
            return None
        process = self.runner.listener(port)
        if process is None:
            return None
        identity = process.identity
        before = self.state.version(record.running).settings
        theirs = settings_from_argv(identity.argv)
        same_command = record.argv is None or without_tunables(identity.argv) == without_tunables(record.argv)
        if same_command and theirs == _set(before):
            # the recorded settings and command (both as /proc shows them): ours, under a new PID
            try:
                with self._write("adopting the engine under a new pid"):
                    self._write_running(process, record.running, None, "by hand")
            except StateError:
                process.close()
                raise
            self._take(process)
            return Reconciled("adopted", f"adopted pid {identity.pid} (the recorded settings)")
        changed = ", ".join(changes(before, theirs))
        why = (
            f"the engine was started outside tunerd (pid {identity.pid}; "
            f"{changed or 'same settings, another command'}): adopted as the new base"
        )
        self._adopt_persons(process, before, theirs, why, "by hand")
        return Reconciled("by_hand", f"adopted pid {identity.pid}, started by a person")

    def _resume(self, intent: Intent) -> Reconciled:
        """An intent a killed tunerd left: set up for its step; the loop advances it. What is
        found — a new engine the killed tunerd spawned and did not record, the step to go on
        from — is written in one transaction (killed again meanwhile, the next tunerd finds the
        intent as it was, and the new engine by its argv again)."""
        assert intent.to_version is not None
        name, now = self.spec.name, self.clock.now()
        step = Step(intent.step)
        kind = SagaKind(intent.kind)
        process: Engine | None = None  # the engine to watch from here (recorded already)
        found: Engine | None = None  # a new engine the killed tunerd spawned but did not record
        spawned: list[str] | None = None
        if step is Step.INTENT:
            process = self._adopt_recorded()
            if process is not None:
                with self._write("cancelling a restart that had not begun"):
                    self.state.update_action(
                        intent.action_id, "skipped", now, "tunerd stopped before the restart began"
                    )
                    self.state.clear_intent(name)
                self._take(process)
                self._busy = False
                self._drop_phase()
                return Reconciled("cancelled", "cancelled a restart that had not begun")
            step = Step.STARTING  # the old engine is gone anyway: bring up the new settings
        elif step is Step.STARTING:
            spawned = self.spec.argv(self.state.version(intent.to_version).settings)
            record = self.state.engine(name)
            recorded_new = record is not None and record.running == intent.to_version
            candidate = self.runner.find_new(spawned)
            if candidate is None and recorded_new:
                candidate = self._adopt_recorded()  # spawned and recorded: only the step was not advanced
            if candidate is not None:
                if recorded_new and record is not None and record.pid == candidate.pid:
                    process = candidate
                else:
                    found = candidate
                step = Step.VERIFYING
            elif not recorded_new and Step.STOPPING in FLOWS[kind] and (old := self._adopt_recorded()):
                process = old  # the stop had not finished: finish it first
                step = Step.STOPPING
        elif step is Step.STOPPING:
            process = self._adopt_recorded()
        else:  # verifying, probation: the recorded engine is the new one, if it lives
            record = self.state.engine(name)
            process = self._adopt_recorded() if record and record.running == intent.to_version else None
            if process is None:
                self._let_go()
                failed = self._failed(intent, "the new engine died while tunerd was down")
                if failed is not None:
                    text = f"an interrupted {intent.kind} ended: {failed.outcome}"
                    return Reconciled("resumed", text, result=failed)
                return Reconciled("resumed", f"rolling back an interrupted {intent.kind}")
        moved = str(step) != intent.step
        if found is not None or moved:
            try:
                with self._write(f"resuming an interrupted {intent.kind}"):
                    if found is not None:
                        how = "spawned by the tunerd before, found by its argv"
                        self._write_running(found, intent.to_version, intent.action_id, how, spawned=spawned)
                    if moved:
                        self.state.advance_intent(name, str(step), now)
            except StateError:
                for engine in (found, process):
                    if engine is not None:
                        engine.close()
                raise
        watched = found if found is not None else process
        if watched is not None:
            self._take(watched)
        else:
            self._let_go()
        self._drop_phase()
        self.on_step(f"resumed at {step}")
        return Reconciled("resumed", f"resuming an interrupted {intent.kind} from '{intent.step}'")
