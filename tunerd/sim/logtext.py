"""vLLM's log lines and failure texts, as the simulator prints them. Pure string building.

Formats follow vLLM 0.33 (``shared/reference/vllm-facts.md`` §2 and §5): the prefix
``(ProcessName pid=N) LEVEL MM-DD HH:MM:SS [file.py:line] message``, GiB as
``round(bytes / 2**30, 2)``, token counts with thousands separators, torch's OOM text with its
``Tried to allocate`` and ``Process N has X memory in use`` parts. ``tunerd inspect log``
reads these lines with the same code that reads a real vLLM's.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from tunerd.sim.engine import CudaOutOfMemory
from tunerd.units import GIB, KIB, MIB

__all__ = ["LogFormat", "gib", "oom_lines", "torch_size"]

VLLM_VERSION = "0.33.0"


def gib(num_bytes: float) -> str:
    """vLLM's ``round(bytes / 2**30, 2)`` printed with ``%s`` (``14.99``, ``6.9``)."""
    return str(round(num_bytes / GIB, 2))


def torch_size(num_bytes: float) -> str:
    """torch's ``format_size`` in OOM texts: ``960.00 MiB``, ``78.43 GiB``."""
    value = float(num_bytes)
    for unit, factor in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if abs(value) >= factor:
            return f"{value / factor:.2f} {unit}"
    return f"{int(value)} bytes"


class LogFormat:
    """Prefixes lines like vLLM's logger; ``clock`` gives the wall time printed."""

    def __init__(self, api_pid: int, engine_pid: int, clock: object = time.time) -> None:
        self.api_pid = api_pid
        self.engine_pid = engine_pid
        self._clock = clock

    def line(
        self,
        message: str,
        *,
        process: str = "APIServer",
        level: str = "INFO",
        source: str = "api_server.py:1839",
    ) -> str:
        pid = self.api_pid if process == "APIServer" else self.engine_pid
        stamp = time.strftime("%m-%d %H:%M:%S", time.localtime(self._clock()))  # type: ignore[operator]
        return f"({process} pid={pid}) {level} {stamp} [{source}] {message}"

    def engine(self, message: str, *, level: str = "INFO", source: str = "core.py:93") -> str:
        return self.line(message, process="EngineCore", level=level, source=source)


def oom_lines(log: LogFormat, oom: CudaOutOfMemory, gpu_index: int = 0) -> list[str]:
    """What vLLM prints when its engine core dies of a CUDA OOM while serving."""
    others = " ".join(
        f"Process {p.pid} has {torch_size(p.used_bytes or 0)} memory in use." for p in oom.others
    )
    text = (
        f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {torch_size(oom.tried_bytes)}. "
        f"GPU {gpu_index} has a total capacity of {torch_size(oom.total_bytes)} of which "
        f"{torch_size(oom.free_bytes)} is free. {others + ' ' if others else ''}Including non-PyTorch "
        f"memory, this process has {torch_size(oom.own_bytes)} memory in use. If reserved but "
        f"unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to "
        f"avoid fragmentation.  See documentation for Memory Management  "
        f"(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
    )
    core = "core.py:710"
    return [
        log.engine("EngineCore encountered a fatal error.", level="ERROR", source=core),
        log.engine("Traceback (most recent call last):", level="ERROR", source=core),
        log.engine(
            '  File "vllm/v1/worker/gpu_model_runner.py", line 2984, in execute_model',
            level="ERROR",
            source=core,
        ),
        log.engine(text, level="ERROR", source=core),
        log.line(
            "[shutdown] MPClient: engine core exited unexpectedly; starting cleanup",
            level="WARNING",
            source="core_client.py:817",
        ),
        log.line("AsyncLLM output_handler failed.", level="ERROR", source="async_llm.py:906"),
        log.line(
            "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack "
            "trace (above) for the root cause.",
            level="ERROR",
            source="async_llm.py:906",
        ),
    ]


def startup_failure_lines(log: LogFormat, lines: Sequence[str]) -> list[str]:
    """A start-up failure: the root cause, then vLLM's summary."""
    out = [log.engine(line, level="ERROR", source="core.py:1510") for line in lines]
    out.append(log.engine("EngineCore failed to start.", level="ERROR", source="core.py:1520"))
    out.append(
        log.line(
            "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
            level="ERROR",
            source="api_server.py:1990",
        )
    )
    return out
