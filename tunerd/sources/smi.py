"""GPU memory through ``nvidia-smi``'s CSV queries: the fallback when NVML cannot be used.

Two queries per poll (argv lists, no shell)::

    nvidia-smi --query-gpu=index,uuid,name,memory.total,memory.used,memory.free,
               memory.reserved,utilization.gpu --format=csv,noheader,nounits
    nvidia-smi --query-compute-apps=gpu_uuid,pid,process_name,used_memory
               --format=csv,noheader,nounits

Values are MiB and percent integers; a field the driver cannot report prints ``[N/A]`` (older
drivers ``[Not Supported]``, deprecated ones ``[Requested functionality has been
deprecated]``), which becomes ``None``, never 0. Drivers without ``memory.reserved`` answer
``Field "memory.reserved" is not a valid field to query.`` and exit 2: the backend drops the
field, remembers that, and asks again. Without a driver nvidia-smi prints ``NVIDIA-SMI has
failed because it couldn't communicate with the NVIDIA driver ...`` and exits 9.

Graphics clients (Xorg, a compositor, a browser) are in no CSV query: ``--query-compute-apps``
lists compute processes only. Every :data:`GRAPHICS_EVERY_S` the backend also reads
``nvidia-smi -q -x`` (the whole report: ``-d PIDS`` does not work with ``-x``) and takes its
``<processes>``, whose ``<type>`` is ``C``, ``G`` or ``C+G``; the graphics ones join the compute
list, one per PID.

``parse_query_gpu``, ``parse_compute_apps`` and ``parse_processes_xml`` are pure, tested on
recorded real output;
:class:`SmiSource` runs the commands through an injectable runner. Numbers are read one way:
ASCII digits with an optional fraction (``24564``, ``85.12``), finite, percentages within
0–100; any other cell (``1e400``, ``²``, ``-5``, ``nan``) is output nvidia-smi should not have
printed, so the parsers raise :class:`SmiError` and nothing else, and ``sample()`` never raises.
"""

from __future__ import annotations

import csv
import math
import re
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from xml.etree import ElementTree

from tunerd.gpu import (
    BOTH,
    COMPUTE,
    DRIVER_GONE,
    ERROR,
    GRAPHICS,
    LIBRARY_MISSING,
    NO_GPU,
    OK,
    GpuProcess,
    GpuReading,
    GpuSample,
)

__all__ = [
    "GPU_FIELDS",
    "CommandResult",
    "SmiError",
    "SmiSource",
    "parse_compute_apps",
    "parse_processes_xml",
    "parse_query_gpu",
]

#: How often the graphics clients are read (``nvidia-smi -q -x`` costs ~0.1–0.3 s): they come
#: and go with a desktop's windows, not with each sample.
GRAPHICS_EVERY_S = 10.0
_XML_MAX_BYTES = 8 << 20  # a box of 8 GPUs reports ~0.3 MiB
_KINDS = {"C": COMPUTE, "G": GRAPHICS, "C+G": BOTH}

MIB = 1024**2
GPU_FIELDS = (
    "index",
    "uuid",
    "name",
    "memory.total",
    "memory.used",
    "memory.free",
    "memory.reserved",
    "utilization.gpu",
)
APP_FIELDS = ("gpu_uuid", "pid", "process_name", "used_memory")
# Every bracketed placeholder nvidia-smi prints instead of a value.
_MISSING_PREFIX = "["
# A value cell: ASCII digits, an optional fraction. float() alone also takes 1e400, nan, -5,
# 1_000 and non-ASCII digits; str.isdigit() takes "²", which int() refuses.
_DECIMAL = re.compile(r"[0-9]+(?:\.[0-9]+)?")
# More digits than any index or PID (int() of a 4,300-digit text raises).
_MAX_DIGITS = 20


class SmiError(ValueError):
    """Output nvidia-smi should not have printed; the message quotes the line."""


@dataclass(frozen=True)
class CommandResult:
    returncode: int
    stdout: str
    stderr: str


Runner = Callable[[Sequence[str], float], CommandResult]


def run_command(argv: Sequence[str], timeout: float) -> CommandResult:
    """Run ``argv`` (no shell); a missing program is returncode 127, a hang 124."""
    try:
        done = subprocess.run(
            list(argv),
            capture_output=True,
            encoding="utf-8",
            errors="replace",  # a name in another encoding is not worth a crash
            timeout=timeout,
            check=False,
        )
    except FileNotFoundError:
        return CommandResult(127, "", f"{argv[0]}: command not found")
    except subprocess.TimeoutExpired:
        return CommandResult(124, "", f"{argv[0]} did not answer within {timeout:g}s")
    except OSError as error:  # not executable, a directory, …: as a shell reports it
        return CommandResult(126, "", f"{argv[0]}: {error.strerror or error}")
    return CommandResult(done.returncode, done.stdout, done.stderr)


