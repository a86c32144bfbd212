"""The processes bench_gate.py measures with, one per command:

- ``upstream PORT``: a trivial OpenAI-style engine on loopback (aiohttp): ``/v1/completions``
  answers at once (plain: a small JSON with ``usage``; ``stream``: eight SSE chunks, the usage
  chunk and ``[DONE]``), ``/tokenize`` counts words, ``/metrics`` and ``/v1/models`` say a
  1.6M-token pool and a 32K context — the fastest upstream a proxy can sit in front of;
- ``proxy-aiohttp``, ``proxy-uvicorn-httpx``, ``proxy-uvicorn-aiohttp`` ``PORT UPSTREAM``: the
  same minimal forwarding proxy (read the body, forward it, stream the answer back chunk by
  chunk) on each candidate stack, for the choice of stack (docs/gate.md);
- ``proxy-splice PORT UPSTREAM``: no HTTP at all, each connection spliced to one upstream
  connection and bytes pumped both ways — the floor any proxy written in Python stands on;
- ``proxy-protocols PORT UPSTREAM``: the same minimal proxy on the gate's own data path
  (``tunerd.gate.wire``: asyncio's transports, its own HTTP/1.1 reading), no admission;
- ``load URL CLIENTS REQUESTS STREAM``: CLIENTS concurrent keep-alive clients sending
  REQUESTS requests in all; prints one JSON line: each request's latency and the wall time.

uvicorn is not a dependency of tunerd: ``pip install uvicorn`` to rerun the stack comparison.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import time
from typing import Any

import aiohttp
from aiohttp import web

PROMPT = " ".join(["the"] * 100)
METRICS = (
    "# TYPE vllm:kv_cache_usage_perc gauge\n"
    'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.0\n'
    "# TYPE vllm:num_requests_running gauge\n"
    'vllm:num_requests_running{engine="0",model_name="m"} 0.0\n'
    "# TYPE vllm:num_requests_waiting gauge\n"
    'vllm:num_requests_waiting{engine="0",model_name="m"} 0.0\n'
    "# TYPE vllm:cache_config_info gauge\n"
    'vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",gpu_memory_utilization="0.9",'
    'num_gpu_blocks="100000"} 1.0\n'
)
HOP = {"connection", "keep-alive", "transfer-encoding", "te", "upgrade", "host", "content-length"}


def upstream(port: int) -> None:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        tokens = len(str(body.get("prompt", "")).split())
        usage = {"prompt_tokens": tokens, "completion_tokens": 8, "total_tokens": tokens + 8}
        if not body.get("stream"):
            return web.json_response(
                {
                    "id": "cmpl-1",
                    "object": "text_completion",
                    "choices": [{"text": " tok" * 8}],
                    "usage": usage,
                }
            )
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(8):
            await response.write(b'data: {"id": "cmpl-1", "choices": [{"text": " tok"}]}\n\n')
        await response.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def tokenize(request: web.Request) -> web.Response:
        body = await request.json()
        count = len(str(body.get("prompt", "")).split())
        return web.json_response({"count": count, "max_model_len": 32768, "tokens": list(range(count))})

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=METRICS, content_type="text/plain")

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m", "max_model_len": 32768}]})

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


def proxy_aiohttp(port: int, target: str) -> None:
    session: aiohttp.ClientSession | None = None

    async def forward(request: web.Request) -> web.StreamResponse:
        assert session is not None
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        async with session.request(
            request.method, target + str(request.rel_url), data=body, headers=headers
        ) as up:
            out = {k: v for k, v in up.headers.items() if k.lower() not in HOP}
            if up.content_length is not None:
                return web.Response(body=await up.read(), status=up.status, headers=out)
            response = web.StreamResponse(status=up.status, headers=out)
            await response.prepare(request)
            async for chunk in up.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def start(app: web.Application) -> None:
        nonlocal session
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)

    app = web.Application()
    app.on_startup.append(start)
    app.router.add_route("*", "/{tail:.*}", forward)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None, handler_cancellation=True)


def _asgi(forward_factory: Any) -> Any:
    state: dict[str, Any] = {}

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    state["client"] = await forward_factory.open()
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {k.decode(): v.decode() for k, v in scope["headers"] if k.decode().lower() not in HOP}
        path = scope["path"] + (("?" + scope["query_string"].decode()) if scope["query_string"] else "")
        await forward_factory.forward(
            state["client"], scope["method"], path, body, headers=headers, send=send
        )

    return app


class _Httpx:
    def __init__(self, target: str) -> None:
        self.target = target

    async def open(self) -> Any:
        import httpx  # noqa: PLC0415

        return httpx.AsyncClient(
            base_url=self.target, limits=httpx.Limits(max_connections=None), timeout=None
        )

    async def forward(
        self, client: Any, method: str, path: str, body: bytes, *, headers: Any, send: Any
    ) -> None:
        request = client.build_request(method, path, content=body, headers=headers)
        answer = await client.send(request, stream=True)
        try:
            out = [(k.encode(), v.encode()) for k, v in answer.headers.items() if k.lower() not in HOP]
            await send({"type": "http.response.start", "status": answer.status_code, "headers": out})
            async for chunk in answer.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await answer.aclose()


class _Aiohttp:
    def __init__(self, target: str) -> None:
        self.target = target

    async def open(self) -> Any:
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)

    async def forward(
        self, client: Any, method: str, path: str, body: bytes, *, headers: Any, send: Any
    ) -> None:
        async with client.request(method, self.target + path, data=body, headers=headers) as answer:
            out = [(k.encode(), v.encode()) for k, v in answer.headers.items() if k.lower() not in HOP]
            await send({"type": "http.response.start", "status": answer.status, "headers": out})
            async for chunk in answer.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})


def proxy_splice(port: int, target: str) -> None:
    """The floor of any proxy written in Python: no HTTP at all, each client connection spliced
    to its own upstream connection, bytes pumped both ways as they come (asyncio streams)."""
    host, upstream_port = target.removeprefix("http://").rsplit(":", 1)

    async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def connected(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(host, int(upstream_port))
        except OSError:
            client_writer.close()
            return
        for writer in (client_writer, upstream_writer):
            sock = writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await asyncio.gather(pump(client_reader, upstream_writer), pump(upstream_reader, client_writer))

    async def serve() -> None:
        server = await asyncio.start_server(connected, "127.0.0.1", port, backlog=1024)
        async with server:
            await server.serve_forever()

    asyncio.run(serve())


def proxy_protocols(port: int, target: str) -> None:
    """The minimal proxy on tunerd's own data path: small answers read whole, the rest piped."""
    from tunerd.gate.h1 import forward_head, request_bytes  # noqa: PLC0415 (only this candidate)
    from tunerd.gate.wire import ClientConnection, ClientRequest, EngineError, EnginePool, Listener  # noqa: PLC0415

    host, upstream_port = target.removeprefix("http://").rsplit(":", 1)
    pool = EnginePool(host, int(upstream_port))

    async def forward(request: ClientRequest, client: ClientConnection) -> None:
        try:
            connection = await pool.connect()
        except EngineError:
            client.send(502, [], b"")
            return
        try:
            answer = await connection.send(
                request_bytes(request.head, pool.authority, request.body), request.head.method
            )
            if answer.length is not None and answer.length <= 1 << 20:
                data = await connection.read(1 << 20)
                client.start(
                    forward_head(answer, length=len(data), connection=client.connection_header) + data
                )
                return
            client.start(forward_head(answer, length=answer.length, chunked=answer.chunked))
            await connection.pipe(client, dechunk=False)
        except EngineError:
            client.abort()
        finally:
            connection.release()

    async def serve() -> None:
        listener = Listener(forward, max_body=64 << 20, too_large=lambda: b"", on_error=print)
        await listener.listen("127.0.0.1", port)
        await asyncio.Event().wait()

    asyncio.run(serve())


