"""Guards on acting (DESIGN §4.9): when tunerd may restart an engine, and when it must stop
tuning and hold. Pure: facts and ``now`` in, a decision out.

- **Budget**: at most ``max_restarts`` restarts (tunerd's own and crash restarts) in
  ``window``; exhausted → hold (or, with ``on_exhausted: skip``, skip the action).
- **Settle**: one change per settle period after a restart — the new engine's memory and
  traffic need time to show what the change did.
- **In flight**: never act while a restart of the engine is in flight.
- **Hold, pin, pause**: a held engine is not tuned (only its last-known-good is restarted,
  with backoff); a pinned one is never changed; a paused one (a person changed it) waits for
  ``tunerd resume``.
- **Crash loop**: a crash with the same settings as the previous crash in the window, or a
  crash of settings tunerd had just rolled back to, is a loop → hold and page.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "EngineFacts",
    "GuardConfig",
    "Refusal",
    "backoff_seconds",
    "budget",
    "is_crash_loop",
    "may_change",
]


@dataclass(frozen=True)
class GuardConfig:
    max_restarts: int = 3
    window: float = 3600.0
    on_exhausted: str = "hold"  # hold | skip
    settle: float = 900.0
    backoff_base: float = 30.0
    backoff_max: float = 1800.0

    def __post_init__(self) -> None:
        if self.max_restarts < 1:
            raise ValueError("guards.max_restarts must be at least 1")
        if self.window <= 0 or self.settle < 0:
            raise ValueError("guards.window must be positive and guards.settle not negative")
        if self.on_exhausted not in ("hold", "skip"):
            raise ValueError(f"guards.on_exhausted must be hold or skip, not '{self.on_exhausted}'")


@dataclass(frozen=True)
class EngineFacts:
    restarts: Sequence[float]  # when each restart in recent history began
    in_flight: bool = False
    held: bool = False
    pinned: bool = False
    paused: str | None = None  # why (a person changed the engine)


@dataclass(frozen=True)
class Refusal:
    """Why an action may not run now; ``hold`` says the engine must be held."""

    reason: str
    hold: bool = False


def budget(facts: EngineFacts, config: GuardConfig, now: float) -> tuple[int, int]:
    """(restarts in the window, restarts left). A restart recorded after ``now`` (the wall
    clock stepped back since) counts as one at ``now``: a clock step never buys restarts."""
    used = sum(1 for time in facts.restarts if now - config.window < time)
    return used, max(0, config.max_restarts - used)


def may_change(facts: EngineFacts, config: GuardConfig, now: float, settle: bool = True) -> Refusal | None:
    """None if a settings change (a restart) may start now; else why not. ``settle=False``
    skips the settle period (after a crash there is nothing left to wait for)."""
    if facts.in_flight:
        return Refusal("a restart is already in flight")
    if facts.pinned:
        return Refusal("pinned: settings are frozen (tunerd resume to unpin)")
    if facts.paused:
        return Refusal(f"tuning paused: {facts.paused} (tunerd resume to continue)")
    if facts.held:
        return Refusal("held after a crash loop or an exhausted budget (tunerd resume to continue)")
    if facts.restarts and settle:
        since = max(0.0, now - max(facts.restarts))  # one "in the future" was just now
        if since < config.settle:
            return Refusal(
                f"settling: {since:.0f} s since the last restart, one change per {config.settle:.0f} s"
            )
    used, left = budget(facts, config, now)
    if left == 0:
        return Refusal(
            f"restart budget spent: {used} restarts in the last {config.window:.0f} s",
            hold=config.on_exhausted == "hold",
        )
    return None


def is_crash_loop(
    crashed: Mapping[str, Any],
    previous_crashes: Sequence[Mapping[str, Any]],
    rolled_back_to: Mapping[str, Any] | None,
) -> bool:
    """A crash is a loop when the same settings crashed before in the window, or when they are
    the settings tunerd just rolled back to (the safe base is not safe)."""
    if rolled_back_to is not None and dict(crashed) == dict(rolled_back_to):
        return True
    return any(dict(crashed) == dict(previous) for previous in previous_crashes)


def backoff_seconds(attempt: int, config: GuardConfig) -> float:
    """Wait before restart ``attempt`` (1, 2, …) of a held engine: doubling, capped."""
    if attempt < 1:
        return 0.0
    return float(min(config.backoff_max, config.backoff_base * 2 ** (attempt - 1)))


def is_quiet(
    samples: Sequence[tuple[float, float | None]], now: float, max_running: int, hold: float
) -> bool:
    """The engine has had at most ``max_running`` requests running for the last ``hold``
    seconds: readings cover the whole stretch (the oldest at or before ``now − hold``) and none
    is over the limit or missing. ``samples`` are (time, num_requests_running), oldest first; one
    stamped after ``now`` (the wall clock stepped back since) counts as a reading at ``now``."""
    recent = [(min(time, now), value) for time, value in samples]
    if not recent or recent[0][0] > now - hold:
        return False  # not watched that long yet
    start = max((time for time, _ in recent if time <= now - hold), default=recent[0][0])
    return all(value is not None and value <= max_running for time, value in recent if time >= start)


def shared_gpu_refusal(
    engine: str,
    utilization: float,
    gpus: Mapping[str, Sequence[int | str]],
    utilizations: Mapping[str, float],
    limit: float,
) -> str | None:
    """Why ``engine`` may not run at ``utilization`` beside the other engines on its GPUs (None
    when it may): on a GPU several engines share, their ``gpu_memory_utilization`` together stay
    within ``limit``. ``gpus`` maps each engine to its GPUs, ``utilizations`` the others' now."""
    for gpu in gpus.get(engine, ()):
        others = {
            name: utilizations[name]
            for name, theirs in gpus.items()
            if name != engine and gpu in theirs and name in utilizations
        }
        total = round(utilization + sum(others.values()), 4)
        if others and total > limit:
            beside = ", ".join(f"{name} {share:g}" for name, share in sorted(others.items()))
            return (
                f"GPU {gpu} would be {total:g} booked "
                f"({engine} {utilization:g} beside {beside}; limit {limit:g})"
            )
    return None
