"""The gate's data path on asyncio's transports: client connections in, engine connections out.

A proxy in front of an engine that answers in a third of a millisecond must itself cost a small
part of that, or it halves the box's throughput (docs/gate.md, "Why its own HTTP"). So the bytes
take the shortest way through: a client connection (:class:`ClientConnection`) reads a request's
head and body and hands the whole request to the gate's handler, a coroutine; the handler sends
it on a pooled keep-alive connection to the engine (:class:`EngineConnection`) and, once the
answer's head is in, either reads the (small) body whole or *pipes* it: from then on each piece
the engine sends is written to the client's transport from the engine connection's own
callback, verbatim when the framing allows, with no task, queue or copy in between.

Backpressure both ways: a client that reads slowly pauses the engine connection's reading
(so an answer is never held in memory), and a client that sends pipelined requests faster than
they are answered is paused past :data:`PIPELINE_CAP` bytes. A client that goes away cancels its
handler, which closes the engine connection: vLLM aborts the request and frees its KV blocks.

Deadlines are kept by one sweep a second (:meth:`Listener.sweep`), not a timer per read: a
request's head and body must arrive within :data:`REQUEST_S` of its first byte, an idle
keep-alive connection is closed after :data:`IDLE_S`, a client that reads nothing of its answer
for :data:`STALL_S` is cut off (its request in the engine with it), and so is an engine silent
mid-answer for ``read_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl as ssl_module
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

from tunerd.gate.h1 import (
    ERROR_HEADERS,
    MAX_HEAD,
    ChunkedDecoder,
    HttpError,
    RequestHead,
    ResponseHead,
    answer_head,
    error_body,
    find_head_end,
    parse_request_head,
    parse_response_head,
)

__all__ = [
    "ClientConnection",
    "ClientRequest",
    "EngineBroken",
    "EngineConnection",
    "EngineDropped",
    "EngineError",
    "EnginePool",
    "EngineRefused",
    "Listener",
]

REQUEST_S = 30.0  # a request's head and body arrive within this long of its first byte (slowloris)
IDLE_S = 75.0  # a client's keep-alive connection with no request is closed after this long
ENGINE_IDLE_S = 4.0  # a pooled engine connection is dropped after this long (uvicorn closes at 5 s)
PIPELINE_CAP = 1 << 20  # bytes of a client's next requests read ahead while one is served
LINGER_S = 5.0  # after refusing a body, what the client still sends is read and dropped this long
STALL_S = 300.0  # a client that reads nothing of its answer this long is cut off
CLOSING_S = 10.0  # a connection closing with bytes its client will not read is cut after this
MAX_REQUEST_CHUNKS = 8192  # a chunked request body in more chunks is refused (each costs Python)


def _nodelay(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


# -- the engine side ---------------------------------------------------------------------------
class EngineError(Exception):
    """The engine did not give a whole answer."""


class EngineRefused(EngineError):
    """No connection to the engine could be made: the request was not sent."""


class EngineDropped(EngineError):
    """The engine closed the connection before any byte of an answer."""


class EngineBroken(EngineError):
    """The engine's answer was malformed, cut off, or stalled past the read deadline."""


