"""The gate's data path (tunerd.gate.wire) on real loopback sockets: a listener whose handler
forwards through an :class:`EnginePool` to a small engine written here with asyncio's streams,
and clients that speak raw bytes — what a client and vLLM's uvicorn do on the wire, including
the awkward parts (pipelining, chunked bodies, ``Expect``, slow and vanishing peers).

Deadlines are driven by calling the sweep with a later ``now``: no test waits for a timer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from tests.fuzzing import fuzz_settings
from tunerd.gate.h1 import find_head_end, forward_head, parse_response_head, request_bytes
from tunerd.gate.wire import (
    ENGINE_IDLE_S,
    IDLE_S,
    MAX_REQUEST_CHUNKS,
    PIPELINE_CAP,
    REQUEST_S,
    STALL_S,
    ClientConnection,
    ClientRequest,
    EngineBroken,
    EngineDropped,
    EngineError,
    EnginePool,
    EngineRefused,
    Listener,
)

HTTP = Path(__file__).parents[2] / "data" / "vllm-http"
Answer = Callable[[bytes, asyncio.StreamWriter], Awaitable[None]]


def run(coroutine: Awaitable[Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coroutine, 30))


@dataclass
class Engine:
    """A loopback engine: each request read whole, answered by ``answer``; what it saw kept."""

    answer: Answer
    requests: list[bytes] = field(default_factory=list)
    connections: int = 0
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    port: int = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                request = head + await reader.readexactly(length)
                self.requests.append(request)
                await self.answer(request, writer)
                if writer.is_closing():
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.closed.set()
            writer.close()


async def forward(pool: EnginePool, request: ClientRequest, client: ClientConnection) -> None:
    """A handler as the gate's is, without admission: send, then read small answers whole and
    pipe the rest (its own framing kept for HTTP/1.1 clients)."""
    try:
        connection = await pool.connect()
    except EngineRefused:
        client.send(502, [], b"refused")
        return
    try:
        try:
            answer = await connection.send(
                request_bytes(request.head, pool.authority, request.body), request.head.method
            )
        except EngineError as error:
            client.send(502, [], type(error).__name__.encode())
            return
        if answer.length is not None and answer.length < 4096:
            data = await connection.read(4096)
            client.start(forward_head(answer, length=len(data), connection=client.connection_header) + data)
            return
        verbatim = not answer.until_close and (request.head.version >= 11 or not answer.chunked)
        client.keep = client.keep and verbatim
        client.start(
            forward_head(
                answer,
                length=answer.length if verbatim else None,
                chunked=answer.chunked and verbatim,
                connection=client.connection_header,
            )
        )
        try:
            await connection.pipe(client, dechunk=not verbatim, tail=64)
        except EngineBroken:
            client.abort()
    finally:
        connection.release()


@dataclass
class World:
    engine: Engine
    pool: EnginePool
    listener: Listener
    port: int
    errors: list[Exception]

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", self.port)

    def sweep(self, after: float) -> None:
        now = time.monotonic() + after
        self.listener.sweep(now)
        self.pool.sweep(now)


@asynccontextmanager
async def world(answer: Answer, max_body: int = 1 << 20) -> AsyncIterator[World]:
    engine = Engine(answer)
    server = await asyncio.start_server(engine.serve, "127.0.0.1", 0)
    engine.port = server.sockets[0].getsockname()[1]
    pool = EnginePool("127.0.0.1", engine.port, read_s=60)
    errors: list[Exception] = []
    listener = Listener(
        lambda request, client: forward(pool, request, client),
        max_body=max_body,
        too_large=lambda: b'{"error": "too large"}',
        on_error=errors.append,
    )
    _, port = await listener.listen("127.0.0.1", 0)
    try:
        yield World(engine, pool, listener, port, errors)
    finally:
        listener.stop_listening()
        await listener.close_all()
        pool.close()
        server.close()


def plain(body: bytes = b'{"ok": true}', extra: bytes = b"") -> Answer:
    async def answer(request: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n" + extra)
        writer.write(b"content-length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()

    return answer


def recorded(name: str, pause: float = 0.0) -> Answer:
    """Answer with a real vLLM's recorded bytes, written a chunk at a time."""
    raw = (HTTP / name).read_bytes()

    async def answer(request: bytes, writer: asyncio.StreamWriter) -> None:
        end = find_head_end(raw)
        writer.write(raw[:end])
        for piece in raw[end:].split(b"\r\n\r\n"):
            writer.write(piece + b"\r\n\r\n" if piece else b"")
            await writer.drain()
            if pause:
                await asyncio.sleep(pause)

    return answer


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One answer read the way a client does (length, chunked, or until close)."""
    head = await reader.readuntil(b"\r\n\r\n")
    answer = parse_response_head(head, "POST")
    headers = dict(answer.headers)
    if answer.length is not None:
        return answer.status, headers, await reader.readexactly(answer.length)
    if not answer.chunked:
        return answer.status, headers, await reader.read()
    body = b""
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        data = await reader.readexactly(size + 2)
        if not size:
            return answer.status, headers, body
        body += data[:-2]


def post(body: bytes, path: str = "/v1/completions", headers: str = "", version: str = "1.1") -> bytes:
    return (
        f"POST {path} HTTP/{version}\r\nHost: gate\r\nContent-Type: application/json\r\n{headers}"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def test_a_request_goes_through_and_the_engine_connection_is_kept_for_the_next() -> None:
    async def scenario() -> None:
        async with world(plain(b'{"n": 1}', b"server: uvicorn\r\n")) as w:
            reader, writer = await w.connect()
            for _ in range(3):
                writer.write(
                    post(b'{"prompt": "hi"}', headers="X-Request-Id: 7\r\nConnection: keep-alive\r\n")
                )
                status, headers, body = await read_answer(reader)
                assert (status, body, headers["server"]) == (200, b'{"n": 1}', "uvicorn")
            assert w.engine.connections == 1  # one pooled connection carried all three
            sent = w.engine.requests[0].decode()
            assert sent.startswith(f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:{w.engine.port}\r\n")
            assert "X-Request-Id: 7" in sent
            assert "keep-alive" not in sent
            assert "gate" not in sent
            writer.close()

    run(scenario())


def test_pipelined_requests_are_answered_in_order() -> None:
    async def scenario() -> None:
        async def echo(request: bytes, writer: asyncio.StreamWriter) -> None:
            body = request.split(b"\r\n\r\n", 1)[1]
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))

        async with world(echo) as w:
            reader, writer = await w.connect()
            writer.write(b"".join(post(b'{"i": %d}' % i) for i in range(5)))  # all at once
            for i in range(5):
                assert (await read_answer(reader))[2] == b'{"i": %d}' % i
            writer.close()

    run(scenario())


def test_a_chunked_request_body_reaches_the_engine_whole_with_its_length() -> None:
    async def scenario() -> None:
        async with world(plain()) as w:
            reader, writer = await w.connect()
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: g\r\nTransfer-Encoding: chunked\r\n\r\n"
                b'7\r\n{"promp\r\n9\r\nt": "hi"}\r\n0\r\n\r\n'
            )
            assert (await read_answer(reader))[0] == 200
            assert w.engine.requests[0].endswith(b'content-length: 16\r\n\r\n{"prompt": "hi"}')
            assert b"chunked" not in w.engine.requests[0]
            writer.close()

    run(scenario())


def test_expect_100_continue_is_met_before_the_body_is_sent() -> None:
    async def scenario() -> None:
        async with world(plain()) as w:
            reader, writer = await w.connect()
            writer.write(
                post(b"")[:-4].replace(b"Content-Length: 0", b"Content-Length: 2")
                + b"\r\nExpect: 100-continue\r\n\r\n"
            )
            assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
            writer.write(b"{}")
            assert (await read_answer(reader))[0] == 200
            assert b"expect" not in w.engine.requests[0].lower()
            writer.close()

    run(scenario())


def test_a_body_over_max_body_gets_413_and_the_client_reads_it_before_the_connection_ends() -> None:
    async def scenario() -> None:
        async with world(plain(), max_body=1000) as w:
            reader, writer = await w.connect()
            writer.write(post(b"x" * 50_000))  # sent whole: the gate reads it and drops it
            await writer.drain()
            status, headers, body = await read_answer(reader)
            assert (status, headers["connection"], body) == (413, "close", b'{"error": "too large"}')
            assert w.engine.requests == []
            assert await reader.read() == b""  # then the end (a half-close, not a reset)
            writer.close()

    run(scenario())


def test_a_request_that_never_arrives_whole_gets_408_and_an_idle_connection_is_closed() -> None:
    async def scenario() -> None:
        async with world(plain()) as w:
            slow_reader, slow = await w.connect()
            slow.write(post(b'{"prompt": "never ends"}')[:-5])
            idle_reader, idle = await w.connect()
            await asyncio.sleep(0.1)
            w.sweep(REQUEST_S - 1)
            assert len(w.listener.connections) == 2  # not yet
            w.sweep(REQUEST_S + 1)
            status, _, body = await read_answer(slow_reader)
            assert status == 408
            assert b"did not arrive whole" in body
            w.sweep(IDLE_S + 1)
            assert await idle_reader.read() == b""
            slow.close()
            idle.close()

    run(scenario())


def test_an_http_1_0_client_gets_a_chunked_stream_as_its_content_until_close() -> None:
    async def scenario() -> None:
        async with world(recorded("chat-stream.http")) as w:
            reader, writer = await w.connect()
            writer.write(post(b'{"stream": true}', version="1.0"))
            head = parse_response_head(await reader.readuntil(b"\r\n\r\n"), "POST")
            assert (head.chunked, head.length, head.until_close) == (False, None, True)
            content = await reader.read()
            assert content.startswith(b"data: {")
            assert content.endswith(b"data: [DONE]\n\n")
            writer.close()

    run(scenario())


def test_a_real_vllm_stream_passes_with_its_framing_and_the_tail_is_its_content() -> None:
    async def scenario() -> None:
        async with world(recorded("chat-stream.http", pause=0.001)) as w:
            reader, writer = await w.connect()
            writer.write(post(b'{"stream": true}', path="/v1/chat/completions"))
            status, headers, body = await read_answer(reader)
            assert (status, headers["transfer-encoding"]) == (200, "chunked")
            events = [line for line in body.split(b"\n") if line.startswith(b"data: ")]
            assert events[-1] == b"data: [DONE]"
            assert json.loads(events[-2][6:])["usage"]["completion_tokens"] == 24
            writer.close()

    run(scenario())


def test_an_answer_until_close_reaches_the_client_whole_and_closes_its_connection() -> None:
    async def scenario() -> None:
        async def until_close(request: bytes, writer: asyncio.StreamWriter) -> None:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n")
            writer.write(b"data: one\n\ndata: [DONE]\n\n")
            writer.close()

        async with world(until_close) as w:
            reader, writer = await w.connect()
            writer.write(post(b"{}"))
            status, headers, body = await read_answer(reader)
            assert (status, headers["connection"], body) == (200, "close", b"data: one\n\ndata: [DONE]\n\n")
            writer.close()

    run(scenario())


def test_an_engine_that_closes_before_answering_is_dropped_and_one_that_breaks_off_cuts_the_client() -> None:
    async def scenario() -> None:
        async def drop(request: bytes, writer: asyncio.StreamWriter) -> None:
            writer.close()

        async with world(drop) as w:
            reader, writer = await w.connect()
            writer.write(post(b"{}"))
            assert await read_answer(reader) == (502, {"content-length": "13"}, b"EngineDropped")
            writer.close()

        async def half(request: bytes, writer: asyncio.StreamWriter) -> None:
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
            await writer.drain()
            writer.close()

        async with world(half) as w:
            reader, writer = await w.connect()
            writer.write(post(b"{}"))
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200 OK")
            assert await reader.read() == b"5\r\nhello\r\n"  # then the gate cuts it too: no end chunk
            writer.close()

    run(scenario())


def test_a_client_that_goes_away_mid_answer_closes_the_engines_connection() -> None:
    async def scenario() -> None:
        async def endless(request: bytes, writer: asyncio.StreamWriter) -> None:
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            while True:
                writer.write(b"6\r\ndata: \r\n")
                await writer.drain()
                await asyncio.sleep(0.01)

        async with world(endless) as w:
            reader, writer = await w.connect()
            writer.write(post(b"{}"))
            await reader.readuntil(b"data: ")
            writer.close()
            await asyncio.wait_for(w.engine.closed.wait(), 5)  # the engine saw its request end
            assert (w.pool.idle, w.pool.busy) == ([], set())

    run(scenario())


def test_a_client_that_reads_slowly_pauses_the_engine_instead_of_filling_memory() -> None:
    async def scenario() -> None:
        sent = 0

        async def flood(request: bytes, writer: asyncio.StreamWriter) -> None:
            nonlocal sent
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            piece = b"x" * 65536
            for _ in range(400):  # 26 MB, far more than the socket buffers hold
                writer.write(b"10000\r\n" + piece + b"\r\n")
                await writer.drain()  # blocks while the gate does not read
                sent += len(piece)
            writer.write(b"0\r\n\r\n")

        async with world(flood) as w:
            reader, writer = await w.connect()
            writer.write(post(b"{}"))
            await reader.readuntil(b"\r\n\r\n")
            await asyncio.sleep(0.5)  # the client reads nothing meanwhile
            (connection,) = w.pool.busy
            assert connection.reading_paused
            assert sent < 16 << 20  # the engine was held back, not the gate's memory filled
            received = 0
            while chunk := await reader.read(1 << 20):
                received += len(chunk)
                if chunk.endswith(b"0\r\n\r\n"):
                    break
            assert sent == 400 * 65536
            assert received > sent
            writer.close()

    run(scenario())


def test_an_engine_silent_past_its_read_deadline_is_cut_off_and_a_refused_one_said() -> None:
    async def scenario() -> None:
        async def silent(request: bytes, writer: asyncio.StreamWriter) -> None:
            await asyncio.sleep(60)

        async with world(silent) as w:
            reader, writer = await w.connect()
            writer.write(post(b"{}"))
            await asyncio.sleep(0.2)
            w.sweep(61)
            assert (await read_answer(reader))[2] == b"EngineBroken"
            writer.close()
            closed_port = w.engine.port
        refused = EnginePool("127.0.0.1", closed_port)
        with pytest.raises(EngineRefused):
            await refused.connect()

    run(scenario())


def test_a_pooled_engine_connection_idle_past_its_limit_is_closed() -> None:
    async def scenario() -> None:
        async with world(plain()) as w:
            reader, writer = await w.connect()
            writer.write(post(b"{}"))
            await read_answer(reader)
            assert len(w.pool.idle) == 1
            w.sweep(ENGINE_IDLE_S + 0.1)
            assert w.pool.idle == []
            await asyncio.wait_for(w.engine.closed.wait(), 5)
            writer.close()

    run(scenario())


def test_junk_from_clients_is_answered_or_dropped_and_the_listener_serves_on() -> None:
    junk = [
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(64)),  # a TLS hello
        b"GET / HTTP/2.0\r\n\r\n",
        b"POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello",
        b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"GET / HTTP/1.1\r\nX: " + b"a" * 70_000,
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    ]

    async def scenario() -> None:
        async with world(plain()) as w:
            for data in junk:
                reader, writer = await w.connect()
                writer.write(data)
                await asyncio.sleep(0.05)
                w.sweep(REQUEST_S + 1)  # what is still not a whole request has had its time
                answer = await asyncio.wait_for(reader.read(), 5)
                assert answer.startswith((b"HTTP/1.1 4", b"HTTP/1.1 5")), answer
                writer.close()
            reader, writer = await w.connect()
            writer.write(b"\r\n\r\n\n" + post(b"{}"))  # blank lines before a request: ignored
            assert (await read_answer(reader))[0] == 200
            assert w.errors == []  # nothing reached the handler as a failure
            writer.close()

    run(scenario())


def test_a_head_request_passes_its_answers_length_without_a_body() -> None:
    async def scenario() -> None:
        async def head(request: bytes, writer: asyncio.StreamWriter) -> None:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1234\r\n\r\n")

        async with world(head) as w:
            reader, writer = await w.connect()
            writer.write(b"HEAD /health HTTP/1.1\r\nHost: g\r\n\r\n")
            assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 200 OK\r\ncontent-length: 1234\r\n\r\n"
            writer.write(b"HEAD /health HTTP/1.1\r\nHost: g\r\n\r\n")  # the connection carries on
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
            writer.close()

    run(scenario())


def test_a_pooled_connection_is_reused_and_one_the_engine_closes_unanswered_reads_as_dropped() -> None:
    async def scenario() -> None:
        async with world(plain()) as w:
            first = await w.pool.connect()
            await first.send(b"GET / HTTP/1.1\r\nhost: e\r\n\r\n", "GET")
            assert await first.read(100) == b'{"ok": true}'
            first.release()
            again = await w.pool.connect()
            assert again is first
            w.engine.answer = _close  # the next request it takes in and closes on, unanswered
            with pytest.raises(EngineDropped):
                await again.send(b"GET / HTTP/1.1\r\nhost: e\r\n\r\n", "GET")
            again.release()
            assert w.pool.idle == []

    run(scenario())


async def _close(request: bytes, writer: asyncio.StreamWriter) -> None:
    writer.close()


def test_a_connection_is_idle_from_the_end_of_its_answer_not_from_its_request() -> None:
    async def scenario() -> None:
        async def slow(request: bytes, writer: asyncio.StreamWriter) -> None:
            await asyncio.sleep(0.5)  # a long answer (a stream of minutes, in short)
            await plain()(request, writer)

        async with world(slow) as w:
            reader, writer = await w.connect()
            writer.write(post(b"{}"))
            await read_answer(reader)
            w.sweep(IDLE_S - 0.3)  # idle since the answer: not yet IDLE_S; since the request: past it
            writer.write(post(b"{}"))  # so the client's next request finds it open
            assert (await read_answer(reader))[0] == 200
            writer.close()

    run(scenario())


def _own(answers: dict[str, bytes]) -> Callable[[ClientRequest, ClientConnection], Awaitable[None]]:
    """A handler that answers by itself: the body for the request's path."""

    async def handler(request: ClientRequest, client: ClientConnection) -> None:
        client.send(200, [("content-type", "text/plain")], answers.get(request.head.path, b"?"))

    return handler


