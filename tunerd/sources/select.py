"""Pick a GPU source by name: what ``tunerd inspect gpu --source`` and the config's
``gpu.source`` both mean."""

from __future__ import annotations

from tunerd.sources.gpu import GpuSource, NoGpuSource
from tunerd.sources.nvml import NvmlSource
from tunerd.sources.sim_gpu import SimGpuSource
from tunerd.sources.smi import SmiSource

__all__ = ["GPU_SOURCES", "gpu_source"]

GPU_SOURCES = ("nvml", "nvidia-smi", "sim", "none")


def gpu_source(kind: str, url: str | None = None, timeout: float = 2.0, watch_xid: bool = False) -> GpuSource:
    """A source of ``kind``; ``url`` is for ``sim`` only. ValueError says what is wrong."""
    if kind not in GPU_SOURCES:
        raise ValueError(f"unknown GPU source '{kind}' (choose from {', '.join(GPU_SOURCES)})")
    if kind == "sim":
        if not url:
            raise ValueError("the sim GPU source needs the simulator's base URL")
        return SimGpuSource(url, timeout=timeout)
    if url:
        raise ValueError("a URL is only for the sim GPU source")
    if kind == "nvidia-smi":
        return SmiSource(timeout=timeout)
    if kind == "none":
        return NoGpuSource()
    return NvmlSource(watch_xid=watch_xid)