def _value(text: str) -> str | None:
    """A cell's text, or None for every placeholder nvidia-smi prints instead of a value:
    ``[N/A]``, ``N/A``, ``[Not Supported]``, ``[Unknown Error]``, ``[Requested functionality
    has been deprecated]``, ``[Insufficient Permissions]``, or nothing."""
    text = text.strip()
    if not text or text.startswith(_MISSING_PREFIX) or text == "N/A":
        return None
    return text


def _decimal(text: str) -> float | None:
    """A cell's finite non-negative number, or None when the cell is anything else."""
    if _DECIMAL.fullmatch(text) is None:
        return None
    value = float(text)  # 400 digits overflow to inf
    return value if math.isfinite(value) else None


def _count(cell: str, field: str, line: str) -> int:
    """An index or a PID: ASCII digits, never a placeholder."""
    text = _value(cell)
    if text is None or not (text.isascii() and text.isdecimal()) or len(text) > _MAX_DIGITS:
        raise SmiError(f"{field}: expected a number, got '{cell.strip()}' in line '{line}'")
    return int(text)


def _mib(text: str, field: str, line: str) -> int | None:
    value = _value(text)
    if value is None:
        return None
    mib = _decimal(value.removesuffix("MiB").strip())  # the unit is there without `nounits`
    size = None if mib is None else mib * MIB
    if size is None or not math.isfinite(size):
        raise SmiError(f"{field}: expected MiB, got '{text.strip()}' in line '{line}'")
    return int(size)


def _ratio(text: str, line: str) -> float | None:
    """``utilization.gpu`` (percent, ``%`` without `nounits`) as 0–1."""
    value = _value(text)
    if value is None:
        return None
    percent = _decimal(value.removesuffix("%").strip())
    if percent is None or percent > 100:
        raise SmiError(f"utilization.gpu: expected percent, got '{value}' in line '{line}'")
    return percent / 100


def _field_name(header: str) -> str:
    """``memory.total [MiB]`` → ``memory.total`` (headers keep units even with nounits)."""
    return header.split(" [", 1)[0].strip()


def _table(text: str, fields: Sequence[str] | None) -> tuple[list[str], list[tuple[str, dict[str, str]]]]:
    """Rows of a CSV answer as {field: cell}; with ``fields=None`` the first line is the header."""
    lines = [line for line in text.splitlines() if line.strip()]
    if fields is None:
        if not lines:
            return [], []
        header, *lines = lines
        fields = [_field_name(cell) for cell in _cells(header)]
    names = list(fields)
    rows = []
    for line in lines:
        cells = [cell.strip() for cell in _cells(line)]
        if len(cells) != len(names):
            raise SmiError(f"expected {len(names)} fields, got {len(cells)} in line '{line}'")
        rows.append((line, dict(zip(names, cells, strict=True))))
    return names, rows


def _cells(line: str) -> list[str]:
    """One CSV line's cells; csv's own error (a cell past its 128 KiB limit) is an SmiError."""
    try:
        return next(csv.reader([line], skipinitialspace=True))
    except csv.Error as error:
        raise SmiError(f"not CSV ({error}) in line '{line[:200]}'") from None


def parse_query_gpu(text: str, fields: Sequence[str] | None = GPU_FIELDS) -> list[GpuSample]:
    """One sample per line of ``--query-gpu=<fields> --format=csv[,noheader][,nounits]``.

    ``fields`` are the queried fields in order (``None``: read them from the header line).
    Fields tunerd does not use are ignored; ``index`` defaults to the line's position.
    """
    _, rows = _table(text, fields)
    samples = []
    for position, (line, row) in enumerate(rows):
        index = _count(row.get("index", str(position)), "index", line)
        ratio = _ratio(row.get("utilization.gpu", ""), line)
        samples.append(
            GpuSample(
                index=index,
                uuid=_value(row.get("uuid", row.get("gpu_uuid", ""))),
                name=_value(row.get("name", row.get("gpu_name", ""))),
                memory_total_bytes=_mib(row.get("memory.total", ""), "memory.total", line),
                memory_used_bytes=_mib(row.get("memory.used", ""), "memory.used", line),
                memory_free_bytes=_mib(row.get("memory.free", ""), "memory.free", line),
                memory_reserved_bytes=_mib(row.get("memory.reserved", ""), "memory.reserved", line),
                utilization_ratio=ratio,
            )
        )
    return samples


