"""nvidia-smi CSV parsing on recorded real outputs (tests/data/nvidia-smi, see PROVENANCE.md)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from tunerd.sources.smi import (
    CommandResult,
    SmiError,
    SmiSource,
    parse_compute_apps,
    parse_processes_xml,
    parse_query_gpu,
)

SMI = Path(__file__).parents[2] / "data" / "nvidia-smi"
MIB = 1024**2
P4_FIELDS = (
    "fan.speed,memory.total,memory.used,memory.free,pstate,temperature.gpu,name,uuid,compute_mode,"
    "utilization.gpu,utilization.memory,index"
).split(",")


def _read(name: str) -> str:
    return (SMI / name).read_text()


class TestParseQueryGpu:
    def test_parse_two_gpus_not_supported_fields_are_none(self) -> None:
        """2 × Tesla P4 (telegraf#4120): fan.speed is [Not Supported]; memory reads right."""
        gpus = parse_query_gpu(_read("query-gpu-2gpu-not-supported-teslap4-384.csv"), P4_FIELDS)
        assert [g.index for g in gpus] == [0, 1]
        for gpu in gpus:
            assert gpu.memory_total_bytes == 7606 * MIB
            assert gpu.memory_used_bytes == 0
            assert gpu.memory_free_bytes == 7606 * MIB
            assert gpu.memory_reserved_bytes is None  # not queried: unknown, never 0
            assert gpu.utilization_ratio == 0.0
            assert gpu.name == "Tesla P4"

    def test_parse_na_memory_is_none_not_zero(self) -> None:
        """DGX Spark (unsloth#10703) reports [N/A] for its unified memory; with a header."""
        gpus = parse_query_gpu(_read("query-gpu-gb10-memory-na.csv"), fields=None)
        assert len(gpus) == 1
        assert gpus[0].name == "NVIDIA GB10"
        assert gpus[0].memory_total_bytes is None
        assert gpus[0].memory_free_bytes is None

    def test_parse_header_with_units_and_reserved(self) -> None:
        """`--format=csv,nounits` keeps units in the header; memory.reserved is read."""
        gpus = parse_query_gpu(_read("query-gpu-memory-reserved-teslap100-nounits.csv"), fields=None)
        assert gpus[0].memory_reserved_bytes == 103 * MIB
        assert gpus[0].memory_used_bytes == 0
        assert gpus[0].memory_free_bytes == 16280 * MIB
        assert gpus[0].index == 0  # no index field: the line's position

    def test_parse_h200_values_with_units_and_placeholders(self) -> None:
        """214 fields from an H200 (driver 580) with units on every value and every kind of
        placeholder ([N/A], [Requested functionality has been deprecated], N/A, empty)."""
        gpus = parse_query_gpu(_read("query-gpu-h200-580-all-fields-memory-reserved.csv"), fields=None)
        gpu = gpus[0]
        assert gpu.name == "NVIDIA H200"
        assert (gpu.memory_total_bytes, gpu.memory_reserved_bytes) == (143771 * MIB, 616 * MIB)
        assert (gpu.memory_used_bytes, gpu.memory_free_bytes) == (0, 143156 * MIB)
        assert gpu.utilization_ratio == 0.0

    def test_parse_many_gpus_with_header(self) -> None:
        gpus = parse_query_gpu(_read("query-gpu-5gpu-header-mixed-geforce.csv"), fields=None)
        assert [g.index for g in gpus] == [0, 1, 2, 3, 4]
        assert gpus[1].name == "GeForce GTX 1080 Ti"
        assert all(g.memory_total_bytes is None for g in gpus)

    def test_parse_not_supported_and_na_agree(self) -> None:
        fields = "memory.total,memory.free,memory.used,temperature.gpu,fan.speed,utilization.gpu,utilization.memory"
        new = parse_query_gpu(_read("query-gpu-fan-na-new-driver.csv"), fields.split(","))
        old = parse_query_gpu(_read("query-gpu-fan-not-supported-old-driver.csv"), fields.split(","))
        assert new == old
        assert new[0].memory_total_bytes == 2004 * MIB

    def test_parse_wrong_field_count_quotes_line(self) -> None:
        with pytest.raises(SmiError, match=r"expected 8 fields, got 2 in line '0, 1'"):
            parse_query_gpu("0, 1\n")

    def test_parse_garbage_memory_quoted(self) -> None:
        with pytest.raises(SmiError, match=r"memory\.total: expected MiB, got 'lots'"):
            parse_query_gpu("0, GPU-a, X, lots, 1, 1, 1, 1\n")


# Cells nvidia-smi never prints in a number's place: each used to escape the parser as a
# ValueError or an OverflowError (``²`` passes str.isdigit; ``1e400`` and 400 digits overflow
# float → int), or to pass as a number (``٣``, ``-5``, ``nan``, ``1_000``) (issue 16).
HOSTILE = ["1e400", "²", "٣", "１", "-5", "nan", "inf", "1_000", "9" * 400, "0x1F", "1.2.3", ""]
GPU_ROW = ["0", "GPU-a", "X", "24564", "100", "23984", "480", "5"]


class TestHostileCells:
    @pytest.mark.parametrize("cell", HOSTILE)
    @pytest.mark.parametrize("column", [0, 3, 4, 5, 6, 7])  # index, memory.*, utilization.gpu
    def test_parse_query_gpu_hostile_cell_is_smi_error(self, column: int, cell: str) -> None:
        row = [*GPU_ROW[:column], cell, *GPU_ROW[column + 1 :]]
        if cell == "" and column != 0:
            assert parse_query_gpu(", ".join(row))[0].index == 0  # empty: not reported, not junk
            return
        with pytest.raises(SmiError):
            parse_query_gpu(", ".join(row))

    @pytest.mark.parametrize("cell", ["101", "100.5", "-0.5"])
    def test_parse_query_gpu_utilization_outside_percent_is_smi_error(self, cell: str) -> None:
        with pytest.raises(SmiError, match=r"utilization\.gpu"):
            parse_query_gpu(", ".join([*GPU_ROW[:7], cell]))

    @pytest.mark.parametrize("cell", HOSTILE)
    def test_parse_compute_apps_hostile_pid_or_memory_is_smi_error(self, cell: str) -> None:
        with pytest.raises(SmiError):
            parse_compute_apps(f"GPU-a, {cell}, python3, 900")
        if cell:
            with pytest.raises(SmiError):
                parse_compute_apps(f"GPU-a, 77, python3, {cell}")

    def test_parse_line_past_csv_field_limit_is_smi_error(self) -> None:
        """csv's 128 KiB field limit raised csv.Error, not SmiError."""
        with pytest.raises(SmiError):
            parse_query_gpu("0, GPU-a, " + "X" * 200_000 + ", 1, 1, 1, 1, 1")

    @pytest.mark.parametrize("cell", HOSTILE)
    def test_source_hostile_answer_is_an_error_reading(self, cell: str) -> None:
        runner = _Smi(
            {
                "--query-gpu": CommandResult(0, ", ".join([*GPU_ROW[:3], cell, *GPU_ROW[4:]]) + "\n", ""),
                "--query-compute-apps": CommandResult(0, f"GPU-a, {cell}, python3, {cell}\n", ""),
            }
        )
        reading = SmiSource(runner=runner).sample()
        assert reading.status == ("ok" if cell == "" else "error")

    def test_source_undecodable_output_is_read(self, tmp_path: Path) -> None:
        """A GPU name in Latin-1 made subprocess's text decoding raise UnicodeDecodeError."""
        script = tmp_path / "nvidia-smi"
        script.write_bytes(
            b"#!/bin/sh\n"
            b'case "$1" in --query-gpu*) printf "0, GPU-a, Tesla \\351, 24564, 100, 23984, 480, 5\\n";; esac\n'
        )
        script.chmod(0o755)
        reading = SmiSource(binary=str(script)).sample()
        assert reading.status == "ok"
        assert reading.gpus[0].name == "Tesla \ufffd"
        assert reading.gpus[0].memory_total_bytes == 24564 * MIB

    def test_source_binary_not_executable_is_an_error_reading(self, tmp_path: Path) -> None:
        """A PermissionError (a path that is not executable) escaped run_command."""
        script = tmp_path / "nvidia-smi"
        script.write_text("")
        script.chmod(0o644)
        reading = SmiSource(binary=str(script)).sample()
        assert reading.status == "error"
        assert "Permission denied" in (reading.error or "")


class TestParseComputeApps:
    def test_parse_compute_apps_two_processes(self) -> None:
        apps = parse_compute_apps(_read("query-compute-apps-linux-2proc-rtx2080super-595.csv"), fields=None)
        [processes] = apps.values()
        assert [(p.pid, p.name, p.used_bytes) for p in processes] == [
            (5268, "ffmpeg", 370 * MIB),
            (5267, "ffmpeg", 230 * MIB),
        ]

    def test_parse_compute_apps_wddm_usage_unknown(self) -> None:
        apps = parse_compute_apps(_read("query-compute-apps-windows-wddm-na-591.csv"), fields=None)
        processes = next(iter(apps.values()))
        assert len(processes) == 12
        assert all(p.used_bytes is None for p in processes)
        assert processes[4].name == r"C:\Program Files\NZXT CAM\NZXT CAM.exe"

    def test_parse_compute_apps_header_only_is_empty(self) -> None:
        assert (
            parse_compute_apps(_read("query-compute-apps-empty-header-only-h200-580.csv"), fields=None) == {}
        )


class _Smi:
    """A runner answering like nvidia-smi from recorded outputs."""

    def __init__(self, answers: dict[str, CommandResult]) -> None:
        self.answers = answers
        self.argv: list[list[str]] = []

    def __call__(self, argv: Sequence[str], timeout: float) -> CommandResult:
        self.argv.append(list(argv))
        for key, answer in self.answers.items():
            if any(arg.startswith(key) for arg in argv):
                return answer
        return CommandResult(0, "", "")


class TestSmiSource:
    def test_source_drops_unknown_field_and_remembers(self) -> None:
        """An older driver without memory.reserved: exit 2 with the message on stdout."""
        unknown = CommandResult(2, 'Field "memory.reserved" is not a valid field to query.\n\n', "")
        runner = _Smi(
            {
                "--query-gpu=index,uuid,name,memory.total,memory.used,memory.free,memory.reserved": unknown,
                "--query-gpu=index,uuid,name,memory.total,memory.used,memory.free,utilization.gpu": CommandResult(
                    0, "0, GPU-a, NVIDIA GeForce RTX 4090, 24564, 1000, 23080, 5\n", ""
                ),
                "--query-compute-apps": CommandResult(0, "GPU-a, 77, python3, 900\n", ""),
            }
        )
        source = SmiSource(runner=runner)
        reading = source.sample()
        assert reading.status == "ok"
        assert reading.gpus[0].memory_reserved_bytes is None
        processes = reading.gpus[0].processes
        assert processes is not None
        assert processes[0].used_bytes == 900 * MIB
        source.sample()
        assert sum("memory.reserved" in " ".join(argv) for argv in runner.argv) == 1

    def test_source_no_driver_is_driver_gone(self) -> None:
        runner = _Smi({"--query-gpu": CommandResult(9, _read("no-driver.txt"), "")})
        reading = SmiSource(runner=runner).sample()
        assert reading.status == "driver_gone"
        assert "couldn't communicate with the NVIDIA driver" in (reading.error or "")
        assert "exit 9" in (reading.error or "")

    @pytest.mark.parametrize(
        ("file", "code", "status"),
        [
            ("no-devices.txt", 6, "no_gpu"),
            ("nvml-no-supported-gpus.txt", 255, "no_gpu"),
            ("nvml-driver-library-mismatch.txt", 18, "driver_gone"),
            ("nvml-unknown-error-query-gpu-stdout.txt", 255, "error"),
        ],
    )
    def test_source_failures_classified(self, file: str, code: int, status: str) -> None:
        runner = _Smi({"--query-gpu": CommandResult(code, _read(file), "")})
        assert SmiSource(runner=runner).sample().status == status

    def test_source_missing_binary(self) -> None:
        reading = SmiSource(binary="/nonexistent/nvidia-smi").sample()
        assert reading.status == "library_missing"
        assert reading.error == "nvidia-smi not found on PATH: no NVIDIA driver installed"


class TestGraphicsClients:
    """Issue 17: a desktop's graphics clients, in no CSV query, read from ``nvidia-smi -q -x``
    (tests/data/nvidia-smi/q-x-gtx1070-418-graphics.xml: a real report, driver 418.56)."""

    def test_parse_the_recorded_report_lists_its_graphics_clients(self) -> None:
        listed = parse_processes_xml(_read("q-x-gtx1070-418-graphics.xml"))
        assert list(listed) == ["GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeffffff"]
        [processes] = listed.values()
        assert [(p.pid, p.name, p.used_bytes, p.kind) for p in processes] == [
            (1860, "/usr/lib/xorg/Xorg", 343 * MIB, "graphics"),
            (
                3498,
                "/usr/share/spotify/spotify --log-file=/usr/share/spotify/debug.log",
                59 * MIB,
                "graphics",
            ),
        ]

    def _runner(self, compute: str, report: str) -> _Smi:
        uuid = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeffffff"
        return _Smi(
            {
                "--query-gpu": CommandResult(0, f"0, {uuid}, GeForce GTX 1070, 8119, 561, 7558, 0, 40\n", ""),
                "--query-compute-apps": CommandResult(0, compute.format(uuid=uuid), ""),
                "-q": CommandResult(0, report, ""),
            }
        )

    def test_the_source_merges_them_with_the_compute_list_and_reads_the_report_every_ten_seconds(
        self,
    ) -> None:
        now = [0.0]
        report = _read("q-x-gtx1070-418-graphics.xml")
        runner = self._runner("{uuid}, 4242, python3, 150\n{uuid}, 3498, spotify, 20\n", report)
        source = SmiSource(runner=runner, monotonic=lambda: now[0])
        gpu = source.sample().gpus[0]
        assert [(p.pid, p.used_bytes, p.kind) for p in gpu.processes or ()] == [
            (4242, 150 * MIB, "compute"),
            (3498, 59 * MIB, "compute+graphics"),  # in both: one process, the larger usage
            (1860, 343 * MIB, "graphics"),
        ]
        assert gpu.unattributed_bytes == (561 - 150 - 59 - 343) * MIB
        now[0] = 5.0
        source.sample()
        now[0] = 10.5
        source.sample()
        assert sum(argv[1:] == ["-q", "-x"] for argv in runner.argv) == 2  # at 0 s and 10.5 s

    @pytest.mark.parametrize(
        "report",
        [
            "",
            "not xml at all",
            '<?xml version="1.0"?><!DOCTYPE d [<!ENTITY a "aaaa">]><nvidia_smi_log>&a;</nvidia_smi_log>',
            "<nvidia_smi_log><gpu><processes/></gpu></nvidia_smi_log>",  # no uuid
            "<nvidia_smi_log><gpu><uuid>GPU-a</uuid><processes><process_info><pid>x</pid>"
            "</process_info></processes></gpu></nvidia_smi_log>",
        ],
        ids=["empty", "text", "entity", "no-uuid", "bad-pid"],
    )
    def test_a_report_that_cannot_be_read_keeps_the_compute_list_and_says_why(self, report: str) -> None:
        with pytest.raises(SmiError):
            parse_processes_xml(report)
        reading = SmiSource(runner=self._runner("{uuid}, 4242, python3, 150\n", report)).sample()
        assert reading.status == "ok"
        assert [p.pid for p in reading.gpus[0].processes or ()] == [4242]
        assert "nvidia-smi -q -x" in reading.details["graphics_error"]
