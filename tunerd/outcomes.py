"""What crosses from the engine controller to the daemon and the alerts: typed, never prose.

A saga (:mod:`tunerd.engine.saga`) reports where it is as a :class:`Progress` and how it ended
as a :class:`SagaResult`; a dead engine is answered with a :class:`CrashResponse`; the run
loop's :class:`Mode`, a policy's :class:`PolicyStatus` and its :class:`Health` are ordered
enums. Their values are the contract's words (DESIGN §4.8), so JSON and history print them
unchanged; the people-facing text is made from them at the very end (alerts, logs, status).
Pure: no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

__all__ = [
    "CrashResponse",
    "Health",
    "Mode",
    "Ordered",
    "Outcome",
    "PolicyStatus",
    "Progress",
    "SagaKind",
    "SagaResult",
    "Step",
]


class Ordered(StrEnum):
    """A string enum whose members compare by their order of definition, not alphabetically
    (``Mode.OBSERVE < Mode.ACT``); equal to their plain string values."""

    @property
    def rank(self) -> int:
        return list(type(self)).index(self)

    def _other(self, other: object) -> int:
        """``other``'s rank: a member of the same enum or one of its values."""
        if not isinstance(other, str):
            raise TypeError(f"cannot order {type(self).__name__} against {type(other).__name__}")
        member: Ordered = type(self)(other)
        return member.rank

    def __lt__(self, other: object) -> bool:
        return self.rank < self._other(other)

    def __le__(self, other: object) -> bool:
        return self.rank <= self._other(other)

    def __gt__(self, other: object) -> bool:
        return self.rank > self._other(other)

    def __ge__(self, other: object) -> bool:
        return self.rank >= self._other(other)


class Mode(Ordered):
    """How far tunerd may go (DESIGN §4.8); a policy's mode can only lower the global one."""

    OBSERVE = "observe"  # record and alert
    ADVISE = "advise"  # alert with the exact flag diff and how to apply it
    ACT = "act"  # apply it


class PolicyStatus(Ordered):
    """A policy's state, in the order it moves through (DESIGN §4.8)."""

    INACTIVE = "inactive"
    PENDING = "pending"
    FIRING = "firing"
    COOLDOWN = "cooldown"


class Health(Ordered):
    """Whether a policy could be evaluated at its last tick."""

    OK = "ok"
    ERROR = "error"


class SagaKind(StrEnum):
    """Why an engine is being started."""

    FIRST_START = "first_start"  # tunerd never ran it: start, verify, make it last-known-good
    RESTART = "restart"  # new settings: drain, stop, start, verify, probation, promote
    ROLLBACK = "rollback"  # the new settings failed: back to last-known-good
    RECOVER = "recover"  # the engine is down (a crash, found down, held): start it again


class Step(StrEnum):
    """A saga's durable step (DESIGN §4.9), written to the state before it is taken."""

    INTENT = "intent"  # recorded; the pre_stop hook runs; the old engine still serves
    STOPPING = "stopping"  # SIGTERM sent; the engine drains; SIGKILL of the group after a timeout
    STARTING = "starting"  # the GPU memory the settings need, then the spawn
    VERIFYING = "verifying"  # /health 200 and vLLM's KV-size line; then post_start
    PROBATION = "probation"  # the new engine must stay up this long


class Outcome(StrEnum):
    """How an action ended (DESIGN §4.8's history outcomes, the final ones)."""

    SUCCEEDED = "succeeded"
    ROLLED_BACK = "rolled_back"
    FAILED = "failed"
    SKIPPED = "skipped"

    @property
    def pages(self) -> bool:
        """A change that did not take: a person must look."""
        return self in (Outcome.ROLLED_BACK, Outcome.FAILED)


@dataclass(frozen=True)
class Progress:
    """A saga in flight, as ``tunerd status`` shows it."""

    kind: SagaKind
    step: Step
    action_id: int
    detail: str  # what it waits for now, for people ("draining: 3 requests in flight")
    deadline: float | None  # when the step gives up, on the daemon clock's now() (None: no limit)
    started: float  # when the saga began, on the daemon clock's now()

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": str(self.kind),
            "step": str(self.step),
            "action_id": self.action_id,
            "detail": self.detail,
            "deadline": self.deadline,
            "started": self.started,
        }


@dataclass(frozen=True)
class SagaResult:
    """How a saga ended (or why it never began: ``SKIPPED``)."""

    kind: SagaKind
    outcome: Outcome
    action_id: int
    version: int | None  # the settings version running afterwards (None: nothing runs)
    reason: str
    crash: str | None = None  # the crash kind that began it (tunerd.diagnosis's kinds), if one did

    @property
    def after_crash(self) -> bool:
        return self.crash is not None

    @property
    def pages(self) -> bool:
        return self.outcome.pages

    def text(self) -> str:
        """What became of it, in a few words for people."""
        if self.kind is SagaKind.RECOVER and self.crash is not None:
            if self.outcome is Outcome.SUCCEEDED:
                return f"restarted after {self.crash} with the same settings"
            return f"restart after {self.crash} {self.outcome}: {self.reason}"
        return f"restart {self.outcome}: {self.reason}"


class CrashResponse(StrEnum):
    """What the supervisor did about a dead engine at one look."""

    NOT_OURS = "not_ours"  # never started under tunerd: nothing to restart
    WAITING = "waiting"  # a held engine's backoff is not over yet
    RESTARTING = "restarting"  # the same settings start again (supervision, every mode)
    TUNING = "tuning"  # the policies' settings start instead (mode act)
    HELD = "held"  # a crash loop or a spent budget: held; last-known-good restarts with backoff
