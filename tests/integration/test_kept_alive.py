"""The kept-alive GET client (tunerd.sources.http) against a real HTTP/1.1 server on loopback:
one connection for many reads, a new one when the server closed it, and no second try (no
doubled wait) when a fresh connection is refused or times out. An answer trickled a byte at a
time — status line, headers or body — or stalled after its headers ends at the read's total
deadline; one larger than the cap, or cut short, is an error, never a shorter answer."""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tunerd.sources.http import DeadlineExceeded, KeptAlive, ResponseTooLarge


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
        if self.path in TRICKLES:
            TRICKLES[self.path](self)
            return
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


def _drip(handler: Handler, data: bytes, every: float = 0.5) -> None:
    """``data`` a byte every ``every`` seconds, until the client or the test goes away."""
    try:
        for byte in data:
            if handler.server.hang.wait(every):
                return
            handler.wfile.write(bytes([byte]))
            handler.wfile.flush()
    except OSError:
        pass  # the client gave up: what is tested


def _head(handler: Handler, length: int | None) -> None:
    handler.send_response(200)
    if length is not None:
        handler.send_header("Content-Length", str(length))
    else:
        handler.close_connection = True  # the body ends when the connection does
    handler.end_headers()
    handler.wfile.flush()


def _cut_short(handler: Handler) -> None:
    _head(handler, 100)
    handler.wfile.write(b"x" * 10)
    handler.close_connection = True


TRICKLES: dict[str, Callable[[Handler], None]] = {
    "/drip-body": lambda h: (_head(h, 100), _drip(h, b"x" * 100)),
    "/drip-headers": lambda h: _drip(h, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"),
    "/stall-body": lambda h: (_head(h, 100), h.server.hang.wait(30)),
    "/drip-until-close": lambda h: (_head(h, None), _drip(h, b"x" * 100)),
    "/huge": lambda h: (_head(h, 9 << 20), h.wfile.write(b"x" * (9 << 20))),
    "/cut-short": _cut_short,
}


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


@pytest.mark.parametrize("path", ["/drip-body", "/drip-headers", "/stall-body", "/drip-until-close"])
def test_an_answer_trickled_or_stalled_ends_at_the_total_deadline(server: Server, path: str) -> None:
    """One byte every 0.5 s passes every per-read timeout (1 s here): before the total deadline
    a read of /drip-body took 50 s and one of /drip-until-close returned whatever had come when
    the server gave up, as if it were the page."""
    client = KeptAlive(server.url, timeout=1.0)
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="no complete answer within 1 s"):
        client.get(path)
    assert time.monotonic() - started < 4  # the deadline (1 s), not the trickle
    assert client.get("/after") == (200, b"/after " + str(len(server.connections)).encode())  # usable again
    client.close()


def test_an_answer_larger_than_the_cap_or_cut_short_is_an_error_not_a_body(server: Server) -> None:
    client = KeptAlive(server.url, timeout=5.0)
    with pytest.raises(ResponseTooLarge, match="larger than 8 MiB"):
        client.get("/huge")  # 9 MiB: read up to the cap (8 MiB, a /metrics page's), not kept
    with pytest.raises(http.client.IncompleteRead):
        client.get("/cut-short")  # Content-Length 100, 10 bytes, closed: not a 10-byte page
    assert client.get("/metrics")[0] == 200
    client.close()
    small = KeptAlive(server.url, max_bytes=5)
    with pytest.raises(ResponseTooLarge, match="larger than 5 bytes"):
        small.get("/metrics")
    small.close()
