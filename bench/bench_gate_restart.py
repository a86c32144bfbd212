"""A restart by tunerd under steady load: how many requests fail, with the gate and without.

Two runs of the same story, each with a fresh state: ``tunerd run`` (mode act) supervises the
simulated seed engine (time ×50), one policy fires once after the engine has served for 3 s
(``max_num_seqs`` one step down, a restart with a 30 s drain), and CLIENTS clients send short
completions back to back — straight to the engine in the first run, through ``tunerd gate``
in the second. Each run lasts until the restart has ended and the new engine has served for
3 s more. Reported: requests sent, failed (a connection error or a status other than 200),
and the p99 and longest latency (what waiting through the restart cost a client).

``python bench/bench_gate_restart.py [CLIENTS]`` (default 8).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from bench_gate import TUNERD, process, quantile
from common import figure, free_port, kill_engine, sim_command

POLICY = {
    "version": 1,
    "policies": [
        {
            "name": "once",
            "when": {"metric": "engine_up", "above": 0.5, "for": "3s"},
            "then": [{"tune": {"max_num_seqs": "step_down"}}, {"restart": {"drain": "30s"}}],
            "cooldown": "1h",
        }
    ],
}


def config(folder: Path, port: int, gate_port: int | None) -> Path:
    (folder / "policy.yaml").write_text(yaml.safe_dump(POLICY))
    engine: dict[str, Any] = {
        "name": "main",
        "command": sim_command(port, 50, 10),
        "url": f"http://127.0.0.1:{port}",
        "settings": {"gpu_memory_utilization": 0.92, "max_model_len": 32768, "max_num_seqs": 8},
        "bounds": {"max_num_seqs": [2, 16]},
        "drain": "30s",
        "startup_timeout": "60s",
        "probation": "1s",
    }
    if gate_port is not None:
        engine["gate"] = {"listen": f"127.0.0.1:{gate_port}", "control": str(folder / "gate.sock")}
    path = folder / "tunerd.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "engine": engine,
                "gpu": {"source": "none"},
                "metrics": {"interval": "500ms"},
                "mode": "act",
                "policies": [str(folder / "policy.yaml")],
                "guards": {"settle": "0s"},
                "state_dir": str(folder / "state"),
                "listen": {"metrics": "127.0.0.1:0", "status": str(folder / "tunerd.sock")},
            }
        )
    )
    return path


def events(lines: list[str], name: str) -> list[dict[str, Any]]:
    found = []
    for line in list(lines):
        if line.startswith("{"):
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") == name:
                found.append(event)
    return found


def run(clients: int, gated: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        port, gate_port = free_port(), free_port()
        path = config(folder, port, gate_port if gated else None)
        tunerd = subprocess.Popen(
            [*TUNERD, "run", "--config", str(path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        lines: list[str] = []
        threading.Thread(
            target=lambda: lines.extend(line.rstrip() for line in tunerd.stdout or ()), daemon=True
        ).start()
        gate = None
        try:
            deadline = time.monotonic() + 60
            while not events(lines, "restart_finished") and time.monotonic() < deadline:
                time.sleep(0.1)
            url = f"http://127.0.0.1:{port}"
            if gated:
                gate = process(
                    [*TUNERD, "gate", "--config", str(path)], f"http://127.0.0.1:{gate_port}/health"
                )
                gate.__enter__()
                url = f"http://127.0.0.1:{gate_port}"
            results: list[tuple[float, float, int]] = []
            stop = threading.Event()

            def client() -> None:
                with httpx.Client(timeout=120) as http:
                    while not stop.is_set():
                        began = time.monotonic()
                        try:
                            code = http.post(
                                f"{url}/v1/completions", json={"prompt": "the " * 50, "max_tokens": 16}
                            ).status_code
                        except httpx.HTTPError:
                            code = -1
                        results.append((began, time.monotonic(), code))

            threads = [threading.Thread(target=client) for _ in range(clients)]
            for thread in threads:
                thread.start()
            deadline = time.monotonic() + 120
            while len(events(lines, "restart_finished")) < 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            restarted = [e for e in events(lines, "restart_step") if e.get("step") == "stopping"]
            time.sleep(3.0)
            stop.set()
            for thread in threads:
                thread.join(120)
        finally:
            if gate is not None:
                gate.__exit__(None, None, None)
            tunerd.terminate()
            tunerd.wait(60)
            kill_engine(folder / "state")
        finished = events(lines, "restart_finished")
        if len(finished) < 2 or not restarted:
            raise SystemExit("the restart did not happen:\n" + "\n".join(lines[-30:]))
        failed = sum(1 for _, _, code in results if code != 200)
        latencies = [end - began for began, end, _ in results]
        return {
            "sent": len(results),
            "failed": failed,
            "p99_s": quantile(latencies, 0.99) if latencies else None,
            "max_s": max(latencies, default=None),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("clients", nargs="?", type=int, default=8)
    args = parser.parse_args()
    direct = run(args.clients, gated=False)
    print(
        f"  without the gate: {direct['sent']} requests, {direct['failed']} failed, "
        f"p99 {direct['p99_s']:.3f} s, longest {direct['max_s']:.3f} s"
    )
    gated = run(args.clients, gated=True)
    print(
        f"  with the gate:    {gated['sent']} requests, {gated['failed']} failed, "
        f"p99 {gated['p99_s']:.3f} s, longest {gated['max_s']:.3f} s"
    )
    figure(
        "restart under load, failed requests with the gate", str(gated["failed"]), "0", gated["failed"] == 0
    )
    print(f"  (without the gate {direct['failed']} of {direct['sent']} failed: the number the gate saves)")


if __name__ == "__main__":
    main()