def test_the_gates_own_answer_to_a_head_request_has_no_body() -> None:
    async def scenario() -> None:
        async with world(plain()) as w:
            w.listener.handler = _own({"/gate/metrics": b"x" * 5000})
            reader, writer = await w.connect()
            writer.write(
                b"HEAD /gate/metrics HTTP/1.1\r\nHost: g\r\n\r\nGET /gate/metrics HTTP/1.1\r\nHost: g\r\n\r\n"
            )
            head = await reader.readuntil(b"\r\n\r\n")
            assert b"content-length: 5000" in head
            assert (await read_answer(reader))[2] == b"x" * 5000  # the next answer, not the HEAD's body
            writer.close()

    run(scenario())


def test_a_client_that_pipelines_and_never_reads_does_not_grow_the_gates_memory() -> None:
    async def scenario() -> None:
        async with world(plain()) as w:
            w.listener.handler = _own({"/big": b"y" * (256 << 10)})
            reader, writer = await w.connect()
            writer.write(b"GET /big HTTP/1.1\r\nHost: g\r\n\r\n" * 400)  # 100 MiB of answers asked for
            await asyncio.sleep(0.5)  # it reads nothing meanwhile
            (connection,) = w.listener.connections
            assert connection.transport is not None
            assert connection.paused
            assert connection.transport.get_write_buffer_size() < 8 << 20
            assert len(connection.buffer) <= PIPELINE_CAP + 65536
            received = 0
            for _ in range(400):  # then it reads: every answer comes, in order
                received += len((await read_answer(reader))[2])
            assert received == 400 * (256 << 10)
            writer.close()

    run(scenario())


