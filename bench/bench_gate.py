"""The gate's overhead, against the engine reached directly, in one run (issue 19).

``python bench/bench_gate.py`` puts ``tunerd gate`` (the shipped command, a config file) in
front of two fast upstreams — the trivial loopback engine of ``bench/gate_peers.py`` and the
simulator at a high time scale — and measures, against the same upstream reached directly:

- added latency: one client, sequential requests; p50 and p99 of the gate's minus direct's;
- throughput: 64 concurrent keep-alive clients, plain and streamed answers; requests per
  second through the gate over direct — with the load from Python (``gate_peers.py load``,
  which takes a core of its own) and, where ``wrk`` is installed, from wrk — and what a
  request cost in CPU (µs, from Linux's
  /proc) the gate and the upstream: the three processes share the machine's cores, so the
  gate's CPU a request against the upstream's and the load's is what the ratio comes to.

Rounds alternate direct and gated so drift hits both; medians over rounds are reported.
``--stacks`` instead compares the candidate async HTTP stacks with the same minimal proxy on
each (the measurement docs/gate.md quotes; needs ``pip install uvicorn``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from common import ROOT, figure, free_port

PEERS = [sys.executable, str(Path(__file__).parent / "gate_peers.py")]
TUNERD = [str(ROOT / ".venv" / "bin" / "tunerd")] if (ROOT / ".venv" / "bin" / "tunerd").exists() else [
    sys.executable, "-m", "tunerd",
]  # fmt: skip


@contextmanager
def process(command: list[str], health: str) -> Iterator[subprocess.Popen[bytes]]:
    started = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(health, timeout=1).status_code < 500:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        else:
            raise SystemExit(f"{command} did not come up")
        yield started
    finally:
        started.terminate()
        try:
            started.wait(15)
        except subprocess.TimeoutExpired:
            started.kill()


def load(url: str, clients: int, requests: int, stream: bool) -> dict[str, Any]:
    done = subprocess.run(
        [*PEERS, "load", url, str(clients), str(requests), "stream" if stream else "plain"],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    result: dict[str, Any] = json.loads(done.stdout)
    if result["errors"]:
        raise SystemExit(f"{result['errors']} requests failed against {url}")
    return result


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def cpu_seconds(pid: int | None) -> float:
    """The user and system seconds process ``pid`` has used (Linux's /proc; 0 without one)."""
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(
    targets: dict[str, tuple[str, int | None]],
    upstream_pid: int,
    rounds: int,
    sequential: int,
    concurrent: int,
) -> dict[str, dict[str, float]]:
    """Per target (URL, the proxy's pid or None): p50/p99 latency (one client), requests/s at 64
    clients plain and streamed, and the CPU a request cost the proxy and the upstream there;
    medians over ``rounds`` rounds that alternate the targets."""
    seen: dict[str, dict[str, list[float]]] = {name: {} for name in targets}
    for round_number in range(rounds):
        for name, (url, pid) in targets.items():
            load(url, 4, 200, False)  # warm the connections
            one = load(url, 1, sequential, False)["latencies"]
            figures = {"p50_ms": quantile(one, 0.5) * 1000, "p99_ms": quantile(one, 0.99) * 1000}
            for kind in ("plain", "stream"):
                before = cpu_seconds(pid), cpu_seconds(upstream_pid)
                wall = load(url, 64, concurrent, kind == "stream")["wall"]
                figures[f"{kind}_rps"] = concurrent / wall
                figures[f"{kind}_proxy_us"] = (cpu_seconds(pid) - before[0]) / concurrent * 1e6
                figures[f"{kind}_upstream_us"] = (cpu_seconds(upstream_pid) - before[1]) / concurrent * 1e6
            for key, value in figures.items():
                seen[name].setdefault(key, []).append(value)
            print(
                f"  round {round_number + 1} {name:24} "
                + "  ".join(f"{k} {v:8.2f}" for k, v in figures.items() if not k.endswith("_us"))
            )
    return {name: {key: statistics.median(values) for key, values in by.items()} for name, by in seen.items()}


BODY = {"prompt": " ".join(["the"] * 100), "max_tokens": 8}  # what gate_peers.py's load sends


def wrk_rps(url: str, stream: bool, folder: Path, seconds: int = 5) -> float:
    """Requests a second at 64 keep-alive connections, the load from wrk (one thread, in C):
    a load generator that leaves the cores to the gate and the engine, as clients on other
    machines do. SystemExit on any socket error or answer other than 200."""
    script = folder / ("stream.lua" if stream else "plain.lua")
    body = {**BODY, "stream": stream} | ({"stream_options": {"include_usage": True}} if stream else {})
    script.write_text(
        'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
        f"wrk.body = {json.dumps(json.dumps(body))}\n"
    )
    command = ["wrk", "-t1", "-c64", f"-d{seconds}s", "-s", str(script), f"{url}/v1/completions"]
    done = subprocess.run(command, capture_output=True, text=True, check=True, timeout=seconds + 60)
    if "Non-2xx" in done.stdout or "Socket errors" in done.stdout:
        raise SystemExit(f"wrk against {url}: {done.stdout}")
    return float(done.stdout.split("Requests/sec:")[1].split()[0])


def measure_wrk(targets: dict[str, str], pairs: int, folder: Path) -> dict[str, dict[str, float]]:
    """Requests/s at 64 connections under wrk, plain and streamed, for ``direct`` and ``gate``:
    ``pairs`` pairs of 2 s runs, direct and gate back to back (in turns, which goes first), so
    the machine's drift hits both of a pair; the ratio is taken pair by pair and its median
    reported (``{kind}_ratio``), with the median requests/s of each."""
    seen: dict[str, dict[str, list[float]]] = {name: {} for name in targets}
    ratios: dict[str, list[float]] = {}
    for kind in ("plain", "stream"):
        for url in targets.values():
            wrk_rps(url, kind == "stream", folder, seconds=1)  # warm
        for pair in range(pairs):
            order = ["direct", "gate"] if pair % 2 == 0 else ["gate", "direct"]
            got = {name: wrk_rps(targets[name], kind == "stream", folder, seconds=2) for name in order}
            for name, rps in got.items():
                seen[name].setdefault(f"{kind}_rps", []).append(rps)
            ratios.setdefault(kind, []).append(got["gate"] / got["direct"])
            print(f"  pair {pair + 1} {kind:6} (wrk) direct {got['direct']:8.0f}/s  "
                  f"gate {got['gate']:8.0f}/s  {got['gate'] / got['direct']:4.0%}")  # fmt: skip
    found = {
        name: {key: statistics.median(values) for key, values in by.items()} for name, by in seen.items()
    }
    for kind, values in ratios.items():
        found["gate"][f"{kind}_ratio"] = statistics.median(values)
    return found


def gate_config(folder: Path, upstream: str) -> tuple[Path, str, Path]:
    port = free_port()
    control = folder / "gate.sock"
    config = {
        "state_dir": str(folder),
        "engines": [
            {
                "name": "main",
                "url": upstream,
                "command": ["vllm", "serve", "m"],
                "gate": {"listen": f"127.0.0.1:{port}", "control": str(control)},
            }
        ],
    }
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, f"http://127.0.0.1:{port}", control


def wait_gate_ready(control: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with httpx.Client(transport=httpx.HTTPTransport(uds=str(control)), timeout=2) as client:
                if client.get("http://gate/status").json()["engines"]["main"]["engine_up"]:
                    return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.1)
    raise SystemExit("the gate never saw its engine")


def bench_gate(rounds: int) -> None:
    upstreams = {
        "trivial": lambda port: [*PEERS, "upstream", str(port)],
        "simulator": lambda port: [
            *TUNERD, "sim", "serve", "--host", "127.0.0.1", "--port", str(port), "--time-scale", "1000",
            "--sim-startup-seconds", "1", "--sim-model", "llama-3.1-8b", "--sim-weights", "awq",
            "--sim-gpu", "h100", "--max-model-len", "32768", "--max-num-seqs", "256",
        ],
    }  # fmt: skip
    for label, command in upstreams.items():
        port = free_port()
        direct = f"http://127.0.0.1:{port}"
        with tempfile.TemporaryDirectory() as folder, process(command(port), f"{direct}/health") as upstream:
            config, gated, control = gate_config(Path(folder), direct)
            with process([*TUNERD, "gate", "--config", str(config)], f"{gated}/health") as gate:
                wait_gate_ready(control)
                print(f"{label} upstream: direct {direct}, through the gate {gated}")
                found = measure(
                    {"direct": (direct, None), "gate": (gated, gate.pid)}, upstream.pid, rounds, 400, 2000
                )
                by_wrk = (
                    measure_wrk({"direct": direct, "gate": gated}, 4 * rounds, Path(folder))
                    if shutil.which("wrk")
                    else None
                )
        d, g = found["direct"], found["gate"]
        p50, p99 = g["p50_ms"] - d["p50_ms"], g["p99_ms"] - d["p99_ms"]
        print(f"  medians: direct {d}\n           gate   {g}")
        figure(f"gate added latency p50 ({label})", f"{p50:.2f} ms", "≤ 1 ms", p50 <= 1.0)
        figure(f"gate added latency p99 ({label})", f"{p99:.2f} ms", "≤ 5 ms", p99 <= 5.0)
        for kind in ("plain", "stream"):
            ratio = g[f"{kind}_rps"] / d[f"{kind}_rps"]
            print(
                f"  {kind}: the gate's CPU {g[f'{kind}_proxy_us']:.0f} µs a request, the upstream's "
                f"{d[f'{kind}_upstream_us']:.0f} µs direct"
            )
            figure(f"gate throughput, 64 clients, {kind} ({label})", f"{ratio:.0%}", "≥ 90%", ratio >= 0.9)
            if by_wrk is None:
                print("  (no wrk on PATH: apt-get install wrk for the throughput with a load in C)")
                continue
            ratio = by_wrk["gate"][f"{kind}_ratio"]
            print(f"  {kind}, the load from wrk: direct {by_wrk['direct'][f'{kind}_rps']:.0f}/s, "
                  f"gate {by_wrk['gate'][f'{kind}_rps']:.0f}/s (medians); "
                  f"the ratio pair by pair {ratio:.0%}")  # fmt: skip
            figure(
                f"gate throughput, 64 connections from wrk, {kind} ({label})",
                f"{ratio:.0%}",
                "≥ 90%",
                ratio >= 0.9,
            )


def bench_stacks(rounds: int) -> None:
    port = free_port()
    direct = f"http://127.0.0.1:{port}"
    candidates = [
        "proxy-splice",
        "proxy-protocols",
        "proxy-aiohttp",
        "proxy-uvicorn-aiohttp",
        "proxy-uvicorn-httpx",
    ]
    if importlib.util.find_spec("uvicorn") is None:  # not a dependency: the rest without it
        candidates = [c for c in candidates if "uvicorn" not in c]
    with process([*PEERS, "upstream", str(port)], f"{direct}/health") as upstream:
        targets: dict[str, tuple[str, int | None]] = {"direct": (direct, None)}
        opened = []
        try:
            for candidate in candidates:
                proxy_port = free_port()
                context = process(
                    [*PEERS, candidate, str(proxy_port), direct], f"http://127.0.0.1:{proxy_port}/health"
                )
                started = context.__enter__()
                opened.append(context)
                targets[candidate] = (f"http://127.0.0.1:{proxy_port}", started.pid)
            found = measure(targets, upstream.pid, rounds, 400, 2000)
        finally:
            for context in opened:
                context.__exit__(None, None, None)
    d = found["direct"]
    print(
        "\nstack                   added p50  added p99  plain rps (of direct)  stream rps (of direct)"
        "  CPU a request, plain/stream"
    )
    for name, f in found.items():
        if name == "direct":
            continue
        print(
            f"{name:22} {f['p50_ms'] - d['p50_ms']:8.2f} ms {f['p99_ms'] - d['p99_ms']:8.2f} ms"
            f"  {f['plain_rps']:7.0f} ({f['plain_rps'] / d['plain_rps']:4.0%})"
            f"        {f['stream_rps']:7.0f} ({f['stream_rps'] / d['stream_rps']:4.0%})"
            f"        {f['plain_proxy_us']:4.0f} / {f['stream_proxy_us']:4.0f} µs"
        )
    print(f"direct                 p50 {d['p50_ms']:.2f} ms, p99 {d['p99_ms']:.2f} ms, "
          f"plain {d['plain_rps']:.0f}/s, stream {d['stream_rps']:.0f}/s; the upstream's CPU a request "
          f"{d['plain_upstream_us']:.0f} / {d['stream_upstream_us']:.0f} µs")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stacks", action="store_true", help="compare the candidate HTTP stacks instead")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.stacks:
        bench_stacks(args.rounds)
    else:
        bench_gate(args.rounds)


if __name__ == "__main__":
    main()
