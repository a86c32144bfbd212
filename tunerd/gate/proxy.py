"""``tunerd gate``: the KV-aware admission proxy in front of each engine (DESIGN §9.1).

One asyncio process serves every engine that has a ``gate:`` block: a listener per engine
that clients talk to, and one control socket tunerd talks to. Its own process (and systemd
unit), so the data path lives through tunerd's restarts.

For ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/responses`` the gate reads the
body, counts the request's KV need (:mod:`tunerd.gate.counting`), and asks the admission
(:mod:`tunerd.gate.admission`) whether it runs now, waits, or is answered by the gate itself
(400/429/503 with ``Retry-After``). Admitted requests are forwarded as they are, the answer
streamed back chunk by chunk as it comes; a client that goes away closes the upstream
request, which makes vLLM abort it. Everything else (``/metrics``, ``/health``,
``/v1/models``, …) passes straight through. An engine that refuses connections (restarting,
crashed) makes requests wait for it, like a hold, up to their ``max_wait``.

The engine's pool (``num_gpu_blocks × block_size``, from ``vllm:cache_config_info``) and
``max_model_len`` (from ``/v1/models``) are read every few seconds, and at once after the
engine comes back. The gate's own metrics are at ``/gate/metrics`` on each listener and at
``/metrics`` on the control socket.

The clients' requests travel on the gate's own HTTP/1.1 data path (:mod:`tunerd.gate.wire` on
:mod:`tunerd.gate.h1`): asyncio's transports, the answer's bytes piped from the engine's
connection to the client's as they come. aiohttp serves the control socket and makes the gate's
own calls (the pool, ``/tokenize``). docs/gate.md has the measurements the data path was built
by.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import ssl
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tunerd.config import Config, GateConfig
from tunerd.gate.admission import GATE_KNOBS, Admission, Limits, Pool, Ticket, Verdict, need_tokens
from tunerd.gate.counting import (
    ENDPOINTS,
    CountError,
    CountPlan,
    count_plan,
    stream_usage,
    tokenize_count,
    usage_prompt_tokens,
)
from tunerd.gate.h1 import ERROR_HEADERS, error_body, forward_head, request_bytes
from tunerd.gate.wire import (
    ClientConnection,
    ClientRequest,
    EngineConnection,
    EngineDropped,
    EngineError,
    EnginePool,
    EngineRefused,
    Listener,
)
from tunerd.logs import say
from tunerd.sdnotify import Notifier
from tunerd.sources.vllm_metrics import parse

__all__ = ["EngineGate", "GateServer", "limits_of", "run_gate"]

REFRESH_S = 5.0  # the pool and max_model_len are read this often while the engine answers
DOWN_REFRESH_S = 0.25  # and this often while it does not
TICK_S = 0.05  # how often waits are checked against their deadlines
CONTROL_TIMEOUT_S = 5.0  # the gate's own calls to the engine: /tokenize, /metrics, /v1/models
SMALL_ANSWER = 1 << 20  # a JSON answer up to this size is read whole (its usage checked)
REFINE_ABOVE = 0.5  # a bound is counted exactly once the needs in flight pass this share of the budget
COUNT_SAMPLE_S = 1.0  # and one bound a second, to keep the count's error measured
TAIL_BYTES = 8192  # what of a stream is kept to find its usage event
HELD_BACK_BYTES = 65536  # a stream's start held back until its first token, at most this much
UPSTREAM_READ_S = 600.0  # the engine may be silent this long mid-answer (a long prefill)
DRAIN_S = 30.0  # SIGTERM: requests in flight may finish for this long
SWEEP_S = 1.0  # the data path's deadlines are checked this often
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0)
WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


def limits_of(config: GateConfig) -> Limits:
    """The admission limits a ``gate:`` block sets."""
    return Limits(
        target_fraction=config.target_fraction,
        long_threshold=config.long_threshold,
        long_lane=config.long_lane,
        max_concurrency=config.max_concurrency,
        queue_requests=config.queue.max_requests,
        queue_tokens=config.queue.max_tokens,
        max_wait=config.queue.max_wait,
        hold_max=config.hold.max,
    )


def _send_error(
    client: ClientConnection, status: int, message: str, kind: str, retry_after: int | None = None
) -> None:
    headers = ERROR_HEADERS if retry_after is None else [*ERROR_HEADERS, ("retry-after", str(retry_after))]
    client.send(status, headers, error_body(status, message, kind))


def _send_verdict(client: ClientConnection, verdict: Verdict) -> None:
    kinds = {400: "BadRequestError", 429: "RateLimitError", 503: "ServiceUnavailableError"}
    status = verdict.status or 503
    _send_error(client, status, verdict.message, kinds.get(status, "GateError"), verdict.retry_after)


@dataclass
class _Waiter:
    ticket: Ticket
    future: asyncio.Future[Verdict]


class EngineGate:
    """The gate of one engine: its admission, its waiters, its view of the engine."""

    def __init__(
        self,
        name: str,
        url: str,
        config: GateConfig,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.url = url.rstrip("/")
        self.config = config
        self.monotonic = monotonic
        self.admission = Admission(limits=limits_of(config))
        self.waiters: dict[int, _Waiter] = {}
        self.engine_up: bool | None = None  # None: not asked yet
        self.ids = itertools.count(1)
        self.sampled_at = -COUNT_SAMPLE_S  # when a bound was last counted exactly to measure the count
        self.session: aiohttp.ClientSession | None = None  # the gate's own calls: pool, /tokenize
        parts = urlsplit(self.url)
        secure = parts.scheme == "https"
        self.engine = EnginePool(  # the clients' requests go on these
            parts.hostname or "127.0.0.1",
            parts.port or (443 if secure else 80),
            connect_s=CONTROL_TIMEOUT_S,
            read_s=UPSTREAM_READ_S,
            ssl=ssl.create_default_context() if secure else None,
        )
        self.prefix = parts.path.rstrip("/")
        self._priority_header = config.priority_header.lower()
        self.address: str | None = None
        self.listener: Listener | None = None
        self.wakeup = asyncio.Event()  # set when the engine should be read again at once
        self.wait_seconds = Histogram(
            "tunerd_gate_wait_seconds", "Time requests waited at the gate before they ran.",
            ["engine"], buckets=WAIT_BUCKETS, registry=None,
        )  # fmt: skip
        self.added_seconds = Histogram(
            "tunerd_gate_added_latency_seconds",
            "The gate's own time per request before it is forwarded (counting included, waiting not).",
            ["engine"], buckets=LATENCY_BUCKETS, registry=None,
        )  # fmt: skip
        self.count_error = Histogram(
            "tunerd_gate_count_error_ratio",
            "The gate's exact prompt count against usage.prompt_tokens: (gate - engine) / engine.",
            ["engine"], buckets=(-0.05, -0.02, -0.01, -0.001, 0.001, 0.01, 0.02, 0.05), registry=None,
        )  # fmt: skip
        self.last_count_error: float | None = None
        # this engine's series, looked up once (a label lookup a request adds up at 1,000/s)
        self._waited = self.wait_seconds.labels(name)
        self._added = self.added_seconds.labels(name)
        self._count_error = self.count_error.labels(name)

    # -- the engine --------------------------------------------------------------------
    async def read_engine(self) -> bool:
        """Read the pool and ``max_model_len``; True when the engine answered both."""
        assert self.session is not None
        timeout = aiohttp.ClientTimeout(total=CONTROL_TIMEOUT_S)
        try:
            async with self.session.get(f"{self.url}/metrics", timeout=timeout) as answer:
                page = (await _read_capped(answer, 8 << 20)).decode("utf-8", "replace")
                metrics_ok = answer.status == 200
            async with self.session.get(f"{self.url}/v1/models", timeout=timeout) as answer:
                models = json.loads(await _read_capped(answer, 1 << 20)) if answer.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError, UnicodeError, _TooLarge):
            self._engine_down()
            return False
        snapshot = parse(page) if metrics_ok else None
        tokens = None if snapshot is None else snapshot.kv_cache_size_tokens
        block = None if snapshot is None else snapshot.block_size
        max_model_len = None
        if isinstance(models, dict) and isinstance(models.get("data"), list) and models["data"]:
            first = models["data"][0]
            value = first.get("max_model_len") if isinstance(first, dict) else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                max_model_len = value
        if not tokens or not block or not max_model_len:
            self._engine_down()
            return False
        pool = Pool(num_blocks=tokens // block, block_size=block, max_model_len=max_model_len)
        now = self.monotonic()
        if pool != self.admission.pool or not self.engine_up:
            for ticket, verdict in self.admission.set_pool(pool, now):
                self._answer(ticket, verdict)
            if not self.engine_up:
                say("gate_engine_up", engine=self.name, pool_tokens=pool.tokens, max_model_len=max_model_len)
        self.engine_up = True
        self._wake(self.admission.pump(now))
        return True

    def _engine_down(self) -> None:
        if self.engine_up is not False:
            say("gate_engine_unavailable", engine=self.name, url=self.url)
        self.engine_up = False
        self.admission.set_pool(None, self.monotonic())

    async def watch_engine(self) -> None:
        """Read the engine every few seconds; while it does not answer, four times a second."""
        while True:
            await self.read_engine()
            self.wakeup.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wakeup.wait(), REFRESH_S if self.engine_up else DOWN_REFRESH_S)

    def tick(self) -> None:
        """Waits past their deadline (and a hold past its max) get their 503."""
        for ticket, verdict in self.admission.expire(self.monotonic()):
            self._answer(ticket, verdict)
        if not self.admission.held(self.monotonic()) and self.admission.queue:
            self._wake(self.admission.pump(self.monotonic()))

    # -- waking requests ---------------------------------------------------------------
    def _wake(self, tickets: Iterable[Ticket]) -> None:
        for ticket in tickets:
            waiter = self.waiters.pop(ticket.id, None)
            if waiter is not None and not waiter.future.done():
                waiter.future.set_result(Verdict("admitted", "long" if ticket.long else "short"))

    def _answer(self, ticket: Ticket, verdict: Verdict) -> None:
        waiter = self.waiters.pop(ticket.id, None)
        if waiter is not None and not waiter.future.done():
            waiter.future.set_result(verdict)

    async def _wait(self, ticket: Ticket) -> Verdict:
        future: asyncio.Future[Verdict] = asyncio.get_running_loop().create_future()
        self.waiters[ticket.id] = _Waiter(ticket, future)
        return await future

    # -- control -----------------------------------------------------------------------
    def hold(self, seconds: float | None, reason: str) -> dict[str, Any]:
        until = self.admission.hold(self.monotonic(), seconds, reason)
        say("gate_held", engine=self.name, seconds=round(until - self.monotonic(), 1), reason=reason)
        return self.snapshot()

    def release(self) -> dict[str, Any]:
        now = self.monotonic()
        was = self.admission.held(now)
        self._wake(self.admission.release(now))
        if was:
            say("gate_released", engine=self.name, waiting=len(self.admission.queue))
        self.wakeup.set()  # the engine may be a new one: read its pool now
        return self.snapshot()

    def retune(self, changes: dict[str, Any]) -> dict[str, Any]:
        before = {knob: getattr(self.admission.limits, knob) for knob in changes}
        self._wake(self.admission.retune(self.monotonic(), **changes))
        say("gate_retuned", engine=self.name, before=before, after=changes)
        return self.snapshot()

    def snapshot(self) -> dict[str, Any]:
        data = self.admission.snapshot(self.monotonic())
        return {
            "engine": self.name,
            "listen": self.address or self.config.listen,
            "upstream": self.url,
            "engine_up": self.engine_up,
            "last_count_error_ratio": self.last_count_error,
            **data,
        }

    # -- requests ----------------------------------------------------------------------
    async def handle(self, request: ClientRequest, client: ClientConnection) -> None:
        """One whole request from a client (the listener's handler)."""
        head = request.head
        path = head.path
        if path == "/gate/metrics":
            page = generate_latest(self.registry())
            client.send(200, [("content-type", "text/plain; version=0.0.4; charset=utf-8")], page)
            return
        endpoint = ENDPOINTS.get(path.rstrip("/")) if head.method == "POST" else None
        if endpoint is not None:
            await self._gated(request, client, endpoint)
            return
        await self._pass(request, client, None)

    def failed(self, error: Exception) -> None:
        """A request the gate itself failed on (a bug): said, answered 500, the gate serves on."""
        say("gate_request_failed", engine=self.name, error=f"{type(error).__name__}: {error}"[:500])

    def too_large(self) -> bytes:
        """The body of the 413 a request over ``max_body`` gets."""
        message = f"the request body is larger than the gate's max_body of {self.config.max_body:,} bytes"
        return error_body(413, message, "BadRequestError")

    async def _gated(self, request: ClientRequest, client: ClientConnection, endpoint: str) -> None:
        started = request.received
        try:
            body = json.loads(request.body)
            if not isinstance(body, dict):
                raise CountError("the body must be a JSON object")
            plan = count_plan(endpoint, body)  # type: ignore[arg-type]
            priority = self._priority(request)
        except (ValueError, RecursionError) as error:  # JSONDecodeError and CountError are ValueErrors
            reason = f"malformed JSON: {error}" if isinstance(error, json.JSONDecodeError) else str(error)
            self.admission.counts[("rejected", "malformed")] += 1
            _send_error(client, 400, reason, "BadRequestError")
            return
        ticket = Ticket(
            id=next(self.ids),
            prompt_tokens=plan.exact if plan.exact is not None else plan.bound,
            max_tokens=plan.max_tokens,
            arrival=self.monotonic(),
            priority=priority,
            exact=plan.exact is not None,
        )
        refine: asyncio.Task[None] | None = None
        if not ticket.exact:
            if self.admission.could_admit(ticket, ticket.arrival):
                # the bound fits: it goes ahead on the bound, and is counted exactly on the side
                # once the pool is half spoken for (below that no decision depends on it), and
                # one a second always (the count's error stays measured; a share of requests
                # would add that share of /tokenize calls to a busy engine)
                sample = ticket.arrival - self.sampled_at >= COUNT_SAMPLE_S
                if sample:
                    self.sampled_at = ticket.arrival
                if sample or self._pool_pressed(ticket):
                    refine = asyncio.create_task(self._refine(ticket, plan))
            else:
                await self._count_exactly(ticket, plan)
        counted = time.perf_counter()
        try:
            verdict = self.admission.offer(ticket, self.monotonic())
            self._wake(self.admission.announce())
            waited = 0.0
            while True:
                if verdict.outcome == "queued":
                    queued_at = time.perf_counter()
                    verdict = await self._wait(ticket)
                    waited += time.perf_counter() - queued_at
                if verdict.outcome != "admitted":
                    _send_verdict(client, verdict)
                    return
                self._waited.observe(waited)
                self._added.observe(counted - started)
                try:
                    await self._pass(request, client, ticket, stream=plan.stream)
                    return
                except _EngineRefused:  # nothing was sent: wait for the engine, then try again
                    self.admission.requeue(ticket, self.monotonic())
                    self._engine_down()
                    self.wakeup.set()
                    verdict = Verdict("queued", "engine_unknown")
        finally:
            if refine is not None:
                refine.cancel()
            self.waiters.pop(ticket.id, None)
            self._wake(self.admission.done(ticket, self.monotonic()))

    def _pool_pressed(self, ticket: Ticket) -> bool:
        """Whether the needs in flight, with ``ticket``'s bound, pass half the budget: from
        there on a bound's excess could keep another request waiting."""
        budget = self.admission.budget
        if budget is None:
            return True
        pool = self.admission.pool
        bound = need_tokens(ticket.prompt_tokens, ticket.max_tokens, pool) if pool is not None else 0
        return self.admission.in_flight_tokens + bound > budget * REFINE_ABOVE

    def _priority(self, request: ClientRequest) -> int:
        value = request.head.header(self._priority_header)
        if value is None:
            return 0
        try:
            priority = int(value.strip())
        except ValueError:
            raise CountError(
                f"{self.config.priority_header} must be a whole number, got {value[:20]!r}"
            ) from None
        return max(-100, min(100, priority))

    async def _tokenize(self, plan: CountPlan) -> int | None:
        if plan.tokenize is None or self.session is None:
            return None
        try:
            async with self.session.post(
                f"{self.url}/tokenize",
                json=plan.tokenize,
                timeout=aiohttp.ClientTimeout(total=CONTROL_TIMEOUT_S),
            ) as answer:
                if answer.status != 200:
                    return None
                return tokenize_count(json.loads(await _read_capped(answer, 64 << 20)))
        except (aiohttp.ClientError, TimeoutError, ValueError, _TooLarge):
            return None

    async def _count_exactly(self, ticket: Ticket, plan: CountPlan) -> None:
        count = await self._tokenize(plan)
        if count is not None:
            ticket.prompt_tokens = count
            ticket.exact = True

    async def _refine(self, ticket: Ticket, plan: CountPlan) -> None:
        count = await self._tokenize(plan)
        if count is not None and ticket.state in {"queued", "admitted"}:
            self._wake(self.admission.count_exact(ticket, count, self.monotonic()))

    async def _send(self, request: ClientRequest, ticket: Ticket | None) -> EngineConnection:
        """The request sent to the engine, its answer's head in: a connection the engine
        closed before any byte of answer is asked once more (a busy vLLM does, now and then: a
        pooled connection it had dropped, or a reset); nothing of it reached the client."""
        data = request_bytes(request.head, self.engine.authority, request.body, prefix=self.prefix)
        for attempt in range(2):
            connection = self.engine.take() or await self.engine.connect()  # EngineRefused: none sent
            try:
                await connection.send(data, request.head.method)
                return connection
            except EngineDropped:
                connection.release()
                if attempt or self._cut_by_hold(ticket):
                    raise
                self.admission.counts[("retried", "engine_gave_no_answer")] += 1
            except BaseException:
                connection.release()
                raise
        raise AssertionError("unreachable")

    async def _pass(
        self,
        request: ClientRequest,
        client: ClientConnection,
        ticket: Ticket | None,
        *,
        stream: bool = False,
    ) -> None:
        """Forward ``request`` to the engine and its answer back, streamed as it comes."""
        try:
            connection = await self._send(request, ticket)
        except EngineRefused as error:
            if ticket is None:
                _send_error(
                    client, 502, f"the engine at {self.url} is not answering: {error}", "BadGatewayError"
                )
                return
            raise _EngineRefused from error
        except EngineError as error:
            if self._cut_by_hold(ticket):
                raise _EngineRefused from error  # cut off by the restart the gate holds for: not served
            _send_error(client, 502, f"the engine at {self.url} gave no answer: {error}", "BadGatewayError")
            return
        try:
            await self._answer_from(connection, request, client, ticket, stream)
        except EngineError as error:
            if client.started:
                client.abort()  # the engine broke off mid-answer: so does the gate
            elif self._cut_by_hold(ticket):
                raise _EngineRefused from error  # nothing reached the client: it waits for the new engine
            else:
                _send_error(client, 502, f"the engine at {self.url} broke off: {error}", "BadGatewayError")
        finally:
            connection.release()

    async def _answer_from(
        self,
        connection: EngineConnection,
        request: ClientRequest,
        client: ClientConnection,
        ticket: Ticket | None,
        stream: bool,
    ) -> None:
        answer = connection.response
        assert answer is not None
        if answer.status == 503 and ticket is not None and self.admission.held(self.monotonic()):
            # admitted just before the hold, arrived after the SIGTERM: vLLM refused it
            # ("shutting down") without running it; it waits for the new engine instead
            raise _EngineRefused
        events = "text/event-stream" in answer.content_type
        if answer.length is not None and answer.length <= SMALL_ANSWER and not events:
            data = await connection.read(SMALL_ANSWER)
            if answer.status == 200 and self._cut_by_hold(ticket) and not _has_tokens(data, plain=True):
                raise _EngineRefused  # the drain answered it with nothing: it waits for the new engine
            if ticket is not None and ticket.exact and answer.status == 200:
                with contextlib.suppress(ValueError):
                    self._usage(ticket, usage_prompt_tokens(json.loads(data)))
            client.start(forward_head(answer, length=len(data), connection=client.connection_header) + data)
            return
        # a gated stream's start is held back until it carries a token: a stream the engine's
        # drain ends with none (vLLM aborts what it had only just taken in) is not served
        # half — nothing has reached the client, so it waits for the new engine
        if (
            ticket is not None
            and answer.status == 200
            and events
            and not await connection.hold_back(_has_tokens, HELD_BACK_BYTES)
            and self._cut_by_hold(ticket)
        ):
            raise _EngineRefused
        # the body as it comes: its own framing kept where the client can read it (HTTP/1.1
        # and a length or chunks), else its content until the connection closes
        verbatim = not answer.until_close and (request.head.version >= 11 or not answer.chunked)
        if not verbatim:
            client.keep = False
        head = forward_head(
            answer,
            length=answer.length if verbatim else None,
            chunked=answer.chunked and verbatim,
            connection=client.connection_header,
        )
        client.start(head)
        keep_tail = TAIL_BYTES if ticket is not None and ticket.exact and stream else 0
        await connection.pipe(client, dechunk=not verbatim, tail=keep_tail)
        if keep_tail:
            self._usage(ticket, stream_usage(connection.tail))  # type: ignore[arg-type]

    def _cut_by_hold(self, ticket: Ticket | None) -> bool:
        """A gated request the engine failed while the gate holds for its restart."""
        return ticket is not None and self.admission.held(self.monotonic())

    def _usage(self, ticket: Ticket, engine_count: int | None) -> None:
        if engine_count:
            error = (ticket.prompt_tokens - engine_count) / engine_count
            self.last_count_error = round(error, 6)
            self._count_error.observe(error)

    # -- metrics -----------------------------------------------------------------------
    def collect(self) -> Iterator[Any]:
        snap = self.admission.snapshot(self.monotonic())
        gauges = [
            ("tunerd_gate_queue_requests", "Requests waiting at the gate.", snap["queued"]),
            (
                "tunerd_gate_queue_tokens",
                "KV need of the requests waiting at the gate (tokens).",
                snap["queued_tokens"],
            ),
            (
                "tunerd_gate_in_flight_requests",
                "Requests the gate has let through, not yet finished.",
                snap["in_flight"],
            ),
            (
                "tunerd_gate_in_flight_tokens",
                "KV need of the requests in flight (tokens).",
                snap["in_flight_tokens"],
            ),
            (
                "tunerd_gate_budget_tokens",
                "The KV need the gate admits up to (pool × target_fraction).",
                snap["budget_tokens"],
            ),
            (
                "tunerd_gate_pool_tokens",
                "The engine's KV pool as it reports it (tokens).",
                snap["pool_tokens"],
            ),
            ("tunerd_gate_held", "1 while tunerd holds new requests (an engine restart).", int(snap["held"])),
            ("tunerd_gate_engine_up", "1 while the engine answers the gate.", int(bool(self.engine_up))),
        ]
        for name, text, value in gauges:
            family = GaugeMetricFamily(name, text, labels=["engine"])
            if value is not None:
                family.add_metric([self.name], float(value))
            yield family
        limits = GaugeMetricFamily("tunerd_gate_limit", "The gate's live limits.", labels=["engine", "limit"])
        for knob in GATE_KNOBS:
            limits.add_metric([self.name, knob], float(getattr(self.admission.limits, knob)))
        yield limits
        decisions = CounterMetricFamily(
            "tunerd_gate_decisions",
            "The gate's decisions, by outcome and reason.",
            labels=["engine", "outcome", "reason"],
        )
        for (outcome, reason), count in sorted(self.admission.counts.items()):
            decisions.add_metric([self.name, outcome, reason], float(count))
        yield decisions
        for histogram in (self.wait_seconds, self.added_seconds, self.count_error):
            yield from histogram.collect()

    def registry(self) -> CollectorRegistry:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collect(self.collect))
        return registry


