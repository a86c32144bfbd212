"""Admission by KV need: who may run now, who waits, who is turned away. Pure.

Each request's need is what it can hold in the engine's KV pool at its longest: its prompt
tokens plus the tokens it may generate (``max_tokens``, or, when the client gave none, the
rest of ``max_model_len``, as vLLM allows), rounded up to whole blocks. The gate admits
while the needs in flight fit ``target_fraction`` of the pool (``num_gpu_blocks ×
block_size``); a request at or above ``long_threshold`` tokens is *long* and runs in the long
lane (``long_lane`` at once; 1 = "run alone"), still inside the budget. A request within the
pool but over the budget runs when nothing else does.

The queue is ordered by priority, then arrival. The first request that waits for room holds
a reservation: those behind it are let past only if they fit beside it (backfilling that
never delays the head), so a long prompt is not starved by a stream of short ones — it waits
for the pool to drain to its size, as the seed's operator wanted ("rather queue than push
the pool to its limit").

Answers of the gate's own: 400 (larger than the whole pool, or than ``max_model_len``), 429
(the queue is full: by requests or by tokens), 503 (waited past ``max_wait``, or past the
hold's ``max``), each with ``Retry-After`` computed from the drain rate where it applies.
While held (tunerd restarts the engine) nothing is admitted, new requests queue, and the
time held does not count against ``max_wait``.

No clock is read here: every call takes ``now`` (seconds, monotonic).
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass, field, replace
from typing import Any, Literal

__all__ = [
    "GATE_KNOBS",
    "Admission",
    "Limits",
    "Pool",
    "Ticket",
    "Verdict",
    "need_tokens",
]

#: the limits a policy's ``gate:`` action may change live (DESIGN §9.1)
GATE_KNOBS = ("target_fraction", "long_threshold", "long_lane", "max_concurrency")
DRAIN_WINDOW_S = 60.0  # the drain rate is the need completed over the last minute
DEFAULT_RETRY_S = 5  # Retry-After before any request has finished
MAX_RETRY_S = 600

Outcome = Literal["admitted", "queued", "rejected", "timed_out"]


@dataclass(frozen=True)
class Limits:
    """The gate's limits for one engine (config ``engines[].gate``)."""

    target_fraction: float = 0.90
    long_threshold: int = 16384
    long_lane: int = 1
    max_concurrency: int = 0  # 0: bounded by the pool only
    queue_requests: int = 256
    queue_tokens: int = 2_000_000
    max_wait: float = 120.0
    hold_max: float = 600.0

    def problems(self) -> list[str]:
        """What is wrong with these limits, in words (empty: nothing)."""
        found = []
        if not 0 < self.target_fraction <= 1:
            found.append(f"target_fraction must be in (0, 1], got {self.target_fraction}")
        if self.long_threshold < 1:
            found.append(f"long_threshold must be at least 1 token, got {self.long_threshold}")
        if self.long_lane < 1:
            found.append(f"long_lane must be at least 1, got {self.long_lane}")
        if self.max_concurrency < 0:
            found.append(f"max_concurrency must be 0 (no cap) or more, got {self.max_concurrency}")
        if self.queue_requests < 0 or self.queue_tokens < 0:
            found.append("queue sizes cannot be negative")
        if self.max_wait <= 0 or self.hold_max <= 0:
            found.append("max_wait and hold max must be positive durations")
        return found


@dataclass(frozen=True)
class Pool:
    """The engine's KV pool and context limit, as the engine reports them."""

    num_blocks: int
    block_size: int
    max_model_len: int

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size


def need_tokens(prompt_tokens: int, max_tokens: int | None, pool: Pool) -> int:
    """A request's KV need in tokens, rounded up to whole blocks: the prompt plus what it may
    generate (``max_tokens``; the rest of ``max_model_len`` when the client gave none)."""
    room = max(0, pool.max_model_len - prompt_tokens)
    out = room if max_tokens is None else min(max_tokens, room)
    blocks = math.ceil((prompt_tokens + out) / pool.block_size)
    return blocks * pool.block_size


