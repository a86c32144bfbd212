"""tunerd's own crash-to-respawn overhead (target ≤ 1 s).

`tunerd run` supervises a simulated engine (real processes on loopback). The engine is killed
with SIGKILL; the overhead is the time from the kill until tunerd has spawned the replacement
process — detection, log diagnosis, the crash record, policy evaluation and the spawn — and
excludes the engine's own start-up, which is vLLM's time, not tunerd's. The replacement's
start is read from the kernel (``/proc/PID/stat``, clock ticks), the kill time from
``time.monotonic`` converted to the same clock (``/proc/uptime`` is CLOCK_BOOTTIME, which
equals CLOCK_MONOTONIC on a machine that has not been suspended). Printed: the median and the
worst of ``ROUNDS`` kills, and the default tick for comparison.

    python bench/bench_respawn.py
"""

from __future__ import annotations

import os
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
import yaml
from common import ROOT, figure, free_port, sim_command

from tunerd.config import load_config
from tunerd.daemon import Daemon
from tunerd.state import State

ROUNDS = 7
TICK = 2.0  # the default metrics interval: without the death poll, the overhead would be up to this


def _started_at(pid: int) -> float:
    """When ``pid`` started, in seconds of the boot clock."""
    text = Path(f"/proc/{pid}/stat").read_text()
    ticks = int(text[text.rindex(")") + 2 :].split()[19])
    return ticks / os.sysconf("SC_CLK_TCK")


def _boot_clock() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def main() -> None:
    port = free_port()
    work = Path(tempfile.mkdtemp(prefix="tunerd-bench-"))
    url = f"http://127.0.0.1:{port}"
    command = sim_command(port, 50, 10)
    # The shipped policies without crash-loop, which would (rightly) hold the engine by the 3rd kill.
    shipped = yaml.safe_load((ROOT / "policies" / "default.yaml").read_text())
    policies = work / "policies.yaml"
    policies.write_text(
        yaml.safe_dump(
            {"version": 1, "policies": [p for p in shipped["policies"] if p["name"] != "crash-loop"]}
        )
    )
    config_path = work / "tunerd.yaml"
    config_path.write_text(
        yaml.safe_dump(
            {
                "engine": {
                    "name": "main",
                    "command": command,
                    "url": url,
                    "settings": {"gpu_memory_utilization": 0.92, "max_model_len": 32768, "max_num_seqs": 8},
                    "probation": "1s",
                    "startup_timeout": "30s",
                },
                "gpu": {"source": "sim", "url": url},
                "metrics": {"interval": f"{TICK}s"},
                "mode": "act",
                "policies": [str(policies)],
                "guards": {
                    "max_restarts": 100,
                    "window": "1s",
                    "settle": "0s",
                },  # no crash-loop hold between kills
                "state_dir": str(work / "state"),
            }
        )
    )
    stop, ready = threading.Event(), threading.Event()
    made: list[Daemon] = []

    def serve() -> None:  # SQLite connections stay in the thread that made them
        daemon = Daemon(load_config(config_path), say=lambda *args, **fields: None)
        made.append(daemon)
        daemon.start()
        ready.set()
        try:
            daemon.run(stop)
        finally:
            process = daemon.engines[0].supervisor.process
            if process is not None:
                process.kill_group()
            daemon.close()

    runner = threading.Thread(target=serve, daemon=True)
    runner.start()
    ready.wait(60)
    daemon = made[0]
    state = State.open(work / "state", readonly=True)
    overheads = []

    def serving(deadline: float) -> None:
        """Until the engine answers and no restart is in flight (the first start is a saga the
        daemon's loop carries out after start())."""
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200 and state.intents() == []:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)

    try:
        serving(time.monotonic() + 60)
        for _ in range(ROUNDS):
            process = daemon.engines[0].supervisor.process
            assert process is not None
            old = process.pid
            time.sleep(0.5)
            killed = _boot_clock()
            os.killpg(old, signal.SIGKILL)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                current = daemon.engines[0].supervisor.process
                if current is not None and current.pid != old:
                    overheads.append(_started_at(current.pid) - killed)
                    break
                time.sleep(0.01)
            serving(deadline)  # the replacement serving again before the next kill
            time.sleep(1.5)
    finally:
        stop.set()
        runner.join(timeout=60)
        state.close()
    print(f"crash-to-respawn overhead over {len(overheads)} kills (tick {TICK:g} s):")
    print(f"  median {statistics.median(overheads) * 1000:.0f} ms, worst {max(overheads) * 1000:.0f} ms")
    median = statistics.median(overheads)
    figure("crash-to-respawn overhead (median)", f"{median * 1000:.0f} ms", "≤ 1000 ms", median <= 1.0)


if __name__ == "__main__":
    main()