def proxy_uvicorn(port: int, target: str, client: str) -> None:
    import uvicorn  # noqa: PLC0415 (only this candidate needs it)

    factory = _Httpx(target) if client == "httpx" else _Aiohttp(target)
    uvicorn.run(_asgi(factory), host="127.0.0.1", port=port, log_level="warning", access_log=False)


async def _load(url: str, clients: int, requests: int, stream: bool) -> dict[str, Any]:
    body = {"prompt": PROMPT, "max_tokens": 8, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    latencies: list[float] = []
    errors = 0
    left = requests
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def client() -> None:
            nonlocal left, errors
            while left > 0:
                left -= 1
                started = time.perf_counter()
                try:
                    async with session.post(f"{url}/v1/completions", json=body) as answer:
                        await answer.read()
                        if answer.status != 200:
                            errors += 1
                except aiohttp.ClientError:
                    errors += 1
                latencies.append(time.perf_counter() - started)

        began = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        wall = time.perf_counter() - began
    return {"latencies": latencies, "wall": wall, "errors": errors}


def main(argv: list[str]) -> None:
    command = argv[0]
    if command == "upstream":
        upstream(int(argv[1]))
    elif command == "proxy-aiohttp":
        proxy_aiohttp(int(argv[1]), argv[2])
    elif command == "proxy-splice":
        proxy_splice(int(argv[1]), argv[2])
    elif command == "proxy-protocols":
        proxy_protocols(int(argv[1]), argv[2])
    elif command in ("proxy-uvicorn-httpx", "proxy-uvicorn-aiohttp"):
        proxy_uvicorn(int(argv[1]), argv[2], command.rsplit("-", 1)[1])
    elif command == "load":
        result = asyncio.run(_load(argv[1], int(argv[2]), int(argv[3]), argv[4] == "stream"))
        print(json.dumps(result))
    else:
        raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
