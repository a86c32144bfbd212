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

aiohttp serves and forwards: docs/gate.md has the measurement it was chosen by.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

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
from tunerd.logs import say
from tunerd.sdnotify import Notifier
from tunerd.sources.vllm_metrics import parse

__all__ = ["EngineGate", "GateServer", "limits_of", "run_gate"]

# Hop-by-hop headers (RFC 9110 §7.6.1) and those the gate recomputes: never forwarded.
HOP_HEADERS = frozenset(
    {
        "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
        "te", "trailer", "transfer-encoding", "upgrade", "host", "content-length",
    }
)  # fmt: skip
REFRESH_S = 5.0  # the pool and max_model_len are read this often while the engine answers
DOWN_REFRESH_S = 0.25  # and this often while it does not
TICK_S = 0.05  # how often waits are checked against their deadlines
CONTROL_TIMEOUT_S = 5.0  # the gate's own calls to the engine: /tokenize, /metrics, /v1/models
SMALL_ANSWER = 1 << 20  # a JSON answer up to this size is read whole (its usage checked)
REFINE_ABOVE = 0.5  # a bound is counted exactly once the needs in flight pass this share of the budget
COUNT_SAMPLE_S = 1.0  # and one bound a second, to keep the count's error measured
TAIL_BYTES = 8192  # what of a stream is kept to find its usage event
HELD_BACK_BYTES = 65536  # a stream's start held back until its first token, at most this much
BODY_TIMEOUT_S = 30.0  # a client has this long to send its body (slowloris)
UPSTREAM_READ_S = 600.0  # the engine may be silent this long mid-answer (a long prefill)
DRAIN_S = 30.0  # SIGTERM: requests in flight may finish for this long
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


def _error(status: int, message: str, kind: str, retry_after: int | None = None) -> web.Response:
    """An answer of the gate's own, shaped as vLLM's errors are (OpenAI's ``error`` object)."""
    headers = {"X-Tunerd-Gate": "1"}
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.json_response(body, status=status, headers=headers)


def _verdict_answer(verdict: Verdict) -> web.Response:
    kinds = {400: "BadRequestError", 429: "RateLimitError", 503: "ServiceUnavailableError"}
    status = verdict.status or 503
    return _error(status, verdict.message, kinds.get(status, "GateError"), verdict.retry_after)


