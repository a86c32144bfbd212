"""A fake of the part of ``pynvml`` (nvidia-ml-py) that tunerd uses, for machines without a GPU.

Faithful where tunerd looks, checked against nvidia-ml-py 13.615.71's ``pynvml.py``:

- the same function names and signatures (``nvmlDeviceGetMemoryInfo(handle, version=None)``,
  ``nvmlEventSetWait(eventSet, timeoutms)`` ...);
- the real error classes: errors are raised as ``pynvml.NVMLError(code)``, which pynvml maps to
  its ``NVMLError_<Name>`` subclass, so ``except pynvml.NVMLError_GpuIsLost`` works unchanged;
- the real ctypes structs (``c_nvmlMemory_t``, ``c_nvmlMemory_v2_t``, ``c_nvmlUtilization_t``)
  and the friendly objects of ``nvmlDeviceGetComputeRunningProcesses``
  (``pid``, ``usedGpuMemory`` = None when not available);
- memory info v1's ``used`` includes driver-reserved memory (R510+, wookayin/gpustat#141), v2
  separates it; a driver without ``nvmlDeviceGetMemoryInfo_v2`` raises FunctionNotFound, as
  ``_nvmlGetFunctionPointer`` does;
- ``nvmlInit`` without libnvidia-ml.so.1 raises LibraryNotFound (seen on this machine: the
  real pynvml, no driver); calls before ``nvmlInit`` raise Uninitialized;
- ``nvmlEventSetWait`` raises Timeout when nothing happened within ``timeoutms``.

A scenario sets devices and failures; tests flip them between polls.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any

import pynvml
from pynvml import (  # the real classes and constants, re-exported like the module does
    NVML_DEVICE_MIG_DISABLE,
    NVML_DEVICE_MIG_ENABLE,
    NVMLError,
    NVMLError_GpuIsLost,
    NVMLError_Timeout,
    c_nvmlMemory_t,
    c_nvmlMemory_v2_t,
    c_nvmlUtilization_t,
    nvmlEventTypeXidCriticalError,
    nvmlFriendlyObject,
    nvmlMemory_v2,
)

__all__ = ["FakeDevice", "FakeNvml", "FakeProcess", "NVMLError", "NVMLError_GpuIsLost", "NVMLError_Timeout"]

MIB = 1024**2


@dataclass
class FakeProcess:
    pid: int
    used_bytes: int | None
    name: str = "python3"


@dataclass
class FakeDevice:
    uuid: str
    name: str = "NVIDIA GeForce RTX 4090"
    total_bytes: int = 24564 * MIB
    reserved_bytes: int = 480 * MIB
    processes: list[FakeProcess] = field(default_factory=list)
    utilization_percent: int = 0
    other_used_bytes: int = 0  # memory used by no listed compute process (a display server)
    mig: bool = False
    lost: bool = False
    supports_v2: bool = True
    supports_xid: bool = True
    utilization_supported: bool = True
    processes_readable: bool = True  # False: NoPermission, as in a container without host PIDs

    @property
    def used_bytes(self) -> int:
        """v2 `used`: processes plus other users, not the driver's reservation."""
        return self.other_used_bytes + sum(p.used_bytes or 0 for p in self.processes)


@dataclass(frozen=True)
class _Handle:
    index: int


