"""tunerd's outbound HTTP, every read of it bounded by a total deadline and a byte cap.

A timeout per read is no limit: a peer that sends one byte every half second (a wedged
exporter, a proxy trickling an error page, a hostile webhook receiver) satisfies every read
timeout forever and holds the thread that asked — the loop, a sink's sender, the CLI. So every
exchange here has a :class:`Deadline` for the whole of it (connect, request, headers, body)
and a cap on the bytes it reads:

- between chunks the deadline and the cap are checked, and each socket read waits at most what
  is left of the deadline;
- a reaper thread (one for the process) shuts the exchange's socket down when its deadline
  passes, so a peer that sends nothing between chunks, or trickles its headers, cannot hold it
  either;
- a body the deadline or the cap cut off is an error (:class:`DeadlineExceeded`,
  :class:`ResponseTooLarge`, ``http.client.IncompleteRead``), never a shorter answer: a socket
  the reaper shut looks, to an HTTP parser reading until the peer closes, like a complete body.

Two clients use it:

- :class:`KeptAlive`, ``GET`` over one kept-alive connection with the standard library's
  ``http.client`` — what the frequent reads use (the GPU 4 times a second, each engine's
  ``/metrics`` and ``/health`` every tick): an httpx request cost ~3 ms of CPU here against
  ~0.5 ms for this (bench/bench_idle.py; DESIGN §8 allows the idle daemon 1 % of a core). One
  connection, re-opened once when the server closed it (a restarted engine, a keep-alive
  timeout), guarded by a lock (the sampler and a restart's room check may read at once).
- :func:`exchange`, one request on a fresh httpx client — the webhooks and the status client.

The deadlines are real time (``time.monotonic``), like the socket timeouts they stand beside,
also when the daemon follows the simulator's clock.
"""

from __future__ import annotations

import contextlib
import heapq
import http.client
import itertools
import socket
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

__all__ = [
    "METRICS_MAX_BYTES",
    "Deadline",
    "DeadlineExceeded",
    "KeptAlive",
    "Reply",
    "ResponseTooLarge",
    "exchange",
    "read_capped",
]

METRICS_MAX_BYTES = 8 << 20  # a /metrics page of a many-LoRA, many-bucket vLLM is ~1 MiB
_CHUNK = 64 << 10


class DeadlineExceeded(TimeoutError):
    """The whole exchange did not end within its deadline (a ``TimeoutError``, so an
    ``OSError``: what callers already treat as no answer)."""


class ResponseTooLarge(http.client.HTTPException):
    """The answer was larger than the cap: it is not read further, and not used."""


class Deadline:
    """A total time limit for one exchange. Use it as a context manager: while inside, the
    reaper calls what :meth:`on_expiry` registered (closing the exchange's socket) once
    :attr:`at` passes; leaving disarms it. :attr:`fired` says that happened — whatever the
    exchange read after that is not to be trusted."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.at = time.monotonic() + seconds
        self.fired = False
        self._closers: list[Callable[[], object]] = []
        self._done = False
        self._lock = threading.Lock()

    def remaining(self) -> float:
        return self.at - time.monotonic()

    def passed(self) -> bool:
        return self.fired or self.remaining() <= 0

    def error(self) -> DeadlineExceeded:
        return DeadlineExceeded(f"no complete answer within {self.seconds:g} s")

    def check(self) -> None:
        """Raise :class:`DeadlineExceeded` once the deadline has passed."""
        if self.passed():
            raise self.error()

    def socket_timeout(self, per_read: float) -> float:
        """What one socket operation may wait: ``per_read``, at most what is left."""
        return max(0.001, min(per_read, self.remaining()))

    def on_expiry(self, close: Callable[[], object]) -> None:
        """Call ``close`` when the deadline passes (at once when it already has)."""
        with self._lock:
            if not self.fired:
                self._closers.append(close)
                return
        _quietly(close)

    def __enter__(self) -> Deadline:
        _REAPER.arm(self)
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._done = True
            self._closers.clear()

    def _fire(self) -> None:
        with self._lock:
            if self._done:
                return
            self.fired = True
            closers, self._closers = self._closers, []
        for close in closers:
            _quietly(close)


def _quietly(close: Callable[[], object]) -> None:
    with contextlib.suppress(OSError):
        close()


def shutdown(sock: socket.socket | None) -> None:
    """End every read and write on ``sock`` now, from any thread (``close`` would not wake a
    read another thread is blocked in)."""
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


class _Reaper:
    """One thread for the process: fires each armed :class:`Deadline` when it passes."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Deadline]] = []
        self._order = itertools.count()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None

    def arm(self, deadline: Deadline) -> None:
        with self._wake:
            heapq.heappush(self._heap, (deadline.at, next(self._order), deadline))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="tunerd-deadlines", daemon=True)
                self._thread.start()
            elif self._heap[0][2] is deadline:
                self._wake.notify()

    def _run(self) -> None:
        while True:
            due: list[Deadline] = []
            with self._wake:
                while self._heap and self._heap[0][2]._done:
                    heapq.heappop(self._heap)  # ended in time: nothing to do
                if not self._heap:
                    self._wake.wait()
                    continue
                wait = self._heap[0][0] - time.monotonic()
                if wait > 0:
                    self._wake.wait(wait)
                    continue
                due.append(heapq.heappop(self._heap)[2])
            for deadline in due:
                deadline._fire()


