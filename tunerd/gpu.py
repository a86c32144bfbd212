"""One GPU sample in the shape of DESIGN §4.3: what every GPU backend (``tunerd.sources``)
returns and every reader of GPU memory (signals, status, the simulator) takes. Pure types.

A reading is what one poll saw: per-GPU samples plus the poll's status. A field a backend
cannot read is ``None``, never a made-up number (a ``0`` would look like an empty GPU to a
detector). A backend never raises for a GPU-side problem — a lost GPU or an unloaded driver is
a status to act on, not a crash; :class:`GpuUnavailable` is only raised by
:func:`require_gpus` for commands that need an answer now.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "BOTH",
    "COMPUTE",
    "DRIVER_GONE",
    "ERROR",
    "GRAPHICS",
    "LIBRARY_MISSING",
    "NO_GPU",
    "OK",
    "PROCESS_KINDS",
    "GpuEvent",
    "GpuProcess",
    "GpuReading",
    "GpuSample",
    "GpuUnavailable",
    "reading_from_dict",
    "require_gpus",
]

#: Statuses of a whole poll.
OK = "ok"
NO_GPU = "no_gpu"  # the `none` backend, or a driver with zero devices
DRIVER_GONE = "driver_gone"  # NVML: DriverNotLoaded; nvidia-smi: cannot talk to the driver
LIBRARY_MISSING = "library_missing"  # libnvidia-ml.so.1 / nvidia-smi not installed
ERROR = "error"  # anything else, with a message


class GpuUnavailable(Exception):
    """No GPU can be read: no driver, no library, no device. The message is one clear line."""


#: What a process does on the GPU, as the driver lists it (nvidia-smi's C, G and C+G).
COMPUTE = "compute"  # CUDA: an engine, a notebook
GRAPHICS = "graphics"  # a display client: Xorg, a compositor, a browser
BOTH = "compute+graphics"
PROCESS_KINDS = (COMPUTE, GRAPHICS, BOTH)


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    name: str | None
    used_bytes: int | None
    kind: str | None = None  # one of PROCESS_KINDS; None where the backend cannot tell

    def to_dict(self) -> dict[str, Any]:
        return {"pid": self.pid, "name": self.name, "used_bytes": self.used_bytes, "kind": self.kind}


@dataclass(frozen=True)
class GpuSample:
    """One GPU at one moment. ``memory_used_bytes`` excludes driver-reserved memory where the
    backend can separate it (NVML memory info v2, nvidia-smi); otherwise it includes it and
    ``memory_reserved_bytes`` is ``None``."""

    index: int
    uuid: str | None
    name: str | None
    memory_total_bytes: int | None
    memory_used_bytes: int | None
    memory_free_bytes: int | None
    memory_reserved_bytes: int | None
    utilization_ratio: float | None
    processes: tuple[GpuProcess, ...] | None = ()  # None: the list could not be read
    status: str = OK  # ok | gpu_lost | mig | error: this GPU's own state
    error: str | None = None

    @property
    def unattributed_bytes(self) -> int | None:
        """Used memory no listed process accounts for (``used`` − the processes' sum, at
        least 0): processes of another PID namespace, a list the driver keeps short, the
        driver's reservation where it cannot be separated (NVML memory info v1). None when
        the list or a usage is unknown."""
        if self.memory_used_bytes is None or self.processes is None:
            return None
        listed = [process.used_bytes for process in self.processes]
        if any(used is None for used in listed):
            return None
        return max(0, self.memory_used_bytes - sum(used for used in listed if used is not None))

    def to_dict(self) -> dict[str, Any]:
        """DESIGN §4.3's GPU object (plus ``status``, ``error`` and ``unattributed_bytes``)."""
        return {
            "index": self.index,
            "uuid": self.uuid,
            "name": self.name,
            "memory_total_bytes": self.memory_total_bytes,
            "memory_used_bytes": self.memory_used_bytes,
            "memory_free_bytes": self.memory_free_bytes,
            "memory_reserved_bytes": self.memory_reserved_bytes,
            "utilization_ratio": self.utilization_ratio,
            "processes": None if self.processes is None else [p.to_dict() for p in self.processes],
            "unattributed_bytes": self.unattributed_bytes,
            "status": self.status,
            "error": self.error,
        }


