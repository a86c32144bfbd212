"""The ``tunerd run`` daemon: wiring. Sources → store → policies → acting → engine control.

Each tick, for every engine: take the newest GPU reading (one for all engines) and the engine's
``/metrics``, record DESIGN §4.7's signals under the engine's name, turn a dead engine into an
``engine_crash`` event, evaluate the policies and hand the plan to :class:`~tunerd.acting.Actor`,
which acts on it as the mode allows (observe, advise, act) and alerts
(:mod:`tunerd.alerting`). A restart is a *saga* (:mod:`tunerd.engine.saga`), a durable state
machine: acting begins it, and the ``sagas`` job advances it a few times a second, a step at a
time, without ever waiting on it — so during a restart of minutes the loop keeps sampling,
scraping and evaluating the other engines, ``tunerd status`` answers with the step and its
deadline, and SIGTERM stops tunerd within seconds (the next tunerd resumes the saga). While an
engine's saga runs, its policies wait; two engines on one GPU never restart at once.

Threads (:mod:`tunerd.scheduler`, APScheduler 3 jobs). The *loop* executor — one thread —
owns the state database and runs everything that changes something: the tick each metrics
interval, the sagas job, a reload (SIGHUP) at the start of a tick, housekeeping each minute.
The *gpu* executor runs the GPU sampling job (:class:`~tunerd.sampler.Sampler`, 4 times a
second by default): it feeds systemd's watchdog (a hung driver read silences it, and so does a
loop job stalled past its interval: :meth:`Daemon._watchdog_hold`), and after
each reading it looks for a dead engine or a reload asked for and brings the tick forward — so
a crash is handled within a sampling period, not a whole interval. The *logs* executor passes
the engines' log lines into tunerd's log. The status API and the metrics endpoint serve what
the loop last published, from threads of their own, and never touch the database. The caller
of :meth:`Daemon.run` only waits for the stop.
"""

from __future__ import annotations

import os
import socket
import sqlite3
import threading
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from tunerd import logs
from tunerd.acting import Actor, EngineLoop
from tunerd.alerting import Did, Outgoing, engine_alert
from tunerd.clock import SYSTEM_CLOCK, Clock
from tunerd.config import Config, ConfigError, EngineConfig, load_config, notify_targets, rate_of
from tunerd.detect import plateaus
from tunerd.diagnosis import LogDiagnosis
from tunerd.engine.guards import GuardConfig, budget
from tunerd.engine.process import copytruncate, process_tree
from tunerd.engine.saga import EngineSpec, Runner, Supervisor
from tunerd.engine.unit import SystemdRunner
from tunerd.exporter import Exporter, MetricsView
from tunerd.gate.client import GateClient
from tunerd.gate.tuning import fit_fraction
from tunerd.gpu import GpuReading, GpuSample
from tunerd.notify.alert import Alert, Severity
from tunerd.notify.dispatch import Dispatcher
from tunerd.notify.sink import Rate
from tunerd.outcomes import Mode, Progress
from tunerd.planner.calibration import Observation, calibrate, fits, predict
from tunerd.planner.rightsize import (
    MIN_REQUESTS,
    Workload,
    advice_to_dict,
    advise,
    materially_different,
    seqs_fit,
)
from tunerd.policy.engine import ActionPlan, EngineContext, PolicyState, evaluate, matures_at, new_states
from tunerd.policy.schema import Policy, PolicyError, load_policy_files
from tunerd.recorder import IncidentRecorder, LiveRecordings
from tunerd.sampler import Sampler
from tunerd.scheduler import LOGS, LOOP, STALL_MARGIN_S, Jobs
from tunerd.sdnotify import Notifier
from tunerd.signals import (
    ENGINE_METRIC_SIGNALS,
    EngineMemory,
    cuda_total_bytes,
    engine_gpus,
    engine_memory,
    gate_signals,
    gpu_room,
    gpu_signals,
)
from tunerd.sources.engine_log import FileFollower, passed_through
from tunerd.sources.gpu import GpuSource
from tunerd.sources.select import gpu_source
from tunerd.sources.sim_clock import SimulatorClock
from tunerd.sources.vllm_metrics import MetricsClient, MetricsSnapshot, ScrapeError, histograms, parse
from tunerd.state import HostLock, State, StateError, StateTrouble
from tunerd.status import engine_state, engine_status, status_document
from tunerd.status_server import StatusServer
from tunerd.store import Event, Store, retention_capacity
from tunerd.units import GIB

__all__ = ["Daemon", "EngineLoop", "secret_names"]

DEFAULT_METRICS = "127.0.0.1:9464"
#: config parts a reload cannot change under running engines: tunerd must restart for them
RESTART_FIELDS = ("engines", "state_dir", "gpu", "listen", "clock")
HOUSEKEEPING_S = 60.0  # engine logs rotated by size, the state's write-ahead log folded in
SAGA_S = 0.25  # how often restarts in flight are advanced
GATE_HOLD_MARGIN_S = 60.0  # a restart holds the gate for the drain, the start-up and this
GATE_FIT_FRESH_S = 30.0  # a pool reading older than this is not fitted by
ROOM_READING_AGE_S = 1.0  # a GPU reading at most this old answers a start's room check
LOG_MAX_BYTES = 64 << 20
LOG_PASS_S = 1.0  # how often the engines' new log lines are passed into tunerd's log
LOG_PASS_MAX = 2000  # lines per engine per pass; the rest are counted, not logged
RETENTION_S = 6 * 3600  # what the store keeps of each signal (the longest policy window)
TICK_FAILURES_TO_STOP = 3  # ticks failing in a row (a bug, a broken disk): stop, systemd restarts
FAILED_VALUE_SECONDS = 7 * 24 * 3600  # a value that failed is not stepped up to for 7 days
_METRIC_FIELDS = tuple(name for name in ENGINE_METRIC_SIGNALS if name != "engine_up")  # from /metrics


def _guards(config: Config) -> GuardConfig:
    return GuardConfig(
        max_restarts=config.guards.max_restarts,
        window=config.guards.window,
        on_exhausted=config.guards.on_exhausted,
        settle=config.guards.settle,
    )


def secret_names(config: Config) -> frozenset[str]:
    """The variables ``config`` names as holding secrets — each notify sink's ``url_env`` (its
    URL carries a token) and ``secret_env`` — whatever their names: kept out of the engines' and
    hooks' environment (with every ``TUNERD_*``) and redacted from tunerd's log."""
    return frozenset(name for sink in config.notify for name in (sink.url_env, sink.secret_env) if name)


def _bytes(gib: float | None) -> int | None:
    return None if gib is None else round(gib * GIB)


def _metrics_fields(snapshot: MetricsSnapshot | None) -> dict[str, Any] | None:
    """DESIGN §4.3's fields of the last page (without the per-engine breakdown)."""
    if snapshot is None:
        return None
    return {key: value for key, value in snapshot.to_dict().items() if key not in ("engines", "cache_config")}