class _TooLarge(Exception):
    """An answer of the engine's to the gate's own call was larger than its cap."""


async def _read_capped(answer: aiohttp.ClientResponse, cap: int) -> bytes:
    """The whole body of ``answer``, or :class:`_TooLarge` past ``cap`` bytes."""
    parts: list[bytes] = []
    size = 0
    async for chunk in answer.content.iter_any():
        size += len(chunk)
        if size > cap:
            raise _TooLarge(f"more than {cap:,} bytes")
        parts.append(chunk)
    return b"".join(parts)


def _has_tokens(data: bytes, plain: bool = False) -> bool:
    """Whether an answer (SSE events, or one JSON body with ``plain``) carries anything of the
    engine's work: a choice with text or content, or one that finished other than ``abort``. An
    answer of another shape counts as work (it is never held back)."""
    bodies = (
        [data] if plain else [line[5:].strip() for line in data.splitlines() if line.startswith(b"data:")]
    )
    for body in bodies:
        if body == b"[DONE]":
            continue
        try:
            event = json.loads(body)
        except ValueError:
            return True
        if not isinstance(event, dict) or not isinstance(event.get("choices"), list):
            return True
        for choice in event["choices"]:
            if not isinstance(choice, dict):
                return True
            delta = choice.get("delta")
            message = choice.get("message")
            delta = delta if isinstance(delta, dict) else {}
            message = message if isinstance(message, dict) else {}
            if choice.get("text") or delta.get("content") or message.get("content"):
                return True
            if choice.get("finish_reason") not in (None, "abort"):
                return True
    return False