def parse_compute_apps(text: str, fields: Sequence[str] | None = APP_FIELDS) -> dict[str, list[GpuProcess]]:
    """Processes per GPU UUID from ``--query-compute-apps=...`` (``None``: header first).

    ``used_memory`` is also read as ``used_gpu_memory`` (its header name); a process whose
    usage the driver cannot see (Windows WDDM prints ``[N/A]``) has ``used_bytes`` None.
    """
    _, rows = _table(text, fields)
    by_gpu: dict[str, list[GpuProcess]] = {}
    for line, row in rows:
        pid = _count(row.get("pid", ""), "pid", line)
        used = row.get("used_memory", row.get("used_gpu_memory", ""))
        by_gpu.setdefault(row.get("gpu_uuid", ""), []).append(
            GpuProcess(
                pid=pid,
                name=_value(row.get("process_name", row.get("name", ""))),
                used_bytes=_mib(used, "used_memory", line),
                kind=COMPUTE,  # the compute list: graphics clients are not in it
            )
        )
    return by_gpu


def parse_processes_xml(text: str) -> dict[str, list[GpuProcess]]:
    """Processes per GPU UUID from ``nvidia-smi -q -x``'s ``<processes>``, with their kind
    (``<type>`` C, G or C+G) and usage (``343 MiB``; ``N/A`` is None). Output nvidia-smi should
    not print — not XML, an entity declaration (nvidia-smi declares none: refused before
    parsing), a GPU without a UUID, a PID or usage that is not a number — is an
    :class:`SmiError`."""
    if len(text) > _XML_MAX_BYTES:
        raise SmiError(f"nvidia-smi -q -x printed {len(text):,} characters, more than any box reports")
    if "<!ENTITY" in text:
        raise SmiError("nvidia-smi -q -x output declares an entity: nvidia-smi never does")
    try:
        root = ElementTree.fromstring(text)
    except (ElementTree.ParseError, ValueError) as error:
        raise SmiError(f"nvidia-smi -q -x output is not XML: {error}") from None
    if root.tag != "nvidia_smi_log":
        raise SmiError(f"nvidia-smi -q -x output is not an nvidia_smi_log: <{root.tag}>")
    by_gpu: dict[str, list[GpuProcess]] = {}
    for gpu in root.findall("gpu"):
        uuid = (gpu.findtext("uuid") or "").strip()
        if not uuid:
            raise SmiError("a <gpu> of nvidia-smi -q -x has no <uuid>")
        listed = by_gpu.setdefault(uuid, [])
        for info in gpu.findall("processes/process_info"):
            pid_text = (info.findtext("pid") or "").strip()
            line = f"pid {pid_text!r} on {uuid}"
            pid = _count(pid_text, "pid", line)
            kind = _KINDS.get((info.findtext("type") or "").strip())
            used_text = (info.findtext("used_memory") or "").strip().removesuffix("MiB").strip()
            name = (info.findtext("process_name") or "").strip() or None
            listed.append(GpuProcess(pid, name, _mib(used_text, "used_memory", line), kind))
    return by_gpu


def _failure(result: CommandResult) -> tuple[str, str]:
    """(status, one-line message) for a failed nvidia-smi run."""
    text = (result.stdout + "\n" + result.stderr).strip()
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    if result.returncode == 127:
        return LIBRARY_MISSING, "nvidia-smi not found on PATH: no NVIDIA driver installed"
    if "couldn't communicate with the NVIDIA driver" in text or result.returncode == 9:
        return DRIVER_GONE, f"nvidia-smi cannot talk to the NVIDIA driver (exit {result.returncode}): {first}"
    if "Driver/library version mismatch" in text:
        return DRIVER_GONE, f"nvidia-smi: {first} (reboot or reload the driver) (exit {result.returncode})"
    if result.returncode == 15 or "fallen off the bus" in text:
        return ERROR, f"nvidia-smi: a GPU has fallen off the bus (exit {result.returncode}): {first}"
    if "No devices were found" in text or "No supported GPUs were found" in text:
        return NO_GPU, f"nvidia-smi: {first}"
    return ERROR, f"nvidia-smi failed (exit {result.returncode}): {first or 'no output'}"