_REAPER = _Reaper()


def read_capped(chunks: Iterable[bytes], deadline: Deadline, cap: int) -> bytes:
    """The chunks joined, while the deadline holds and they stay within ``cap`` bytes;
    :class:`DeadlineExceeded` or :class:`ResponseTooLarge` otherwise — also when the chunks
    ended because the deadline closed the socket (that end looks like a complete body)."""
    parts: list[bytes] = []
    size = 0
    for chunk in chunks:
        deadline.check()
        size += len(chunk)
        if size > cap:
            raise ResponseTooLarge(f"the answer is larger than {_size(cap)}: not read further")
        parts.append(chunk)
    deadline.check()
    return b"".join(parts)


def _size(count: int) -> str:
    if count >= 1 << 20 and not count % (1 << 20):
        return f"{count >> 20} MiB"
    if count >= 1 << 10 and not count % (1 << 10):
        return f"{count >> 10} KiB"
    return f"{count} bytes"


class KeptAlive:
    """``GET base_url + path`` → (status, body), within ``deadline`` seconds in all (default:
    ``timeout``) and ``max_bytes`` of body. Raises ``ValueError`` for a URL it cannot use,
    ``OSError`` (``ConnectionRefusedError``, ``TimeoutError`` — :class:`DeadlineExceeded`
    among them…) or ``http.client.HTTPException`` (:class:`ResponseTooLarge`, a body cut
    short) when there is no complete answer."""

    def __init__(
        self,
        base_url: str,
        timeout: float = 2.0,
        *,
        deadline: float | None = None,
        max_bytes: int = METRICS_MAX_BYTES,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.problem: str | None = None  # why the URL cannot be used, if it cannot
        self._port: int | None = None
        try:
            parts = urlsplit(self.base_url)
            self._port = parts.port
        except ValueError as error:  # "http://[::1", a port that is not a number
            self.problem = f"{base_url!r}: {error}"
            parts = urlsplit("")
        if self.problem is None and (parts.scheme not in ("http", "https") or not parts.hostname):
            self.problem = f"not an http(s) URL: {base_url!r}"
        self._https = parts.scheme == "https"
        self._host = parts.hostname or ""
        self._prefix = parts.path
        self._timeout = timeout
        self.deadline = timeout if deadline is None else deadline
        self.max_bytes = max_bytes
        self._connection: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()

    def _connect(self) -> http.client.HTTPConnection:
        if self._https:
            return http.client.HTTPSConnection(self._host, self._port, timeout=self._timeout)
        return http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)

    def get(self, path: str) -> tuple[int, bytes]:
        if self.problem is not None:
            raise ValueError(self.problem)
        with self._lock, Deadline(self.deadline) as deadline:
            while True:
                fresh = self._connection is None
                if self._connection is None:
                    self._connection = self._connect()
                connection = self._connection
                try:
                    return self._exchange(connection, path, deadline)
                except (OSError, http.client.HTTPException) as error:
                    connection.close()
                    self._connection = None
                    if deadline.passed():  # whatever the error says, the deadline ended it
                        raise deadline.error() from error
                    # a kept-alive connection the server had closed fails at once: try a new
                    # one; a refusal or a timeout on a fresh connection is the answer, and so
                    # is an answer too large
                    if fresh or isinstance(error, ResponseTooLarge):
                        raise

    def _exchange(
        self, connection: http.client.HTTPConnection, path: str, deadline: Deadline
    ) -> tuple[int, bytes]:
        connection.timeout = deadline.socket_timeout(self._timeout)
        if connection.sock is None:
            connection.connect()
        sock = connection.sock
        assert sock is not None
        # the response keeps reading from this socket also after the connection let go of it
        # (an answer that ends the connection): the deadline shuts this one
        deadline.on_expiry(lambda: shutdown(sock))
        sock.settimeout(connection.timeout)
        connection.request("GET", self._prefix + path)
        response = connection.getresponse()
        try:
            body = read_capped(self._chunks(sock, response, deadline), deadline, self.max_bytes)
            if response.length:  # the server closed before the length it announced
                raise http.client.IncompleteRead(body, response.length)
        finally:
            response.close()  # read to its end: the connection is free for the next request
        return response.status, body

    def _chunks(
        self, sock: socket.socket, response: http.client.HTTPResponse, deadline: Deadline
    ) -> Iterator[bytes]:
        while True:
            sock.settimeout(deadline.socket_timeout(self._timeout))
            chunk = response.read1(_CHUNK)
            if not chunk:
                return
            yield chunk

    def close(self) -> None:
        with self._lock:
            if self._connection is not None:
                self._connection.close()
                self._connection = None


