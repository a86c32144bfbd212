"""`tunerd inspect` as a user runs it: real processes, recorded inputs, stand-ins on PATH."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

DATA = Path(__file__).parents[1] / "data"
FAKES = Path(__file__).parents[1] / "fakes"
MIB = 1024**2
P4_FIELDS = (
    "fan.speed,memory.total,memory.used,memory.free,pstate,temperature.gpu,name,uuid,compute_mode,"
    "utilization.gpu,utilization.memory,index"
).split(",")


def tunerd(
    *args: str, env: dict[str, str] | None = None, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tunerd", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
        input=stdin,
    )


def _p4_recording(apps: Path) -> dict[str, Any]:
    """The recorded two Tesla P4s (telegraf#4120, driver 384), with ``apps`` as the processes."""
    return {
        "query_gpu": {
            "fields": P4_FIELDS,
            "file": str(DATA / "nvidia-smi" / "query-gpu-2gpu-not-supported-teslap4-384.csv"),
        },
        "compute_apps": {"fields": ["gpu_uuid", "pid", "process_name", "used_memory"], "file": str(apps)},
    }


@pytest.fixture
def fake_smi(tmp_path: Path) -> Any:
    """Install a stand-in nvidia-smi on PATH; returns a function taking the recording."""

    def install(recording: dict[str, Any]) -> dict[str, str]:
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir(exist_ok=True)
        wrapper = bin_dir / "nvidia-smi"
        wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKES / "nvidia_smi.py"} "$@"\n')
        wrapper.chmod(0o755)
        spec = tmp_path / "recording.json"
        spec.write_text(json.dumps(recording))
        env = dict(os.environ)
        env.update(
            PATH=f"{bin_dir}{os.pathsep}{env['PATH']}",
            FAKE_SMI_RECORDING=str(spec),
            FAKE_SMI_CALLS=str(tmp_path / "calls.txt"),
        )
        return env

    return install


class TestInspectGpu:
    def test_inspect_gpu_nvidia_smi_two_gpus_unsupported_fields_null(
        self, fake_smi: Any, tmp_path: Path
    ) -> None:
        """Two Tesla P4s as recorded (driver 384): memory.reserved is an unknown field there,
        fan.speed [Not Supported]; the JSON has nulls, never zeros, for what it cannot read."""
        apps = tmp_path / "apps.csv"
        apps.write_text("GPU-xxx, 4242, python3, 5000\n")
        env = fake_smi(_p4_recording(apps))
        result = tunerd("inspect", "gpu", "--source", "nvidia-smi", "--json", env=env)
        assert result.returncode == 0, result.stderr
        gpus = json.loads(result.stdout)["gpus"]
        assert [g["index"] for g in gpus] == [0, 1]
        for gpu in gpus:
            assert gpu["memory_total_bytes"] == 7606 * MIB
            assert gpu["memory_used_bytes"] == 0
            assert gpu["memory_reserved_bytes"] is None
            assert set(gpu) >= {
                "index",
                "uuid",
                "name",
                "memory_total_bytes",
                "memory_used_bytes",
                "memory_free_bytes",
                "memory_reserved_bytes",
                "utilization_ratio",
                "processes",
            }
        assert gpus[0]["processes"] == [
            {"pid": 4242, "name": "python3", "used_bytes": 5000 * MIB, "kind": "compute"}
        ]
        calls = (tmp_path / "calls.txt").read_text().splitlines()
        assert calls[0].startswith(
            "--query-gpu=index,uuid,name,memory.total,memory.used,memory.free,memory.reserved"
        )
        assert "memory.reserved" not in calls[1]

    def test_inspect_gpu_no_driver_exit_1_one_line(self, fake_smi: Any) -> None:
        env = fake_smi({"fail": {"exit": 9, "file": str(DATA / "nvidia-smi" / "no-driver.txt")}})
        result = tunerd("inspect", "gpu", "--source", "nvidia-smi", env=env)
        assert result.returncode == 1
        assert result.stdout == ""
        assert result.stderr.count("\n") == 1
        assert result.stderr.startswith(
            "tunerd inspect gpu: nvidia-smi cannot talk to the NVIDIA driver (exit 9)"
        )

    def test_inspect_gpu_human_output(self, fake_smi: Any) -> None:
        env = fake_smi(_p4_recording(Path(os.devnull)))
        result = tunerd("inspect", "gpu", "--source", "nvidia-smi", env=env)
        assert result.returncode == 0
        assert "GPU 1 Tesla P4 GPU-xxx" in result.stdout
        assert "used 0 B of 7.43 GiB" in result.stdout

    def test_inspect_gpu_nvml_without_driver_exit_1(self) -> None:
        """This machine has no NVIDIA driver: the real NVML says so in one line."""
        result = tunerd("inspect", "gpu")
        assert result.returncode == 1
        assert (
            result.stderr
            == "tunerd inspect gpu: NVML library not found (libnvidia-ml.so.1): no NVIDIA driver\n"
        )

    def test_inspect_gpu_sim_needs_url(self) -> None:
        result = tunerd("inspect", "gpu", "--source", "sim")
        assert result.returncode == 2
        assert "--source sim needs --url" in result.stderr


