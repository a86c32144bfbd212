"""GPU sources for the tests of what is built on them (the sampler, the daemon)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pynvml

from tunerd.gpu import OK, GpuReading

__all__ = ["MismatchedGpu"]


class MismatchedGpu:
    """A source whose reads raise what nvidia-ml-py 13 raises on a driver without
    ``nvmlDeviceGetComputeRunningProcesses_v3``: NVMLLibraryMismatchError, a plain Exception
    (what the NVML backend let out before issue 17) — until ``fixed``; then good readings with
    ``details``."""

    name = "nvml"

    def __init__(self, details: Mapping[str, Any] | None = None) -> None:
        self.fixed = False
        self.details = dict(details or {})

    def sample(self) -> GpuReading:
        if not self.fixed:
            raise pynvml.NVMLLibraryMismatchError("Unversioned function called and the pyNVML version ...")
        return GpuReading(source=self.name, status=OK, details=self.details)

    def close(self) -> None:
        pass