def test_a_client_that_reads_nothing_of_its_answer_for_long_is_cut_off_with_the_engines_request() -> None:
    async def scenario() -> None:
        async def flood(request: bytes, writer: asyncio.StreamWriter) -> None:
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            while True:
                writer.write(b"10000\r\n" + b"z" * 65536 + b"\r\n")
                await writer.drain()

        async with world(flood) as w:
            _reader, writer = await w.connect()
            writer.write(post(b"{}"))
            await asyncio.sleep(0.5)
            (connection,) = w.listener.connections
            assert connection.paused
            w.sweep(STALL_S - 10)
            assert not connection.closed
            w.sweep(STALL_S + 1)
            await asyncio.wait_for(w.engine.closed.wait(), 5)  # the engine's request ended with it
            writer.close()

    run(scenario())


def test_a_connection_the_engine_closed_before_the_request_went_reads_as_dropped_at_once() -> None:
    async def scenario() -> None:
        async with world(plain()) as w:
            connection = await w.pool.connect()
            assert connection.transport is not None
            connection.transport.abort()
            await asyncio.sleep(0)  # its connection_lost runs
            with pytest.raises(EngineDropped):
                connection.send(b"GET / HTTP/1.1\r\nhost: e\r\n\r\n", "GET")
            connection.release()

    run(scenario())


