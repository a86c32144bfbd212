"""Deliver alerts to the configured sinks, off the daemon's threads, and never lose one silently.

:meth:`Dispatcher.submit` never blocks on a sink: it files the alert with every sink that
wants it (``to:`` names, ``min_severity``) and returns (its only I/O is the dead-letter file,
for a flood beyond what may wait). Each sink has a *lane* with a
thread of its own, so a sink that hangs delays only itself. A lane:

- keeps the service's rate limit (its module's :data:`RATE`, or the sink's ``rate:``): alerts
  that arrive while it is spent wait, and when it frees they go out together as one digest
  message — grouped, never dropped;
- groups repeats: the same condition (fingerprint and status) again within ``group_window`` of
  its last message waits out the window and then goes as one message with a count;
- retries what the service says to retry (5xx, 429, a rate-limit code in the body, a timeout,
  a refused connection) with capped exponential backoff and jitter, waiting at least what the
  service asked (``Retry-After``); after ``max_attempts``, or at once for a refusal for good,
  the alerts go to the dead-letter file (JSON lines: when, which sink, why, the alerts);
- re-sends firing alerts every :data:`~tunerd.notify.sinks.alertmanager.RESEND_S` for
  Alertmanager (which expires what is not re-sent) until they resolve;
- on :meth:`close`, whatever could not be sent in time is written to the dead-letter file;
- holds at most ``max_waiting`` distinct conditions waiting: a flood beyond that goes to the
  dead-letter file at once, so memory stays bounded and nothing is dropped unsaid;
- never dies: each POST has a total deadline (``timeout``, connect to the last byte) and reads
  at most :data:`REPLY_MAX_BYTES` of the reply (:func:`tunerd.sources.http.exchange`); a reply
  parser never raises (:mod:`tunerd.notify.sink`); and anything that still raises while a
  batch is being sent — a URL httpx refuses, a bug — ends with that batch in the dead-letter
  file with the reason, and the lane goes on with the next. Every alert ends delivered or
  dead-lettered.

No URL and no secret is ever logged or written: a reply or an error that quotes them has
them replaced by ``[redacted]``.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from tunerd.clock import SYSTEM_CLOCK, Clock
from tunerd.notify.alert import Alert, iso, severity_at_least
from tunerd.notify.sink import Outcome, Rate, Request, SinkModule, Target, wait_seconds
from tunerd.notify.sinks import alertmanager, module
from tunerd.paths import open_private, private_dir
from tunerd.sources.http import DeadlineExceeded, ResponseTooLarge, exchange

__all__ = ["DEAD_LETTER", "REPLY_MAX_BYTES", "Delivery", "Dispatcher", "redactor", "send"]

DEAD_LETTER = "notify-dead-letter.jsonl"
REPLY_MAX_BYTES = 64 << 10  # a service's reply is a few hundred bytes
_MAX_BATCH = 50  # alerts in one digest message
_LONGEST_WAIT = 3600.0  # a lane looks again at least this often, whatever it waits for


def redactor(target: Target) -> Callable[[str], str]:
    """Replaces the sink's URL (and its path and query, where tokens live) and its secret."""
    try:
        parts = urlsplit(target.url)
        needles = [target.url, parts.path, parts.query, target.secret or ""]
    except ValueError:  # a URL that does not even split: all of it is the needle
        needles = [target.url, target.secret or ""]
    needles = sorted({needle for needle in needles if len(needle) >= 6}, key=len, reverse=True)

    def redact(text: str) -> str:
        for needle in needles:
            text = text.replace(needle, "[redacted]")
        return text

    return redact


@dataclass
class Delivery:
    """What a lane did, for status, metrics and tests."""

    sent_messages: int = 0
    sent_alerts: int = 0  # counted with their repeats
    retries: int = 0
    dead_alerts: int = 0
    last_error: str | None = None


@dataclass
class _Sending:
    """A lane thread's own: the batch it is sending and its tries."""

    resend_at: float
    batch: list[Alert] = field(default_factory=list)
    attempt: int = 0
    not_before: float = 0.0


@dataclass
class _Lane:
    target: Target
    module: SinkModule
    rate: Rate
    pending: dict[tuple[str, str], Alert] = field(default_factory=dict)  # (fingerprint, status) → alert
    held: dict[tuple[str, str], Alert] = field(default_factory=dict)  # repeats waiting out the window
    last_sent: dict[tuple[str, str], float] = field(default_factory=dict)
    firing: dict[str, Alert] = field(default_factory=dict)  # Alertmanager: re-sent until resolved
    sends: deque[float] = field(default_factory=deque)  # monotonic times of recent messages
    delivery: Delivery = field(default_factory=Delivery)
    thread: threading.Thread | None = None
    in_flight: list[Alert] = field(default_factory=list)  # the batch being posted now
    abandoned: threading.Event = field(default_factory=threading.Event)  # close() dead-lettered the
    # batch in flight: the thread must not again