class FakeNvml:
    """Stands in for the ``pynvml`` module: ``NvmlSource(nvml=FakeNvml(...))``."""

    # constants and error classes are the real ones
    NVMLError = NVMLError
    NVMLError_Timeout = NVMLError_Timeout
    NVMLError_GpuIsLost = NVMLError_GpuIsLost
    NVML_DEVICE_MIG_ENABLE = NVML_DEVICE_MIG_ENABLE
    NVML_DEVICE_MIG_DISABLE = NVML_DEVICE_MIG_DISABLE
    nvmlMemory_v2 = nvmlMemory_v2
    nvmlEventTypeXidCriticalError = nvmlEventTypeXidCriticalError

    def __init__(self, devices: list[FakeDevice] | None = None) -> None:
        self.devices = devices if devices is not None else []
        self.library_present = True
        self.driver_loaded = True
        self.initialized = 0  # nvmlInit is reference-counted
        self.calls: list[str] = []
        self._event_sets: dict[int, queue.Queue[tuple[int, int]]] = {}
        self._registered: dict[int, set[int]] = {}
        self._lock = threading.Lock()

    # -- helpers for tests -------------------------------------------------------------
    def raise_xid(self, index: int, xid: int) -> None:
        """An XID critical error on GPU ``index`` (delivered to every set it is registered in)."""
        for set_id, devices in self._registered.items():
            if index in devices:
                self._event_sets[set_id].put((index, xid))

    # -- internals ---------------------------------------------------------------------
    def _call(self, name: str) -> None:
        with self._lock:
            self.calls.append(name)
        if not self.initialized:
            raise NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        if not self.driver_loaded:
            raise NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)

    def _device(self, handle: _Handle) -> FakeDevice:
        device = self.devices[handle.index]
        if device.lost:
            raise NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return device

    # -- the pynvml API tunerd uses ----------------------------------------------------
    def nvmlInit(self) -> None:
        self.calls.append("nvmlInit")
        if not self.library_present:
            raise NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
        if not self.driver_loaded:
            raise NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
        self.initialized += 1

    def nvmlShutdown(self) -> None:
        self._call("nvmlShutdown")
        self.initialized -= 1

    def nvmlDeviceGetCount(self) -> int:
        self._call("nvmlDeviceGetCount")
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        self._call("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.devices):
            raise NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return _Handle(index)

    def nvmlDeviceGetIndex(self, handle: _Handle) -> int:
        self._call("nvmlDeviceGetIndex")
        return handle.index

    def nvmlDeviceGetUUID(self, handle: _Handle) -> str:
        self._call("nvmlDeviceGetUUID")
        return self._device(handle).uuid

    def nvmlDeviceGetName(self, handle: _Handle) -> str:
        self._call("nvmlDeviceGetName")
        return self._device(handle).name

    def nvmlDeviceGetMigMode(self, device: _Handle) -> list[int]:
        self._call("nvmlDeviceGetMigMode")
        fake = self._device(device)
        if not fake.name.startswith(("NVIDIA A100", "NVIDIA H100", "NVIDIA H200", "NVIDIA A30")):
            raise NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)  # consumer cards have no MIG
        mode = NVML_DEVICE_MIG_ENABLE if fake.mig else NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    def nvmlDeviceGetMemoryInfo(self, handle: _Handle, version: int | None = None) -> Any:
        self._call("nvmlDeviceGetMemoryInfo")
        device = self._device(handle)
        if not version:
            memory = c_nvmlMemory_t()
            memory.total = device.total_bytes
            memory.used = device.used_bytes + device.reserved_bytes  # v1 counts the reservation
            memory.free = device.total_bytes - memory.used
            return memory
        if not device.supports_v2:
            raise NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        memory2 = c_nvmlMemory_v2_t()
        memory2.version = version
        memory2.total = device.total_bytes
        memory2.reserved = device.reserved_bytes
        memory2.used = device.used_bytes
        memory2.free = device.total_bytes - device.reserved_bytes - device.used_bytes
        return memory2

    def nvmlDeviceGetUtilizationRates(self, handle: _Handle) -> Any:
        self._call("nvmlDeviceGetUtilizationRates")
        device = self._device(handle)
        if not device.utilization_supported:
            raise NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        rates = c_nvmlUtilization_t()
        rates.gpu = device.utilization_percent
        rates.memory = 0
        return rates

    def nvmlDeviceGetComputeRunningProcesses(self, handle: _Handle) -> list[Any]:
        self._call("nvmlDeviceGetComputeRunningProcesses")
        device = self._device(handle)
        if not device.processes_readable:
            raise NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)
        result = []
        for process in device.processes:
            info = nvmlFriendlyObject(
                {
                    "pid": process.pid,
                    "usedGpuMemory": process.used_bytes,
                    "gpuInstanceId": 0xFFFFFFFF,
                    "computeInstanceId": 0xFFFFFFFF,
                }
            )
            result.append(info)
        return result

    def nvmlSystemGetProcessName(self, pid: int) -> str:
        self._call("nvmlSystemGetProcessName")
        for device in self.devices:
            for process in device.processes:
                if process.pid == pid:
                    return process.name
        raise NVMLError(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlEventSetCreate(self) -> int:
        self._call("nvmlEventSetCreate")
        set_id = len(self._event_sets) + 1
        self._event_sets[set_id] = queue.Queue()
        self._registered[set_id] = set()
        return set_id

    def nvmlDeviceGetSupportedEventTypes(self, handle: _Handle) -> int:
        self._call("nvmlDeviceGetSupportedEventTypes")
        return nvmlEventTypeXidCriticalError if self._device(handle).supports_xid else 0

    def nvmlDeviceRegisterEvents(self, handle: _Handle, eventTypes: int, eventSet: int) -> None:
        self._call("nvmlDeviceRegisterEvents")
        if not self._device(handle).supports_xid:
            raise NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        self._registered[eventSet].add(handle.index)

    def nvmlEventSetWait(self, eventSet: int, timeoutms: int) -> Any:
        self._call("nvmlEventSetWait")
        try:
            index, xid = self._event_sets[eventSet].get(timeout=timeoutms / 1000)
        except queue.Empty:
            raise NVMLError(pynvml.NVML_ERROR_TIMEOUT) from None
        # The real call returns a c_nvmlEventData_t whose `device` is a handle pointer; these
        # attribute names are the ones it has.
        return nvmlFriendlyObject(
            {
                "device": _Handle(index),
                "eventType": nvmlEventTypeXidCriticalError,
                "eventData": xid,
                "gpuInstanceId": 0,
                "computeInstanceId": 0,
            }
        )

    def nvmlEventSetFree(self, eventSet: int) -> None:
        self._call("nvmlEventSetFree")
        self._event_sets.pop(eventSet, None)
        self._registered.pop(eventSet, None)