class TestInspectLogAndMetrics:
    def test_inspect_log_json_from_stdin(self) -> None:
        text = (DATA / "vllm-failures" / "oom-27466.log").read_text()
        result = tunerd("inspect", "log", "-", "--json", stdin=text)
        assert result.returncode == 0
        crash = json.loads(result.stdout)["crash"]
        assert crash["kind"] == "cuda_oom"
        assert crash["other_processes"] == [{"pid": 854401, "bytes": round(78.43 * 1024**3)}]

    def test_inspect_log_says_what_the_log_lacks_never_a_dash_with_a_unit(self, tmp_path: Path) -> None:
        """Issue 21: a log without the start-up figures (an engine that died early) printed
        `- GiB` and `-x at - tokens`."""
        log = tmp_path / "early.log"
        log.write_text(
            "(APIServer pid=1) INFO 12-02 10:00:00 [api_server.py:1] vLLM API server version 0.33.0\n"
        )
        result = tunerd("inspect", "log", str(log))
        assert result.returncode == 0, result.stderr
        assert "  model loading          not in the log\n" in result.stdout
        assert "  max concurrency        not in the log\n" in result.stdout
        assert "- GiB" not in result.stdout
        assert "-x" not in result.stdout

    def test_inspect_metrics_shows_each_engines_usage_as_the_totals(self, tmp_path: Path) -> None:
        page = tmp_path / "dp.txt"
        page.write_text(
            "".join(
                f'vllm:kv_cache_usage_perc{{engine="{n}",model_name="m"}} {usage}\n'
                f'vllm:num_requests_running{{engine="{n}",model_name="m"}} 2\n'
                for n, usage in ((0, 0.25), (1, 0.5))
            )
        )
        result = tunerd("inspect", "metrics", str(page))
        assert result.returncode == 0, result.stderr
        assert "KV cache usage             50.0%" in result.stdout  # the worst engine's
        assert "engine 0: usage 25.0%" in result.stdout
        assert "engine 1: usage 50.0%" in result.stdout

    def test_inspect_log_missing_file_exit_2(self) -> None:
        result = tunerd("inspect", "log", "/nonexistent.log")
        assert result.returncode == 2
        assert result.stderr == "tunerd inspect log: error: /nonexistent.log: no such file\n"

    def test_inspect_metrics_excerpt(self) -> None:
        result = tunerd(
            "inspect", "metrics", str(DATA / "vllm-excerpts" / "m3-early-v1-no-engine-label.txt"), "--json"
        )
        assert result.returncode == 0, result.stderr
        snapshot = json.loads(result.stdout)
        assert snapshot["kv_cache_usage"] == 0.0
        assert snapshot["engine_count"] == 1
        assert snapshot["model_name"] == "Qwen/Qwen2.5-Coder-32B-Instruct"

    def test_inspect_metrics_junk_exit_1(self, tmp_path: Path) -> None:
        page = tmp_path / "page.txt"
        page.write_text("<html><body>502 Bad Gateway</body></html>\n")
        result = tunerd("inspect", "metrics", str(page), "--json")
        assert result.returncode == 1
        assert json.loads(result.stdout)["problems"]
        assert "not a metric" in result.stderr

    def test_inspect_metrics_unreachable_url_exit_1(self) -> None:
        result = tunerd("inspect", "metrics", "http://127.0.0.1:9/", "--timeout", "2")
        assert result.returncode == 1
        assert "connection refused" in result.stderr


def test_inspect_metrics_malformed_url_exit_2() -> None:
    result = tunerd("inspect", "metrics", "http://[::1")
    assert result.returncode == 2
    assert result.stderr.startswith("tunerd inspect metrics: error: ")
    assert "Traceback" not in result.stderr