class SmiSource:
    """Poll GPUs by running nvidia-smi (about 10–20 ms a call; NVML is ~100× cheaper)."""

    name = "nvidia-smi"

    def __init__(
        self,
        binary: str = "nvidia-smi",
        runner: Runner = run_command,
        timeout: float = 5.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._binary = binary
        self._runner = runner
        self._timeout = timeout
        self._fields = list(GPU_FIELDS)
        self._monotonic = monotonic
        self._graphics: dict[str, list[GpuProcess]] = {}  # the last -q -x's graphics clients
        self._graphics_at: float | None = None
        self._graphics_problem: str | None = None

    def _query(self, *args: str) -> CommandResult:
        return self._runner([self._binary, *args], self._timeout)

    def _query_gpus(self) -> CommandResult:
        while True:
            result = self._query(f"--query-gpu={','.join(self._fields)}", "--format=csv,noheader,nounits")
            unknown = _unknown_field(result)
            if unknown is None or unknown not in self._fields or unknown in {"index", "uuid"}:
                return result
            self._fields.remove(unknown)  # an older driver: ask without it from now on

    def sample(self) -> GpuReading:
        result = self._query_gpus()
        if result.returncode != 0:
            status, message = _failure(result)
            return GpuReading(source=self.name, status=status, error=message)
        try:
            samples = parse_query_gpu(result.stdout, self._fields)
        except SmiError as error:
            return GpuReading(source=self.name, status=ERROR, error=f"nvidia-smi --query-gpu: {error}")
        if not samples:
            return GpuReading(source=self.name, status=NO_GPU, error="nvidia-smi lists no GPU")
        apps = self._query(f"--query-compute-apps={','.join(APP_FIELDS)}", "--format=csv,noheader,nounits")
        processes: dict[str, list[GpuProcess]] = {}
        problem = None
        if apps.returncode == 0:
            try:
                processes = parse_compute_apps(apps.stdout)
            except SmiError as error:
                problem = f"nvidia-smi --query-compute-apps: {error}"
        else:
            problem = _failure(apps)[1]
        graphics = self._graphics_clients()
        gpus = tuple(
            replace(
                sample,
                processes=None
                if problem
                else _merged(processes.get(sample.uuid or "", []), graphics.get(sample.uuid or "", [])),
            )
            for sample in samples
        )
        details = {"fields": ",".join(self._fields)}
        if problem:
            details["processes_error"] = problem
        if self._graphics_problem:
            details["graphics_error"] = self._graphics_problem
        return GpuReading(source=self.name, status=OK, gpus=gpus, details=details)

    def _graphics_clients(self) -> dict[str, list[GpuProcess]]:
        """The graphics clients per GPU UUID, read anew every :data:`GRAPHICS_EVERY_S`. A report
        that cannot be read keeps the last list and says why (``details.graphics_error``)."""
        now = self._monotonic()
        if self._graphics_at is not None and now - self._graphics_at < GRAPHICS_EVERY_S:
            return self._graphics
        self._graphics_at = now
        report = self._query("-q", "-x")
        if report.returncode != 0:
            self._graphics_problem = _failure(report)[1]
            return self._graphics
        try:
            listed = parse_processes_xml(report.stdout)
        except SmiError as error:
            self._graphics_problem = f"nvidia-smi -q -x: {error}"
            return self._graphics
        self._graphics_problem = None
        self._graphics = {
            uuid: [process for process in processes if process.kind in (GRAPHICS, BOTH)]
            for uuid, processes in listed.items()
        }
        return self._graphics

    def close(self) -> None:
        return None


def _merged(compute: list[GpuProcess], graphics: list[GpuProcess]) -> tuple[GpuProcess, ...]:
    """The compute list and the graphics clients, one per PID (both: ``compute+graphics``)."""
    merged = {process.pid: process for process in compute}
    for client in graphics:
        known = merged.get(client.pid)
        if known is None:
            merged[client.pid] = client
        else:
            used = max((u for u in (known.used_bytes, client.used_bytes) if u is not None), default=None)
            merged[client.pid] = GpuProcess(client.pid, known.name or client.name, used, BOTH)
    return tuple(merged.values())


def _unknown_field(result: CommandResult) -> str | None:
    """The field named in ``Field "x" is not a valid field to query.``, if that is the error."""
    text = result.stdout + result.stderr
    marker = "is not a valid field to query"
    if result.returncode == 0 or marker not in text:
        return None
    for line in text.splitlines():
        if marker in line and '"' in line:
            return line.split('"')[1]
    return None
