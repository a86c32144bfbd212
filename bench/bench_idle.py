"""The idle daemon's cost (DESIGN §8: ≤ 1 % of a core, ≤ 80 MiB RSS).

`tunerd run` watches one simulated engine with no traffic: the GPU read 4 times a second
(``gpu.interval: 250ms``, from the simulator's ``/sim/gpu``), ``/metrics`` every 2 s
(``metrics.interval: 2s``), the shipped policies evaluated each tick, the status API and its
own ``/metrics`` serving. After a warm-up, the daemon's CPU time is read from
``/proc/PID/stat`` (utime + stime, clock ticks) at the start and end of ``SECONDS``, and its
RSS from ``/proc/PID/status`` once a second. Only tunerd's own process is counted: the
simulator is the engine's cost, not tunerd's. Printed: CPU as a share of one core over the
whole window (and the median of its 10 s windows), the median and the highest RSS, against
the targets.

    python bench/bench_idle.py [SECONDS]     # default 60
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml
from common import ROOT, figure, free_port, kill_engine, sim_command

TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")
CPU_TARGET = 0.01  # of one core
WINDOW_S = 10.0  # the CPU share is also printed per window of this length, with their median
RSS_TARGET = 80 * 1024 * 1024


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS_PER_SECOND  # utime, stime


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def main(seconds: float) -> int:
    with tempfile.TemporaryDirectory(prefix="tunerd-bench-idle-") as tmp:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        command = sim_command(port, 1, 1)
        config = Path(tmp) / "tunerd.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "engine": {
                        "name": "main",
                        "command": command,
                        "url": url,
                        "settings": {
                            "gpu_memory_utilization": 0.92,
                            "max_model_len": 32768,
                            "max_num_seqs": 8,
                        },
                        "startup_timeout": "60s",
                        "probation": "1s",
                    },
                    "gpu": {"source": "sim", "url": url, "interval": "250ms"},
                    "metrics": {"interval": "2s"},
                    "mode": "advise",
                    "policies": [str(ROOT / "policies" / "default.yaml")],
                    "state_dir": str(Path(tmp) / "state"),
                    "listen": {"status": str(Path(tmp) / "tunerd.sock"), "metrics": "127.0.0.1:0"},
                }
            )
        )
        tunerd = subprocess.Popen(
            [sys.executable, "-m", "tunerd", "run", "--config", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            time.sleep(5)  # warm-up: the first start, imports, the first ticks
            cpu_before, wall_before = _cpu_seconds(tunerd.pid), time.monotonic()
            window = (cpu_before, wall_before)
            rss, windows = [], []
            while time.monotonic() - wall_before < seconds:
                rss.append(_rss_bytes(tunerd.pid))
                time.sleep(1.0)
                if time.monotonic() - window[1] >= WINDOW_S:
                    now = (_cpu_seconds(tunerd.pid), time.monotonic())
                    windows.append((now[0] - window[0]) / (now[1] - window[1]))
                    window = now
            cpu = (_cpu_seconds(tunerd.pid) - cpu_before) / (time.monotonic() - wall_before)
        finally:
            tunerd.send_signal(signal.SIGTERM)
            tunerd.wait(timeout=30)
            kill_engine(Path(tmp) / "state")
    mib = 1024 * 1024
    print(f"idle tunerd over {seconds:g} s (4 Hz GPU, 0.5 Hz metrics, {len(rss)} RSS readings):")
    per_window = ", ".join(f"{share * 100:.2f}" for share in windows)
    print(
        f"  CPU  {cpu * 100:.2f} % of one core over the whole window   "
        f"(target ≤ {CPU_TARGET * 100:g} %: ratio {cpu / CPU_TARGET:.2f})"
    )
    if windows:
        print(
            f"       median of {WINDOW_S:g} s windows {statistics.median(windows) * 100:.2f} % ({per_window})"
        )
    print(
        f"  RSS  median {statistics.median(rss) / mib:.1f} MiB, highest {max(rss) / mib:.1f} MiB   "
        f"(target ≤ {RSS_TARGET / mib:g} MiB: ratio {max(rss) / RSS_TARGET:.2f})"
    )
    figure(
        "idle CPU (share of one core)", f"{cpu * 100:.2f} %", f"≤ {CPU_TARGET * 100:g} %", cpu <= CPU_TARGET
    )
    figure(
        "idle RSS (highest)",
        f"{max(rss) / mib:.0f} MiB",
        f"≤ {RSS_TARGET / mib:g} MiB",
        max(rss) <= RSS_TARGET,
    )
    return 0 if cpu <= CPU_TARGET and max(rss) <= RSS_TARGET else 1


if __name__ == "__main__":
    sys.exit(main(float(sys.argv[1]) if len(sys.argv) > 1 else 60.0))