class EngineConnection(asyncio.Protocol):
    """One keep-alive connection to the engine, carrying one exchange at a time.

    After :meth:`send`, the future it returns resolves with the answer's head (:attr:`response`).
    The body then waits in memory until the handler says what to do with it: :meth:`read` (all
    of it), :meth:`hold_back` (until a test on what came passes), or :meth:`pipe` (to a client,
    as it comes). :meth:`release` ends the exchange: the connection goes back to the pool if the
    answer came whole and the engine keeps it open, and is closed otherwise (which is how a
    request the client gave up on is aborted)."""

    def __init__(self, pool: EnginePool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self.last_read = 0.0
        self.reading_paused = False
        self._reset()

    def _reset(self) -> None:
        self.method = "GET"
        self.head_future: asyncio.Future[ResponseHead] | None = None
        self.response: ResponseHead | None = None
        self._buffer = bytearray()
        self._got_any = False
        self._decoder: ChunkedDecoder | None = None
        self._left = 0  # bytes of a length-framed body still to come
        self.complete = False
        self.broken: EngineError | None = None
        self._raw: list[bytes] = []  # the body's bytes as they came (framing included)
        self._payload: list[bytes] = []  # the body's content (framing removed)
        self._payload_size = 0
        self._wake: asyncio.Future[None] | None = None
        self._client: ClientConnection | None = None
        self._dechunk = False
        self._tail_keep = 0
        self.tail = b""

    # asyncio's callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not asyncio's class
        _nodelay(transport)

    def data_received(self, data: bytes) -> None:
        self.last_read = time.monotonic()
        self._got_any = True
        if self.complete or self.head_future is None:  # bytes the engine sent unasked
            self._fail(EngineBroken("the engine sent bytes after its answer"))
            return
        if self.response is None:
            buffer = data if not self._buffer else bytes(self._buffer) + data
            position = 0
            try:
                while self.response is None:
                    end = find_head_end(buffer, position)
                    if end < 0:
                        self._buffer[:] = buffer[position:]
                        return
                    head = parse_response_head(buffer[position:end], self.method)
                    position = end
                    if 100 <= head.status < 200:  # an interim answer (100 Continue): the real one follows
                        continue
                    self.response = head
            except HttpError as error:
                self._fail(EngineBroken(f"a malformed answer head: {error}"))
                return
            if self.response.chunked:
                self._decoder = ChunkedDecoder()
            elif self.response.length is not None:
                self._left = self.response.length
            rest = buffer[position:]
            self._buffer.clear()
            if self.head_future is not None and not self.head_future.done():
                self.head_future.set_result(self.response)
            if self.response.length == 0:
                self._complete(rest)
                return
            data = rest
            if not data:
                return
        self._body(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
        if self.complete:
            return
        if self.response is not None and self.response.until_close:
            self._complete(b"")
            return
        if self.response is None and not self._got_any:
            self._fail(EngineDropped("the engine closed the connection before answering"))
        else:
            self._fail(EngineBroken("the engine closed the connection before its answer ended"))

    def pause_writing(self) -> None:  # a large request body on its way to the engine: nothing to do
        pass

    def resume_writing(self) -> None:
        pass

    def pause(self) -> None:
        """Stop reading the answer (the client reads slower than it comes)."""
        if not self.reading_paused and self.transport is not None and not self.closed:
            self.reading_paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.reading_paused and self.transport is not None and not self.closed:
            self.reading_paused = False
            self.transport.resume_reading()

    # the body
    def _body(self, data: bytes) -> None:
        payload: list[bytes]
        extra = b""
        if self._decoder is not None:
            try:
                payload = self._decoder.feed(data)
            except HttpError as error:
                self._fail(EngineBroken(f"a malformed chunked answer: {error}"))
                return
            if self._decoder.done:
                extra = self._decoder.extra
                data = data[: len(data) - len(extra)] if extra else data
        elif self.response is not None and self.response.until_close:
            payload = [data]
        else:
            if len(data) > self._left:
                extra = data[self._left :]
                data = data[: self._left]
            self._left -= len(data)
            payload = [data]
        client = self._client
        if client is not None:
            if self._dechunk:
                for piece in payload:
                    client.write(piece)
            else:
                client.write(data)
            if self._tail_keep:
                self.tail = (self.tail + b"".join(payload))[-self._tail_keep :]
        else:
            self._raw.append(data)
            for piece in payload:
                self._payload.append(piece)
                self._payload_size += len(piece)
        done = (self._decoder is not None and self._decoder.done) or (
            self._decoder is None
            and self.response is not None
            and not self.response.until_close
            and not self._left
        )
        if extra and self.response is not None:  # bytes past the end: not a connection to reuse
            self.response.keep_alive = False
        if done:
            self._complete(b"")
        elif client is None:
            self._poke()  # a reader waits on what came (piping, nobody does: no wake-up a piece)

    def _complete(self, rest: bytes) -> None:
        self.complete = True
        if rest and self.response is not None:
            self.response.keep_alive = False
        self._poke()

    def _fail(self, error: EngineError) -> None:
        if self.broken is None and not self.complete:
            self.broken = error
        if self.head_future is not None and not self.head_future.done():
            self.head_future.set_exception(error)
            self.head_future.exception()  # retrieved here: a caller that went away never asks
        self._poke()
        if self.transport is not None and not self.closed:
            self.transport.abort()

    def _poke(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    async def _wait(self) -> None:
        self._wake = asyncio.get_running_loop().create_future()
        try:
            await self._wake
        finally:
            self._wake = None

    # the handler's side
    def send(self, data: bytes, method: str) -> asyncio.Future[ResponseHead]:
        """Send one request; the future resolves with the answer's head."""
        assert self.transport is not None
        if self.closed or self.transport.is_closing():  # the engine closed it before the request went
            raise EngineDropped("the engine closed the connection before the request was sent")
        self._reset()
        self.method = method
        self.last_read = time.monotonic()
        self.head_future = asyncio.get_running_loop().create_future()
        self.pool.busy.add(self)
        self.transport.write(data)
        return self.head_future

    @property
    def payload(self) -> bytes:
        """The body's content that has come and not been piped yet."""
        return b"".join(self._payload)

    async def read(self, cap: int) -> bytes:
        """The whole body's content; :class:`EngineBroken` if it is cut off or over ``cap``."""
        while not self.complete:
            if self.broken is not None:
                raise self.broken
            if self._payload_size > cap:
                raise EngineBroken(f"an answer larger than {cap:,} bytes")
            await self._wait()
        return self.payload

    async def hold_back(self, enough: Callable[[bytes], bool], cap: int) -> bool:
        """Wait until what came passes ``enough`` or is over ``cap`` bytes (True), or the
        body ended (False). :class:`EngineBroken` if it is cut off first."""
        checked = 0  # what came up to here was tested already (whole lines only)
        while True:
            if self._payload_size > cap:
                return True
            payload = self.payload
            end = payload.rfind(b"\n") + 1
            if end > checked:
                if enough(payload[checked:end]):
                    return True
                checked = end
            if self.complete:
                return end < len(payload) and enough(payload[end:])
            if self.broken is not None:
                raise self.broken
            await self._wait()

    async def pipe(self, client: ClientConnection, *, dechunk: bool, tail: int = 0) -> None:
        """Write what came and what comes to ``client`` (as it came, or its content alone
        with ``dechunk``) until the body ends; :class:`EngineBroken` if it is cut off.
        ``tail``: keep the content's last bytes in :attr:`tail`."""
        held = b"".join(self._payload) if dechunk else b"".join(self._raw)
        if tail:
            self.tail = b"".join(self._payload)[-tail:]
        self._raw.clear()
        self._payload.clear()
        self._payload_size = 0
        if held:
            client.write(held)
        self._client = client
        self._dechunk = dechunk
        self._tail_keep = tail
        client.source = self
        if client.paused:
            self.pause()
        try:
            while not self.complete:
                if self.broken is not None:
                    raise self.broken
                await self._wait()
        finally:
            self._client = None
            client.source = None

    def release(self) -> None:
        """End the exchange: back to the pool when whole and reusable, else closed."""
        self.pool.busy.discard(self)
        reusable = (
            self.complete
            and self.broken is None
            and self.response is not None
            and self.response.keep_alive
            and not self.closed
        )
        self._client = None
        if reusable:
            self.resume()
            self.pool.put(self)
        else:
            self.close()

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()
        self.closed = True
        self.pool.forget(self)


class EnginePool:
    """Keep-alive connections to one engine (``host``, ``port``), opened as needed."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        connect_s: float = 5.0,
        read_s: float = 600.0,
        ssl: ssl_module.SSLContext | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.ssl = ssl
        self.connect_s = connect_s
        self.read_s = read_s
        self.idle: list[EngineConnection] = []
        self.busy: set[EngineConnection] = set()
        self.authority = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"

    def take(self) -> EngineConnection | None:
        """An idle connection, the most recently used, or None."""
        now = time.monotonic()
        while self.idle:
            connection = self.idle.pop()
            if not connection.closed and now - connection.idle_since < ENGINE_IDLE_S:
                assert connection.transport is not None
                if not connection.transport.is_closing():
                    return connection
            connection.close()
        return None

    async def connect(self) -> EngineConnection:
        """An idle connection, else a new one (:class:`EngineRefused` if none can be made)."""
        idle = self.take()
        if idle is not None:
            return idle
        loop = asyncio.get_running_loop()
        try:
            _, protocol = await asyncio.wait_for(
                loop.create_connection(lambda: EngineConnection(self), self.host, self.port, ssl=self.ssl),
                self.connect_s,
            )
        except (OSError, TimeoutError) as error:
            raise EngineRefused(f"{self.authority}: {error or type(error).__name__}") from error
        return protocol

    def put(self, connection: EngineConnection) -> None:
        connection.idle_since = time.monotonic()
        self.idle.append(connection)

    def forget(self, connection: EngineConnection) -> None:
        self.busy.discard(connection)
        if connection in self.idle:
            self.idle.remove(connection)

    def sweep(self, now: float) -> None:
        """Close idle connections the engine would soon close itself, and cut off answers
        silent past ``read_s``."""
        for connection in [c for c in self.idle if now - c.idle_since >= ENGINE_IDLE_S]:
            connection.close()
        for connection in [c for c in self.busy if not c.complete and now - c.last_read > self.read_s]:
            connection._fail(EngineBroken(f"the engine sent nothing for {self.read_s:g} s"))

    def close(self) -> None:
        for connection in [*self.idle, *self.busy]:
            connection.close()


# -- the client side ---------------------------------------------------------------------------
class ClientRequest:
    """A whole request from a client, as the handler gets it."""

    __slots__ = ("body", "head", "received")

    def __init__(self, head: RequestHead, body: bytes, received: float) -> None:
        self.head = head
        self.body = body
        self.received = received  # time.perf_counter() when its last byte came


Handler = Callable[[ClientRequest, "ClientConnection"], Awaitable[None]]


class ClientConnection(asyncio.Protocol):
    """One client's connection: requests read whole, one at a time; the answer written by the
    handler through :meth:`send` (a whole answer) or :meth:`start` and :meth:`write`.

    Nothing the client does grows the gate's memory without bound: the requests it pipelines
    are read ahead up to :data:`PIPELINE_CAP`, and the next is not started while the client
    has not read the last answer (its transport's buffer past the high-water mark)."""

    def __init__(self, listener: Listener) -> None:
        self.listener = listener
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.head: RequestHead | None = None
        self.decoder: ChunkedDecoder | None = None
        self.chunks: list[bytes] = []
        self.chunked_size = 0
        self.task: asyncio.Task[None] | None = None
        self.began: float | None = None  # when the request being read began (monotonic)
        self.last_seen = time.monotonic()
        self.method = "GET"  # the current request's
        self.started = False  # the current answer's head has been written
        self.keep = True  # the connection carries another request after this answer
        self.said_alive = False  # an HTTP/1.0 client asked to keep the connection: say it is kept
        self.paused = False  # the client reads slower than the answer comes
        self.paused_since = 0.0
        self.reading = True
        self.source: EngineConnection | None = None  # the engine connection piping to it
        self.lingering_until: float | None = None
        self.closing_since: float | None = None
        self.closed = False

    # asyncio's callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not asyncio's class
        _nodelay(transport)
        self.listener.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.listener.connections.discard(self)
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the client went away: its handler ends, and with it the engine's request

    def pause_writing(self) -> None:
        self.paused = True
        self.paused_since = time.monotonic()
        if self.source is not None:
            self.source.pause()

    def resume_writing(self) -> None:
        self.paused = False
        if self.source is not None:
            self.source.resume()
        elif self.task is None and not self.closed:
            self._next()  # the answer it was reading is out: its next request, if any

    def data_received(self, data: bytes) -> None:
        self.last_seen = time.monotonic()
        if self.lingering_until is not None:
            return  # a refused body's rest: read and dropped
        if (
            self.task is None
            and self.head is None
            and not self.buffer
            and not self.paused
            and self._whole(data)
        ):
            return  # the usual case: one whole request in one read
        self.buffer += data
        if self.began is None:
            self.began = self.last_seen
        if self.task is not None or self.paused:  # the next request waits, read ahead within a cap
            self._cap_reading()
            return
        self._advance()

    # reading requests
    def _cap_reading(self) -> None:
        if len(self.buffer) > PIPELINE_CAP and self.transport is not None and self.reading:
            self.reading = False
            self.transport.pause_reading()

    def _whole(self, data: bytes) -> bool:
        """Serve ``data`` if it is exactly one whole request with a length (no copy into the
        buffer); False, having done nothing, for anything else."""
        end = data.find(b"\r\n\r\n")
        if end < 0 or end + 4 > MAX_HEAD:
            return False
        try:
            head = parse_request_head(data[: end + 4])
        except HttpError:
            return False  # the general path says why
        length = head.content_length
        if head.chunked or head.expect_continue or length is None or end + 4 + length != len(data):
            return False
        if length > self.listener.max_body:
            return False
        self.began = None
        self._start(head, data[end + 4 :])
        return True

    def _start(self, head: RequestHead, body: bytes) -> None:
        self.keep = head.keep_alive
        self.said_alive = head.keep_alive and head.version == 10
        self.method = head.method
        self.started = False
        request = ClientRequest(head, body, time.perf_counter())
        self.task = asyncio.get_running_loop().create_task(self._serve(request))

    def _advance(self) -> None:
        listener = self.listener
        try:
            if self.head is None:
                while self.buffer[:2] == b"\r\n" or self.buffer[:1] == b"\n":
                    del self.buffer[: 2 if self.buffer[:1] == b"\r" else 1]  # blank lines before a request
                end = find_head_end(self.buffer)
                if end < 0:
                    if not self.buffer:
                        self.began = None
                    return
                self.head = parse_request_head(bytes(self.buffer[:end]))
                del self.buffer[:end]
                length = self.head.content_length
                if length is not None and length > listener.max_body:
                    self._refuse_body()
                    return
                if self.head.chunked:
                    self.decoder = ChunkedDecoder()
                if self.head.expect_continue and self.head.version >= 11 and self.transport is not None:
                    complete = length is not None and len(self.buffer) >= length
                    if not complete:  # (never to HTTP/1.0: RFC 9110 §10.1.1)
                        self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            head = self.head
            if self.decoder is not None:
                pieces = self.decoder.feed(bytes(self.buffer))
                self.chunks += pieces
                self.chunked_size += sum(map(len, pieces))
                self.buffer.clear()
                if self.chunked_size > listener.max_body:
                    self._refuse_body()
                    return
                if len(self.chunks) > MAX_REQUEST_CHUNKS:
                    raise HttpError(
                        400, f"a chunked body in more than {MAX_REQUEST_CHUNKS:,} chunks (send larger ones)"
                    )
                if not self.decoder.done:
                    return
                self.buffer += self.decoder.extra
                body = b"".join(self.chunks)
                self.chunks, self.decoder, self.chunked_size = [], None, 0
            else:
                length = head.content_length or 0
                if len(self.buffer) < length:
                    return
                body = bytes(self.buffer[:length])
                del self.buffer[:length]
        except HttpError as error:
            self._refuse(error.status, str(error))
            return
        self.head = None
        self.began = None if not self.buffer else time.monotonic()
        self._start(head, body)

    def _next(self) -> None:
        """After an answer: the next request, if the client is reading and has sent one."""
        if not self.reading and self.transport is not None and len(self.buffer) <= PIPELINE_CAP:
            self.reading = True
            self.transport.resume_reading()
        if self.buffer and not self.paused and not self.listener.draining:
            self._advance()

    async def _serve(self, request: ClientRequest) -> None:
        try:
            await self.listener.handler(request, self)
        except asyncio.CancelledError:
            self.keep = False
            raise
        except Exception as error:  # a bug of the gate's: the client gets a 500, the gate lives
            self.listener.on_error(error)
            if not self.started:
                self.send(500, [("content-type", "text/plain")], b"the gate failed on this request\n")
            self.keep = False
        finally:
            self.task = None
            self.last_seen = time.monotonic()  # idle from the answer's end, not the request's
            if self.began is not None:
                self.began = self.last_seen  # a pipelined request's time runs from here
            if not self.keep or self.closed or self.listener.draining:
                self.close()
            else:
                self._next()

    def _refuse(self, status: int, message: str) -> None:
        """An answer of the gate's own to a request it could not read; the connection ends."""
        self.keep = False
        self.send(status, ERROR_HEADERS, error_body(status, message, "BadRequestError"))
        self.close()

    def _refuse_body(self) -> None:
        """413 for a body over ``max_body``; what the client still sends is read and dropped for
        a moment, so the answer reaches it rather than a reset."""
        self.keep = False
        body = self.listener.too_large()
        self.send(413, ERROR_HEADERS, body)
        self.buffer.clear()
        self.head = None
        self.lingering_until = time.monotonic() + LINGER_S
        if self.transport is not None and self.transport.can_write_eof():
            self.transport.write_eof()

    # writing the answer
    @property
    def connection_header(self) -> str | None:
        """What the answer's ``Connection`` header says: close, keep-alive (to HTTP/1.0), or
        nothing (HTTP/1.1 keeps it by default)."""
        if not self.keep:
            return "close"
        return "keep-alive" if self.said_alive else None

    def send(
        self,
        status: int,
        headers: list[tuple[str, str]],
        body: bytes,
        *,
        close: bool = False,
    ) -> None:
        """A whole answer of the gate's own (to a HEAD: its head alone)."""
        if close:
            self.keep = False
        self.started = True
        if self.transport is not None and not self.transport.is_closing():
            head = answer_head(status, headers, length=len(body), connection=self.connection_header)
            self.transport.write(head if self.method == "HEAD" else head + body)

    def start(self, head: bytes) -> None:
        """An answer's head (from :func:`~tunerd.gate.h1.forward_head`), and what of its body
        is at hand; the rest follows by :meth:`write`."""
        self.started = True
        self.write(head)

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def close(self) -> None:
        """Close once what was written is sent (a client that never reads it is cut off by the
        sweep after :data:`CLOSING_S`)."""
        self.keep = False
        if self.closing_since is None:
            self.closing_since = time.monotonic()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def abort(self) -> None:
        """Cut the connection (the engine broke off mid-answer: so does the gate)."""
        self.keep = False
        if self.transport is not None:
            self.transport.abort()


class Listener:
    """The connections of one listening socket, the handler they serve, and their deadlines."""

    def __init__(
        self,
        handler: Handler,
        *,
        max_body: int,
        too_large: Callable[[], bytes],
        on_error: Callable[[Exception], Any],
    ) -> None:
        self.handler = handler
        self.max_body = max_body
        self.too_large = too_large
        self.on_error = on_error
        self.connections: set[ClientConnection] = set()
        self.server: asyncio.Server | None = None
        self.draining = False  # stopping: no new request is started

    def protocol(self) -> ClientConnection:
        return ClientConnection(self)

    async def listen(self, host: str, port: int) -> tuple[str, int]:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(self.protocol, host, port, backlog=1024, reuse_address=True)
        address = self.server.sockets[0].getsockname()
        return str(address[0]), int(address[1])

    def sweep(self, now: float) -> None:
        """Deadlines: a request not whole within :data:`REQUEST_S` of its first byte gets 408;
        an idle keep-alive connection past :data:`IDLE_S` and a lingering one are closed; one
        whose client has read nothing for :data:`STALL_S`, or that could not close for
        :data:`CLOSING_S`, is cut."""
        for connection in list(self.connections):
            if connection.closing_since is not None:
                if now - connection.closing_since > CLOSING_S:
                    connection.abort()
            elif connection.paused and now - connection.paused_since > STALL_S:
                connection.abort()  # its handler is cancelled: the engine's request too
            elif connection.lingering_until is not None:
                if now >= connection.lingering_until:
                    connection.close()
            elif connection.task is not None:
                continue
            elif connection.began is not None and now - connection.began > REQUEST_S:
                connection._refuse(408, f"the request did not arrive whole within {REQUEST_S:g} s")
            elif connection.began is None and now - connection.last_seen > IDLE_S:
                connection.close()

    def busy(self) -> int:
        return sum(1 for connection in self.connections if connection.task is not None)

    def stop_listening(self) -> None:
        self.draining = True
        if self.server is not None:
            self.server.close()

    def close_idle(self) -> None:
        for connection in list(self.connections):
            if connection.task is None:
                connection.close()

    async def close_all(self) -> None:
        """Cut every connection and wait for their handlers to end."""
        tasks = [c.task for c in self.connections if c.task is not None]
        for connection in list(self.connections):
            connection.abort()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.server is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.server.wait_closed(), 1.0)
