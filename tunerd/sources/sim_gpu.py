"""GPU memory from the simulator's ``/sim/gpu`` (DESIGN §4.3's object plus ``time``).

Read 4 times a second by the sampler, over one kept-alive connection
(:class:`~tunerd.sources.http.KeptAlive`: httpx cost ~4 ms of CPU a read here, 1.6 % of a core
at 4 Hz on its own, bench/bench_idle.py).
"""

from __future__ import annotations

import http.client
import json

from tunerd.gpu import DRIVER_GONE, ERROR, GpuReading, reading_from_dict
from tunerd.sources.http import KeptAlive

__all__ = ["SimGpuSource"]


class SimGpuSource:
    """Reads a simulated GPU over HTTP; short timeouts."""

    name = "sim"

    def __init__(self, url: str, timeout: float = 2.0) -> None:
        self._url = url.rstrip("/") + "/sim/gpu"
        self._http = KeptAlive(url, timeout)

    def sample(self) -> GpuReading:
        try:
            status, body = self._http.get("/sim/gpu")
        except (OSError, http.client.HTTPException, ValueError) as error:
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
        self._http.close()
