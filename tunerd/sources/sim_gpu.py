"""GPU memory from the simulator's ``/sim/gpu`` (DESIGN §4.3's object plus ``time``)."""

from __future__ import annotations

import httpx

from tunerd.sources.gpu import DRIVER_GONE, ERROR, GpuReading, reading_from_dict

__all__ = ["SimGpuSource"]


class SimGpuSource:
    """Reads a simulated GPU over HTTP; one pooled connection, short timeouts."""

    name = "sim"

    def __init__(self, url: str, timeout: float = 2.0, client: httpx.Client | None = None) -> None:
        self._url = url.rstrip("/") + "/sim/gpu"
        self._client = client or httpx.Client(timeout=httpx.Timeout(timeout))
        self._owns_client = client is None

    def sample(self) -> GpuReading:
        try:
            response = self._client.get(self._url)
        except httpx.TransportError as error:
            # The simulated driver is unreachable: for the daemon that is a vanished driver.
            return GpuReading(
                source=self.name,
                status=DRIVER_GONE,
                error=f"simulator at {self._url} unreachable: {type(error).__name__}",
            )
        if response.status_code != 200:
            return GpuReading(
                source=self.name,
                status=ERROR,
                error=f"simulator at {self._url} answered HTTP {response.status_code}",
            )
        try:
            return reading_from_dict(response.json(), self.name)
        except ValueError as error:
            return GpuReading(source=self.name, status=ERROR, error=f"simulator at {self._url}: {error}")

    def close(self) -> None:
        if self._owns_client:
            self._client.close()
