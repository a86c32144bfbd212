"""The restart saga of DESIGN §4.9 for a supervised engine, durable at every step.

A restart moves through :data:`STEPS`; each step is written to the state database (an
*intent*) before it is taken, so a tunerd killed anywhere in the middle is followed by one
that reads the intent and :meth:`Supervisor.reconcile` finishes or undoes the restart:

=============  =============================================  ===============================
step reached   what may have happened                         the next tunerd
=============  =============================================  ===============================
``intent``     nothing yet: the old engine serves              cancels (``skipped``)
``stopping``   SIGTERM sent, the old engine may still drain    stops it, starts the new one
``starting``   the new engine may have been spawned            adopts it (its argv is exact)
                                                               or spawns it
``verifying``  the new engine is up or starting                verifies it again
``probation``  the new engine passed start-up                  finishes probation, promotes
=============  =============================================  ===============================

Verification is ``/health`` 200 *and* vLLM's KV-size log line; a start-up failure or a crash
in probation rolls back to the last-known-good settings. Each action is one history record,
moved from ``applied`` to its outcome; nothing is recorded twice. Time comes from the injected
:class:`~tunerd.clock.Clock`.

Before each spawn the supervisor waits (``gpu_wait_seconds``) until the engine's GPUs have the
free memory the new settings need, as vLLM checks at start-up; still short, the start fails
like any other (and a restart rolls back). The engine's ``pre_stop`` hook runs before the
stop — a failure aborts the restart with the old engine still serving — and ``post_start``
after each verified start (a failure is written on the action). The quiet-period wait happens
before a restart is asked for (the daemon). Not yet here: probation by traffic, systemd mode.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from tunerd.clock import SYSTEM_CLOCK, Clock
from tunerd.engine.args import engine_argv, settings_from_argv, without_tunables
from tunerd.engine.guards import (
    EngineFacts,
    GuardConfig,
    backoff_seconds,
    budget,
    is_crash_loop,
    may_change,
)
from tunerd.engine.process import Identity, ProcessError, ProcessRunner, StopResult, run_hook
from tunerd.sources.engine_log import LogDiagnoser, LogDiagnosis
from tunerd.sources.vllm_metrics import MetricsClient
from tunerd.state import State
from tunerd.tune import changes

__all__ = ["STEPS", "Engine", "EngineSpec", "RestartResult", "Runner", "Supervisor"]

STEPS = ("intent", "stopping", "starting", "verifying", "probation")
_POLL_S = 0.2
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
    def stop(self, timeout: float) -> StopResult: ...
    def close(self) -> None: ...


class Runner(Protocol):
    """How engines are started and found again: supervise mode's
    :class:`~tunerd.engine.process.ProcessRunner` or systemd mode's
    :class:`~tunerd.engine.unit.SystemdRunner`. ``argv`` is what :meth:`EngineSpec.argv` gives:
    the whole command in supervise mode, the flags alone in systemd mode (the unit has the
    command)."""

    waits_for_room: bool  # wait for the GPU memory between the stop and the start

    def spawn(self, argv: Sequence[str]) -> Engine: ...
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
class RestartResult:
    outcome: str  # succeeded | rolled_back | failed | skipped
    action_id: int
    version: int | None  # the settings version running afterwards
    reason: str


class _StartFailed(Exception):
    pass


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


class Supervisor:
    """Starts, restarts, verifies and rolls back one engine; every step durable in ``state``.

    ``on_step(step)`` is called after each step is recorded (and with ``"spawned"`` right after
    a spawn, before its identity is recorded): the daemon logs it, the fault-injection tests
    kill tunerd there. ``on_held(reason)`` is called when the engine becomes held (a crash loop,
    a spent restart budget): the daemon pages a person.
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
        self.runner = runner or ProcessRunner(spec.log_path, spec.env, clock)
        self.process: Engine | None = None
        self._crash: dict[str, Any] | None = None  # the dead process's diagnosis, once
        self.next_restart_at: float | None = None  # a held engine's backoff, on the clock's now()
        self._held_attempts = 0
        self.adopted_by_hand: str | None = None  # why, when reconcile found a person's engine
        #: the mode in force (the daemon keeps it current): what history records for the
        #: supervision tunerd does in every mode — first starts, crash restarts
        self.mode = "act"

    # -- queries ---------------------------------------------------------------------------
    def running_settings(self) -> dict[str, Any] | None:
        record = self.state.engine(self.spec.name)
        if record is None or record.running is None:
            return None
        return self.state.version(record.running).settings

    def healthy(self) -> bool:
        return self.client.health() == 200

    def close(self) -> None:
        if self.process is not None:
            self.process.close()
        if self._owns_client:
            self.client.close()

    # -- the first start ----------------------------------------------------------------------
    def start_initial(self, settings: Mapping[str, Any]) -> RestartResult:
        """Start the engine with the configured settings and make them last-known-good."""
        now = self.clock.now()
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
        try:
            started = self._launch(version)
            self._verify(version)
            self._post_start(action)
        except _StartFailed as failure:
            self.state.mark_failed(version, self.clock.now())
            self.state.update_action(action, "failed", self.clock.now(), f"first start failed: {failure}")
            return RestartResult("failed", action, None, str(failure))
        self.state.promote(self.spec.name, version, self.clock.monotonic() - started)
        self.state.update_action(action, "succeeded", self.clock.now())
        return RestartResult("succeeded", action, version, "started")

    # -- a restart with new settings -------------------------------------------------------------
    def restart(
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
    ) -> RestartResult:
        """Restart with ``settings`` through every step of the saga, if the guards allow.
        ``after_crash``: the engine is already down, so the settle period does not apply (the
        crash is the observation the settle period waits for). ``asked``: the history record of
        a person's ``tunerd rollback`` (or of settings a person wrote in the config, with
        ``source="initial"``); a person is not held to pins, pauses, holds, settle periods or
        budgets — only a restart already in flight waits. ``version``: restart with that
        recorded version (a person's config, recorded as the new base) instead of a new one."""
        record = self.state.engine(self.spec.name)
        if record is None or record.running is None:
            raise ProcessError(f"engine {self.spec.name} was never started under tunerd")
        now = self.clock.now()
        old = self.state.version(record.running)
        facts = self.facts()
        if asked is not None:
            if facts.in_flight:
                return RestartResult("skipped", asked, old.id, "a restart is already in flight")
            if version is None:
                version = self.state.add_version(self.spec.name, settings, source, now)
            self.state.update_action(asked, "applied", now)
            self.state.begin_intent(
                self.spec.name, asked, "intent", now, from_version=old.id, to_version=version
            )
            self.on_step("intent")
            return self._from_step("stopping", asked, old.id, version)
        refusal = may_change(facts, self.guards, now, settle=not after_crash)
        if refusal is not None:
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
            if refusal.hold and not record.held:
                self.state.set_flags(self.spec.name, held=True)
                self.on_held(f"{refusal.reason}: tuning stopped")
            return RestartResult("skipped", action, old.id, refusal.reason)
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
        self.state.begin_intent(
            self.spec.name, action, "intent", now, from_version=old.id, to_version=version
        )
        self.on_step("intent")
        return self._from_step("stopping", action, old.id, version)

    def _step(self, step: str) -> None:
        self.state.advance_intent(self.spec.name, step, self.clock.now())
        self.on_step(step)

    def _from_step(self, step: str, action: int, old: int, new: int) -> RestartResult:
        steps = STEPS[STEPS.index(step) :]
        try:
            if "stopping" in steps:
                if (refused := self._hook("pre_stop")) is not None:
                    return self._abort(action, f"pre_stop hook failed ({refused})")
                self._step("stopping")
                self._stop()
            if "starting" in steps:
                self._step("starting")
                started = self._launch(new)
            else:
                started = self.clock.monotonic()
            if "verifying" in steps:
                self._step("verifying")
                self._verify(new)
                self._post_start(action)
            startup = self.clock.monotonic() - started
            self._step("probation")
            self._probation()
        except _StartFailed as failure:
            return self._roll_back(action, old, new, str(failure))
        self.state.promote(self.spec.name, new, startup if "starting" in steps else None)
        self.state.update_action(action, "succeeded", self.clock.now())
        self.state.clear_intent(self.spec.name)
        return RestartResult("succeeded", action, new, "passed start-up and probation")

    def _hook(self, hook: str) -> str | None:
        """Run the engine's ``hook`` if it has one; None if it passed (or there is none), else
        what went wrong. Its output goes to ``NAME.hooks.log`` beside the engine's log."""
        argv = self.spec.hooks.get(hook)
        if not argv:
            return None
        result = run_hook(
            hook,
            argv,
            timeout=self.spec.hook_timeout_seconds,
            log_path=self.spec.log_path.with_name(f"{self.spec.name}.hooks.log"),
            env={"TUNERD_ENGINE": self.spec.name, "TUNERD_ENGINE_URL": self.spec.url, "TUNERD_HOOK": hook},
            clock=self.clock,
        )
        self.on_step(f"{hook} {result.summary}")
        return None if result.ok else result.summary

    def _post_start(self, action: int | None) -> None:
        """The engine serves again: put it back (e.g. into the load balancer). A failure does
        not undo a healthy engine; it is written on the action, whose outcome pages a person."""
        failed = self._hook("post_start")
        if failed is not None and action is not None:
            self.state.note_action(action, f"post_start hook failed ({failed}); it may be out of rotation")

    def _abort(self, action: int, why: str) -> RestartResult:
        """Nothing was stopped: record the failure, end the intent; the old engine serves on
        (or, after a crash, stays down for the next check)."""
        alive = self.process is not None and self.process.alive()
        why += ": the old engine still serves" if alive else ": the engine stays down"
        self.state.update_action(action, "failed", self.clock.now(), why)
        self.state.clear_intent(self.spec.name)
        record = self.state.engine(self.spec.name)
        return RestartResult("failed", action, record.running if record else None, why)

    def _roll_back(self, action: int, old: int, new: int, why: str) -> RestartResult:
        now = self.clock.now()
        self.state.mark_failed(new, now)
        self._stop()
        record = self.state.engine(self.spec.name)
        good = record.last_known_good if record and record.last_known_good else old
        try:
            self._launch(good)
            self._verify(good)
            self._post_start(action)
        except _StartFailed as failure:
            self.state.update_action(
                action, "failed", self.clock.now(), f"{why}; and last-known-good failed too: {failure}"
            )
            self.state.set_flags(self.spec.name, held=True)
            self.state.clear_intent(self.spec.name)
            return RestartResult("failed", action, None, str(failure))
        self.state.update_action(action, "rolled_back", self.clock.now(), f"rolled back: {why}")
        self.state.clear_intent(self.spec.name)
        return RestartResult("rolled_back", action, good, why)

    # -- the pieces ----------------------------------------------------------------------------
    def _stop(self) -> None:
        process = self.process or self._adopt_recorded()
        if process is not None:
            process.stop(timeout=self.spec.drain_seconds + 30)
        self.process = None

    def _launch(self, version: int) -> float:
        """Spawn the engine with ``version``'s settings; record its identity; return the
        monotonic time it was started at."""
        settings = self.state.version(version).settings
        if self.runner.waits_for_room:
            self._wait_for_room(settings)
        argv = self.spec.argv(settings)
        started = self.clock.monotonic()
        try:
            process = self.runner.spawn(argv)
        except ProcessError as error:
            raise _StartFailed(str(error)) from None
        self.on_step("spawned")
        self._record(process, version, spawned=argv)
        return started

    def _wait_for_room(self, settings: Mapping[str, Any]) -> None:
        """Wait until the GPU has the memory ``settings`` need (the old engine's processes may
        still be releasing theirs, a neighbour may hold it); vLLM would refuse to start."""
        deadline = self.clock.monotonic() + self.spec.gpu_wait_seconds
        while (short := self.room(settings)) is not None:
            if self.clock.monotonic() >= deadline:
                raise _StartFailed(f"GPU memory still short after {self.spec.gpu_wait_seconds:g} s: {short}")
            self.clock.sleep(1.0)

    def _record(self, process: Engine, version: int, spawned: Sequence[str] | None = None) -> None:
        """``process`` runs ``version`` now; ``spawned``: the argv tunerd gave exec (None for
        an engine tunerd found rather than started)."""
        if self.process is not None and self.process is not process:
            self.process.close()
        self.process = process
        self._crash = None
        identity = process.identity
        self.state.set_running(
            self.spec.name,
            version,
            pid=identity.pid,
            pid_start=identity.start_ticks,
            argv=list(identity.argv),
            spawned_argv=None if spawned is None else list(spawned),
        )

    def _timeout(self, version: int) -> float:
        measured = self.state.version(version).startup_seconds
        if measured is None:
            return self.spec.startup_timeout
        return max(60.0, math.ceil(3 * measured))  # a known start, with room for a slow disk

    def _verify(self, version: int) -> None:
        """``/health`` 200 and the KV-size line, before the start-up timeout."""
        process = self.process
        assert process is not None
        deadline = self.clock.monotonic() + self._timeout(version)
        while True:
            if not process.alive():
                crash = self._diagnose_exited(process).crash
                detail = f"{crash.kind}: {crash.message}" if crash else "no failure text in the log"
                raise _StartFailed(f"the engine exited during start-up ({detail})")
            diagnosis = self._diagnose(process)
            if diagnosis.kv_cache_size_tokens is not None and self.healthy():
                return
            if self.clock.monotonic() >= deadline:
                raise _StartFailed(f"not healthy after {self._timeout(version):g} s")
            self.clock.sleep(_POLL_S)

    def diagnose(self) -> LogDiagnosis | None:
        """What the running engine's log says (start-up figures, a crash), or None."""
        return None if self.process is None else self._diagnose(self.process)

    def _diagnose(self, process: Engine) -> LogDiagnosis:
        try:
            lines = process.log_path.read_text(errors="replace").splitlines()
        except OSError:
            lines = []
        returncode = process.returncode
        return LogDiagnoser().feed_many(lines).result(exit_code=returncode)

    def _diagnose_exited(self, process: Engine) -> LogDiagnosis:
        """The diagnosis of an engine whose main process is gone, once its log has caught up
        (read too early, the failure text is not there yet: "nothing recognised")."""
        if process.log_settled():
            return self._diagnose(process)  # no writer left: nothing to wait for
        deadline = self.clock.monotonic() + _LOG_SETTLE_S
        size, still_since = _log_size(process.log_path), self.clock.monotonic()
        while self.clock.monotonic() < deadline:
            self.clock.sleep(0.1)
            now, current = self.clock.monotonic(), _log_size(process.log_path)
            if current != size:
                size, still_since = current, now
            elif now - still_since >= _LOG_STILL_S:
                break
        return self._diagnose(process)

    def _probation(self) -> None:
        process = self.process
        assert process is not None
        deadline = self.clock.monotonic() + self.spec.probation_seconds
        while self.clock.monotonic() < deadline:
            if not process.alive():
                crash = self._diagnose_exited(process).crash
                raise _StartFailed(f"crashed in probation ({crash.kind if crash else 'no failure text'})")
            self.clock.sleep(_POLL_S)

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
            in_flight=any(i.engine == self.spec.name for i in self.state.intents()),
            held=bool(record and record.held),
            pinned=bool(record and record.pinned),
            paused=record.paused if record else None,
        )

    def crashed(self) -> dict[str, Any] | None:
        """The engine's crash (kind, phase, message… from its log) if its process is gone, else
        None. The run loop turns it into an ``engine_crash`` event before the policies run."""
        if self.process is None or self.process.alive():
            return None
        if self._crash is None:
            diagnosis = self._diagnose_exited(self.process)
            self._crash = (
                diagnosis.crash.to_dict()
                if diagnosis.crash
                else {"kind": "unknown", "phase": "runtime", "message": "the engine exited"}
            )
            self._crash["exit_code"] = self.process.returncode
        return self._crash

    def check(
        self,
        tuned: Mapping[str, Any] | None = None,
        *,
        reason: str = "",
        policy: str | None = None,
        evidence: Mapping[str, Any] | None = None,
    ) -> str | None:
        """Deal with a dead engine (the run loop calls this each tick); say what was done.

        A crash is recorded with its diagnosis and log tail. With ``tuned`` settings (what the
        policies asked for after seeing the crash) the engine restarts with them; without, with
        the same settings. A crash loop or a spent budget holds the engine instead: tuning
        stops and last-known-good is restarted with backoff.
        """
        crash = self.crashed()
        if crash is None or self.process is None:
            return None
        now = self.clock.now()
        if self.next_restart_at is not None:
            if now < self.next_restart_at:
                return None
            return self._restart_held()
        record = self.state.engine(self.spec.name)
        if record is None or record.running is None:
            return None  # never started under tunerd: nothing to restart
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
        tail = diagnosis_tail(self.process)
        may_tune = may_change(self.facts(), self.guards, now, settle=False) is None  # pinned, paused…
        if tuned is not None and dict(tuned) != crashed and may_tune and not (loop or spent):
            result = self.restart(
                tuned,
                reason=f"{crashed_because}; {reason}".rstrip("; "),
                policy=policy,
                evidence={**dict(evidence or {}), "crash": crash, "log_lines": tail},
                after_crash=True,
            )
            return f"restarted with tuned settings after {crash['kind']}: {result.outcome}"
        action = self.state.record_action(
            engine=self.spec.name,
            kind="restart",
            mode=self.mode,
            outcome="applied",
            reason=crashed_because,
            now=now,
            from_settings=crashed,
            to_settings=crashed,
            evidence={"crash": crash, "log_lines": tail},
        )
        if loop or spent or record.held:
            why = "crash loop" if loop else ("restart budget spent" if spent else "engine is held")
            self.state.update_action(
                action,
                "skipped",
                now,
                f"{crashed_because}; {why}: holding, last-known-good restarts with backoff",
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
                self.on_held(f"{why} after {crash['kind']} ({crash['message']}): tuning stopped")
            self._held_attempts += 1
            self.next_restart_at = now + backoff_seconds(self._held_attempts, self.guards)
            return f"held ({why}); restarting last-known-good at {self.next_restart_at:.0f}"
        try:
            self._launch(record.running)
            self._verify(record.running)
            self._post_start(action)
        except _StartFailed as failure:
            self.state.update_action(
                action, "failed", self.clock.now(), f"restart after crash failed: {failure}"
            )
            return f"restart after crash failed: {failure}"
        self.state.update_action(action, "succeeded", self.clock.now())
        return f"restarted after {crash['kind']}"

    def _restart_held(self) -> str:
        record = self.state.engine(self.spec.name)
        assert record is not None
        good = record.last_known_good or record.running
        assert good is not None
        now = self.clock.now()
        action = self.state.record_action(
            engine=self.spec.name,
            kind="restart",
            mode=self.mode,
            outcome="applied",
            reason=f"held: restarting last-known-good (attempt {self._held_attempts})",
            now=now,
            to_settings=self.state.version(good).settings,
        )
        try:
            self._launch(good)
            self._verify(good)
        except _StartFailed as failure:
            self.state.update_action(action, "failed", self.clock.now(), str(failure))
            self._held_attempts += 1
            self.next_restart_at = self.clock.now() + backoff_seconds(self._held_attempts, self.guards)
            return f"last-known-good failed to start; next try at {self.next_restart_at:.0f}"
        self.state.update_action(action, "succeeded", self.clock.now())
        self.next_restart_at = None
        return "last-known-good restarted (still held)"

    # -- after tunerd starts ------------------------------------------------------------------------
    def reconcile(self) -> str:
        """Make reality and state agree after tunerd (re)starts; say what was done."""
        intent = next((i for i in self.state.intents() if i.engine == self.spec.name), None)
        if intent is not None and intent.from_version is not None and intent.to_version is not None:
            return self._resume(intent.step, intent.action_id, intent.from_version, intent.to_version)
        record = self.state.engine(self.spec.name)
        if record is None or record.running is None:
            return "no engine recorded"
        self.process = self._adopt_recorded()
        if self.process is not None:
            return f"adopted pid {self.process.pid}"
        by_hand = self._adopt_by_hand()
        if by_hand is not None:
            return by_hand
        pending = self.state.pending_base(self.spec.name)  # a person's config not yet applied
        version = record.running if pending is None else pending.id
        try:
            self._launch(version)
            self._verify(version)
        except _StartFailed as failure:
            if pending is not None:
                self.state.mark_failed(pending.id, self.clock.now())
            return f"engine was down; restarting it failed: {failure}"
        if pending is not None:
            self.state.promote(self.spec.name, version)
            return "engine was down; started with the settings a person wrote in the config"
        return "engine was down; restarted with its recorded settings"

    def _adopt_by_hand(self) -> str | None:
        """tunerd's engine is gone and another process listens on its port: a person started
        one by hand. Its flags become the new base (a ``source: adopt`` version, last-known-good:
        it serves), tuning pauses, and :attr:`adopted_by_hand` says why for the alert."""
        record = self.state.engine(self.spec.name)
        port = urlsplit(self.spec.url).port
        if record is None or record.running is None or port is None:
            return None
        process = self.runner.listener(port)
        if process is None:
            return None
        identity = process.identity
        now = self.clock.now()
        before = self.state.version(record.running).settings
        theirs = settings_from_argv(identity.argv)
        same_command = record.argv is None or without_tunables(identity.argv) == without_tunables(record.argv)
        if same_command and theirs == {knob: value for knob, value in before.items() if value is not None}:
            # the recorded settings and command (both as /proc shows them): ours, under a new PID
            self._record(process, record.running)
            return f"adopted pid {identity.pid} (the recorded settings)"
        changed = ", ".join(changes(before, theirs))
        why = (
            f"the engine was started outside tunerd (pid {identity.pid}; "
            f"{changed or 'same settings, another command'}): adopted as the new base"
        )
        version = self.state.add_version(self.spec.name, theirs, "adopt", now)
        self.state.record_action(
            engine=self.spec.name,
            kind="adopt",
            mode=self.mode,
            outcome="succeeded",
            reason=why,
            now=now,
            from_settings=before,
            to_settings=theirs,
            evidence={"asked_by": "by hand", "argv": list(identity.argv)},
        )
        self._record(process, version)
        self.state.promote(self.spec.name, version)
        self.state.set_flags(
            self.spec.name, paused=f"{why}; tuning paused until `tunerd resume {self.spec.name}`"
        )
        self.adopted_by_hand = why
        return f"adopted pid {identity.pid}, started by a person"

    def _resume(self, step: str, action: int, old: int, new: int) -> str:
        if step == "intent":
            self.process = self._adopt_recorded()
            if self.process is not None:
                self.state.update_action(
                    action, "skipped", self.clock.now(), "tunerd stopped before the restart began"
                )
                self.state.clear_intent(self.spec.name)
                return "cancelled a restart that had not begun"
            step = "starting"  # the old engine is gone anyway: bring up the new settings
        if step == "starting":
            found = self._find_new(new)
            if found is not None:
                record = self.state.engine(self.spec.name)
                if record and record.running == new and record.pid == found.pid:
                    self.process = found  # spawned and recorded: only the step was not advanced
                else:
                    self._record(found, new, spawned=self.spec.argv(self.state.version(new).settings))
                step = "verifying"
            else:
                old_engine = self._adopt_recorded()  # the stop had finished: nothing should be left
                if old_engine is not None:
                    old_engine.stop(timeout=self.spec.drain_seconds + 30)
        elif step in ("verifying", "probation"):
            self.process = self._adopt_recorded()
            if self.process is None:
                result = self._roll_back(action, old, new, "the new engine died while tunerd was down")
                return f"rolled back ({result.outcome})"
        result = self._from_step(step, action, old, new)
        return f"finished an interrupted restart from '{step}': {result.outcome}"

    def _find_new(self, version: int) -> Engine | None:
        return self.runner.find_new(self.spec.argv(self.state.version(version).settings))
