"""The NVML backend against a faithful fake of pynvml (tests/fakes/nvml.py)."""

from __future__ import annotations

import time

import pytest

from tests.fakes.nvml import FakeDevice, FakeNvml, FakeProcess
from tunerd.sources.nvml import NvmlSource

MIB = 1024**2


def _box(**first: object) -> FakeNvml:
    devices = [
        FakeDevice(
            uuid="GPU-0aaa",
            processes=[FakeProcess(4242, 20_000 * MIB, "python3"), FakeProcess(1100, 300 * MIB, "Xorg")],
            utilization_percent=87,
            **first,  # type: ignore[arg-type]
        ),
        FakeDevice(uuid="GPU-1bbb", name="NVIDIA GeForce RTX 4090"),
    ]
    return FakeNvml(devices)


class TestMemory:
    def test_sample_memory_v2_separates_reserved(self) -> None:
        reading = NvmlSource(_box(), watch_xid=False).sample()
        gpu = reading.gpus[0]
        assert reading.status == "ok"
        assert reading.details["memory_info"] == "v2"
        assert gpu.memory_total_bytes == 24564 * MIB
        assert gpu.memory_reserved_bytes == 480 * MIB
        assert gpu.memory_used_bytes == 20_300 * MIB  # the processes, not the reservation
        assert gpu.memory_free_bytes == (24564 - 480 - 20_300) * MIB
        assert gpu.utilization_ratio == pytest.approx(0.87)

    def test_sample_memory_v1_fallback_probed_once(self) -> None:
        """An older driver without nvmlDeviceGetMemoryInfo_v2: v1, whose `used` includes the
        reservation, and `reserved` unknown (None, not 0). The probe is not repeated."""
        nvml = _box(supports_v2=False)
        source = NvmlSource(nvml, watch_xid=False)
        first = source.sample()
        calls_after_first = nvml.calls.count("nvmlDeviceGetMemoryInfo")
        second = source.sample()
        assert first.details["memory_info"] == "v1"
        assert first.gpus[0].memory_reserved_bytes is None
        assert first.gpus[0].memory_used_bytes == (20_300 + 480) * MIB
        assert second.gpus[0].memory_used_bytes == first.gpus[0].memory_used_bytes
        # first poll: GPU 0 tried v2 then v1, GPU 1 went straight to v1; later polls: v1 only
        assert calls_after_first == 3
        assert nvml.calls.count("nvmlDeviceGetMemoryInfo") == calls_after_first + 2

    def test_sample_unsupported_utilization_is_none(self) -> None:
        reading = NvmlSource(_box(utilization_supported=False), watch_xid=False).sample()
        assert reading.gpus[0].utilization_ratio is None
        assert "nvmlDeviceGetUtilizationRates" in reading.details["unsupported"]

    def test_sample_processes_with_names_and_unknown_usage(self) -> None:
        nvml = _box()
        nvml.devices[0].processes.append(FakeProcess(5555, None, "notebook"))
        gpu = NvmlSource(nvml, watch_xid=False).sample().gpus[0]
        assert [(p.pid, p.name, p.used_bytes) for p in gpu.processes] == [
            (4242, "python3", 20_000 * MIB),
            (1100, "Xorg", 300 * MIB),
            (5555, "notebook", None),
        ]

    def test_sample_gpus_identified_by_uuid(self) -> None:
        reading = NvmlSource(_box(), watch_xid=False).sample()
        assert [(g.index, g.uuid) for g in reading.gpus] == [(0, "GPU-0aaa"), (1, "GPU-1bbb")]


class TestFailures:
    def test_sample_library_missing_is_a_status(self) -> None:
        nvml = _box()
        nvml.library_present = False
        reading = NvmlSource(nvml, watch_xid=False).sample()
        assert reading.status == "library_missing"
        assert reading.gpus == ()
        assert "libnvidia-ml.so.1" in (reading.error or "")

    def test_sample_driver_not_loaded_then_recovers(self) -> None:
        nvml = _box()
        nvml.driver_loaded = False
        source = NvmlSource(nvml, watch_xid=False)
        assert source.sample().status == "driver_gone"
        nvml.driver_loaded = True
        assert source.sample().status == "ok"

    def test_sample_driver_unloaded_while_running_reinitialises(self) -> None:
        nvml = _box()
        source = NvmlSource(nvml, watch_xid=False)
        assert source.sample().status == "ok"
        nvml.driver_loaded = False
        assert source.sample().status == "driver_gone"
        nvml.driver_loaded = True
        assert source.sample().status == "ok"
        assert nvml.calls.count("nvmlInit") == 2

    def test_sample_gpu_lost_is_an_event_not_a_crash(self) -> None:
        """A GPU that falls off the bus: its sample says so (all readings None), one
        `gpu_lost` event; NVML is re-initialised; recovery is an event too."""
        nvml = _box()
        source = NvmlSource(nvml, watch_xid=False)
        source.sample()
        nvml.devices[0].lost = True
        lost = source.sample()
        assert lost.status == "ok"  # the other GPU still reads
        assert lost.gpus[0].status == "gpu_lost"
        assert lost.gpus[0].memory_used_bytes is None
        assert lost.gpus[1].memory_used_bytes is not None
        assert [(e.kind, e.gpu_index) for e in lost.events] == [("gpu_lost", 0)]
        assert source.sample().events == ()  # still lost: no second event
        nvml.devices[0].lost = False
        recovered = source.sample()
        assert [(e.kind, e.gpu_uuid) for e in recovered.events] == [("gpu_recovered", "GPU-0aaa")]
        assert nvml.calls.count("nvmlInit") >= 2

    def test_sample_mig_gpu_refused_clearly(self) -> None:
        nvml = FakeNvml([FakeDevice(uuid="GPU-a100", name="NVIDIA A100-SXM4-80GB", mig=True)])
        gpu = NvmlSource(nvml, watch_xid=False).sample().gpus[0]
        assert gpu.status == "mig"
        assert "MIG mode" in (gpu.error or "")
        assert gpu.name == "NVIDIA A100-SXM4-80GB"
        assert gpu.memory_used_bytes is None

    def test_close_shuts_nvml_down(self) -> None:
        nvml = _box()
        source = NvmlSource(nvml, watch_xid=False)
        source.sample()
        source.close()
        assert nvml.initialized == 0


class TestXid:
    def test_xid_event_reported_on_next_poll(self) -> None:
        nvml = _box()
        source = NvmlSource(nvml, watch_xid=True)
        try:
            assert source.sample().events == ()
            nvml.raise_xid(1, 79)
            deadline = time.monotonic() + 5
            events = []
            while not events and time.monotonic() < deadline:
                time.sleep(0.02)
                events = [e for e in source.sample().events if e.kind == "xid"]
            assert [(e.gpu_index, e.gpu_uuid, e.data) for e in events] == [(1, "GPU-1bbb", 79)]
        finally:
            source.close()
        assert "nvmlEventSetFree" in nvml.calls

    def test_xid_not_watched_when_unsupported(self) -> None:
        nvml = FakeNvml([FakeDevice(uuid="GPU-x", supports_xid=False)])
        source = NvmlSource(nvml, watch_xid=True)
        source.sample()
        source.close()
        assert "nvmlEventSetWait" not in nvml.calls