@dataclass(frozen=True)
class GpuEvent:
    """Something that happened to a GPU between polls: ``gpu_lost``, ``gpu_recovered``,
    ``xid`` (with the XID number in ``data``)."""

    kind: str
    gpu_uuid: str | None
    gpu_index: int | None
    data: int | None = None
    message: str = ""


@dataclass(frozen=True)
class GpuReading:
    """One poll: every GPU the backend sees, the poll's status and what happened since."""

    source: str
    status: str
    gpus: tuple[GpuSample, ...] = ()
    error: str | None = None
    events: tuple[GpuEvent, ...] = field(default=())
    details: Mapping[str, Any] = field(default_factory=dict)  # e.g. {"memory_info": "v2"}

    def to_dict(self) -> dict[str, Any]:
        """``{"gpus": [...]}`` as ``tunerd inspect gpu --json`` prints it, plus status."""
        return {
            "gpus": [gpu.to_dict() for gpu in self.gpus],
            "source": self.source,
            "status": self.status,
            "error": self.error,
            **({"details": dict(self.details)} if self.details else {}),
        }


def require_gpus(reading: GpuReading) -> GpuReading:
    """``reading`` if it saw at least one GPU; else :class:`GpuUnavailable` with its reason."""
    if reading.status == OK and reading.gpus:
        return reading
    reason = reading.error or f"no GPU found ({reading.source})"
    raise GpuUnavailable(reason)


def _optional_int(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"'{name}' must be an integer or null, got {value!r}")
    return value


def _optional_ratio(value: Any, name: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"'{name}' must be a number or null, got {value!r}")
    return float(value)


def reading_from_dict(data: Mapping[str, Any], source: str) -> GpuReading:
    """Parse ``{"gpus": [...]}`` (the simulator's ``/sim/gpu``, ``inspect gpu --json``)."""
    gpus = data.get("gpus")
    if not isinstance(gpus, list):
        raise ValueError("expected an object with a 'gpus' list")
    samples = []
    for position, raw in enumerate(gpus):
        if not isinstance(raw, Mapping):
            raise ValueError(f"gpus[{position}] must be an object")
        processes: list[GpuProcess] = []
        listed = "processes" not in raw or raw["processes"] is not None  # null: unreadable
        for item in raw.get("processes") or []:
            if not isinstance(item, Mapping) or _optional_int(item.get("pid"), "pid") is None:
                raise ValueError(f"gpus[{position}].processes: each needs an integer 'pid'")
            kind = item.get("kind")
            if kind is not None and kind not in PROCESS_KINDS:
                kinds = ", ".join(PROCESS_KINDS)
                raise ValueError(f"gpus[{position}].processes: 'kind' must be one of {kinds}")
            processes.append(
                GpuProcess(
                    pid=int(item["pid"]),
                    name=str(item["name"]) if item.get("name") is not None else None,
                    used_bytes=_optional_int(item.get("used_bytes"), "used_bytes"),
                    kind=kind,
                )
            )
        index = _optional_int(raw.get("index"), "index")
        samples.append(
            GpuSample(
                index=position if index is None else index,
                uuid=str(raw["uuid"]) if raw.get("uuid") is not None else None,
                name=str(raw["name"]) if raw.get("name") is not None else None,
                memory_total_bytes=_optional_int(raw.get("memory_total_bytes"), "memory_total_bytes"),
                memory_used_bytes=_optional_int(raw.get("memory_used_bytes"), "memory_used_bytes"),
                memory_free_bytes=_optional_int(raw.get("memory_free_bytes"), "memory_free_bytes"),
                memory_reserved_bytes=_optional_int(
                    raw.get("memory_reserved_bytes"), "memory_reserved_bytes"
                ),
                utilization_ratio=_optional_ratio(raw.get("utilization_ratio"), "utilization_ratio"),
                processes=tuple(processes) if listed else None,
                status=str(raw.get("status") or OK),
                error=str(raw["error"]) if raw.get("error") is not None else None,
            )
        )
    details = {"time": data["time"]} if isinstance(data.get("time"), int | float) else {}
    return GpuReading(source=source, status=OK if samples else NO_GPU, gpus=tuple(samples), details=details)
