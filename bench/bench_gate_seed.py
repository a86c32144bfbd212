"""The seed's load with the gate and without it: preemptions, OOMs and short requests' TTFT.

The seed's box (DESIGN §6: an RTX 4090, Llama 3 8B AWQ, 32K context, 8 sequences, 2048
batched tokens, ``gpu_memory_utilization`` 0.92) serves, in simulated time, what the seed's
operator threw at it — four clients with 28K-token conversations (a 28,000-token prompt, 512
tokens out, one after another) — while eight chat clients send short questions (a 200-token
message, 128 tokens out, streamed). Each configuration runs twice on a fresh engine: straight
to the engine, and through ``tunerd gate`` with its defaults (requests over 16K tokens in a
long lane of one: "run alone"). Reported per run: the engine's own preemption counter, whether
it died of a CUDA OOM (its log), requests finished and failed, and the short requests' time to
first token (p50, p99, simulated seconds, measured by the clients).

The configurations: the seed's final settings (``kv_cache_dtype fp8``) and test (4 × 28K),
the seed's promise with a 16-bit KV cache (every one of the four at the full 32K context: a
pool of 129,872 tokens just short of it), and both again on a randomized box (``--box-seed``:
hidden parameters the planner does not know). Nothing here knows what the engine will do; the
simulator's scheduler and memory decide.

``python bench/bench_gate_seed.py [--minutes M] [--scale S] [--box-seed N]`` (about 5 minutes
at the defaults).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from bench_gate import TUNERD, quantile
from common import figure, free_port

SEED = [
    "--sim-model", "llama-3.1-8b", "--sim-weights", "awq", "--sim-gpu", "rtx4090",
    "--gpu-memory-utilization", "0.92", "--max-model-len", "32768", "--max-num-seqs", "8",
    "--max-num-batched-tokens", "2048",
]  # fmt: skip
LONG_CLIENTS, LONG_PROMPT, LONG_OUT = 4, 28_000, 512
#: the seed's promise, "every one of the four supports the full 32K context": 32,000 + 512 out
FULL_PROMPT = 32_000
SHORT_CLIENTS, SHORT_PROMPT, SHORT_OUT = 8, 200, 128


@dataclass
class Tally:
    scale: float
    lock: threading.Lock = field(default_factory=threading.Lock)
    ok: dict[str, int] = field(default_factory=lambda: {"long": 0, "short": 0})
    failed: dict[str, int] = field(default_factory=lambda: {"long": 0, "short": 0})
    errors: dict[str, int] = field(default_factory=dict)
    short_ttft: list[float] = field(default_factory=list)  # simulated seconds

    def record(self, kind: str, ttft: float | None, error: str | None) -> None:
        with self.lock:
            if error is None:
                self.ok[kind] += 1
                if kind == "short" and ttft is not None:
                    self.short_ttft.append(ttft * self.scale)
            else:
                self.failed[kind] += 1
                self.errors[error] = self.errors.get(error, 0) + 1


def words(n: int) -> str:
    return " ".join(["the"] * n)  # one token a word for the simulated tokenizer


def streamed(http: httpx.Client, url: str, body: dict[str, Any]) -> tuple[float | None, str | None]:
    """Send one streamed request; the wall seconds to its first token, or what went wrong."""
    began = time.monotonic()
    first: float | None = None
    try:
        with http.stream("POST", url, json={**body, "stream": True}) as response:
            if response.status_code != 200:
                response.read()
                return None, f"HTTP {response.status_code}"
            finished = False
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    finished = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return None, "error in stream"
                if first is None:
                    first = time.monotonic() - began
            if not finished:
                return None, "stream cut"
    except httpx.HTTPError as error:
        return None, type(error).__name__
    return first, None


def client(kind: str, url: str, stop: threading.Event, tally: Tally, long_prompt: int) -> None:
    if kind == "long":
        path = "/v1/completions"
        body = {"prompt": words(long_prompt), "max_tokens": LONG_OUT, "ignore_eos": True}
    else:
        path = "/v1/chat/completions"
        messages = [{"role": "user", "content": words(SHORT_PROMPT)}]
        body = {"messages": messages, "max_tokens": SHORT_OUT, "ignore_eos": True}
    with httpx.Client(timeout=httpx.Timeout(600, connect=5)) as http:
        while not stop.is_set():
            ttft, error = streamed(http, url + path, {"model": "seed", **body})
            tally.record(kind, ttft, error)
            if error is not None:
                time.sleep(0.05)  # a client that backs off a little, not a hot loop on a dead engine


def metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith((name + "{", name + " ")):
            total += float(line.rsplit(" ", 1)[1])
    return total


def start(command: list[str], output: list[str]) -> subprocess.Popen[str]:
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    threading.Thread(target=lambda: output.extend(process.stdout or ()), daemon=True).start()
    return process


def wait_up(url: str, process: subprocess.Popen[str], output: list[str]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit("".join(output[-30:]))
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise SystemExit(f"{url} did not come up:\n" + "".join(output[-30:]))


def run(
    engine_args: list[str], long_prompt: int, gated: bool, seconds: float, scale: float
) -> dict[str, Any]:
    port = free_port()
    engine_url = f"http://127.0.0.1:{port}"
    engine_log: list[str] = []
    engine = start(
        [*TUNERD, "sim", "serve", "--host", "127.0.0.1", "--port", str(port), "--time-scale", f"{scale:g}",
         "--sim-startup-seconds", "5", "--served-model-name", "seed", *engine_args],
        engine_log,
    )  # fmt: skip
    gate = None
    with tempfile.TemporaryDirectory() as folder:
        try:
            wait_up(engine_url + "/health", engine, engine_log)
            url = engine_url
            if gated:
                gate_port = free_port()
                path = Path(folder) / "tunerd.yaml"
                listen = {"listen": f"127.0.0.1:{gate_port}", "control": str(Path(folder) / "gate.sock")}
                engine_config = {"name": "main", "url": engine_url, "command": ["vllm", "serve", "seed"]}
                config = {
                    "state_dir": str(Path(folder) / "state"),
                    "engine": {**engine_config, "gate": listen},
                }
                path.write_text(yaml.safe_dump(config))
                gate_log: list[str] = []
                gate = start([*TUNERD, "gate", "--config", str(path)], gate_log)
                url = f"http://127.0.0.1:{gate_port}"
                wait_up(url + "/health", gate, gate_log)
            before = metric(engine_url, "vllm:num_preemptions_total")
            tally, stop = Tally(scale), threading.Event()
            kinds = ["long"] * LONG_CLIENTS + ["short"] * SHORT_CLIENTS
            threads = [
                threading.Thread(target=client, args=(kind, url, stop, tally, long_prompt)) for kind in kinds
            ]
            for thread in threads:
                thread.start()
            began = time.monotonic()
            while time.monotonic() - began < seconds / scale and engine.poll() is None:
                time.sleep(0.2)
            died = engine.poll() is not None or any("CUDA out of memory" in line for line in engine_log)
            # an engine that died took its counter with it: the count is then unknown
            alive = engine.poll() is None
            preemptions = metric(engine_url, "vllm:num_preemptions_total") - before if alive else None
            stop.set()
            for thread in threads:
                thread.join(600)
        finally:
            for process in (gate, engine):
                if process is not None and process.poll() is None:
                    process.terminate()
                    process.wait(30)
    return {
        "gated": gated,
        "oom": died,
        "preemptions": None if preemptions is None else int(preemptions),
        "ok": tally.ok,
        "failed": tally.failed,
        "errors": tally.errors,
        "short_ttft_p50": quantile(tally.short_ttft, 0.5) if tally.short_ttft else None,
        "short_ttft_p99": quantile(tally.short_ttft, 0.99) if tally.short_ttft else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=5, help="simulated minutes per run (default 5)")
    parser.add_argument(
        "--scale",
        type=float,
        default=10,
        help="simulated seconds a wall second (default 10; at 50 the 2 cores' own delays show as seconds)",
    )
    parser.add_argument("--box-seed", type=int, default=7, help="the randomized box's seed (default 7)")
    parser.add_argument("--only", help="run one configuration, by its name")
    options = parser.parse_args()
    box = ["--box-seed", str(options.box_seed)]
    fp8, bits16 = ["--kv-cache-dtype", "fp8"], ["--kv-cache-dtype", "auto"]
    configurations: dict[str, tuple[list[str], int]] = {
        "seed box, fp8 KV, 4 × 28K (the seed's config and test)": ([*SEED, *fp8], LONG_PROMPT),
        "seed box, 16-bit KV, 4 × 32K (the seed's promise)": ([*SEED, *bits16], FULL_PROMPT),
        f"random box {options.box_seed}, fp8 KV, 4 × 28K": ([*SEED, *fp8, *box], LONG_PROMPT),
        f"random box {options.box_seed}, 16-bit KV, 4 × 32K": ([*SEED, *bits16, *box], FULL_PROMPT),
    }
    rows = []
    for name, (args, long_prompt) in configurations.items():
        if options.only and options.only not in name:
            continue
        for gated in (False, True):
            result = run(args, long_prompt, gated, options.minutes * 60, options.scale)
            result["configuration"] = name
            print(json.dumps(result), flush=True)
            rows.append(result)
    print()
    columns = ["configuration", "path", "preemptions", "OOM", "long done", "short done", "failed"]
    print("| " + " | ".join([*columns, "short TTFT p50", "p99"]) + " |")
    print("|---" * (len(columns) + 2) + "|")
    for row in rows:
        p50, p99 = row["short_ttft_p50"], row["short_ttft_p99"]
        print(
            f"| {row['configuration']} | {'gate' if row['gated'] else 'direct'} | {row['preemptions']} | "
            f"{'yes' if row['oom'] else 'no'} | {row['ok']['long']} | {row['ok']['short']} | "
            f"{sum(row['failed'].values())} | {p50 if p50 is None else f'{p50:.2f} s'} | "
            f"{p99 if p99 is None else f'{p99:.2f} s'} |"
        )
    gated = [row for row in rows if row["gated"]]
    if gated:
        clean = all(row["preemptions"] == 0 and not row["oom"] for row in gated)
        figure("gate: seed load, 0 preemptions and 0 OOMs", "yes" if clean else "no", "yes", clean)


if __name__ == "__main__":
    main()