@dataclass(frozen=True)
class Reply:
    status: int
    headers: Mapping[str, str]
    body: bytes


def exchange(
    method: str,
    url: str,
    *,
    deadline: float,
    max_bytes: int,
    content: bytes | None = None,
    headers: Mapping[str, str] | None = None,
    transport: httpx.BaseTransport | None = None,
) -> Reply:
    """One request on a fresh httpx client, all of it within ``deadline`` seconds and its
    answer's body within ``max_bytes`` (after decompression). Raises
    :class:`DeadlineExceeded`, :class:`ResponseTooLarge`, ``httpx.HTTPError`` (refused,
    reset, a body cut short…) or ``httpx.InvalidURL``."""
    sent = {"Accept-Encoding": "identity", **(headers or {})}
    with (
        httpx.Client(transport=transport, timeout=httpx.Timeout(deadline)) as client,
        Deadline(deadline) as limit,
    ):

        def trace(event: str, info: dict[str, Any]) -> None:
            # each new connection's socket (TCP, unix, then TLS over it): shut at the deadline
            if event in _CONNECTED:
                stream = info.get("return_value")
                sock = stream.get_extra_info("socket") if stream is not None else None
                if isinstance(sock, socket.socket):
                    limit.on_expiry(lambda: shutdown(sock))

        try:
            with client.stream(
                method,
                url,
                content=content,
                headers=sent,
                extensions={"trace": trace},
            ) as response:
                raw = read_capped(response.iter_raw(), limit, max_bytes)
                body = _decoded(raw, response.headers.get("Content-Encoding", ""), max_bytes)
                return Reply(response.status_code, response.headers, body)
        except httpx.HTTPError as error:
            if limit.passed():
                raise limit.error() from error
            raise


_CONNECTED = frozenset(
    {
        "connection.connect_tcp.complete",
        "connection.connect_unix_socket.complete",
        "connection.start_tls.complete",
    }
)


def _decoded(raw: bytes, encoding: str, cap: int) -> bytes:
    """``raw`` undone of a gzip or deflate encoding a server used though asked not to, within
    ``cap`` bytes (a small compressed body can unpack to gigabytes); any other encoding is
    left as it came."""
    encoding = encoding.strip().lower()
    shapes: tuple[int, ...]
    if encoding in ("gzip", "x-gzip"):
        shapes = (47,)  # the gzip header, detected
    elif encoding == "deflate":
        shapes = (15, -15)  # zlib-wrapped as the RFC says, or bare as some servers send it
    else:
        return raw
    problem: zlib.error | None = None
    for wbits in shapes:
        inflate = zlib.decompressobj(wbits)
        try:
            body = inflate.decompress(raw, cap + 1)
        except zlib.error as error:
            problem = error
            continue
        if len(body) > cap or inflate.unconsumed_tail:
            raise ResponseTooLarge(f"the answer unpacks to more than {_size(cap)}: not read further")
        return body
    raise httpx.DecodingError(f"a {encoding} body that does not decode: {problem}")
