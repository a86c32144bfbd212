"""A box of fake engines for the saga's fast tier: the supervisor's ``Runner`` and ``Engine``
interfaces (tunerd.engine.saga) over processes that exist only here, on a manual clock.

What it keeps of the real thing (checked against tests/integration/test_saga.py, which runs the
same stories against real simulator processes): an engine's identity is a PID and a start
time; it writes vLLM's KV-size line to its log once it has started (``startup_seconds`` after
the spawn), and ``/health`` answers 200 from then on; one that cannot start writes vLLM's failure text and exits 1; SIGTERM to the
main process drains for ``drain_seconds`` of the clock, then it exits; SIGKILL of the group ends
it at once. Behaviour is chosen per settings: ``box.fails[settings key] = text`` makes every
start with them fail with vLLM's ``text``; ``box.crash_after`` kills an engine that many
seconds after it started (a leak: CUDA out of memory).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tunerd.engine.args import settings_from_argv
from tunerd.engine.process import Identity, Successor

__all__ = ["FakeBox", "FakeEngine", "FakeRunner", "ManualClock"]

OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
    "capacity of 23.52 GiB of which 0.38 GiB is free."
)


class ManualClock:
    """Time that moves only when told (``sleep`` moves it): hours of restarts in milliseconds."""

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self._now = start
        self._mono = 1000.0

    def now(self) -> float:
        return self._now

    def monotonic(self) -> float:
        return self._mono

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)

    def advance(self, seconds: float) -> None:
        self._now += max(0.0, seconds)
        self._mono += max(0.0, seconds)


def settings_key(settings: Mapping[str, Any]) -> str:
    return json.dumps({k: v for k, v in settings.items() if v is not None}, sort_keys=True)


@dataclass
class FakeEngine:
    """One engine process of the box."""

    box: FakeBox
    identity: Identity
    log_path: Path
    settings: dict[str, Any]
    started_at: float
    exit_code: int | None = None
    term_at: float | None = None
    leftovers: list[int] = field(default_factory=list)  # children still up after the main exits
    up: bool = False  # it has started (its KV-size line is in the log)

    @property
    def pid(self) -> int:
        return self.identity.pid

    def _update(self) -> None:
        now = self.box.clock.monotonic()
        if self.exit_code is not None:
            return
        if not self.up and now >= self.started_at + self.box.startup_seconds:
            self.up = True
            self._log("INFO GPU KV cache size: 131,072 tokens")
            self._log("INFO Application startup complete.")
        if self.term_at is not None and now >= self.term_at + self.box.drain_seconds:
            self.exit_code = 0
            self._log("[shutdown] API server: shutdown triggered by signal=SIGTERM")
        elif self.box.crash_after is not None and now >= self.started_at + self.box.crash_after:
            self.exit_code = 1
            self._log(OOM)

    def _log(self, line: str) -> None:
        with self.log_path.open("a") as log:
            log.write(line + "\n")

    @property
    def returncode(self) -> int | None:
        self._update()
        return self.exit_code

    def alive(self) -> bool:
        self._update()
        return self.exit_code is None

    def log_settled(self) -> bool:
        return True

    def terminate(self) -> None:
        if self.alive() and self.term_at is None:
            self.term_at = self.box.clock.monotonic()

    def kill_group(self) -> None:
        if self.alive():
            self.exit_code = -9
        self.leftovers.clear()

    def members(self) -> list[int]:
        return ([self.pid] if self.alive() else []) + self.leftovers

    def close(self) -> None:
        pass

    def healthy(self) -> bool:
        return self.alive() and self.up


@dataclass
class _Started:
    engine: FakeEngine

    def poll(self) -> FakeEngine:
        return self.engine

    def detail(self) -> str:
        return f"spawned pid {self.engine.pid}"


class FakeRunner:
    """The supervisor's runner over the box (supervise mode's shape)."""

    waits_for_room = True
    stops_in_start = False

    def __init__(self, box: FakeBox) -> None:
        self.box = box

    def start(self, argv: Sequence[str]) -> _Started:
        return _Started(self.box.spawn(argv))

    def adopt(self, identity: Identity) -> FakeEngine | None:
        engine = self.box.engines.get(identity.pid)
        if engine is None or not engine.alive() or engine.identity.start_ticks != identity.start_ticks:
            return None
        return engine

    def find_new(self, argv: Sequence[str]) -> FakeEngine | None:
        return next(
            (e for e in self.box.engines.values() if e.alive() and e.identity.argv == tuple(argv)), None
        )

    def listener(self, port: int) -> FakeEngine | None:
        return self.box.by_hand

    def successor(self, engine: FakeEngine) -> Successor:
        return Successor()


class FakeClient:
    """``/health`` of the box's newest live engine."""

    def __init__(self, box: FakeBox) -> None:
        self.box = box

    def health(self) -> int | None:
        live = [e for e in self.box.engines.values() if e.alive()]
        return 200 if live and live[-1].healthy() else None

    def close(self) -> None:
        pass


class FakeBox:
    """Engines, their log, the clock, and how starts go."""

    def __init__(self, log_path: Path, clock: ManualClock | None = None, drain_seconds: float = 5.0) -> None:
        self.clock = clock or ManualClock()
        self.log_path = log_path
        self.drain_seconds = drain_seconds
        self.engines: dict[int, FakeEngine] = {}
        self.fails: dict[str, str] = {}  # settings key → vLLM's failure text
        self.crash_after: float | None = None
        self.startup_seconds = 0.0  # from the spawn to the KV-size line and /health
        self.spawned: list[dict[str, Any]] = []  # each spawn's settings, in order
        self.by_hand: FakeEngine | None = None
        self._next_pid = 4000
        self.runner = FakeRunner(self)
        self.client = FakeClient(self)

    def spawn(self, argv: Sequence[str], *, record: bool = True) -> FakeEngine:
        self._next_pid += 1
        settings = settings_from_argv(argv)
        engine = FakeEngine(
            self,
            Identity(self._next_pid, self._next_pid * 10, tuple(argv)),
            self.log_path,
            settings,
            self.clock.monotonic(),
        )
        self.engines[engine.pid] = engine
        if record:
            self.spawned.append(settings)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        engine._log("INFO vLLM API server version 0.33.0")
        failure = self.fails.get(settings_key(settings))
        if failure is not None:
            engine._log(failure)
            engine.exit_code = 1
        engine._update()
        return engine

    def live(self) -> list[FakeEngine]:
        return [engine for engine in self.engines.values() if engine.alive()]
