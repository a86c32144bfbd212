"""GET over one kept-alive connection: what the daemon's frequent reads use.

The standard library's ``http.client``, not httpx: the GPU is read 4 times a second and each
engine's ``/metrics`` every tick, and an httpx request cost ~3 ms of CPU here against ~0.5 ms
for this (bench/bench_idle.py; DESIGN §8 allows the idle daemon 1 % of a core). One connection,
re-opened once when the server closed it (a restarted engine, a keep-alive timeout), guarded
by a lock (the sampler and a restart's room check may read at once).
"""

from __future__ import annotations

import http.client
import threading
from urllib.parse import urlsplit

__all__ = ["KeptAlive"]


class KeptAlive:
    """``GET base_url + path`` → (status, body). Raises ``ValueError`` for a URL it cannot
    use, ``OSError`` (``ConnectionRefusedError``, ``TimeoutError``…) or
    ``http.client.HTTPException`` when there is no answer."""

    def __init__(self, base_url: str, timeout: float = 2.0) -> None:
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
        self._connection: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()

    def _connect(self) -> http.client.HTTPConnection:
        if self._https:
            return http.client.HTTPSConnection(self._host, self._port, timeout=self._timeout)
        return http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)

    def get(self, path: str) -> tuple[int, bytes]:
        if self.problem is not None:
            raise ValueError(self.problem)
        with self._lock:
            while True:
                fresh = self._connection is None
                if self._connection is None:
                    self._connection = self._connect()
                try:
                    self._connection.request("GET", self._prefix + path)
                    response = self._connection.getresponse()
                    return response.status, response.read()
                except (OSError, http.client.HTTPException):
                    self._connection.close()
                    self._connection = None
                    # a kept-alive connection the server had closed fails at once: try a new
                    # one; a refusal or a timeout on a fresh connection is the answer
                    if fresh:
                        raise

    def close(self) -> None:
        with self._lock:
            if self._connection is not None:
                self._connection.close()
                self._connection = None