class Dispatcher:
    def __init__(
        self,
        targets: Sequence[Target],
        state_dir: str | os.PathLike[str],
        *,
        say: Callable[..., None] = lambda event, **fields: None,
        rates: Mapping[str, Rate] | None = None,
        group_window: float = 300.0,
        max_attempts: int = 6,
        backoff_base: float = 2.0,
        backoff_max: float = 300.0,
        timeout: float = 10.0,
        max_waiting: int = 1000,
        resend: float = alertmanager.RESEND_S,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.say = say
        self.group_window = group_window
        self.max_attempts = max_attempts
        self.backoff_base = backoff_base
        self.backoff_max = backoff_max
        self.timeout = timeout
        self.max_waiting = max_waiting  # distinct conditions waiting per sink: memory stays bounded
        self.resend = resend  # Alertmanager: how often a firing alert is sent again
        # the system's, even when the daemon follows the simulator's: signatures carry real time
        self.clock = clock
        self.dead_letter = Path(state_dir) / DEAD_LETTER
        self._lock = threading.Condition()
        self._closing = False
        self._dead_lock = threading.Lock()
        self.lanes = {
            target.name: _Lane(
                target, module(target.kind), (rates or {}).get(target.name) or module(target.kind).RATE
            )
            for target in targets
        }

    # -- the daemon's side -------------------------------------------------------------------
    def start(self) -> Dispatcher:
        for lane in self.lanes.values():
            lane.thread = threading.Thread(
                target=self._work, args=(lane,), name=f"tunerd-notify-{lane.target.name}", daemon=True
            )
            lane.thread.start()
        return self

    def submit(self, alert: Alert, to: Sequence[str] | None = None) -> list[str]:
        """File ``alert`` with the sinks that want it (all, or those ``to`` names); the names.
        Never blocks."""
        chosen, overflow = [], []
        with self._lock:
            for name, lane in self.lanes.items():
                if to is not None and name not in to:
                    continue
                if not severity_at_least(alert.severity, lane.target.min_severity):
                    continue
                if not self._file(lane, alert, self.clock.monotonic()):
                    overflow.append(lane)
                chosen.append(name)
            self._lock.notify_all()
        for lane in overflow:  # a flood: written down after the lock, never dropped
            self._dead(lane, [alert], f"more than {self.max_waiting} alerts waiting for this sink", 0)
        return chosen

    def close(self, timeout: float = 5.0) -> None:
        """Give the lanes ``timeout`` seconds to finish what is due; dead-letter the rest."""
        deadline = self.clock.monotonic() + timeout
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        for lane in self.lanes.values():
            if lane.thread is not None:
                lane.thread.join(max(0.0, deadline - self.clock.monotonic()))
        with self._lock:
            for lane in self.lanes.values():
                left = [*lane.pending.values(), *lane.held.values()]
                lane.pending.clear()
                lane.held.clear()
                if left:
                    self._dead(lane, left, "tunerd stopped before it could be sent", 0)
                if lane.in_flight and lane.thread is not None and lane.thread.is_alive():
                    lane.abandoned.set()  # a send still hanging: its answer will never be read
                    self._dead(lane, lane.in_flight, "tunerd stopped while sending (it may have arrived)", 0)
            self._lock.notify_all()  # a lane still waiting on its rate limit finds nothing left

    # -- filing ---------------------------------------------------------------------------
    def _file(self, lane: _Lane, alert: Alert, now: float) -> bool:
        """File ``alert`` in ``lane``; False when too many conditions already wait there."""
        key = (alert.fingerprint, alert.status)
        if alert.status == "resolved":
            lane.held.pop((alert.fingerprint, "firing"), None)  # stale repeats of what cleared
            lane.firing.pop(alert.fingerprint, None)
        elif lane.module is alertmanager:
            lane.firing[alert.fingerprint] = alert
        if key in lane.pending:
            lane.pending[key] = _merged(lane.pending[key], alert)
        elif key not in lane.held and len(lane.pending) + len(lane.held) >= self.max_waiting:
            return False
        elif (last := lane.last_sent.get(key)) is not None and now - last < self.group_window:
            lane.held[key] = _merged(lane.held[key], alert) if key in lane.held else alert
        else:
            lane.pending[key] = alert
        return True

    # -- a lane's thread ----------------------------------------------------------------------
    def _work(self, lane: _Lane) -> None:
        sending = _Sending(resend_at=self.clock.monotonic() + self.resend)
        while True:
            try:
                if not self._turn(lane, sending):
                    return
            except Exception as error:  # a bug, or something no one foresaw: never the thread's end
                if not self._survive(lane, sending, error):
                    return

    def _turn(self, lane: _Lane, sending: _Sending) -> bool:
        """Wait until the lane may send, send one message, file what came of it; False when
        the lane is done (tunerd stops)."""
        with self._lock:
            while True:
                now = self.clock.monotonic()
                self._release_held(lane, now)
                if lane.module is alertmanager and now >= sending.resend_at:
                    sending.resend_at = now + self.resend
                    for fingerprint, alert in lane.firing.items():
                        lane.pending.setdefault((fingerprint, "firing"), alert)
                if lane.abandoned.is_set():
                    return False
                if self._closing and (sending.attempt or not (lane.pending or sending.batch)):
                    if sending.batch:  # a batch waiting for its next try: no time left for it
                        self._dead(
                            lane,
                            sending.batch,
                            f"tunerd stopped; last try: {lane.delivery.last_error}",
                            sending.attempt,
                        )
                        sending.batch = []
                    return False  # close() dead-letters what is still pending
                wait = self._wait(lane, now, sending.not_before, bool(sending.batch or lane.pending))
                if wait <= 0:
                    break
                if lane.module is alertmanager and lane.firing:
                    wait = min(wait, max(0.0, sending.resend_at - now))
                self._lock.wait(min(wait, _LONGEST_WAIT))
            taken = sorted(lane.pending.values(), key=lambda alert: alert.time)[
                : _MAX_BATCH - len(sending.batch)
            ]
            for alert in taken:
                del lane.pending[(alert.fingerprint, alert.status)]
            sending.batch = _merge_into(sending.batch, taken)
            lane.sends.append(now)
            lane.in_flight = sending.batch
        batch = sending.batch
        outcome = self._send(lane, batch)
        with self._lock:
            lane.in_flight = []
            if lane.abandoned.is_set():
                return False
        now = self.clock.monotonic()
        if outcome.ok:
            with self._lock:
                for alert in batch:
                    lane.last_sent[(alert.fingerprint, alert.status)] = now
                lane.delivery.sent_messages += 1
                lane.delivery.sent_alerts += sum(alert.count for alert in batch)
            attempt = sending.attempt
            sending.batch, sending.attempt, sending.not_before = [], 0, 0.0
            self._say(
                "notify_sent",
                sink=lane.target.name,
                alerts=sum(a.count for a in batch),
                messages=1,
                attempt=attempt + 1,
            )
            return True
        sending.attempt += 1
        attempt = sending.attempt
        lane.delivery.last_error = outcome.detail
        if outcome.kind == "permanent" or attempt >= self.max_attempts:
            why = (
                outcome.detail
                if outcome.kind == "permanent"
                else f"gave up after {attempt} tries: {outcome.detail}"
            )
            with self._lock:
                self._dead(lane, batch, why, attempt)
            sending.batch, sending.attempt, sending.not_before = [], 0, 0.0
            return True
        backoff = min(self.backoff_max, self.backoff_base * 2.0 ** min(attempt - 1, 64)) * random.uniform(
            0.8, 1.2
        )
        delay = max(backoff, wait_seconds(outcome.retry_after) or 0.0)
        lane.delivery.retries += 1
        self._say(
            "notify_retry",
            sink=lane.target.name,
            reason=outcome.detail,
            attempt=attempt,
            wait=round(delay, 2),
        )
        sending.not_before = now + delay
        return True

    def _survive(self, lane: _Lane, sending: _Sending, error: Exception) -> bool:
        """After ``error`` escaped a turn: the batch being sent goes to the dead-letter file
        with the reason, and the lane goes on (False: it is to end)."""
        why = f"tunerd failed while sending: {type(error).__name__}: {error}"
        with self._lock:
            lost = sending.batch or lane.in_flight
            lane.in_flight = []
            attempts = sending.attempt + 1
            sending.batch, sending.attempt, sending.not_before = [], 0, 0.0
            lane.delivery.last_error = redactor(lane.target)(why)
            if lane.abandoned.is_set():
                return False  # close() wrote the batch down already
            if lost:
                self._dead(lane, lost, why, attempts)
            if not self._closing:
                self._lock.wait(1.0)  # a fault that repeats costs a look a second, not a core
        self._say("notify_error", sink=lane.target.name, reason=redactor(lane.target)(why))
        return True

    def _wait(self, lane: _Lane, now: float, not_before: float, work: bool) -> float:
        """Seconds until the lane may send (inf: nothing to send)."""
        if not work:
            return min((self._hold_ends(lane) or float("inf")) - now, float("inf"))
        while lane.sends and now - lane.sends[0] >= lane.rate.seconds:
            lane.sends.popleft()
        rate_free = lane.sends[0] + lane.rate.seconds if len(lane.sends) >= lane.rate.messages else now
        return max(not_before, rate_free) - now

    def _hold_ends(self, lane: _Lane) -> float | None:
        ends = [lane.last_sent[key] + self.group_window for key in lane.held if key in lane.last_sent]
        return min(ends) if ends else None

    def _release_held(self, lane: _Lane, now: float) -> None:
        for key in [key for key in lane.held if now - lane.last_sent.get(key, 0.0) >= self.group_window]:
            alert = lane.held.pop(key)
            lane.pending[key] = _merged(lane.pending[key], alert) if key in lane.pending else alert

    def _send(self, lane: _Lane, batch: list[Alert]) -> Outcome:
        return send(lane.target, batch, self.clock.now(), self.timeout)

    def _say(self, event: str, **fields: object) -> None:
        """Say it; a logger that raises never takes a lane down."""
        with contextlib.suppress(Exception):
            self.say(event, **fields)

    def _dead(self, lane: _Lane, alerts: Sequence[Alert], why: str, attempts: int) -> None:
        """Append the alerts to the dead-letter file (the caller holds the lock); never raises."""
        count = sum(alert.count for alert in alerts)
        lane.delivery.dead_alerts += count
        record = {
            "time": iso(self.clock.now()),
            "sink": lane.target.name,
            "kind": lane.target.kind,
            "reason": redactor(lane.target)(why),
            "attempts": attempts,
            "alerts": [alert.to_dict() for alert in alerts],
        }
        try:
            with self._dead_lock:
                private_dir(self.dead_letter.parent)
                with open_private(self.dead_letter, "a", encoding="utf-8") as out:  # 0600: alert texts
                    out.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
                    out.flush()
                    os.fsync(out.fileno())
        except (OSError, ValueError, TypeError, RecursionError) as error:  # not even the file: say it
            self._say(
                "notify_dead_letter_failed",
                sink=lane.target.name,
                reason=str(error),
                titles=[alert.title for alert in alerts],
            )
        self._say("notify_dead_letter", sink=lane.target.name, reason=record["reason"], alerts=count)

    def deliveries(self) -> dict[str, Delivery]:
        return {name: replace(lane.delivery) for name, lane in self.lanes.items()}


def send(target: Target, alerts: Sequence[Alert], now: float, timeout: float = 10.0) -> Outcome:
    """One POST of ``alerts`` to ``target`` — all of it within ``timeout`` seconds, at most
    :data:`REPLY_MAX_BYTES` of reply read — and what its reply means. Never raises: what
    cannot be sent at all (a URL httpx refuses, a message that cannot be built) is refused for
    good, with why. No URL or secret in the outcome's detail."""
    try:
        sink = module(target.kind)
        request: Request = sink.build(alerts, target, now)
        reply = exchange(
            "POST",
            request.url,
            deadline=timeout,
            max_bytes=REPLY_MAX_BYTES,
            content=request.body,
            headers=request.headers,
        )
        outcome = sink.classify(reply.status, reply.headers, reply.body)
    except (httpx.TimeoutException, DeadlineExceeded):
        outcome = Outcome("retry", f"no complete answer within {timeout:g} s")
    except ResponseTooLarge as error:
        outcome = Outcome("retry", f"a reply too large: {error}")
    except (httpx.InvalidURL, httpx.UnsupportedProtocol) as error:
        outcome = Outcome("permanent", f"the URL cannot be used: {type(error).__name__}: {error}")
    except httpx.HTTPError as error:
        outcome = Outcome("retry", f"{type(error).__name__}: {error}")
    except Exception as error:  # a bug in building or reading: said, and this message dead-lettered
        outcome = Outcome("permanent", f"could not be sent: {type(error).__name__}: {error}")
    return replace(
        outcome, detail=redactor(target)(outcome.detail)[:1000], retry_after=wait_seconds(outcome.retry_after)
    )


def _merged(older: Alert, newer: Alert) -> Alert:
    """The same condition again: the newer text, the first time, the counts added."""
    return replace(newer, time=older.time, count=older.count + newer.count)


def _merge_into(batch: list[Alert], taken: list[Alert]) -> list[Alert]:
    by_key: dict[tuple[str, str], Alert] = {(a.fingerprint, a.status): a for a in batch}
    for alert in taken:
        key = (alert.fingerprint, alert.status)
        by_key[key] = _merged(by_key[key], alert) if key in by_key else alert
    return list(by_key.values())
