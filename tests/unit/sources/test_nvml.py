"""The NVML backend against a faithful fake of pynvml (tests/fakes/nvml.py)."""

from __future__ import annotations

import time

import pynvml
import pytest

from tests.fakes.nvml import FakeDevice, FakeNvml, FakeProcess
from tunerd.sources.nvml import NvmlSource

MIB = 1024**2


def _box(**first: object) -> FakeNvml:
    devices = [
        FakeDevice(
            uuid="GPU-0aaa",
            processes=[
                FakeProcess(4242, 20_000 * MIB, "python3"),
                FakeProcess(1100, 300 * MIB, "Xorg", kind="graphics"),
            ],
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
        assert [(p.pid, p.name, p.used_bytes, p.kind) for p in gpu.processes] == [
            (4242, "python3", 20_000 * MIB, "compute"),
            (5555, "notebook", None, "compute"),
            (1100, "Xorg", 300 * MIB, "graphics"),
        ]
        assert gpu.unattributed_bytes is None  # one usage unknown: cannot say

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


# -- older drivers, desktops, failing fields (issue 17) ----------------------------------------

#: What drivers export, by release (the fake's docstring has the sources): R470 has _v2 but no
#: _v3; R440 has only the original calls and memory info v1.
R470 = {"nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetGraphicsRunningProcesses_v3"}
R440 = R470 | {
    "nvmlDeviceGetComputeRunningProcesses_v2",
    "nvmlDeviceGetGraphicsRunningProcesses_v2",
    "nvmlDeviceGetMemoryInfo_v2",
}


DESKTOP_PIDS = [1100, 1789, 2424, 3003, 4242, 5151]


def _desktop(lacks: set[str] | None = None) -> FakeNvml:
    """A desktop 4090 (the seed's box): the engine, a notebook, the display server, a
    compositor and a browser drawing on it, one process doing both, and 37 MiB no list holds."""
    return FakeNvml(
        [
            FakeDevice(
                uuid="GPU-desk",
                processes=[
                    FakeProcess(4242, 20_000 * MIB, "python3"),
                    FakeProcess(5151, 900 * MIB, "jupyter"),
                    FakeProcess(1100, 310 * MIB, "/usr/lib/xorg/Xorg", kind="graphics"),
                    FakeProcess(1789, 120 * MIB, "/usr/bin/gnome-shell", kind="graphics"),
                    FakeProcess(2424, 260 * MIB, "firefox", kind="graphics"),
                    FakeProcess(3003, 500 * MIB, "blender", kind="compute+graphics"),
                ],
                other_used_bytes=37 * MIB,
            )
        ],
        lacks=lacks,
    )


class TestOlderDrivers:
    def test_the_unversioned_call_on_a_driver_without_v3_is_missing_not_a_crash(self) -> None:
        """nvidia-ml-py 13's nvmlDeviceGetComputeRunningProcesses calls _v3 and raises
        NVMLLibraryMismatchError, a plain Exception, where the driver lacks it: the door
        turns it into a status instead of letting it out of sample()."""
        nvml = _desktop(lacks=R470)
        source = NvmlSource(nvml, watch_xid=False)
        source.sample()
        handle = nvml.nvmlDeviceGetHandleByIndex(0)
        with pytest.raises(nvml.NVMLLibraryMismatchError):
            nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        result = source._query("nvmlDeviceGetComputeRunningProcesses", handle)
        assert (result.ok, result.status) == (False, "missing")
        assert "pyNVML version does not match" in result.message

    @pytest.mark.parametrize(
        ("lacks", "calls"),
        [
            (set(), ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetGraphicsRunningProcesses_v3")),
            (R470, ("nvmlDeviceGetComputeRunningProcesses_v2", "nvmlDeviceGetGraphicsRunningProcesses_v2")),
            (R440, ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses")),
        ],
        ids=["r550", "r470", "r440"],
    )
    def test_processes_come_through_the_newest_call_the_driver_has(
        self, lacks: set[str], calls: tuple[str, str]
    ) -> None:
        """v3 → v2 → the original v1 call, probed on the first poll and kept: later polls ask
        the chosen call only, and the reading says which calls the driver lacks."""
        nvml = _desktop(lacks=lacks)
        source = NvmlSource(nvml, watch_xid=False)
        first = source.sample()
        asked = len(nvml.calls)
        second = source.sample()
        for reading in (first, second):
            assert reading.status == "ok"
            assert sorted(p.pid for p in reading.gpus[0].processes or ()) == DESKTOP_PIDS
        later = nvml.calls[asked:]
        for call in calls:  # once; the original C call twice: the count, then the array
            assert later.count(call) == (2 if lacks == R440 else 1), (call, later)
        assert not [c for c in later if "RunningProcesses" in c and c not in calls], later
        # what the driver lacks is said where it shows — how the lists are read — and is not
        # listed as unread, since an older call read them
        assert "RunningProcesses" not in first.details.get("unsupported", "")
        if lacks:
            said = first.details["process_calls"]
            assert f"compute processes via {calls[0]}" in said, said
            assert all(name in said for name in lacks if "Processes" in name), said
        else:
            assert "process_calls" not in first.details

    def test_a_driver_without_any_process_call_has_no_list_and_is_not_asked_again(self) -> None:
        everything = {
            f"nvmlDeviceGet{kind}RunningProcesses{version}"
            for kind in ("Compute", "Graphics")
            for version in ("", "_v2", "_v3")
        }
        nvml = _desktop(lacks=everything)
        source = NvmlSource(nvml, watch_xid=False)
        first = source.sample()
        asked = len(nvml.calls)
        second = source.sample()
        assert first.status == second.status == "ok"
        assert first.gpus[0].processes is None  # unknown, not an empty GPU
        assert first.gpus[0].memory_used_bytes == (20_000 + 900 + 310 + 120 + 260 + 500 + 37) * MIB
        assert not [call for call in nvml.calls[asked:] if "RunningProcesses" in call]


class TestDesktop:
    def test_graphics_clients_are_seen_and_attributed_per_pid(self) -> None:
        gpu = NvmlSource(_desktop(), watch_xid=False).sample().gpus[0]
        seen = {p.pid: (p.name, p.used_bytes, p.kind) for p in gpu.processes or ()}
        assert seen == {
            4242: ("python3", 20_000 * MIB, "compute"),
            5151: ("jupyter", 900 * MIB, "compute"),
            3003: ("blender", 500 * MIB, "compute+graphics"),  # in both lists, counted once
            1100: ("/usr/lib/xorg/Xorg", 310 * MIB, "graphics"),
            1789: ("/usr/bin/gnome-shell", 120 * MIB, "graphics"),
            2424: ("firefox", 260 * MIB, "graphics"),
        }
        assert gpu.unattributed_bytes == 37 * MIB
        assert gpu.to_dict()["unattributed_bytes"] == 37 * MIB

    def test_an_unreadable_graphics_list_leaves_the_compute_processes(self) -> None:
        nvml = _desktop()
        nvml.failing["nvmlDeviceGetGraphicsRunningProcesses_v3"] = pynvml.NVML_ERROR_UNKNOWN
        gpu = NvmlSource(nvml, watch_xid=False).sample().gpus[0]
        assert sorted(p.pid for p in gpu.processes or ()) == [3003, 4242, 5151]
        assert gpu.unattributed_bytes == (310 + 120 + 260 + 37) * MIB  # the display's share too


class TestFailingFields:
    @pytest.mark.parametrize(
        ("function", "code"),
        [
            ("nvmlDeviceGetUtilizationRates", pynvml.NVML_ERROR_UNKNOWN),
            ("nvmlDeviceGetName", pynvml.NVML_ERROR_NO_PERMISSION),
            ("nvmlSystemGetProcessName", pynvml.NVML_ERROR_NOT_FOUND),
            ("nvmlDeviceGetMigMode", pynvml.NVML_ERROR_UNKNOWN),
        ],
    )
    def test_one_failing_field_is_none_and_the_sample_goes_on(self, function: str, code: int) -> None:
        nvml = _desktop()
        nvml.failing[function] = code
        reading = NvmlSource(nvml, watch_xid=False).sample()
        gpu = reading.gpus[0]
        assert (reading.status, gpu.status) == ("ok", "ok")
        assert gpu.memory_used_bytes is not None
        assert len(gpu.processes or ()) == 6

    def test_a_field_that_raises_something_else_is_an_error_reading_of_that_field(self) -> None:
        """pynvml decodes names as UTF-8; a driver that hands back other bytes raises
        UnicodeDecodeError — and a future binding may raise anything. The field is None."""
        nvml = _desktop()

        def broken(handle: object) -> str:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

        nvml.nvmlDeviceGetName = broken  # type: ignore[method-assign]
        reading = NvmlSource(nvml, watch_xid=False).sample()
        assert reading.status == "ok"
        assert reading.gpus[0].name is None
        assert reading.gpus[0].memory_total_bytes == 24564 * MIB


class TestWhatIsSaidMissing:
    def test_a_geforce_without_mig_or_xid_has_nothing_unsupported(self) -> None:
        """A GeForce answers 'not supported' to MIG mode and may to XID events: answers about
        the card, not fields tunerd failed to read."""
        nvml = _desktop()
        nvml.devices[0].supports_xid = False
        reading = NvmlSource(nvml, watch_xid=True).sample()
        assert "unsupported" not in reading.details, reading.details

    def test_bindings_that_take_no_memory_version_fall_back_to_v1(self) -> None:
        """An nvidia-ml-py whose nvmlDeviceGetMemoryInfo takes no ``version`` raises TypeError:
        the door makes it an error, and the probe then settles on v1 (the review found the
        fallback unreachable behind the door)."""
        nvml = _desktop()
        real = nvml.nvmlDeviceGetMemoryInfo

        def old(handle: object) -> object:
            return real(handle)  # type: ignore[arg-type]

        nvml.nvmlDeviceGetMemoryInfo = old  # type: ignore[method-assign, assignment]
        source = NvmlSource(nvml, watch_xid=False)
        first, second = source.sample(), source.sample()
        for reading in (first, second):
            assert reading.details["memory_info"] == "v1"
            assert reading.gpus[0].memory_total_bytes == 24564 * MIB
            assert reading.gpus[0].memory_reserved_bytes is None
        assert "unsupported" not in first.details