def _forwarded(headers: Iterable[tuple[str, str]]) -> Iterator[tuple[str, str]]:
    for key, value in headers:
        if key.lower() not in HOP_HEADERS:
            yield key, value


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
        self.session: aiohttp.ClientSession | None = None
        self.address: str | None = None
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
    async def handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        if path == "/gate/metrics":
            return web.Response(body=generate_latest(self.registry()), content_type="text/plain")
        endpoint = ENDPOINTS.get(path.rstrip("/")) if request.method == "POST" else None
        if endpoint is not None:
            return await self._gated(request, endpoint)
        try:
            body = await self._body(request)
        except (web.HTTPRequestEntityTooLarge, TimeoutError) as error:
            return self._body_refused(error)
        return await self._pass(request, body, time.perf_counter(), None)

    def _body_refused(self, error: Exception) -> web.Response:
        """413 for a body over ``max_body``, 408 for one that did not arrive in time."""
        if isinstance(error, web.HTTPRequestEntityTooLarge):
            return _error(
                413,
                f"the request body is larger than the gate's max_body of {self.config.max_body:,} bytes",
                "BadRequestError",
            )
        return _error(408, f"the request body did not arrive within {BODY_TIMEOUT_S:g} s", "BadRequestError")

    async def _body(self, request: web.Request) -> bytes:
        """The whole body; a client that has not sent it within ``BODY_TIMEOUT_S`` gets 408
        (a body already received — the usual case — is read without a timer)."""
        if request.content.is_eof():
            return await request.read()
        return await asyncio.wait_for(request.read(), BODY_TIMEOUT_S)

    async def _gated(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        started = time.perf_counter()
        try:
            raw = await self._body(request)
        except (web.HTTPRequestEntityTooLarge, TimeoutError) as error:
            return self._body_refused(error)
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise CountError("the body must be a JSON object")
            plan = count_plan(endpoint, body)  # type: ignore[arg-type]
            priority = self._priority(request)
        except (ValueError, RecursionError) as error:  # JSONDecodeError and CountError are ValueErrors
            reason = f"malformed JSON: {error}" if isinstance(error, json.JSONDecodeError) else str(error)
            self.admission.counts[("rejected", "malformed")] += 1
            return _error(400, reason, "BadRequestError")
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
                    return _verdict_answer(verdict)
                self._waited.observe(waited)
                self._added.observe(counted - started)
                try:
                    return await self._pass(request, raw, started, ticket, stream=plan.stream)
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

    def _priority(self, request: web.Request) -> int:
        value = request.headers.get(self.config.priority_header)
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

    async def _pass(
        self,
        request: web.Request,
        body: bytes,
        started: float,
        ticket: Ticket | None,
        *,
        stream: bool = False,
    ) -> web.StreamResponse:
        """Forward ``request`` to the engine and its answer back, streamed as it comes."""
        assert self.session is not None
        url = f"{self.url}{request.rel_url}"
        headers = list(_forwarded(request.headers.items()))
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONTROL_TIMEOUT_S, sock_read=UPSTREAM_READ_S)
        try:
            for attempt in range(2):
                upstream_cm = self.session.request(
                    request.method,
                    url,
                    data=body or None,
                    headers=headers,
                    timeout=timeout,
                    allow_redirects=False,
                )
                try:
                    upstream = await upstream_cm.__aenter__()
                    break
                except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as error:
                    # the engine closed the connection before any answer (a busy vLLM does, now
                    # and then: a pooled connection it had dropped, or a reset): nothing of it
                    # reached the client, so the gate asks once more rather than fail it
                    if (
                        attempt
                        or isinstance(error, aiohttp.ClientConnectorError)
                        or self._cut_by_hold(ticket)
                    ):
                        raise
                    self.admission.counts[("retried", "engine_gave_no_answer")] += 1
        except aiohttp.ClientConnectorError as error:
            if ticket is None:
                return _error(
                    502, f"the engine at {self.url} is not answering: {error.os_error}", "BadGatewayError"
                )
            raise _EngineRefused from error
        except (aiohttp.ClientError, TimeoutError) as error:
            if self._cut_by_hold(ticket):
                raise _EngineRefused from error  # cut off by the restart the gate holds for: not served
            return _error(
                502, f"the engine at {self.url} gave no answer: {type(error).__name__}", "BadGatewayError"
            )
        if upstream.status == 503 and ticket is not None and self.admission.held(self.monotonic()):
            # admitted just before the hold, arrived after the SIGTERM: vLLM refused it
            # ("shutting down") without running it; it waits for the new engine instead
            await upstream_cm.__aexit__(None, None, None)
            raise _EngineRefused
        try:
            answer_headers = list(_forwarded(upstream.headers.items()))
            kind = upstream.headers.get("Content-Type", "")
            length = upstream.content_length
            if length is not None and length <= SMALL_ANSWER and "text/event-stream" not in kind:
                data = await upstream.read()
                if upstream.status == 200 and self._cut_by_hold(ticket) and not _has_tokens(data, plain=True):
                    raise _EngineRefused  # the drain answered it with nothing: it waits for the new engine
                if ticket is not None and ticket.exact and upstream.status == 200:
                    with contextlib.suppress(ValueError):
                        self._usage(ticket, usage_prompt_tokens(json.loads(data)))
                return web.Response(body=data, status=upstream.status, headers=answer_headers)
            response = web.StreamResponse(status=upstream.status, headers=answer_headers)
            if length is not None:
                response.content_length = length
            chunks = upstream.content.iter_any()
            first: list[bytes] = []
            if ticket is not None and upstream.status == 200 and "text/event-stream" in kind:
                # the answer's start is held back until it carries a token: a stream the engine's
                # drain ends with none (vLLM aborts what it had only just taken in) is not served
                # half — nothing has reached the client, so it waits for the new engine
                async for chunk in chunks:
                    first.append(chunk)
                    if _has_tokens(b"".join(first)) or sum(map(len, first)) > HELD_BACK_BYTES:
                        break
                else:
                    if self._cut_by_hold(ticket):
                        raise _EngineRefused
            await response.prepare(request)
            tail = b"".join(first)[-TAIL_BYTES:]
            for chunk in first:
                await response.write(chunk)
            async for chunk in chunks:
                await response.write(chunk)
                if ticket is not None:
                    tail = (tail + chunk)[-TAIL_BYTES:]
            await response.write_eof()
            if ticket is not None and ticket.exact and stream:
                self._usage(ticket, stream_usage(tail))
            return response
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, TimeoutError):
            if request.transport is not None:
                request.transport.close()  # the engine broke off mid-answer: so does the gate
            raise
        finally:
            await upstream_cm.__aexit__(None, None, None)

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
            assert gate.config is not None
            app = web.Application(client_max_size=gate.config.max_body)
            app.router.add_route("*", "/{tail:.*}", gate.handle)
            runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
            await runner.setup()
            host, _, port = gate.config.listen.rpartition(":")
            site = web.TCPSite(runner, host.strip("[]"), int(port), backlog=1024, reuse_address=True)
            await site.start()
            self.runners.append(runner)
            address = runner.addresses[0]
            gate.address = (
                f"{address[0]}:{address[1]}" if ":" not in address[0] else f"[{address[0]}]:{address[1]}"
            )
            say("gate_listening", engine=gate.name, address=gate.address, upstream=gate.url)
            self.tasks.append(asyncio.create_task(gate.watch_engine()))
        self.tasks.append(asyncio.create_task(self._ticker()))
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
        for runner in self.runners:
            await runner.shutdown()
        deadline = time.monotonic() + drain
        while any(gate.admission.running for gate in self.gates.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        for task in self.tasks:
            task.cancel()
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