def test_a_chunked_body_in_too_many_chunks_is_refused() -> None:
    async def scenario() -> None:
        async with world(plain()) as w:
            reader, writer = await w.connect()
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: g\r\nTransfer-Encoding: chunked\r\n\r\n")
            writer.write(b"1\r\na\r\n" * (MAX_REQUEST_CHUNKS + 1) + b"0\r\n\r\n")
            status, _, body = await read_answer(reader)
            assert status == 400
            assert b"chunks" in body
            assert w.engine.requests == []
            writer.close()

    run(scenario())


def test_an_http_1_0_client_is_told_its_connection_is_kept_and_is_never_sent_100_continue() -> None:
    async def scenario() -> None:
        async with world(plain()) as w:
            reader, writer = await w.connect()
            writer.write(post(b"{}", headers="Connection: keep-alive\r\n", version="1.0"))
            status, headers, _ = await read_answer(reader)
            assert (status, headers["connection"]) == (200, "keep-alive")
            writer.write(
                b"POST /v1/completions HTTP/1.0\r\nConnection: keep-alive\r\nContent-Length: 2\r\n"
                b"Expect: 100-continue\r\n\r\n"
            )
            await asyncio.sleep(0.2)
            writer.write(b"{}")
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200 OK")  # no 100 first
            writer.close()

    run(scenario())


