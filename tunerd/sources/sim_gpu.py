"""GPU memory from the simulator's ``/sim/gpu`` (DESIGN §4.3's object plus ``time``).

Read 4 times a second by the sampler, so the client is the standard library's: one kept-alive
connection (re-opened once when the simulator restarted and closed it), guarded by a lock
(the sampler and a restart's room check may read at once). httpx cost ~4 ms of CPU a read
here, 1.6 % of a core at 4 Hz on its own (bench/bench_idle.py).
"""

from __future__ import annotations

import http.client
import json
import threading
from urllib.parse import urlsplit

from tunerd.sources.gpu import DRIVER_GONE, ERROR, GpuReading, reading_from_dict

__all__ = ["SimGpuSource"]


class SimGpuSource:
    """Reads a simulated GPU over HTTP; short timeouts."""

    name = "sim"

    def __init__(self, url: str, timeout: float = 2.0) -> None:
        parts = urlsplit(url.rstrip("/"))
        self._host = parts.hostname or "127.0.0.1"
        self._port = parts.port or 80
        self._path = parts.path + "/sim/gpu"
        self._url = url.rstrip("/") + "/sim/gpu"
        self._timeout = timeout
        self._connection: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()

    def _get(self) -> tuple[int, bytes]:
        with self._lock:
            for attempt in (1, 2):
                if self._connection is None:
                    self._connection = http.client.HTTPConnection(
                        self._host, self._port, timeout=self._timeout
                    )
                try:
                    self._connection.request("GET", self._path)
                    response = self._connection.getresponse()
                    return response.status, response.read()
                except (OSError, http.client.HTTPException):
                    self._connection.close()
                    self._connection = None
                    if attempt == 2:
                        raise
        raise AssertionError("unreachable")

    def sample(self) -> GpuReading:
        try:
            status, body = self._get()
        except (OSError, http.client.HTTPException) as error:
            # The simulated driver is unreachable: for the daemon that is a vanished driver.
            return GpuReading(
                source=self.name,
                status=DRIVER_GONE,
                error=f"simulator at {self._url} unreachable: {type(error).__name__}",
            )
        if status != 200:
            return GpuReading(
                source=self.name, status=ERROR, error=f"simulator at {self._url} answered HTTP {status}"
            )
        try:
            return reading_from_dict(json.loads(body), self.name)
        except ValueError as error:
            return GpuReading(source=self.name, status=ERROR, error=f"simulator at {self._url}: {error}")

    def close(self) -> None:
        with self._lock:
            if self._connection is not None:
                self._connection.close()
                self._connection = None
