"""The interface every GPU backend serves, and the ``none`` backend. The samples themselves
are :mod:`tunerd.gpu`'s (DESIGN §4.3)."""

from __future__ import annotations

from typing import Protocol

from tunerd.gpu import NO_GPU, GpuReading

__all__ = ["GpuSource", "NoGpuSource"]


class GpuSource(Protocol):
    """A GPU backend: ``sample()`` never raises for GPU-side trouble; ``close()`` frees it."""

    name: str

    def sample(self) -> GpuReading: ...

    def close(self) -> None: ...


class NoGpuSource:
    """The ``none`` backend: no GPU (a real vLLM on CPU, or a box without NVIDIA)."""

    name = "none"

    def sample(self) -> GpuReading:
        return GpuReading(source=self.name, status=NO_GPU, error="no GPU source configured (none)")

    def close(self) -> None:
        return None
