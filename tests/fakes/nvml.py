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
- ``nvmlEventSetWait`` raises Timeout when nothing happened within ``timeoutms``;
- older drivers (``FakeNvml(lacks=...)``: the C functions the driver's libnvidia-ml.so.1 does
  not export) as nvidia-ml-py 13 meets them: a versioned wrapper whose symbol is missing raises
  FunctionNotFound (``_nvmlGetFunctionPointer``), and the unversioned
  ``nvmlDeviceGetComputeRunningProcesses`` / ``...GraphicsRunningProcesses`` — which call
  ``_v3`` under ``throwOnVersionMismatch`` — raise ``NVMLLibraryMismatchError``, a plain
  ``Exception``. Drivers before R450 have no ``_v2`` (pynvml#43: ``undefined symbol:
  nvmlDeviceGetComputeRunningProcesses_v2`` on 430 and 440; NVIDIA/k8s-device-plugin#331), and
  ``_v3`` came with R510/R515 (DataDog/integrations-extras#2159); the original call with the
  v1 struct (``pid``, ``usedGpuMemory``) every driver exports, through
  ``_nvmlGetFunctionPointer``: C calling convention (count by reference, ``None`` or an
  array; NVML_ERROR_INSUFFICIENT_SIZE with the count when it does not fit);
- graphics clients (Xorg, a compositor, a browser) are in the *graphics* list only, a process
  that is both in both lists with the same usage (what nvidia-smi shows as ``C+G``); memory no
  listed process holds (``other_used_bytes``) is in ``used`` but in no list.

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
    kind: str = "compute"  # "compute", "graphics" (Xorg, a compositor) or "compute+graphics"


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

    NVML_SUCCESS = pynvml.NVML_SUCCESS
    NVML_ERROR_INSUFFICIENT_SIZE = pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    NVMLLibraryMismatchError = pynvml.NVMLLibraryMismatchError

    def __init__(self, devices: list[FakeDevice] | None = None, *, lacks: set[str] | None = None) -> None:
        self.devices = devices if devices is not None else []
        #: C functions this driver's libnvidia-ml.so.1 does not export (an older driver)
        self.lacks = set(lacks or ())
        #: a function whose every call fails with this NVML error code (a failing field)
        self.failing: dict[str, int] = {}
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
    def _call(self, name: str, symbol: str | None = None) -> None:
        """Bookkeeping of a call to ``name`` whose C function is ``symbol`` (default: the same)."""
        with self._lock:
            self.calls.append(name)
        if not self.initialized:
            raise NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        if (symbol or name) in self.lacks:  # as _nvmlGetFunctionPointer does
            raise NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        if not self.driver_loaded:
            raise NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
        if name in self.failing:
            raise NVMLError(self.failing[name])

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
        if not device.supports_v2 or "nvmlDeviceGetMemoryInfo_v2" in self.lacks:
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

    def _listed(self, handle: _Handle, kind: str) -> list[FakeProcess]:
        device = self._device(handle)
        if not device.processes_readable:
            raise NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)
        return [process for process in device.processes if kind in process.kind.split("+")]

    def _friendly(self, processes: list[FakeProcess]) -> list[Any]:
        """What nvidia-ml-py's _v2/_v3 wrappers return: friendly objects of the v2 struct, with
        ``usedGpuMemory`` None where the driver says NVML_VALUE_NOT_AVAILABLE."""
        return [
            nvmlFriendlyObject(
                {
                    "pid": process.pid,
                    "usedGpuMemory": process.used_bytes,
                    "gpuInstanceId": 0xFFFFFFFF,
                    "computeInstanceId": 0xFFFFFFFF,
                }
            )
            for process in processes
        ]

    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle: _Handle) -> list[Any]:
        self._call("nvmlDeviceGetComputeRunningProcesses_v3")
        return self._friendly(self._listed(handle, "compute"))

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: _Handle) -> list[Any]:
        self._call("nvmlDeviceGetComputeRunningProcesses_v2")
        return self._friendly(self._listed(handle, "compute"))

    def nvmlDeviceGetGraphicsRunningProcesses_v3(self, handle: _Handle) -> list[Any]:
        self._call("nvmlDeviceGetGraphicsRunningProcesses_v3")
        return self._friendly(self._listed(handle, "graphics"))

    def nvmlDeviceGetGraphicsRunningProcesses_v2(self, handle: _Handle) -> list[Any]:
        self._call("nvmlDeviceGetGraphicsRunningProcesses_v2")
        return self._friendly(self._listed(handle, "graphics"))

    def _mismatch(self, versioned: Any, handle: _Handle) -> list[Any]:
        """nvidia-ml-py 13's unversioned call: ``_v3`` under ``throwOnVersionMismatch``."""
        try:
            result: list[Any] = versioned(handle)
        except pynvml.NVMLError_FunctionNotFound:
            raise pynvml.NVMLLibraryMismatchError(
                "Unversioned function called and the pyNVML version does not match the NVML lib "
                "version. Either use matching pyNVML and NVML lib versions or use a versioned "
                "function such as nvmlDeviceGetComputeRunningProcesses_v2"
            ) from None
        return result

    def nvmlDeviceGetComputeRunningProcesses(self, handle: _Handle) -> list[Any]:
        return self._mismatch(self.nvmlDeviceGetComputeRunningProcesses_v3, handle)

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: _Handle) -> list[Any]:
        return self._mismatch(self.nvmlDeviceGetGraphicsRunningProcesses_v3, handle)

    def _nvmlGetFunctionPointer(self, name: str) -> Any:
        """A C function of the library, called the C way (the original process calls, v1)."""
        if not self.initialized:
            raise NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        if name in self.lacks:
            raise NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        kinds = {
            "nvmlDeviceGetComputeRunningProcesses": "compute",
            "nvmlDeviceGetGraphicsRunningProcesses": "graphics",
        }
        if name not in kinds:
            raise NotImplementedError(f"the fake has no C function {name}")

        def function(handle: _Handle, count: Any, infos: Any) -> int:
            """``nvmlReturn_t fn(nvmlDevice_t, unsigned int *infoCount, nvmlProcessInfo_v1_t *)``."""
            try:
                self._call(name)
                listed = self._listed(handle, kinds[name])
            except NVMLError as error:
                return int(error.value)
            room = count._obj.value  # byref(c_uint): the array's length going in
            count._obj.value = len(listed)
            if not listed:
                return pynvml.NVML_SUCCESS
            if infos is None or room < len(listed):
                return pynvml.NVML_ERROR_INSUFFICIENT_SIZE
            for slot, process in zip(infos, listed, strict=False):
                slot.pid = process.pid
                used = process.used_bytes
                slot.usedGpuMemory = pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value if used is None else used
            return pynvml.NVML_SUCCESS

        return function

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
