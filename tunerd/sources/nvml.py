"""GPU memory through NVML (``nvidia-ml-py``, module ``pynvml``): the only file importing it.

Every NVML call goes through :meth:`NvmlSource._query`, which turns ``NVMLError`` subclasses
into a status (``not_supported``, ``no_permission``, ``gpu_lost``, ``driver_gone``,
``error``) and the reading into ``None``: a GPU that falls off the bus is an event, not a
crash. NVML is initialised once, on first use, and re-initialised on the poll after a lost
GPU or an unloaded driver. Memory info v2 (which separates driver-reserved memory) is probed
once per process and the choice is reported in ``GpuReading.details``. XID critical errors
are read by one background thread (NVML's event sets are not thread safe, so nothing else
touches that set). MIG-enabled GPUs are refused per GPU with a clear message: their memory
belongs to GPU instances that tunerd does not read yet.

Checked against nvidia-ml-py 13.615.71 (function names, signatures, struct fields, error
classes); ``tests/fakes/nvml.py`` mirrors exactly the part used here.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import pynvml  # the one import of NVML in tunerd

from tunerd.gpu import (
    BOTH,
    COMPUTE,
    DRIVER_GONE,
    ERROR,
    GRAPHICS,
    LIBRARY_MISSING,
    NO_GPU,
    OK,
    GpuEvent,
    GpuProcess,
    GpuReading,
    GpuSample,
)

__all__ = ["NvmlSource", "XidWatcher"]

GPU_LOST = "gpu_lost"
NOT_SUPPORTED = "not_supported"  # the GPU does not do it (a GeForce's MIG, XID events)
MISSING = "missing"  # the driver or the bindings lack the function: an older one may do
NO_PERMISSION = "no_permission"
_MIG = "mig"

# NVMLError subclass name (without the prefix) → status. Anything else is "error".
_ERROR_STATUS = {
    "NotSupported": NOT_SUPPORTED,
    "FunctionNotFound": MISSING,
    "ArgumentVersionMismatch": MISSING,
    "NoPermission": NO_PERMISSION,
    "GpuIsLost": GPU_LOST,
    "ResetRequired": GPU_LOST,
    "GpuNotFound": GPU_LOST,
    "DriverNotLoaded": DRIVER_GONE,
    "Uninitialized": DRIVER_GONE,
    "LibraryNotFound": LIBRARY_MISSING,
}


@dataclass(frozen=True)
class _Result:
    value: Any
    status: str
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.status == OK


class NvmlSource:
    """Poll every GPU through NVML. ``nvml`` is the ``pynvml`` module (or a faithful fake)."""

    name = "nvml"

    def __init__(self, nvml: Any | None = None, *, watch_xid: bool = True) -> None:
        self._nvml = nvml if nvml is not None else pynvml
        self._watch_xid = watch_xid
        self._initialized = False
        self._memory_version: str | None = None  # "v2" or "v1", probed once
        self._lost: set[int] = set()  # indexes of GPUs last seen lost
        self._uuids: dict[int, str] = {}  # index → UUID, remembered for GPUs that get lost
        self._process_names: dict[int, str | None] = {}
        self._alive_pids: set[int] = set()
        self._xid_unavailable = False  # no GPU supports XID events: do not ask every poll
        #: functions whose absence (or the GPU's "not supported") left a field unread
        self._missing: set[str] = set()
        #: kind of process list → how it is read when the newest call is missing
        self._fallbacks: dict[str, str] = {}
        #: kind of process list → the position in _PROCESS_CALLS of the call this driver answers
        self._process_call: dict[str, int] = {}
        self._xid: XidWatcher | None = None
        self._lock = threading.Lock()

    # -- the one door -------------------------------------------------------------------
    def _status_of(self, error: BaseException) -> str:
        name = type(error).__name__.removeprefix("NVMLError_")
        return _ERROR_STATUS.get(name, ERROR)

    def _query(self, function: str, *args: Any, **kwargs: Any) -> _Result:
        """Call ``function`` of the module through :meth:`_guard`."""
        call = getattr(self._module(), function, None)
        if call is None:  # an nvidia-ml-py older than the function
            self._missing.add(function)
            return _Result(None, MISSING, f"{function}: not in this nvidia-ml-py")
        return self._guard(function, call, *args, **kwargs)

    def _guard(self, function: str, call: Callable[..., Any], *args: Any, **kwargs: Any) -> _Result:
        """The one door: whatever a call raises becomes a status, so one field never ends a
        sample. A function this driver or these bindings lack is :data:`MISSING` and
        remembered (``GpuReading.details["unsupported"]``), as is one the GPU does not do."""
        nvml = self._module()
        mismatch = getattr(nvml, "NVMLLibraryMismatchError", ())
        try:
            return _Result(call(*args, **kwargs), OK)
        except nvml.NVMLError as error:
            status = self._status_of(error)
            if status in {NOT_SUPPORTED, MISSING} and function not in _CAPABILITY_PROBES:
                self._missing.add(function)
            return _Result(None, status, f"{function}: {error}")
        except mismatch as error:  # a plain Exception: the unversioned call's _v3 is missing
            self._missing.add(function)
            return _Result(None, MISSING, f"{function}: {error}")
        except Exception as error:  # UnicodeDecodeError (names are decoded as UTF-8), ctypes, …
            return _Result(None, ERROR, f"{function}: {type(error).__name__}: {error}")

    def _module(self) -> Any:
        return self._nvml

    # -- lifecycle ----------------------------------------------------------------------
    def _ensure_init(self) -> _Result:
        if self._initialized:
            return _Result(None, OK)
        result = self._query("nvmlInit")
        if result.ok:
            self._initialized = True
            return result
        if result.status == LIBRARY_MISSING:
            return _Result(
                None, LIBRARY_MISSING, "NVML library not found (libnvidia-ml.so.1): no NVIDIA driver"
            )
        if result.status == DRIVER_GONE:
            return _Result(None, DRIVER_GONE, "NVIDIA driver not loaded (NVML: DriverNotLoaded)")
        return _Result(None, result.status, f"NVML failed to initialise: {result.message}")

    def _reset(self) -> list[GpuEvent]:
        """Forget the NVML session so that the next poll initialises it again; returns the XID
        events the watcher still held (an XID 79 comes with a lost GPU)."""
        events: list[GpuEvent] = []
        if self._xid is not None:
            self._xid.stop()
            events = self._xid.drain()
            self._xid = None
        self._xid_unavailable = False
        if self._initialized:
            self._query("nvmlShutdown")
        self._initialized = False
        return events

    def close(self) -> None:
        self._reset()

    # -- polling ------------------------------------------------------------------------
    def sample(self) -> GpuReading:
        with self._lock:
            return self._sample()

    def _sample(self) -> GpuReading:
        init = self._ensure_init()
        if not init.ok:
            return GpuReading(source=self.name, status=init.status, error=init.message)
        count = self._query("nvmlDeviceGetCount")
        if not count.ok:
            self._reset()
            status = ERROR if count.status == ERROR else DRIVER_GONE
            return GpuReading(source=self.name, status=status, error=count.message)
        if count.value == 0:
            return GpuReading(source=self.name, status=NO_GPU, error="NVML sees no GPU")
        samples: list[GpuSample] = []
        events: list[GpuEvent] = []
        handles: list[tuple[Any, str | None]] = []
        self._alive_pids = set()
        newly_lost = False
        for index in range(count.value):
            sample, handle = self._sample_device(index)
            if sample.uuid is not None:
                self._uuids[index] = sample.uuid
            elif index in self._uuids:
                sample = replace(sample, uuid=self._uuids[index])
            samples.append(sample)
            handles.append((handle, sample.uuid))
            if sample.status == GPU_LOST and index not in self._lost:
                self._lost.add(index)
                newly_lost = True
                events.append(GpuEvent("gpu_lost", sample.uuid, index, message=sample.error or ""))
            elif sample.status != GPU_LOST and index in self._lost:
                self._lost.discard(index)
                events.append(GpuEvent("gpu_recovered", sample.uuid, index))
        for pid in set(self._process_names) - self._alive_pids:
            del self._process_names[pid]
        if any(sample.status == DRIVER_GONE for sample in samples):
            events.extend(self._reset())
            return GpuReading(
                source=self.name,
                status=DRIVER_GONE,
                gpus=tuple(samples),
                error="NVIDIA driver went away while reading",
                events=tuple(events),
            )
        if newly_lost:
            events.extend(self._reset())  # NVML wants a fresh session after a GPU is lost
        elif self._watch_xid and self._xid is None and not self._xid_unavailable:
            self._xid = XidWatcher.start(self._module(), handles, self._query)
            self._xid_unavailable = self._xid is None
        if self._xid is not None:
            events.extend(self._xid.drain())
        details = {"memory_info": self._memory_version or "unknown"}
        if self._missing:
            details["unsupported"] = ", ".join(sorted(self._missing))
        if self._fallbacks:
            details["process_calls"] = "; ".join(self._fallbacks[kind] for kind in sorted(self._fallbacks))
        return GpuReading(
            source=self.name, status=OK, gpus=tuple(samples), events=tuple(events), details=details
        )

    def _lost_sample(self, index: int, uuid: str | None, status: str, message: str) -> GpuSample:
        return GpuSample(
            index=index,
            uuid=uuid,
            name=None,
            memory_total_bytes=None,
            memory_used_bytes=None,
            memory_free_bytes=None,
            memory_reserved_bytes=None,
            utilization_ratio=None,
            status=status,
            error=message,
        )

    def _sample_device(self, index: int) -> tuple[GpuSample, Any]:
        handle = self._query("nvmlDeviceGetHandleByIndex", index)
        if not handle.ok:
            return self._lost_sample(index, None, handle.status, handle.message), None
        uuid = self._query("nvmlDeviceGetUUID", handle.value)
        uuid_value = str(uuid.value) if uuid.ok else None
        if uuid.status in {GPU_LOST, DRIVER_GONE}:
            return self._lost_sample(index, None, uuid.status, uuid.message), handle.value
        name = self._query("nvmlDeviceGetName", handle.value)
        mig = self._query("nvmlDeviceGetMigMode", handle.value)
        if mig.ok and mig.value[0] == self._module().NVML_DEVICE_MIG_ENABLE:
            message = (
                f"GPU {index} ({uuid_value}) is in MIG mode: its memory belongs to GPU instances, "
                f"which tunerd does not read; run the engine on a GPU without MIG"
            )
            sample = self._lost_sample(index, uuid_value, _MIG, message)
            return replace(sample, name=str(name.value) if name.ok else None), handle.value
        memory = self._memory(handle.value)
        if memory.status in {GPU_LOST, DRIVER_GONE}:
            return self._lost_sample(index, uuid_value, memory.status, memory.message), handle.value
        total = used = free = reserved = None
        if memory.ok:
            total, used, free, reserved = memory.value
        utilization = self._query("nvmlDeviceGetUtilizationRates", handle.value)
        processes = self._processes(handle.value)
        return (
            GpuSample(
                index=index,
                uuid=uuid_value,
                name=str(name.value) if name.ok else None,
                memory_total_bytes=total,
                memory_used_bytes=used,
                memory_free_bytes=free,
                memory_reserved_bytes=reserved,
                utilization_ratio=utilization.value.gpu / 100 if utilization.ok else None,
                processes=processes,
            ),
            handle.value,
        )

    def _memory(self, handle: Any) -> _Result:
        """(total, used, free, reserved) bytes; v2 separates reserved memory from used."""
        nvml = self._module()
        if self._memory_version in {None, "v2"}:
            version = getattr(nvml, "nvmlMemory_v2", None)
            result = (
                _Result(None, MISSING)  # an nvidia-ml-py older than memory info v2
                if version is None
                else self._query("nvmlDeviceGetMemoryInfo", handle, version=version)
            )
            if result.ok:
                self._memory_version = "v2"
                info = result.value
                return _Result((int(info.total), int(info.used), int(info.free), int(info.reserved)), OK)
            # the probe: v2 missing, refused, or the bindings taking no version (a TypeError
            # the door made an error) — v1 from now on; once v2 worked, a failure is a failure
            probing = self._memory_version is None and result.status not in {GPU_LOST, DRIVER_GONE}
            if not (probing or result.status in {NOT_SUPPORTED, MISSING}):
                return result
            self._memory_version = "v1"
            self._missing.discard("nvmlDeviceGetMemoryInfo")  # v1 answers: nothing is unread
        result = self._query("nvmlDeviceGetMemoryInfo", handle)
        if not result.ok:
            return result
        info = result.value
        # v1's `used` includes driver-reserved memory (since R510); it cannot be separated.
        return _Result((int(info.total), int(info.used), int(info.free), None), OK)

    def _processes(self, handle: Any) -> tuple[GpuProcess, ...] | None:
        """The processes on a GPU — compute (CUDA) and graphics (Xorg, a compositor, a
        browser) — one per PID: a process in both lists is ``compute+graphics`` with the larger
        of its two usages (the driver reports the same). ``None`` when the compute list cannot
        be read (not an empty GPU: a container without the host PID namespace, NoPermission);
        an unreadable graphics list leaves the compute processes."""
        compute = self._listed(handle, COMPUTE)
        if compute is None:
            return None
        merged: dict[int, tuple[int | None, list[str]]] = {}
        for kind, listed in ((COMPUTE, compute), (GRAPHICS, self._listed(handle, GRAPHICS) or [])):
            for pid, used in listed:
                known, kinds = merged.get(pid, (None, []))
                if used is not None:
                    known = used if known is None else max(known, used)
                merged[pid] = (known, [*kinds, kind] if kind not in kinds else kinds)
        processes = []
        for pid, (used, kinds) in merged.items():
            self._alive_pids.add(pid)
            if pid not in self._process_names:
                name = self._query("nvmlSystemGetProcessName", pid)
                self._process_names[pid] = str(name.value) if name.ok else None
            kind = kinds[0] if len(kinds) == 1 else BOTH
            processes.append(GpuProcess(pid, self._process_names[pid], used, kind))
        return tuple(processes)

    def _listed(self, handle: Any, kind: str) -> list[tuple[int, int | None]] | None:
        """(pid, used bytes) of one list, through the newest call this driver answers: the
        calls are probed newest first until one is there, and the choice is kept."""
        calls = _PROCESS_CALLS[kind]
        chosen = self._process_call.get(kind)
        if chosen == len(calls):  # the driver has none of them
            return None
        v1 = len(calls) - 1  # the original call: C calling convention
        for position in range(len(calls)) if chosen is None else (chosen,):
            function = calls[position]
            if position == v1:
                result = self._guard(f"{function} (v1)", self._v1_processes, function, handle)
            else:
                result = self._query(function, handle)
            if result.status == MISSING and chosen is None:
                continue  # not in this driver: an older call may be
            self._process_call[kind] = position
            if chosen is None and position:  # an older call answers: the newer ones are not a lack
                skipped = calls[:position]
                self._missing.difference_update(skipped)
                label = f"{function} (v1)" if position == v1 else function
                self._fallbacks[kind] = f"{kind} processes via {label}: the driver lacks {', '.join(skipped)}"
            if not result.ok:
                return None
            if position == v1:
                return list(result.value)
            return [
                (int(info.pid), None if info.usedGpuMemory is None else int(info.usedGpuMemory))
                for info in result.value
            ]
        self._process_call[kind] = len(calls)  # none is: not asked again
        return None

    def _v1_processes(self, symbol: str, handle: Any) -> list[tuple[int, int | None]]:
        """The original process call (``nvmlProcessInfo_v1_t``: pid, used memory), which every
        driver exports and nvidia-ml-py 12+ no longer wraps: drivers before R450 have nothing
        newer. Called as nvidia-ml-py calls the others: the count first, then an array with
        room for processes that start meanwhile."""
        nvml = self._module()
        function = nvml._nvmlGetFunctionPointer(symbol)
        count = ctypes.c_uint(0)
        code = function(handle, ctypes.byref(count), None)
        if code == nvml.NVML_SUCCESS:
            return []
        if code != nvml.NVML_ERROR_INSUFFICIENT_SIZE:
            raise nvml.NVMLError(code)
        count.value = count.value * 2 + 5
        infos = (_ProcessInfoV1 * count.value)()
        code = function(handle, ctypes.byref(count), infos)
        if code != nvml.NVML_SUCCESS:
            raise nvml.NVMLError(code)
        return [
            (int(info.pid), None if info.usedGpuMemory == _NOT_AVAILABLE else int(info.usedGpuMemory))
            for info in infos[: count.value]
        ]


class _ProcessInfoV1(ctypes.Structure):
    """``nvmlProcessInfo_v1_t`` (nvml.h before R450)."""

    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]


#: Calls whose "not supported" is an answer about the GPU, not a field left unread: a GeForce
#: has no MIG mode, many GPUs no XID events.
_CAPABILITY_PROBES = {
    "nvmlDeviceGetMigMode",
    "nvmlDeviceGetSupportedEventTypes",
    "nvmlDeviceRegisterEvents",
    "nvmlEventSetCreate",
}
_NOT_AVAILABLE = 2**64 - 1  # NVML_VALUE_NOT_AVAILABLE as an unsigned long long: usage unknown
#: Each list's calls, newest first. ``_v3`` (R510+), ``_v2`` (R450+) are nvidia-ml-py's; the
#: last is the driver's original C function (v1), which every driver exports. nvidia-ml-py 13's
#: unversioned wrappers call ``_v3`` and raise NVMLLibraryMismatchError without it.
_PROCESS_CALLS = {
    COMPUTE: (
        "nvmlDeviceGetComputeRunningProcesses_v3",
        "nvmlDeviceGetComputeRunningProcesses_v2",
        "nvmlDeviceGetComputeRunningProcesses",
    ),
    GRAPHICS: (
        "nvmlDeviceGetGraphicsRunningProcesses_v3",
        "nvmlDeviceGetGraphicsRunningProcesses_v2",
        "nvmlDeviceGetGraphicsRunningProcesses",
    ),
}


class XidWatcher:
    """One thread waiting on an NVML event set for XID critical errors on every GPU."""

    WAIT_MS = 500

    def __init__(
        self, nvml: Any, event_set: Any, uuids: dict[int, str | None], query: Callable[..., _Result]
    ) -> None:
        self._nvml = nvml
        self._event_set = event_set
        self._uuids = uuids  # id(handle) is unreliable across calls; map by device index
        self._query = query
        self._events: list[GpuEvent] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tunerd-nvml-xid", daemon=True)

    @classmethod
    def start(
        cls, nvml: Any, handles: list[tuple[Any, str | None]], query: Callable[..., _Result]
    ) -> XidWatcher | None:
        """Register every GPU that supports XID events; ``None`` when none does."""
        created = query("nvmlEventSetCreate")
        if not created.ok:
            return None
        registered = 0
        uuids: dict[int, str | None] = {}
        for index, (handle, uuid) in enumerate(handles):
            if handle is None:
                continue
            supported = query("nvmlDeviceGetSupportedEventTypes", handle)
            if not supported.ok or not supported.value & nvml.nvmlEventTypeXidCriticalError:
                continue
            if query(
                "nvmlDeviceRegisterEvents", handle, nvml.nvmlEventTypeXidCriticalError, created.value
            ).ok:
                registered += 1
                uuids[index] = uuid
        if not registered:
            query("nvmlEventSetFree", created.value)
            return None
        watcher = cls(nvml, created.value, uuids, query)
        watcher._thread.start()
        return watcher

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    data = self._nvml.nvmlEventSetWait(self._event_set, self.WAIT_MS)
                except self._nvml.NVMLError_Timeout:
                    continue
                except self._nvml.NVMLError as error:
                    with self._lock:
                        self._events.append(GpuEvent("xid_watch_failed", None, None, message=str(error)))
                    return
                index_result = self._query("nvmlDeviceGetIndex", data.device)
                index = int(index_result.value) if index_result.ok else None
                uuid = self._uuids.get(index) if index is not None else None
                with self._lock:
                    self._events.append(
                        GpuEvent(
                            "xid", uuid, index, data=int(data.eventData), message=f"XID {int(data.eventData)}"
                        )
                    )
        finally:
            self._query("nvmlEventSetFree", self._event_set)

    def drain(self) -> list[GpuEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.WAIT_MS / 1000)