def test_a_pipelined_request_has_its_time_from_the_end_of_the_answer_before_it() -> None:
    async def scenario() -> None:
        async def slow(request: bytes, writer: asyncio.StreamWriter) -> None:
            await asyncio.sleep(0.5)
            await plain()(request, writer)

        async with world(slow) as w:
            reader, writer = await w.connect()
            writer.write(post(b"{}") + post(b'{"second": 1}')[:-3])  # the second still arriving
            await read_answer(reader)
            w.sweep(REQUEST_S - 0.3)  # since the answer's end: not yet; since its first byte: past
            writer.write(b" 1}")  # the last bytes
            assert (await read_answer(reader))[0] == 200
            writer.close()

    run(scenario())


@st.composite
def _requests(draw: st.DrawFn) -> list[bytes]:
    """Some well-formed requests: lengths and chunked bodies, HTTP/1.1 and 1.0 keep-alive."""
    out = []
    for index in range(draw(st.integers(1, 5))):
        body = b'{"i": %d, "pad": "%s"}' % (index, b"x" * draw(st.integers(0, 3000)))
        if draw(st.booleans()):
            cuts = sorted(draw(st.lists(st.integers(1, len(body) - 1), max_size=4, unique=True)))
            pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
            framed = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
            out.append(b"POST /echo HTTP/1.1\r\nHost: g\r\nTransfer-Encoding: chunked\r\n\r\n" + framed)
        else:
            version = draw(st.sampled_from([b"1.1", b"1.0"]))
            alive = b"Connection: keep-alive\r\n" if version == b"1.0" else b""
            out.append(
                b"POST /echo HTTP/%s\r\nHost: g\r\n%sContent-Length: %d\r\n\r\n%s"
                % (version, alive, len(body), body)
            )
    return out