class _EngineRefused(Exception):
    """The engine refused the connection: the request was not sent."""


class _Collect(Collector):
    def __init__(self, source: Callable[[], Iterator[Any]]) -> None:
        self.source = source

    def collect(self) -> Iterator[Any]:
        return self.source()


class GateServer:
    """Every engine's gate, and the control socket, in one event loop."""

    def __init__(self, config: Config, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.gates: dict[str, EngineGate] = {}
        for engine in config.gated():
            assert engine.gate is not None
            self.gates[engine.name] = EngineGate(engine.name, engine.url, engine.gate, monotonic)
        self.control_path = config.gate_control()
        self.runners: list[web.AppRunner] = []
        self.tasks: list[asyncio.Task[None]] = []
        self.session: aiohttp.ClientSession | None = None
        self.stopping = asyncio.Event()

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False, trust_env=False)
        for gate in self.gates.values():
            gate.session = self.session
            listener = Listener(
                gate.handle,
                max_body=gate.config.max_body,
                too_large=gate.too_large,
                on_error=gate.failed,
            )
            host, _, port = gate.config.listen.rpartition(":")
            address = await listener.listen(host.strip("[]"), int(port))
            gate.listener = listener
            gate.address = (
                f"{address[0]}:{address[1]}" if ":" not in address[0] else f"[{address[0]}]:{address[1]}"
            )
            say("gate_listening", engine=gate.name, address=gate.address, upstream=gate.url)
            self.tasks.append(asyncio.create_task(gate.watch_engine()))
        self.tasks.append(asyncio.create_task(self._ticker()))
        self.tasks.append(asyncio.create_task(self._sweeper()))
        await self._control()

    async def _control(self) -> None:
        app = web.Application(client_max_size=1 << 20)
        app.router.add_get("/status", self._status)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/engines/{engine}/hold", self._hold)
        app.router.add_post("/engines/{engine}/release", self._release)
        app.router.add_post("/engines/{engine}/limits", self._limits)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        self.control_path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.control_path.unlink()  # a socket left by a gate that died
        site = web.UnixSite(runner, str(self.control_path))
        await site.start()
        os.chmod(self.control_path, 0o660)
        self.runners.append(runner)
        say("gate_control_listening", path=str(self.control_path))

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            for gate in self.gates.values():
                gate.tick()

    async def _sweeper(self) -> None:
        """The data path's deadlines, once a second (wire.py): slow clients, idle connections,
        an engine silent mid-answer."""
        while True:
            await asyncio.sleep(SWEEP_S)
            now = time.monotonic()
            for gate in self.gates.values():
                if gate.listener is not None:
                    gate.listener.sweep(now)
                gate.engine.sweep(now)

    def _gate(self, request: web.Request) -> EngineGate:
        name = request.match_info["engine"]
        gate = self.gates.get(name)
        if gate is None:
            raise web.HTTPNotFound(
                text=json.dumps(
                    {"error": f"no gate for engine {name!r} (gated: {', '.join(self.gates) or 'none'})"}
                ),
                content_type="application/json",
            )
        return gate

    async def _json_body(self, request: web.Request) -> dict[str, Any]:
        try:
            data = await request.json() if request.can_read_body else {}
        except ValueError:
            data = None
        if not isinstance(data, dict):
            raise web.HTTPBadRequest(
                text=json.dumps({"error": "expected a JSON object"}), content_type="application/json"
            )
        return data

    async def _status(self, request: web.Request) -> web.Response:
        return web.json_response({"engines": {name: gate.snapshot() for name, gate in self.gates.items()}})

    async def _metrics(self, request: web.Request) -> web.Response:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collect(lambda: _merged(self.gates.values())))
        return web.Response(body=generate_latest(registry), content_type="text/plain")

    async def _hold(self, request: web.Request) -> web.Response:
        gate = self._gate(request)
        data = await self._json_body(request)
        seconds = data.get("seconds")
        if seconds is not None and (
            isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds < 0
        ):
            return web.json_response({"error": "seconds must be a number of seconds, 0 or more"}, status=400)
        reason = str(data.get("reason", "restart"))[:200]
        return web.json_response(gate.hold(None if seconds is None else float(seconds), reason))

    async def _release(self, request: web.Request) -> web.Response:
        return web.json_response(self._gate(request).release())

    async def _limits(self, request: web.Request) -> web.Response:
        gate = self._gate(request)
        data = await self._json_body(request)
        unknown = sorted(set(data) - set(GATE_KNOBS))
        if unknown or not data:
            return web.json_response(
                {"error": f"expected some of {', '.join(GATE_KNOBS)}; got {', '.join(unknown) or 'nothing'}"},
                status=400,
            )
        for knob, value in data.items():
            numeric = isinstance(value, int | float) and not isinstance(value, bool)
            if not numeric or (knob != "target_fraction" and not isinstance(value, int)):
                return web.json_response(
                    {"error": f"{knob}: expected a number, got {value!r}"[:200]}, status=400
                )
        try:
            return web.json_response(gate.retune(data))
        except ValueError as error:
            return web.json_response({"error": str(error)}, status=400)

    async def stop(self, drain: float = DRAIN_S) -> None:
        """Stop listening, let requests in flight finish for up to ``drain`` seconds, close."""
        listeners = [gate.listener for gate in self.gates.values() if gate.listener is not None]
        for listener in listeners:
            listener.stop_listening()
            listener.close_idle()
        for runner in self.runners:
            await runner.shutdown()
        deadline = time.monotonic() + drain
        while any(listener.busy() for listener in listeners) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            for listener in listeners:
                listener.close_idle()  # a keep-alive connection whose answer just ended
        for task in self.tasks:
            task.cancel()
        for listener in listeners:
            await listener.close_all()
        for gate in self.gates.values():
            gate.engine.close()
        for runner in self.runners:
            await runner.cleanup()
        if self.session is not None:
            await self.session.close()
        with contextlib.suppress(FileNotFoundError):
            self.control_path.unlink()


def _merged(gates: Iterable[EngineGate]) -> Iterator[Any]:
    """Every gate's families, one family per name (Prometheus wants each name once)."""
    families: dict[str, Any] = {}
    for gate in gates:
        for family in gate.collect():
            if family.name in families:
                families[family.name].samples.extend(family.samples)
            else:
                families[family.name] = family
    yield from families.values()


async def _serve(config: Config) -> int:
    server = GateServer(config)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await server.start()
    except OSError as error:
        say("gate_start_failed", error=str(error))
        await server.stop(0)
        return 1
    notifier = Notifier()
    notifier.ready(f"gating {', '.join(server.gates)}")
    await stop.wait()
    notifier.stopping()
    say("gate_stopping", in_flight=sum(len(g.admission.running) for g in server.gates.values()))
    await server.stop()
    return 0


def run_gate(config: Config) -> int:
    """``tunerd gate``: serve until SIGTERM or SIGINT; 0 after a clean stop."""
    if not config.gated():
        say("gate_start_failed", error="no engine in the config has a gate: block (docs/gate.md)")
        return 2
    return asyncio.run(_serve(config))
