"""The kept-alive GET client (tunerd.sources.http) against a real HTTP/1.1 server on loopback:
one connection for many reads, a new one when the server closed it, and no second try (no
doubled wait) when a fresh connection is refused or times out."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tunerd.sources.http import KeptAlive


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.connections: list[tuple[str, int]] = []  # one entry per TCP connection
        self.close_next = False  # answer the next request with Connection: close
        self.hang = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive
    server: Server

    def setup(self) -> None:
        super().setup()
        self.server.connections.append(self.client_address)

    def do_GET(self) -> None:
        if self.path == "/hang":
            self.server.hang.wait(10)
        body = f"{self.path} {len(self.server.connections)}".encode()
        self.send_response(404 if self.path.endswith("/missing") else 200)
        self.send_header("Content-Length", str(len(body)))
        if self.server.close_next:
            self.server.close_next = False
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[Server]:
    made = Server()
    thread = threading.Thread(target=made.serve_forever, daemon=True)
    thread.start()
    yield made
    made.hang.set()
    made.shutdown()
    made.server_close()


def test_many_reads_share_one_connection_and_a_closed_one_is_replaced(server: Server) -> None:
    client = KeptAlive(server.url + "/base")
    try:
        for _ in range(20):
            assert client.get("/metrics") == (200, b"/base/metrics 1")
        assert client.get("/missing")[0] == 404
        assert len(server.connections) == 1
        server.close_next = True
        assert client.get("/x")[0] == 200  # the server closes after this answer
        assert client.get("/y") == (200, b"/base/y 2")  # a new connection, without an error
    finally:
        client.close()


def test_a_refused_or_silent_fresh_connection_fails_once(server: Server) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens there
    with pytest.raises(ConnectionRefusedError):
        KeptAlive(f"http://127.0.0.1:{port}").get("/health")
    client = KeptAlive(server.url, timeout=0.5)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        client.get("/hang")
    assert time.monotonic() - started < 0.9  # one timeout, not two
    client.close()


@pytest.mark.parametrize("url", ["http://[::1", "ftp://host/", "not a url", "http://host:port/"])
def test_an_unusable_url_is_a_value_error_when_used(url: str) -> None:
    client = KeptAlive(url)
    assert client.problem
    with pytest.raises(ValueError, match=r"URL|port"):
        client.get("/metrics")