@dataclass
class Ticket:
    """One request as the gate sees it. ``prompt_tokens`` is an upper bound until ``exact``."""

    id: int
    prompt_tokens: int
    max_tokens: int | None
    arrival: float
    priority: int = 0
    exact: bool = True
    need: int = 0
    long: bool = False
    deadline: float = math.inf
    state: Literal["new", "queued", "admitted", "done"] = "new"
    admitted_at: float | None = None


@dataclass(frozen=True)
class Verdict:
    """What the gate answers a request: run it, let it wait, or answer ``status`` itself."""

    outcome: Outcome
    reason: str = ""
    status: int | None = None  # the gate's own HTTP answer (rejected, timed out)
    message: str = ""
    retry_after: int | None = None  # seconds, with 429 and 503


@dataclass
class Admission:
    """The admission state of one engine's gate. Every method takes ``now``; those that can
    let waiting requests run return the tickets admitted as a result (the proxy wakes them)."""

    limits: Limits = field(default_factory=Limits)
    pool: Pool | None = None
    running: dict[int, Ticket] = field(default_factory=dict)
    queue: list[Ticket] = field(default_factory=list)
    held_until: float | None = None
    held_since: float | None = None
    hold_reason: str = ""
    counts: Counter[tuple[str, str]] = field(default_factory=Counter)
    _finished: deque[tuple[float, int]] = field(default_factory=deque)
    _since: float | None = None  # the first request: the drain rate's window starts no earlier
    #: waiting requests an offer let run besides its own (see :meth:`announce`)
    unannounced: list[Ticket] = field(default_factory=list)
    # the running requests' need and long ones, kept as they change (a request reads them twice)
    _running_need: int = 0
    _running_long: int = 0

    # -- what is in flight -------------------------------------------------------------
    @property
    def budget(self) -> int | None:
        """The tokens the admitted requests may need at once (None: the pool is not known)."""
        if self.pool is None:
            return None
        return math.floor(self.pool.tokens * self.limits.target_fraction)

    @property
    def in_flight_tokens(self) -> int:
        return self._running_need

    @property
    def queued_tokens(self) -> int:
        return sum(t.need for t in self.queue)

    @property
    def long_running(self) -> int:
        return self._running_long

    def held(self, now: float) -> bool:
        return self.held_until is not None and now < self.held_until

    # -- requests ----------------------------------------------------------------------
    def offer(self, ticket: Ticket, now: float) -> Verdict:
        """A new request: admitted now, queued (the proxy waits for it to be admitted or to
        time out), or rejected with the gate's own answer."""
        if self._since is None:
            self._since = now
        if self.pool is not None:
            refused = self._too_large(ticket, self.pool)
            if refused is not None:
                self._count("rejected", "too_large")
                return refused
            self._size(ticket, self.pool)
        ticket.deadline = now + self.limits.max_wait
        if (
            not self.queue
            and self.pool is not None
            and not self.held(now)
            and not self._blocked_by_count(ticket)
            and self._fits(ticket, 0)
        ):  # nothing waits and it fits: what the pump would do, without the queue
            self._run(ticket, now)
            return Verdict("admitted", "long" if ticket.long else "short")
        ticket.state = "queued"
        self.queue.append(ticket)
        self._order()
        # others may run too (a hold that ran out since the last tick): the proxy wakes them
        self.unannounced += [t for t in self._pump(now) if t is not ticket]
        if ticket.id in self.running:
            return Verdict("admitted", "long" if ticket.long else "short")
        waiting = [t for t in self.queue if t is not ticket]
        full = len(waiting) + 1 > self.limits.queue_requests
        full_tokens = sum(t.need for t in waiting) + ticket.need > self.limits.queue_tokens
        if full or full_tokens:
            self.queue.remove(ticket)
            ticket.state = "done"
            reason = "queue_full" if full else "queue_tokens"
            self._count("rejected", reason)
            what = (
                f"{self.limits.queue_requests} requests"
                if full
                else f"{self.limits.queue_tokens:,} tokens of KV need"
            )
            return Verdict(
                "rejected",
                reason,
                status=429,
                message=f"the gate's queue is full ({what} waiting); retry later",
                retry_after=self.retry_after(now, ticket.need),
            )
        why = self._why_waiting(ticket, now)
        self._count("held" if why == "held" else "queued", why)
        return Verdict("queued", why)

    def announce(self) -> list[Ticket]:
        """The waiting requests an :meth:`offer` admitted besides the one offered (their
        waiters must be woken), once."""
        found, self.unannounced = self.unannounced, []
        return found

    def could_admit(self, ticket: Ticket, now: float) -> bool:
        """Whether ``ticket``, sized as it is, would be admitted at once (nothing changes):
        the gate asks before it spends a call on the exact count."""
        if self.held(now) or self.pool is None or self.queue:
            return False
        need = need_tokens(ticket.prompt_tokens, ticket.max_tokens, self.pool)
        budget = self.budget
        fits = budget is not None and self._running_need + need <= budget
        return fits and need < self.limits.long_threshold and not self._at_cap()

    def done(self, ticket: Ticket, now: float) -> list[Ticket]:
        """A request finished (answered, failed or cancelled): its need is free again. A
        queued one that is given up (the client went away) just leaves the queue."""
        if ticket.state == "admitted":
            self._unrun(ticket)
            self._finished.append((now, ticket.need))
        elif ticket.state == "queued" and ticket in self.queue:
            self.queue.remove(ticket)
            self._count("cancelled", "client_gone")
        ticket.state = "done"
        return self._pump(now)

    def requeue(self, ticket: Ticket, now: float) -> None:
        """An admitted request the engine could not take (it is down): back to the head of
        its priority, to wait for the engine like a held one. Its deadline stands."""
        if ticket.state == "admitted":
            self._unrun(ticket)
        ticket.state = "queued"
        ticket.admitted_at = None
        self.queue.append(ticket)
        self.queue.sort(key=lambda t: (-t.priority, t is not ticket, t.arrival, t.id))

    def count_exact(self, ticket: Ticket, prompt_tokens: int, now: float) -> list[Ticket]:
        """The exact prompt count replaces the bound a ticket was sized by."""
        ticket.prompt_tokens = prompt_tokens
        ticket.exact = True
        if self.pool is not None and ticket.state in {"queued", "admitted"}:
            self._size(ticket, self.pool)
        return self._pump(now)

    def expire(self, now: float) -> list[tuple[Ticket, Verdict]]:
        """The waiting requests whose time is up, each with its 503. A hold whose length ran
        out ends (the caller pumps); one that reached its ``max`` ends answering 503 to
        everything that waited for it."""
        out: list[tuple[Ticket, Verdict]] = []
        if self.held_until is not None and now >= self.held_until:
            # the hold's own length ran out without a release: it ends, and they run (or wait
            # for the engine); only one that reached ``hold.max`` answers them 503
            started = self.held_since if self.held_since is not None else self.held_until
            if self.held_until >= started + self.limits.hold_max - 1e-6:
                for ticket in list(self.queue):
                    out.append((ticket, self._time_out(ticket, now, "hold_expired")))
            self._lift(now)
        if not self.held(now):
            for ticket in [t for t in self.queue if now >= t.deadline]:
                out.append((ticket, self._time_out(ticket, now, "max_wait")))
        return out

    # -- control (tunerd, the engine's health) ----------------------------------------
    def hold(self, now: float, seconds: float | None, reason: str = "restart") -> float:
        """Admit nothing for ``seconds`` (at most the hold's ``max``); returns when it ends.
        A second hold extends the first (never past ``max`` from the first's start)."""
        wanted = self.limits.hold_max if seconds is None else min(max(0.0, seconds), self.limits.hold_max)
        if self.held_since is None or not self.held(now):
            self.held_since = now
        limit = self.held_since + self.limits.hold_max
        self.held_until = min(max(self.held_until or now, now + wanted), limit)
        self.hold_reason = reason
        return self.held_until

    def release(self, now: float) -> list[Ticket]:
        """The hold ends: the time it lasted is given back to every waiting request's
        ``max_wait``, and they run as the pool allows."""
        self._lift(now)
        return self._pump(now)

    def retune(self, now: float, **changes: Any) -> list[Ticket]:
        """Change limits live (``GATE_KNOBS`` and the queue's); waiting requests are re-sized
        (a new long threshold re-lanes them) and run if the new limits allow."""
        limits = replace(self.limits, **changes)
        problems = limits.problems()
        if problems:
            raise ValueError("; ".join(problems))
        self.limits = limits
        if self.pool is not None:
            for ticket in [*self.queue, *self.running.values()]:
                self._size(ticket, self.pool)
        return self._pump(now)

    def set_pool(self, pool: Pool | None, now: float) -> list[tuple[Ticket, Verdict]]:
        """The engine's pool as it now reports it (None: the engine is not answering). The
        waiting requests are re-sized; one that no longer fits at all gets its 400."""
        self.pool = pool
        refused: list[tuple[Ticket, Verdict]] = []
        if pool is None:
            return refused
        for ticket in list(self.queue):
            verdict = self._too_large(ticket, pool)
            if verdict is not None:
                self.queue.remove(ticket)
                ticket.state = "done"
                self._count("rejected", "too_large")
                refused.append((ticket, verdict))
            else:
                self._size(ticket, pool)
        for ticket in self.running.values():
            self._size(ticket, pool)
        return refused

    def pump(self, now: float) -> list[Ticket]:
        """Admit what may run now (after any change the caller made)."""
        return self._pump(now)

    # -- answers -----------------------------------------------------------------------
    def drain_rate(self, now: float) -> float | None:
        """KV need completed per second over the last minute (None: nothing finished yet)."""
        while self._finished and self._finished[0][0] < now - DRAIN_WINDOW_S:
            self._finished.popleft()
        if not self._finished:
            return None
        start = max(now - DRAIN_WINDOW_S, self._since if self._since is not None else now)
        span = max(1.0, now - start)
        return sum(tokens for _, tokens in self._finished) / span

    def retry_after(self, now: float, need: int = 0) -> int:
        """Seconds until a request of ``need`` tokens could be admitted: the hold's end while
        held, else the queue ahead drained at the recent rate."""
        if self.held(now) and self.held_until is not None:
            return max(1, math.ceil(self.held_until - now))
        rate = self.drain_rate(now)
        if rate is None or rate <= 0:
            return DEFAULT_RETRY_S
        return max(1, min(MAX_RETRY_S, math.ceil((self.queued_tokens + need) / rate)))

    def snapshot(self, now: float) -> dict[str, Any]:
        """The gate's state for ``tunerd status`` and the control socket."""
        return {
            "held": self.held(now),
            "hold_reason": self.hold_reason if self.held(now) else None,
            "held_for_s": None
            if not self.held(now) or self.held_since is None
            else round(now - self.held_since, 3),
            "pool_tokens": None if self.pool is None else self.pool.tokens,
            "max_model_len": None if self.pool is None else self.pool.max_model_len,
            "budget_tokens": self.budget,
            "in_flight": len(self.running),
            "in_flight_tokens": self.in_flight_tokens,
            # the prompts in flight (an incident's "what was in flight"): their sum and the longest
            "in_flight_prompt_tokens": sum(t.prompt_tokens for t in self.running.values()),
            "longest_prompt_in_flight": max((t.prompt_tokens for t in self.running.values()), default=0),
            "long_in_flight": self.long_running,
            "queued": len(self.queue),
            "queued_tokens": self.queued_tokens,
            "limits": {
                "target_fraction": self.limits.target_fraction,
                "long_threshold": self.limits.long_threshold,
                "long_lane": self.limits.long_lane,
                "max_concurrency": self.limits.max_concurrency,
                "queue_requests": self.limits.queue_requests,
                "queue_tokens": self.limits.queue_tokens,
                "max_wait_s": self.limits.max_wait,
                "hold_max_s": self.limits.hold_max,
            },
            "decisions": {f"{outcome}/{reason}": n for (outcome, reason), n in sorted(self.counts.items())},
        }

    # -- inside ------------------------------------------------------------------------
    def _count(self, outcome: str, reason: str) -> None:
        self.counts[(outcome, reason)] += 1

    def _order(self) -> None:
        self.queue.sort(key=lambda t: (-t.priority, t.arrival, t.id))

    def _size(self, ticket: Ticket, pool: Pool) -> None:
        running = self.running.get(ticket.id) is ticket
        if running:
            self._running_need -= ticket.need
            self._running_long -= ticket.long
        ticket.need = need_tokens(ticket.prompt_tokens, ticket.max_tokens, pool)
        ticket.long = ticket.need >= self.limits.long_threshold
        if running:
            self._running_need += ticket.need
            self._running_long += ticket.long

    def _run(self, ticket: Ticket, now: float) -> None:
        ticket.state = "admitted"
        ticket.admitted_at = now
        self.running[ticket.id] = ticket
        self._running_need += ticket.need
        self._running_long += ticket.long
        self._count("admitted", "long" if ticket.long else "short")

    def _unrun(self, ticket: Ticket) -> None:
        if self.running.pop(ticket.id, None) is ticket:
            self._running_need -= ticket.need
            self._running_long -= ticket.long

    def _too_large(self, ticket: Ticket, pool: Pool) -> Verdict | None:
        if not ticket.exact:
            return None  # a bound may overstate: the exact count decides
        limit = pool.max_model_len
        if ticket.prompt_tokens >= limit or (
            ticket.max_tokens is not None and ticket.prompt_tokens + ticket.max_tokens > limit
        ):
            asked = ticket.prompt_tokens + (ticket.max_tokens or 0)
            return Verdict(
                "rejected",
                "too_large",
                status=400,
                message=(
                    f"This model's maximum context length is {limit} tokens. However, you requested "
                    f"{asked} tokens ({ticket.prompt_tokens} in the messages, {ticket.max_tokens or 0} in "
                    "the completion). Please reduce the length of the messages or completion."
                ),
            )
        need = need_tokens(ticket.prompt_tokens, ticket.max_tokens, pool)
        if need > pool.tokens:
            return Verdict(
                "rejected",
                "too_large",
                status=400,
                message=(
                    f"this request may need {need:,} tokens of KV cache (prompt {ticket.prompt_tokens:,} + "
                    f"output {need - ticket.prompt_tokens:,}), more than the engine's whole pool of "
                    f"{pool.tokens:,}: it could never run; lower max_tokens or shorten the prompt"
                ),
            )
        return None

    def _fits(self, ticket: Ticket, reserved: int, in_flight: int | None = None) -> bool:
        budget = self.budget
        if budget is None:
            return False
        if (self.in_flight_tokens if in_flight is None else in_flight) + reserved + ticket.need <= budget:
            return True
        return not self.running and reserved == 0  # over the budget, within the pool: alone

    def _at_cap(self) -> bool:
        cap = self.limits.max_concurrency
        return bool(cap) and len(self.running) >= cap

    def _blocked_by_count(self, ticket: Ticket, long_running: int | None = None) -> bool:
        if self._at_cap():
            return True
        lane = self.long_running if long_running is None else long_running
        return ticket.long and lane >= self.limits.long_lane

    def _pump(self, now: float) -> list[Ticket]:
        if self.held(now) or self.pool is None or not self.queue:
            return []
        admitted: list[Ticket] = []
        reserved = 0
        in_flight, long_running = self.in_flight_tokens, self.long_running  # kept as it admits
        for ticket in list(self.queue):
            if self._blocked_by_count(ticket, long_running):
                continue
            if self._fits(ticket, reserved, in_flight):
                self.queue.remove(ticket)
                self._run(ticket, now)
                admitted.append(ticket)
                in_flight += ticket.need
                long_running += ticket.long
            elif reserved == 0:
                reserved = ticket.need  # the first that waits for room: nothing may delay it
        return admitted

    def _why_waiting(self, ticket: Ticket, now: float) -> str:
        if self.held(now):
            return "held"
        if self.pool is None:
            return "engine_unknown"
        if self._blocked_by_count(ticket):
            return "long_lane" if ticket.long else "max_concurrency"
        return "kv_budget"

    def _time_out(self, ticket: Ticket, now: float, reason: str) -> Verdict:
        if ticket in self.queue:
            self.queue.remove(ticket)
        ticket.state = "done"
        self._count("timed_out", reason)
        waited = round(now - ticket.arrival, 1)
        what = "the engine's restart" if reason == "hold_expired" else "room in the KV pool"
        return Verdict(
            "timed_out",
            reason,
            status=503,
            message=f"waited {waited} s at the gate for {what}; retry later",
            retry_after=self.retry_after(now, ticket.need),
        )

    def _lift(self, now: float) -> None:
        if self.held_since is not None:
            for ticket in self.queue:
                ticket.deadline += max(0.0, now - max(self.held_since, ticket.arrival))
        self.held_until = None
        self.held_since = None
        self.hold_reason = ""