class Daemon:
    def __init__(
        self,
        config: Config,
        *,
        clock: Clock | None = None,  # None: the config's (the system's, or the simulator's)
        gpu: GpuSource | None = None,
        say: Callable[..., None] = logs.say,
        notifier: Notifier | None = None,
        log_max_bytes: int = LOG_MAX_BYTES,
    ) -> None:
        self.config = config
        self.log_max_bytes = log_max_bytes  # an engine log past this is copied aside and truncated
        self.notifier = notifier or Notifier()  # systemd's, when NOTIFY_SOCKET is set
        # WATCHDOG=1 says the loop moves too: withheld while a job is this late past its interval
        self.stall_margin = STALL_MARGIN_S
        self._withheld: str | None = None
        self.notifier.hold = self._watchdog_hold
        self.clock = clock or (
            SimulatorClock(config.clock.url or "") if config.clock.source == "sim" else SYSTEM_CLOCK
        )
        clock = self.clock
        self.say = say
        self.policies: list[Policy] = load_policy_files(config.policy_files())
        self.lock = HostLock(config.state_dir)
        self.lock.acquire()
        self.state = State.open(config.state_dir)
        self.store = Store.for_retention(RETENTION_S, max(config.metrics.interval, 0.25))
        self.recorder = IncidentRecorder(self.state, self.store, self.say)
        self.gpu = gpu or gpu_source(config.gpu.source, config.gpu.url)
        self.sampler = Sampler(self.gpu, config.gpu.interval, self.notifier, clock)
        self.jobs: Jobs | None = None  # started with the sampling, in start() or run()
        self.ticks = 0
        self._tick_failures = 0
        self.failure: str | None = None  # why run() stopped on its own (ticks kept failing)
        self._stop = threading.Event()
        self._tick_limit: int | None = None
        self.published: dict[str, Any] | None = None  # what the status API hands out
        self.live = LiveRecordings(
            self.store,
            lambda: self.engines,
            self.clock.now,
            lambda: self.config.metrics.interval * self._clock_rate(),
            retention_s=RETENTION_S,
            nudge=lambda: (
                self.jobs.run_soon("recordings") if self.jobs and self.jobs.has("recordings") else None
            ),
        )
        self.status_server = StatusServer(
            config.status_socket(), lambda: self.published, wake=self._wake, recording=self.live.ask
        )
        self._serving = False
        self.metrics_view: MetricsView | None = None  # what tunerd's own /metrics reports
        self.scrape_errors: dict[str, int] = {}
        #: writes the state refused (a full disk…) per (job, engine), tried again — a tick's at
        #: the next tick, a reconcile's with backoff; a saga's own are its supervisor's trouble
        self.state_troubles: dict[tuple[str, str], StateTrouble] = {}
        #: tunerd's own alerts about the host in force (the state refusing writes, a degraded
        #: GPU source), each resolved when its condition clears: what → the alert
        self._host_alerts: dict[str, Alert] = {}
        self._hold_due: dict[str, ActionPlan] = {}  # a plan's hold the state refused to record
        self.exporter: Exporter | None = None
        self.reload_requested = threading.Event()  # SIGHUP sets it; the loop reloads between ticks
        self.host = socket.gethostname()
        self.dispatcher: Dispatcher | None = self._dispatcher(config)
        #: ``tunerd gate``'s control socket, when an engine has a gate (docs/gate.md)
        self.gate = GateClient(config.gate_control()) if config.gated() else None
        now = clock.now()
        self.engines: list[EngineLoop] = []
        self.actor = Actor(
            config=config,
            state=self.state,
            store=self.store,
            clock=clock,
            say=say,
            send=self._send_alert,
            host=self.host,
            engines=self.engines,
            env_path=lambda engine: str(self._env_path(engine)),
            gpus=lambda: self.sampler.latest.gpus if self.sampler.latest is not None else (),
            retune_gate=self._retune_gate,
        )
        self.engines += [self._loop(engine, _guards(config), now) for engine in config.engines]

    @property
    def mode(self) -> Mode:
        return Mode(self.config.mode)

    def _dispatcher(self, config: Config) -> Dispatcher | None:
        """The chat sinks' dispatcher (started with the sampling), or None without sinks."""
        if not config.notify:
            return None
        rates = {sink.name: Rate(*rate_of(sink.rate)) for sink in config.notify if sink.rate}
        return Dispatcher(notify_targets(config, os.environ), config.state_dir, say=self.say, rates=rates)

    def _loop(self, engine: EngineConfig, guards: GuardConfig, now: float) -> EngineLoop:
        client = MetricsClient(engine.url)  # one client for /metrics and /health
        supervisor = Supervisor(
            self._spec(engine),
            self.state,
            self.clock,
            guards=guards,
            client=client,
            on_step=lambda step: self._on_step(engine.name, step),
            on_held=lambda reason: self.actor.page_held(engine.name, reason),
            room=lambda settings: self._gpu_room(engine, settings),
            runner=self._runner(engine),
            stopping=self._stop.is_set,
        )
        supervisor.mode = self.mode
        supervisor.secret_names = secret_names(self.config)
        loop = EngineLoop(engine, supervisor, client, new_states(self.policies), now)
        try:  # what the box showed before tunerd restarted still calibrates it
            latest = self.state.observations(engine.name, limit=1)
        except StateError:
            latest = []
        if latest:
            loop.observation = loop.observation_saved = Observation.from_dict(latest[0])
        return loop

    def _on_step(self, engine: str, step: str) -> None:
        self.say("restart_step", engine=engine, step=step, at=self.clock.now())
        loop = next((loop for loop in self.engines if loop.name == engine), None)
        if loop is not None:
            if step == "stopping":  # before the SIGTERM: new requests wait at the gate, not fail
                self._gate_hold(loop)
            elif step == "probation":  # the new engine serves: let them through
                self._gate_release(loop)
        self.publish()  # `tunerd status` shows the restart's step while it runs

    def _gate_hold(self, loop: EngineLoop) -> None:
        """Hold new requests at the engine's gate for its drain and start-up (the last one
        measured, else the start-up timeout) and a minute more; the gate bounds it by its
        ``hold.max``. A gate that does not answer is said; the restart goes on."""
        if self.gate is None or loop.config.gate is None:
            return
        intent = self.state.intent(loop.name)
        version = intent.to_version if intent is not None else None
        startup = self.state.version(version).startup_seconds if version is not None else None
        seconds = loop.config.drain + (startup or loop.config.startup_timeout) + GATE_HOLD_MARGIN_S
        reply = self.gate.hold(loop.name, seconds, "restart")
        loop.gate_held = reply.ok
        if reply.ok:
            self.say("gate_hold", engine=loop.name, seconds=round(seconds, 1))
        else:
            self.say("gate_unavailable", engine=loop.name, doing="hold", error=reply.error)

    def _retune_gate(self, engine: str, limits: dict[str, Any]) -> str | None:
        """A policy's ``gate:`` action, carried out: None when the gate took it, else why not."""
        if self.gate is None:
            return "no engine has a gate in the config"
        reply = self.gate.retune(engine, limits)
        return None if reply.ok else reply.error

    def _gate_release(self, loop: EngineLoop) -> None:
        if self.gate is None or not loop.gate_held:
            return
        reply = self.gate.release(loop.name)
        loop.gate_held = not reply.ok and loop.gate_held
        if reply.ok:
            self.say("gate_release", engine=loop.name)
        else:  # the hold ends at its own deadline
            self.say("gate_unavailable", engine=loop.name, doing="release", error=reply.error)

    def publish(self) -> None:
        """Build the status the API hands out; a failure is said, never raised: status must
        not take the loop down."""
        try:
            self.published = self.status()
            self.metrics_view = MetricsView(
                status=self.published,
                signals={
                    key: sample.value
                    for key in self.store.recorded()
                    if (sample := self.store.latest(*key)) is not None and sample.value is not None
                },
                actions=tuple(self.state.action_counts()),
                scrape_errors=dict(self.scrape_errors),
                sampling_lag_seconds=self.sampler.age(),
                jobs_skipped=dict(self.jobs.skipped) if self.jobs else {},
                job_errors=dict(self.jobs.errors) if self.jobs else {},
            )
        except Exception as error:  # reported, and the loop goes on
            self.say("status_failed", error=f"{type(error).__name__}: {error}")

    def _runner(self, engine: EngineConfig) -> Runner | None:
        """systemd mode's unit runner; None: supervise mode's own (the supervisor's default)."""
        if engine.control != "systemd":
            return None
        assert engine.unit is not None  # the config requires it
        return SystemdRunner(
            engine.unit,
            self._env_path(engine),
            self._log_path(engine),
            self.clock,
            # systemctl restart waits for the drain and TimeoutStopSec's kill, then the start
            restart_timeout=engine.drain + 30 + 120,
        )

    def _env_path(self, engine: EngineConfig) -> Path:
        return Path(self.config.state_dir) / "engines" / f"{engine.name}.env"

    def _log_path(self, engine: EngineConfig) -> Path:
        return Path(self.config.state_dir) / "engines" / f"{engine.name}.log"

    def _gpu_room(self, engine: EngineConfig, settings: Mapping[str, Any]) -> str | None:
        """Why ``engine`` could not start with ``settings`` now, from a fresh GPU reading: the
        sampler's newest if it is at most a second old (a start looks 4 times a second; a read
        of its own each time would wait on the sampler's), else one of its own."""
        age = self.sampler.age()
        latest = self.sampler.latest
        reading = latest if latest is not None and age is not None and age <= ROOM_READING_AGE_S else None
        gpus = (reading or self.sampler.read()).gpus
        return gpu_room(engine_gpus(gpus, engine.gpus), settings)

    def _spec(self, engine: EngineConfig) -> EngineSpec:
        return EngineSpec(
            name=engine.name,
            command=tuple(engine.command),
            url=engine.url.rstrip("/"),
            log_path=self._log_path(engine),
            env=engine.env,
            drain_seconds=engine.drain,
            startup_timeout=engine.startup_timeout,
            probation_seconds=engine.probation,
            gpu_wait_seconds=engine.gpu_wait,
            hooks={hook: tuple(argv) for hook, argv in engine.hooks.items()},
            hook_timeout_seconds=engine.hook_timeout,
        )

    # -- life cycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Serve the status API, start sampling, say READY, then reconcile every engine with its
        state: adopt the ones that serve, resume a restart a killed tunerd left, begin the
        starts that are due. Nothing here waits for an engine: :meth:`run` advances the starts
        (a first start takes minutes, longer than systemd waits for READY)."""
        if not self._serving:
            try:
                self.status_server.start()
                self._serving = True
            except OSError as error:
                self.say("status_unavailable", socket=str(self.status_server.path), reason=str(error))
        self._start_sampling()
        self.notifier.ready(f"{self.config.mode}: starting {len(self.engines)} engine(s)")
        if self.exporter is None:
            address = self.config.listen.get("metrics", DEFAULT_METRICS)
            try:
                self.exporter = Exporter(address, lambda: self.metrics_view).start()
                self.say("metrics_listening", address=f"{self.exporter.host}:{self.exporter.port}")
            except (OSError, ValueError) as error:
                self.say("metrics_unavailable", address=address, reason=str(error))
        for loop in self.engines:
            if isinstance(loop.supervisor.runner, SystemdRunner):
                for problem in loop.supervisor.runner.problems(loop.config.drain):
                    self.say("unit_problem", engine=loop.name, problem=problem)
            self._reconcile(loop)
        self.publish()
        self.notifier.status(self.status_line())

    def _reconcile(self, loop: EngineLoop) -> None:
        """What the state says about ``loop``'s engine against what runs: a restart a killed
        tunerd left is resumed at once; a start that is due begins once no other engine on its
        GPU is restarting."""
        if not loop.supervisor.in_flight() and self.actor.gpu_busy(loop) is not None:
            return  # the sagas job reconciles it once the GPU's other restart has ended
        trouble = self.state_troubles.get(("reconcile", loop.name))
        if trouble is not None and not trouble.due(self.clock.monotonic()):
            return  # the state refused the last try: the next comes after a backoff
        try:
            done = loop.supervisor.reconcile()
            if done.what == "no_engine":
                loop.supervisor.begin_first_start(loop.config.settings)
                done = type(done)("starting", "first start under tunerd")
        except StateError as error:  # not reconciled until its writes go through
            self._state_refused("reconcile", loop.name, error)
            return
        self.state_troubles.pop(("reconcile", loop.name), None)
        loop.reconciled = True
        self.say("engine_reconciled", engine=loop.name, outcome=done.text)
        if done.result is not None:
            self.actor.finished(loop, done.result)  # an interrupted saga ended here: alerts
        if (why := loop.supervisor.take_adopted_by_hand()) is not None:
            self.actor.alert_adopted(loop, why)  # the engine is their word
        elif done.what != "starting":
            loop.people_due = True  # once no restart runs: did a person change the config?
        if loop.people_due and not loop.supervisor.in_flight():
            self._people_win(loop)
        self.publish()

    def _people_win(self, loop: EngineLoop) -> None:
        loop.people_due = False
        try:
            self.actor.people_win(loop)
        except StateError:
            loop.people_due = True  # a write the state refused: looked at again next tick
            raise

    def run(self, stop: threading.Event | None = None, ticks: int | None = None) -> None:
        """Schedule the loop's jobs and wait until ``stop`` (or ``ticks`` ticks, or
        :data:`TICK_FAILURES_TO_STOP` failed ticks in a row: :attr:`failure` says so); then
        wait for the job in progress — never more than one step of a restart — and stop
        scheduling. A restart in flight stays in the state for the next tunerd."""
        if stop is not None:
            self._stop = stop
            for loop in self.engines:
                loop.supervisor.stopping = stop.is_set
        self._tick_limit = ticks
        self._start_sampling()
        jobs = self.jobs
        assert jobs is not None
        jobs.every("tick", self.config.metrics.interval, self._tick_job, LOOP)
        jobs.every("housekeeping", HOUSEKEEPING_S, self.housekeeping, LOOP)
        jobs.every("recordings", 1.0, self.live.answer, LOOP)  # `tunerd record ENGINE --for D`
        self._schedule_sagas()
        try:
            while not self._stop.wait(1.0):
                pass
        finally:
            self.notifier.stopping()
            jobs.shutdown()
            self.jobs = None

    def _tick_job(self) -> None:
        if self.reload_requested.is_set():
            self.reload_requested.clear()
            self.reload()
        try:
            self.tick()
        except Exception:
            self._tick_failures += 1
            raise  # the scheduler hands it to _job_failed, which logs it
        finally:
            self._state_health()
            self._gpu_health()
        self._tick_failures = 0
        self._tick_when_due()
        self._schedule_sagas()  # a restart this tick began needs the job
        self.publish()
        self.notifier.status(self.status_line())
        self.ticks += 1
        if self._tick_limit is not None and self.ticks >= self._tick_limit:
            self._stop.set()

    def advance_sagas(self) -> None:
        """The sagas job: each restart in flight takes what steps it can now; an engine whose
        reconcile waited for another's restart on its GPU is reconciled once that has ended."""
        for loop in self.engines:
            self._each(loop, "sagas", self._saga_of)
        self._schedule_sagas()
        self._state_health()

    def _schedule_sagas(self) -> None:
        """The sagas job runs while there is something for it — a saga in flight, an engine
        waiting to be reconciled — and not otherwise: an idle daemon wakes for nothing."""
        if self.jobs is None or not self.jobs.has("tick"):
            return  # not running yet: run() schedules it
        due = any(not loop.reconciled or loop.supervisor.in_flight() for loop in self.engines)
        if due and not self.jobs.has("sagas"):
            self.jobs.every("sagas", SAGA_S, self.advance_sagas, LOOP, now=False)
        elif not due and self.jobs.has("sagas"):
            self.jobs.remove("sagas")
            for key in [key for key in self.state_troubles if key[0] == "sagas"]:
                del self.state_troubles[key]  # the job has stopped: nothing of it is tried again

    def _saga_of(self, loop: EngineLoop) -> None:
        if not loop.reconciled:
            self._reconcile(loop)
        elif loop.supervisor.in_flight():
            self._advance(loop)

    def in_flight(self) -> list[str]:
        """The engines with a restart under way, or not yet reconciled."""
        return [loop.name for loop in self.engines if not loop.reconciled or loop.supervisor.in_flight()]

    def _advance(self, loop: EngineLoop) -> None:
        result = loop.supervisor.advance()
        if result is not None:
            self._gate_release(loop)  # however it ended: a hold outlasting it helps no one
            self.actor.finished(loop, result)
            self.publish()
            if self.jobs is not None and any(other.waiting for other in self.engines):
                self.jobs.run_soon("tick")  # a plan waiting for this GPU goes ahead now

    def _clock_rate(self) -> float:
        """How many of the daemon's seconds pass in a second of real time (the simulator's
        clock runs faster)."""
        return self.clock.scale if isinstance(self.clock, SimulatorClock) else 1.0

    def _wake(self) -> None:
        """A person's pin, resume or rollback was written to the state: look at it now."""
        if self.jobs is not None:
            self.jobs.run_soon("tick")

    def _tick_when_due(self) -> None:
        """When a policy's ``for`` completes before the next tick, tick then (a little after, so
        the clock has passed it): acting takes ``for`` + one interval at most, not two."""
        now = self.clock.now()
        dues = [matures_at(self.policies, loop.policy_states, now) for loop in self.engines]
        due = min((d for d in dues if d is not None), default=None)
        if due is None or self.jobs is None:
            return
        self.jobs.run_within("tick", (due - now) / self._clock_rate() + 0.01)

    def _death_watch(self) -> None:
        """After each GPU reading (on the sampling thread): bring the tick forward when an
        engine died or a reload was asked for. It only reads — the tick, on the loop thread,
        does the rest — and a hung GPU read delays it no more than the tick's own look."""
        if self.jobs is not None and (self._engine_died() or self.reload_requested.is_set()):
            self.jobs.run_soon("tick")

    def _watchdog_hold(self) -> str | None:
        """Why systemd's watchdog is not to be fed now (the sampler asks before each ping): a
        job of the daemon not completed for its interval plus :attr:`stall_margin` — a frozen
        loop gets tunerd restarted even while sampling goes on. Said when it begins and ends."""
        jobs = self.jobs
        late = jobs.stalled(self.stall_margin) if jobs is not None else []
        why = f"late past their interval + {self.stall_margin:g} s: {', '.join(late)}" if late else None
        if why is not None and self._withheld is None:
            self.say("watchdog_withheld", reason=why)
        elif why is None and self._withheld is not None:
            self.say("watchdog_resumed", was=self._withheld)
        self._withheld = why
        return why

    def _job_failed(self, job: str, error: BaseException, trace: str | None) -> None:
        self.say("job_failed", job=job, error=f"{type(error).__name__}: {error}", traceback=trace)
        if job == "tick" and self._tick_failures >= TICK_FAILURES_TO_STOP:
            last = f"{type(error).__name__}: {error}"
            self.failure = f"{self._tick_failures} ticks in a row failed; last: {last}"
            self.say("stopping", reason=self.failure)
            self._stop.set()

    def housekeeping(self) -> None:
        """Each minute: an engine log past :attr:`log_max_bytes` is copied aside and truncated
        (both modes append to it; keeps 5), and the state's write-ahead log is folded in."""
        for loop in self.engines:
            path = loop.supervisor.spec.log_path
            try:
                rotated = copytruncate(path, self.log_max_bytes)
            except OSError as error:  # a full disk must not stop the daemon
                self.say("engine_log_rotate_failed", engine=loop.name, path=str(path), reason=str(error))
                continue
            if rotated:
                self.say("engine_log_rotated", engine=loop.name, path=str(path), max_bytes=self.log_max_bytes)
        try:
            self.state.checkpoint()
        except (StateError, sqlite3.Error) as error:  # a full disk: said, and tried again next time
            self.say("state_checkpoint_failed", reason=str(error))

    def status(self) -> dict[str, Any]:
        """DESIGN §4.8's ``tunerd status --json``: live values from the last tick."""
        now = self.clock.now()
        reading = self.sampler.latest
        gpus = list(reading.gpus) if reading is not None else []
        free_by_index = {gpu.index: gpu.memory_free_bytes for gpu in gpus}
        total_by_index = {gpu.index: gpu.memory_total_bytes for gpu in gpus}
        engines = []
        for loop in self.engines:
            record = self.state.engine(loop.name)
            supervisor = loop.supervisor
            progress = supervisor.progress()
            process = supervisor.process
            alive = process is not None and process.alive()
            figures = self._startup_figures(loop) if alive else None
            memory = loop.memory
            used, budget_left = budget(supervisor.facts(), supervisor.guards, now)
            lkg = record.last_known_good if record else None
            engines.append(
                engine_status(
                    name=loop.name,
                    state=self._engine_state(loop, progress),
                    generation=record.generation if record else 0,
                    settings=supervisor.running_settings() or dict(loop.config.settings),
                    pid=process.pid if process is not None and alive else None,
                    healthy=alive and loop.healthy,
                    last_known_good=self.state.version(lkg).settings if lkg else None,
                    paused=record.paused if record else None,
                    pinned=bool(record and record.pinned),
                    held=bool(record and record.held),
                    weights=_bytes(figures.model_loading_gib) if figures else None,
                    kv_pool=_bytes(figures.available_kv_cache_gib) if figures else None,
                    memory=memory,
                    free=free_by_index.get(memory.gpu_index)
                    if memory and memory.gpu_index is not None
                    else None,
                    total=total_by_index.get(memory.gpu_index)
                    if memory and memory.gpu_index is not None
                    else None,
                    metrics=_metrics_fields(loop.snapshot),
                    policies=loop.policy_states.values(),
                    restarts_in_window=used,
                    budget_left=budget_left,
                    last_actions=self.state.history(engine=loop.name, limit=5),
                    restart=progress,
                    stuck=None
                    if supervisor.trouble is None
                    else supervisor.trouble.to_dict(now, self.clock.monotonic()),
                    calibration=self._calibration(loop),
                    recommendation=self._recommendation(loop),
                    gate=loop.gate,
                    plateaus=None
                    if loop.plateaus is None
                    else [plateau.to_dict(now) for plateau in loop.plateaus],
                )
            )
        monotonic = self.clock.monotonic()
        troubles = [
            {"engine": engine, **trouble.to_dict(now, monotonic)} for engine, trouble in self.troubles()
        ]
        return status_document(
            mode=self.mode,
            now=now,
            gpus=gpus,
            engines=engines,
            state_trouble=troubles,
            gpu_source=self.sampler.health().to_dict(),
            wall_time=SYSTEM_CLOCK.now() if isinstance(self.clock, SimulatorClock) else None,
        )

    def _recommendation(self, loop: EngineLoop) -> dict[str, Any] | None:
        """``tunerd status --json``'s ``recommendation``: right-sizing from the requests the
        engine served and the measured box (``tunerd advise``'s, DESIGN §9.2)."""
        if loop.workload is None:
            return None
        settings = loop.supervisor.running_settings() or dict(loop.config.settings)
        snapshot = loop.snapshot
        fit = self.config.fit
        advice = advise(
            settings,
            loop.workload,
            pool_tokens=snapshot.kv_cache_size_tokens if snapshot is not None else None,
            observation=loop.observation,
            bounds=loop.config.bounds,
            creep=fit.creep,
            margin=fit.margin,
            block_size=(snapshot.block_size if snapshot is not None else None) or 16,
        )
        return {"requests": loop.workload.requests, **advice_to_dict(advice)}

    def _calibration(self, loop: EngineLoop) -> dict[str, Any] | None:
        """``tunerd status``'s calibration block: the observed start's bills, the headroom they
        leave, the last prediction's error and each ``fit`` target with its reason."""
        observation = loop.observation
        if observation is None:
            return None
        calibration = calibrate(observation)
        settings = loop.supervisor.running_settings() or dict(loop.config.settings)
        return {
            "version": observation.version,
            "pid": observation.pid,
            "observed_at": observation.time,
            "bills": None if calibration is None else calibration.to_dict(),
            "neighbours": {pid: dict(item) for pid, item in observation.neighbours.items()},
            "prediction_error_ratio": loop.prediction_error,
            "fits": {
                knob: {"value": value, "reason": reason, "prediction": prediction}
                for knob, (value, reason, prediction) in self._fits(loop, settings).items()
            },
        }

    def _startup_figures(self, loop: EngineLoop) -> LogDiagnosis | None:
        """The running engine's start-up figures (weights, KV pool) from its log, read once per
        process: they do not change while it runs."""
        process = loop.supervisor.process
        if process is None:
            return None
        if loop.figures is None or loop.figures[0] != process.pid:
            diagnosis = loop.supervisor.diagnose()
            if diagnosis is None or diagnosis.available_kv_cache_gib is None:
                return diagnosis  # not started yet: read again next time
            loop.figures = (process.pid, diagnosis)
        return loop.figures[1]

    def reload(self) -> bool:
        """Read the config file and its policies again (SIGHUP). All or nothing: with any
        problem the running ones stay and the problems are said, each with its file and line.
        Policies (their states kept by name), mode, guards, metrics interval and notify take
        effect; engines, state_dir, gpu, listen and clock need tunerd restarted (said). Everything
        that can fail is done before anything changes: a problem of any kind is reload_failed."""
        self.notifier.reloading()
        try:
            loaded = load_config(self.config.source_file)
            policies = load_policy_files(loaded.policy_files())
            later = [name for name in RESTART_FIELDS if getattr(loaded, name) != getattr(self.config, name)]
            config = loaded.model_copy(update={name: getattr(self.config, name) for name in later})
            new_sinks = config.notify != self.config.notify
            dispatcher = self._dispatcher(config) if new_sinks else self.dispatcher
        except (ConfigError, PolicyError) as error:
            return self._reload_failed(error.problems)
        except Exception as error:  # a bug in reading them must not take the running set along
            return self._reload_failed(
                [f"{self.config.source_file}: could not be reloaded: {type(error).__name__}: {error}"]
            )
        interval = self.config.metrics.interval
        self.config = config
        self.actor.config = self.config
        if self.config.metrics.interval != interval:  # the tick's pace, and what 6 h of it holds
            self.store.resize(retention_capacity(RETENTION_S, max(self.config.metrics.interval, 0.25)))
            if self.jobs is not None and self.jobs.has("tick"):
                self.jobs.every("tick", self.config.metrics.interval, self._tick_job, LOOP, now=False)
        self.policies = policies
        if new_sinks:  # new sinks from now on; the old ones finish what is due
            old, self.dispatcher = self.dispatcher, dispatcher
            if self.dispatcher is not None and self.jobs is not None:
                self.dispatcher.start()
            if old is not None:
                old.close(timeout=2.0)
        guards = _guards(self.config)
        for loop in self.engines:
            loop.waiting = None  # a plan made under the old config is not carried over
            loop.policy_states = {
                policy.name: loop.policy_states.get(policy.name) or PolicyState(policy.name)
                for policy in policies
            }
            loop.supervisor.guards = guards
            loop.supervisor.mode = self.mode
            loop.supervisor.secret_names = secret_names(self.config)  # the next spawn's, the next hook's
        logs.redact_also(secret_names(self.config))
        self.say(
            "reloaded",
            policies=[policy.name for policy in policies],
            mode=self.config.mode,
            needs_restart=later,
        )
        self.notifier.ready(self.status_line())
        self.publish()
        return True

    def _reload_failed(self, problems: list[str]) -> bool:
        """A reload that found problems: said, each located; the running config and policies stay."""
        self.say("reload_failed", problems=problems, kept="the running config and policies")
        self.notifier.ready(self.status_line())
        return False

    def _engine_state(self, loop: EngineLoop, progress: Progress | None) -> str:
        """DESIGN §4.8's engine state."""
        record = self.state.engine(loop.name)
        process = loop.supervisor.process
        return engine_state(
            held=bool(record and record.held),
            pinned=bool(record and record.pinned),
            step=None if progress is None else str(progress.step),
            alive=process is not None and process.alive(),
            healthy=loop.healthy,
            crashed=loop.crash_reported,
        )

    def _start_sampling(self) -> None:
        if self.jobs is None:
            self.jobs = Jobs(self._job_failed)
            self.sampler.schedule(self.jobs, then=self._death_watch)
            if self.dispatcher is not None:
                self.dispatcher.start()
            for loop in self.engines:  # from here on: what the engines write from now
                if loop.config.log_passthrough != "none" and loop.log is None:
                    loop.log = FileFollower(loop.supervisor.spec.log_path)
            self.jobs.every("engine-logs", LOG_PASS_S, self.pass_engine_logs, LOGS, now=False)

    def pass_engine_logs(self) -> None:
        """The engines' new log lines into tunerd's log, ``source: engine``: by default the
        warnings and errors (``log_passthrough`` per engine: warnings | all | none). Follows
        the log file both modes write (rotation and copytruncate included) from where it was
        when tunerd started."""
        for loop in self.engines:
            if loop.log is None:
                continue
            lines = loop.log.read_lines()
            passed = 0
            for line in lines:
                level = passed_through(line, loop.config.log_passthrough)
                if level is None:
                    continue
                if passed == LOG_PASS_MAX:
                    self.say("engine_log_skipped", engine=loop.name, source="engine", lines=len(lines))
                    break
                passed += 1
                self.say("engine_log", engine=loop.name, source="engine", engine_level=level, line=line)

    def status_line(self) -> str:
        """One line for ``systemctl status``: the mode and each engine's state and settings."""
        parts = []
        for loop in self.engines:
            settings = loop.supervisor.running_settings() or {}
            seqs = settings.get("max_num_seqs")
            util = settings.get("gpu_memory_utilization")
            shown = ", ".join(
                f"{key} {value:g}" for key, value in (("util", util), ("seqs", seqs)) if value is not None
            )
            state = self._engine_state(loop, loop.supervisor.progress())
            parts.append(f"{loop.name} {state}" + (f" ({shown})" if shown else ""))
        if troubles := self.troubles():
            parts.append(f"the state refuses writes: {troubles[0][1].error}")
        return f"{self.config.mode}: " + "; ".join(parts)

    def _engine_died(self) -> bool:
        """A supervised engine's process is gone and its crash not yet handled (a restart in
        flight watches its own engine)."""
        return any(
            loop.supervisor.process is not None
            and not loop.supervisor.process.alive()
            and loop.supervisor.next_restart_at is None
            and not loop.crash_reported
            and not loop.supervisor.in_flight()
            for loop in self.engines
        )

    def close(self) -> None:
        """Stop watching; the engines keep running (they outlive tunerd by design), and a
        restart in flight stays recorded for the next tunerd."""
        self._stop.set()  # nothing is spawned from here on
        if self.jobs is not None:
            self.jobs.shutdown()
            self.jobs = None
        self.pass_engine_logs()  # the last lines before tunerd stops
        if self.dispatcher is not None:
            self.dispatcher.close()  # what is due goes out; what cannot, to the dead-letter file
        for loop in self.engines:
            if loop.log is not None:
                loop.log.close()
                loop.log = None
        if self._serving:
            self.status_server.close()
            self._serving = False
        if self.exporter is not None:
            self.exporter.close()
            self.exporter = None
        for loop in self.engines:
            loop.supervisor.close()  # the engine keeps running; a unit's journal copy stops
            loop.metrics.close()
        self.gpu.close()
        try:  # the open incidents get the minutes after that there were
            self.recorder.flush(self.engines, self.clock.now())
        except Exception as error:
            self.say("incident_unwritten", kind="open incidents", error=f"{type(error).__name__}: {error}")
        self.state.close()
        self.lock.release()

    # -- one tick --------------------------------------------------------------------------------
    def tick(self) -> None:
        if isinstance(self.clock, SimulatorClock):
            self.clock.sync()  # until the simulator first answers (tunerd may be starting it)
        now = self.clock.now()
        latest = self.sampler.latest if self.jobs is not None else None
        reading = latest if latest is not None else self.sampler.read()
        failed = [
            loop.name
            for loop in self.engines
            if not self._each(loop, "tick", lambda loop: self._tick_engine(loop, reading, now))
        ]
        for loop in self.engines:  # its failure is said; it never counts against the loop
            self._each(loop, "incidents", lambda loop: self.recorder.tick(loop, reading, now))
        self.live.answer()  # a recording asked for since the last tick, cut at this one
        if failed:  # the other engines had their tick; this one counts toward TICK_FAILURES_TO_STOP
            raise RuntimeError(f"the tick failed for {', '.join(failed)}")

    def _each(self, loop: EngineLoop, job: str, work: Callable[[EngineLoop], object]) -> bool:
        """One engine's part of a job: its failure is said and does not keep the other engines'
        parts from running. False when it failed. A write the state refused (a full disk) is
        not a failure of the job: it is recorded (:meth:`_state_refused`) and tried again, and
        the loop goes on — ticking, answering ``tunerd status``, feeding the watchdog."""
        try:
            work(loop)
        except StateError as error:
            self._state_refused(job, loop.name, error)
            return True
        except Exception as error:
            self.say("engine_job_failed", engine=loop.name, job=job, error=f"{type(error).__name__}: {error}")
            return False
        self.state_troubles.pop((job, loop.name), None)  # it went through
        return True

    def _state_refused(self, job: str, engine: str, error: StateError) -> None:
        """The state refused a write of ``job`` for ``engine``: kept until one goes through;
        said when it begins and when its reason changes, not at each try."""
        key = (job, engine)
        trouble = self.state_troubles.get(key)
        if trouble is None:
            self.state_troubles[key] = StateTrouble.first(
                job, error, self.clock.now(), self.clock.monotonic()
            )
            self.say("state_refused", engine=engine, job=job, error=str(error))
            return
        said = trouble.error
        trouble.again(job, error, self.clock.monotonic())
        if trouble.error != said:
            self.say("state_refused", engine=engine, job=job, error=str(error), tries=trouble.attempts)

    def troubles(self) -> list[tuple[str, StateTrouble]]:
        """(engine, trouble) for each write the state refuses now: the sagas' and the jobs'."""
        found = [(loop.name, loop.supervisor.trouble) for loop in self.engines if loop.supervisor.trouble]
        return found + [(engine, trouble) for (_, engine), trouble in self.state_troubles.items()]

    def _raise(self, what: str, outgoing: Outgoing) -> None:
        """Send one of tunerd's own alerts about the host and keep it until :meth:`_clear`."""
        self._host_alerts[what] = outgoing.alert
        self._send_alert(outgoing)

    def _clear(self, what: str, text: str) -> Alert | None:
        """Resolve the alert ``what`` raised, if one is in force; the alert, or None."""
        alert = self._host_alerts.pop(what, None)
        if alert is not None:
            self._send_alert(Outgoing(alert.resolved(self.clock.now(), text), None, self.mode))
        return alert

    def _host_alert(self, event: str, severity: Severity, title: str, summary: str) -> Outgoing:
        """An alert about the host, not one engine: to every sink, named by every engine."""
        engines = ", ".join(loop.name for loop in self.engines) or "-"
        return engine_alert(
            engines,
            event,
            severity=severity,
            title=title,
            summary=summary,
            host=self.host,
            now=self.clock.now(),
            mode=self.mode,
            undo=None,
        )

    def _state_health(self) -> None:
        """One critical alert (``state-unwritable``) when the state begins to refuse writes,
        resolved once they all go through again; said in the log at both ends."""
        troubles = self.troubles()
        if troubles and "state" not in self._host_alerts:
            engine, trouble = troubles[0]
            self.say("state_trouble", engine=engine, what=trouble.what, error=trouble.error)
            outgoing = engine_alert(
                engine,
                "state-unwritable" if trouble.unwritable else "state-error",
                severity="critical",
                title=f"tunerd cannot write its state ({self.config.state_dir})",
                summary=f"{trouble.what}: {trouble.error}; tunerd goes on and tries again with backoff "
                "(free space, or make the state folder writable)",
                host=self.host,
                now=self.clock.now(),
                mode=self.mode,
                undo=None,
            )
            self._raise("state", outgoing)
        elif not troubles and (alert := self._clear("state", "writes to the state go through again")):
            self.say("state_trouble_over", engine=alert.engine)

    def _gpu_health(self) -> None:
        """One alert (``gpu-source-degraded``) when the GPU source has failed long enough —
        tunerd goes on supervising, blind to GPU memory — resolved when readings come back."""
        health = self.sampler.health()
        if health.degraded and "gpu" not in self._host_alerts:
            self.say("gpu_source_degraded", source=health.source, error=health.error)
            lacks = f"; not available from this driver: {health.unsupported}" if health.unsupported else ""
            summary = (
                f"{health.failures_in_a_row} readings in a row failed: {health.error}{lacks}; engines "
                "are still supervised (crashes restarted) but GPU memory is not watched"
            )
            title = f"tunerd cannot read the GPU ({health.source})"
            self._raise("gpu", self._host_alert("gpu-source-degraded", "warning", title, summary))
        elif health.state == "ok" and self._clear("gpu", "GPU readings come through again"):
            self.say("gpu_source_recovered", source=health.source)

    def _record_signals(
        self, loop: EngineLoop, reading: GpuReading, now: float, settings: Mapping[str, Any], generation: int
    ) -> None:
        name = loop.name
        process = loop.supervisor.process
        up = 0.0
        if process is not None and process.alive():
            try:
                page = loop.metrics.fetch()
                snapshot = parse(page)
                loop.workload = Workload.from_histograms(histograms(page))
            except ScrapeError:
                snapshot = None
                self.scrape_errors[name] = self.scrape_errors.get(name, 0) + 1
            if snapshot is not None and snapshot.engine_count > 0:
                up = 1.0
                loop.snapshot = snapshot
                for signal in _METRIC_FIELDS:
                    value = getattr(snapshot, signal)
                    self.store.record(signal, name, now, None if value is None else float(value), generation)
        self.store.record("engine_up", name, now, up, generation)
        loop.healthy = up == 1.0
        if self.gate is not None and loop.config.gate is not None:
            reply = self.gate.status()
            found = reply.data.get("engines", {}).get(name) if reply.ok else None
            loop.gate = dict(found) if isinstance(found, dict) else {"error": reply.error or "no such gate"}
            for signal, value in gate_signals(loop.gate).items():  # None while the gate does not answer
                self.store.record(signal, name, now, value, generation)
        gpus = engine_gpus(reading.gpus, loop.config.gpus)
        if gpus:
            worst = max(gpus, key=lambda gpu: gpu.memory_used_bytes or 0)
            for signal, value in gpu_signals(worst).items():
                self.store.record(signal, name, now, value, generation)
        pids = process_tree(process.pid) if process is not None and process.alive() else []
        if pids:
            loop.engine_pids = set(pids)
        memory = engine_memory(gpus, pids, settings.get("gpu_memory_utilization"))
        loop.memory = memory
        for signal, value in memory.as_signals().items():
            self.store.record(signal, name, now, value, generation)
        self._observe(loop, gpus, memory, now)

    def _report_plateaus(self, loop: EngineLoop, now: float, generation: int) -> None:
        """The engine's memory rises of the look-back, kept for ``status``; a transient one (the
        seed's prefill plateau that fell back) is said once, when it has fallen — in the journal
        and as an event of the recording — with its height, how long it stood and what was in
        flight. A rise that stays is the ratchet the policies act on."""
        loop.plateaus = plateaus(self.store, loop.name, now)
        for plateau in loop.plateaus or []:
            if plateau.kind != "transient" or plateau.start in loop.reported_transients:
                continue
            loop.reported_transients.append(plateau.start)
            data = plateau.to_dict(now)
            self.store.add_event(Event(now, "transient_plateau", loop.name, generation, data=data))
            self.say("transient_plateau", engine=loop.name, **data)

    def _observe(self, loop: EngineLoop, gpus: list[GpuSample], memory: EngineMemory, now: float) -> None:
        """Calibration: what the serving engine's start showed of the box (its log's figures,
        the CUDA total) and the most it and its neighbours have held since; written to the
        state when it moved. A new start of a restart's settings is compared with what was
        predicted for it: the error goes to history, status and the metrics."""
        process = loop.supervisor.process
        record = self.state.engine(loop.name)
        if (
            process is None
            or not process.alive()
            or not loop.healthy
            or record is None
            or record.running is None
        ):
            return
        figures = self._startup_figures(loop)
        if figures is None or figures.available_kv_cache_gib is None:
            return
        observation = loop.observation
        if observation is None or (observation.version, observation.pid) != (record.running, process.pid):
            gpu = next((g for g in gpus if g.index == memory.gpu_index), None)
            total = cuda_total_bytes(gpu) if gpu is not None else None
            observation = self._first_observation(
                loop, version=record.running, pid=process.pid, figures=figures, total=total, now=now
            )
            loop.free_at_start = None  # it started: what a refused start saw is over
        sample = next((g for g in gpus if g.index == memory.gpu_index), None)
        listed = (sample.processes or ()) if sample is not None else ()
        neighbours = {
            p.pid: (p.name or "?", p.used_bytes)
            for p in listed
            if p.pid not in loop.engine_pids and p.used_bytes is not None
        }
        observation = observation.seen(
            memory.engine_memory_bytes, memory.other_processes_memory_bytes, now, neighbours
        )
        loop.observation = observation
        self._save_observation(loop, now)

    def _first_observation(
        self,
        loop: EngineLoop,
        *,
        version: int,
        pid: int,
        figures: LogDiagnosis,
        total: int | None,
        now: float,
    ) -> Observation:
        """What a new start of ``version`` showed of the box: its log's start-up figures and
        the CUDA total, compared with what was predicted for it."""
        observation = Observation.from_figures(
            engine=loop.name,
            version=version,
            pid=pid,
            settings=self.state.version(version).settings,
            time=now,
            cuda_total_bytes=total,
            weights_gib=figures.model_loading_gib,
            kv_available_gib=figures.available_kv_cache_gib,
            kv_cache_tokens=figures.kv_cache_size_tokens,
            cuda_graph_gib=figures.cuda_graph_gib,
        )
        observation = self._compare_prediction(loop, observation)
        return replace(observation, outside_floor_bytes=self._outside_floor(loop))

    def _observe_oom(self, loop: EngineLoop, crash: Mapping[str, Any], now: float) -> None:
        """A CUDA OOM: what the engine needed when it died (its own memory and the allocation
        torch's text names) joins the observation of it. An engine that died before any tick
        measured it is observed from its log here: the start-up figures are in it, and torch's
        text gives the CUDA total ("a total capacity of …") and the processes beside it."""
        process = loop.supervisor.process
        record = self.state.engine(loop.name)
        version = record.running if record is not None else None
        observation = loop.observation
        seen = None if observation is None else (observation.version, observation.pid)
        if process is not None and version is not None and seen != (version, process.pid):
            observation = self._observed_at_death(loop, crash, version, process.pid, now) or observation
        if observation is None:
            return
        total = crash.get("total_bytes")
        if observation.cuda_total_bytes is None and isinstance(total, int):
            observation = replace(observation, cuda_total_bytes=total)  # no GPU reading had it
        loop.observation = observation.died_of_oom(
            crash.get("own_bytes"), crash.get("tried_to_allocate_bytes"), now
        )
        self._save_observation(loop, now)

    def _observed_at_death(
        self, loop: EngineLoop, crash: Mapping[str, Any], version: int, pid: int, now: float
    ) -> Observation | None:
        figures = self._startup_figures(loop)
        total = crash.get("total_bytes")
        if figures is None or figures.available_kv_cache_gib is None or not isinstance(total, int):
            return None  # it died before its pool was sized, or torch's text had no total
        observation = self._first_observation(
            loop, version=version, pid=pid, figures=figures, total=total, now=now
        )
        neighbours = {
            int(item["pid"]): ("?", int(item["bytes"]))
            for item in crash.get("other_processes") or []
            if item.get("pid") not in loop.engine_pids
        }
        self.say("engine_observed_at_death", engine=loop.name, version=version, pid=pid)
        return observation.seen(None, sum(used for _, used in neighbours.values()), now, neighbours)

    def _outside_floor(self, loop: EngineLoop) -> int | None:
        """The least outside-the-budget memory the engine's earlier starts showed (its CUDA
        context is the box's, whatever the settings)."""
        previous = loop.observation
        if previous is None:
            return None
        calibration = calibrate(previous)
        found = [previous.outside_floor_bytes, calibration.outside_budget_bytes if calibration else None]
        known = [value for value in found if value is not None]
        return min(known) if known else None

    def _compare_prediction(self, loop: EngineLoop, observation: Observation) -> Observation:
        """A start of the settings a restart predicted: keep the prediction with it and say
        how far off it was (the history record's reason gains it)."""
        if loop.predicted is None:
            return observation
        action_id, settings, prediction = loop.predicted
        if dict(observation.settings) != settings or observation.kv_cache_tokens is None:
            return observation
        loop.predicted = None
        predicted = prediction.get("kv_cache_tokens")
        if not isinstance(predicted, int) or observation.kv_cache_tokens <= 0:
            return observation
        error = (observation.kv_cache_tokens - predicted) / observation.kv_cache_tokens
        loop.prediction_error = error
        note = (
            f"KV pool predicted {predicted:,} tokens, started with {observation.kv_cache_tokens:,} "
            f"({error:+.2%})"
        )
        self.say("kv_prediction", engine=loop.name, predicted=predicted, observed=observation.kv_cache_tokens,
                 error=round(error, 5))  # fmt: skip
        try:
            self.state.note_action(action_id, note)
        except StateError as error_writing:
            self.say("kv_prediction_not_recorded", engine=loop.name, error=str(error_writing))
        return replace(observation, predicted_kv_tokens=predicted)

    def _save_observation(self, loop: EngineLoop, now: float) -> None:
        observation = loop.observation
        if observation is None or not observation.differs(loop.observation_saved):
            return
        try:
            self.state.save_observation(
                loop.name, observation.version, observation.pid, observation.to_dict(), now
            )
        except StateError as error:  # a full disk: kept in memory, written when it takes writes
            self.say("observation_not_recorded", engine=loop.name, error=str(error))
            return
        loop.observation_saved = observation

    def _gate_fits(self, loop: EngineLoop) -> dict[str, tuple[Any, str]]:
        """The computed ``gate: {target_fraction: fit}``: from the gate's admitted need (its
        status at this tick) and the engine's pool usage (its latest reading)."""
        status = loop.gate
        if status is None or _number(_gate_limits(status).get("target_fraction")) is None:
            return {}  # no gate, or it did not answer: the action says so
        usage = self.store.latest("kv_cache_usage", loop.name)
        if usage is not None and self.clock.now() - usage.time > GATE_FIT_FRESH_S:
            usage = None  # a reading from before the engine went quiet says nothing of now
        in_flight, pool = _number(status.get("in_flight_tokens")), _number(status.get("pool_tokens"))
        fitted = fit_fraction(
            None if in_flight is None else int(in_flight),
            None if pool is None else int(pool),
            None if usage is None else usage.value,
        )
        return {"target_fraction": fitted}

    def _fits(self, loop: EngineLoop, settings: Mapping[str, Any]) -> dict[str, tuple[Any, str, Any]]:
        """The ``fit`` targets for the engine's knobs, from the latest observation of it."""
        fit = self.config.fit
        found = fits(
            loop.observation,
            settings,
            loop.config.bounds,
            creep=fit.creep,
            margin=fit.margin,
            free_at_start=loop.free_at_start,
        )
        snapshot = loop.snapshot
        found["max_num_seqs"] = seqs_fit(
            settings,
            loop.workload,
            pool_tokens=snapshot.kv_cache_size_tokens if snapshot is not None else None,
            block_size=(snapshot.block_size if snapshot is not None else None) or 16,
        )
        return {
            knob: (item.value, item.reason, item.prediction.to_dict() if item.prediction else None)
            for knob, item in found.items()
        }

    def _post_recommendation(self, loop: EngineLoop, now: float) -> None:
        """In advise mode, the right-sizing recommendation to chat when it changes materially
        (a knob's target moved from what was last posted and differs from its value)."""
        if self.mode != Mode.ADVISE or loop.workload is None or loop.workload.requests < MIN_REQUESTS:
            return  # before the engine has served enough, the peak and the lengths are not known
        recommendation = self._recommendation(loop)
        if recommendation is None:
            return
        targets = {knob: item for knob, item in recommendation.items() if isinstance(item, dict)}
        moved = materially_different(loop.posted_recommendation, targets)
        if not moved:
            return
        loop.posted_recommendation = {knob: item["target"] for knob, item in targets.items()}
        lines = [
            f"{knob} {targets[knob]['current']} → {targets[knob]['target']} "
            f"(range {targets[knob]['lower']}–{targets[knob]['upper']}): {targets[knob]['reason']}"
            for knob in moved
        ]
        self._send_alert(
            engine_alert(
                loop.name,
                "right-sizing",
                severity="info",
                title=f"right-sizing for {loop.name}",
                summary="; ".join(lines) + f" (tunerd advise {loop.name} for the whole table)",
                host=self.host,
                now=now,
                mode=self.mode,
                undo=None,
            )
        )

    def _predict(self, loop: EngineLoop, settings: Mapping[str, Any]) -> dict[str, Any] | None:
        """What ``settings`` would give on the calibrated box (None: nothing calibrated)."""
        calibration = calibrate(loop.observation) if loop.observation is not None else None
        prediction = predict(calibration, settings) if calibration is not None else None
        return None if prediction is None else prediction.to_dict()

    def _tick_engine(self, loop: EngineLoop, reading: GpuReading, now: float) -> None:
        name = loop.name
        supervisor = loop.supervisor
        if not loop.reconciled:
            self._reconcile(loop)
        settings = supervisor.running_settings() or dict(loop.config.settings)
        record = self.state.engine(name)
        generation = record.generation if record else 0
        self._record_signals(loop, reading, now, settings, generation)
        self._report_plateaus(loop, now, generation)
        if not loop.reconciled:
            return
        if supervisor.in_flight():
            self._advance(loop)  # its policies wait until the restart has ended
            return
        if loop.people_due:
            self._people_win(loop)
            if supervisor.in_flight():
                self._advance(loop)
                return
        crash = supervisor.crashed()
        new_crash = False
        if (why := supervisor.take_adopted_by_hand()) is not None:
            self.actor.alert_adopted(loop, why)  # a person restarted it with flags of theirs
        if crash is None and self.actor.rollback_asked(loop):
            self._advance(loop)
            return  # a person's rollback took this tick; the policies look again after it
        if crash is not None and not loop.crash_reported:
            self.store.add_event(Event(now, "engine_crash", name, data=crash))
            loop.crash_reported = True
            listed = crash.get("other_processes") or []
            if crash.get("kind") == "cuda_oom" and listed:
                # torch's OOM text lists the processes on the GPU at the moment of death: the
                # freshest reading of the neighbours there is (the GPU sample may be seconds old).
                others = sum(item["bytes"] for item in listed if item["pid"] not in loop.engine_pids)
                self.store.record("other_processes_memory_bytes", name, now, float(others), generation)
            free, total = crash.get("free_at_start_bytes"), crash.get("total_bytes")
            if crash.get("kind") == "insufficient_free_memory" and free is not None and total is not None:
                loop.free_at_start = (int(free), int(total))
            if crash.get("kind") == "cuda_oom":
                self._observe_oom(loop, crash, now)
            new_crash = True
            self.say("engine_crash", engine=name, kind=crash.get("kind"), message=crash.get("message"))
        context = EngineContext(
            name=name,
            settings=settings,
            bounds=loop.config.bounds,
            ladders=loop.config.ladders,
            failed=self.state.failed_values(name, now - FAILED_VALUE_SECONDS),
            mode=self.mode,
            observed_since=loop.observed_since,
            fits=self._fits(loop, settings),
            gate=_gate_limits(loop.gate) if loop.config.gate is not None else None,
            gate_fits=self._gate_fits(loop),
        )
        before = loop.policy_states
        loop.policy_states, plan = evaluate(self.policies, before, self.store, context, now)
        loop.tape.tick(now, context, before, plan)
        if new_crash:  # its incident, with what the policies decided, before the restart begins
            try:
                self.recorder.crash(loop, crash or {}, reading, now, plan)
            except Exception as error:  # said; the recovery goes on
                self.say(
                    "incident_unwritten", engine=name, kind="crash", error=f"{type(error).__name__}: {error}"
                )
        if plan is not None and plan.changes and plan.prediction is None:
            plan = replace(plan, prediction=self._predict(loop, plan.after))
        self._resolve_cleared(loop, now)
        hold = plan if plan is not None and plan.hold else self._hold_due.get(name)
        if hold is not None and record is not None and not record.held:
            self._hold_due[name] = hold  # until it is written: a refused write is tried next tick
            with self.state.transaction():
                self.state.set_flags(name, held=True)
                self.state.record_action(
                    engine=name,
                    kind="hold",
                    mode=hold.mode,
                    outcome="succeeded",
                    reason="; ".join(hold.reasons) or "a policy asked to hold",
                    now=now,
                    policy=",".join(hold.policies),
                    evidence={"signals": dict(hold.evidence)},
                )
            self.say("engine_held", engine=name, policies=list(hold.policies))
        self._hold_due.pop(name, None)
        fresh = plan is not None
        if crash is not None:
            loop.waiting = None  # crashes never wait, and what the waiting plan assumed is gone
        elif plan is None and loop.waiting is not None:
            plan = loop.waiting[0]  # a plan still waiting (quiet period, busy GPU): look again
        try:
            acted = self.actor.act(loop, plan, crash, now)
        except StateError:  # what it could not write is asked again at the next tick, not lost
            if crash is not None:
                loop.crash_plan = plan or loop.crash_plan
            elif plan is not None and plan.changes and not plan.hold:
                loop.waiting = loop.waiting or (plan, now)
            raise
        if loop.waiting is not None and loop.waiting[0] is plan and acted.did in (Did.PROPOSED, Did.OBSERVED):
            loop.waiting = None  # a proposal retried after a refused write: recorded now
        if acted.did is Did.RESTARTING:
            progress = supervisor.progress()
            if plan is not None and progress is not None:
                loop.plans[progress.action_id] = (plan, fresh)  # its alert comes with the result
                if plan.prediction is not None:
                    loop.predicted = (progress.action_id, dict(plan.after), dict(plan.prediction))
            self._advance(loop)
            return
        if acted.did is Did.RECOVERING:
            self._advance(loop)  # a crash restart spawns in this very tick
        self._post_recommendation(loop, now)
        if plan is not None and ((fresh and plan.notify) or acted.pages):
            self.actor.alert_plan(loop, plan, acted)  # a change that did not take pages a person

    def _send_alert(self, outgoing: Outgoing) -> None:
        """Hand an alert to the dispatcher (never blocks) and record it in history: applied
        with the sinks it went to (what they answered is in the log, what could not be sent in
        the dead-letter file), or skipped when no sink takes it. When the state refuses the
        record (a full disk) the alert still goes: said in the log instead, never raised — a
        retry of what raised it would send it twice."""
        alert = outgoing.alert
        texts = self.recorder.postmortem_for(alert.engine, alert.time) if not alert.test else None
        if texts is not None and alert.status == "firing" and alert.postmortem is None:
            alert = replace(alert, postmortem=texts)  # a crash's alerts quote its incident
        if alert.link is None:
            alert = replace(alert, link=self.config.metrics_link(self.host))
        sent = self.dispatcher.submit(alert, outgoing.sinks) if self.dispatcher is not None else []
        where = (
            f"sent to {', '.join(sent)}"
            if sent
            else "not delivered: no notify sink takes it"
            + ("" if self.config.notify else " (none configured)")
        )
        try:
            self.state.record_action(
                engine=alert.engine,
                kind="notify",
                mode=outgoing.mode,
                outcome="applied" if sent else "skipped",
                reason=f"{alert.severity} {alert.status}: {alert.title}: {alert.summary} ({where})",
                now=alert.time,
                policy=alert.policy,
                evidence=dict(alert.evidence),
            )
        except StateError as error:
            self.say("alert_not_recorded", engine=alert.engine, policy=alert.policy, error=str(error))
        self.say(
            "alert",
            engine=alert.engine,
            severity=alert.severity,
            status=alert.status,
            policy=alert.policy,
            sinks=sent,
        )

    def _resolve_cleared(self, loop: EngineLoop, now: float) -> None:
        """A policy that alerted and whose condition no longer holds: a resolve message."""
        for policy, alert in list(loop.notified.items()):
            state = loop.policy_states.get(policy)
            if state is None or state.clear:
                del loop.notified[policy]
                summary = f"{policy} no longer holds on {loop.name}"
                self._send_alert(Outgoing(alert.resolved(now, summary), None, self.mode))


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _gate_limits(gate: Mapping[str, Any] | None) -> dict[str, Any]:
    """The live limits of an engine's gate as it answered at the last tick (empty: it did not
    answer): what a policy's ``gate:`` action starts from."""
    limits = gate.get("limits") if gate and not gate.get("error") else None
    return dict(limits) if isinstance(limits, dict) else {}