async def _echo(request: ClientRequest, client: ClientConnection) -> None:
    client.send(200, [("content-type", "application/json")], request.body)


@pytest.mark.fuzz
@fuzz_settings(scale=0.3)
@given(st.data())
def test_fuzz_pipelined_requests_cut_anywhere_are_answered_whole_and_in_order(data: st.DataObject) -> None:
    requests = data.draw(_requests())
    stream = b"".join(requests)
    cuts = sorted(data.draw(st.lists(st.integers(1, len(stream) - 1), max_size=12, unique=True)))

    async def scenario() -> None:
        async with world(plain()) as w:
            w.listener.handler = _echo
            reader, writer = await w.connect()
            for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True):
                writer.write(stream[a:b])
                await writer.drain()
                await asyncio.sleep(0)
            for index in range(len(requests)):
                status, _, body = await read_answer(reader)
                assert status == 200
                assert body.startswith(b'{"i": %d,' % index)
            writer.close()

    run(scenario())


@pytest.mark.fuzz
@fuzz_settings(scale=0.3)
@given(st.lists(st.binary(min_size=1, max_size=200), min_size=1, max_size=6))
@example([b"\r\n\n"])  # blank lines: an idle connection
@example([b"POST /echo HTTP/1.1\r\nContent-Length: 9\r\n\r\n{"])  # a body that never ends
@example([b"GET / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", b"1\r\na\r\n" * 50])
def test_fuzz_junk_from_a_client_is_refused_or_waited_on_and_the_listener_serves_on(
    pieces: list[bytes],
) -> None:
    async def scenario() -> None:
        async with world(plain()) as w:
            w.listener.handler = _echo
            reader, writer = await w.connect()
            for piece in pieces:
                writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.01)
            w.sweep(REQUEST_S + 1)  # whatever is not a request by now has had its time
            await asyncio.sleep(0.01)
            w.sweep(IDLE_S + 1)  # and a connection left with nothing (blank lines) its idle time
            with contextlib.suppress(ConnectionError):
                await asyncio.wait_for(reader.read(), 5)  # refused, answered, or idle: never a hang
            writer.close()
            assert w.errors == []
            good_reader, good = await w.connect()
            good.write(post(b"{}", path="/echo"))
            assert (await read_answer(good_reader))[0] == 200
            good.close()

    run(scenario())
