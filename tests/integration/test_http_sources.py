"""HTTP sources against real servers on loopback: /metrics, /health and the simulator's /sim/gpu."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

from tunerd.sources.sim_gpu import SimGpuSource
from tunerd.sources.vllm_metrics import MetricsClient, ScrapeError, parse

PAGE = (Path(__file__).parents[1] / "data" / "vllm" / "metrics-0.32-load.txt").read_text()
SIM_GPU = {
    "time": 123.5,
    "gpus": [
        {
            "index": 0,
            "uuid": "GPU-sim-0",
            "name": "NVIDIA GeForce RTX 4090 (simulated)",
            "memory_total_bytes": 25_254_363_136,
            "memory_used_bytes": 22_000_000_000,
            "memory_free_bytes": 3_254_363_136,
            "memory_reserved_bytes": None,
            "utilization_ratio": 0.9,
            "processes": [{"pid": 4242, "name": "vllm", "used_bytes": 21_500_000_000}],
        }
    ],
}


class _Handler(BaseHTTPRequestHandler):
    routes: ClassVar[dict[str, tuple[int, str, str]]] = {}
    hits: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        self.hits.append(self.path)
        status, kind, body = self.routes.get(self.path, (404, "text/plain", "not found"))
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        return


@pytest.fixture
def server() -> Iterator[tuple[str, type[_Handler]]]:
    handler = type("Handler", (_Handler,), {"routes": {}, "hits": []})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", handler
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_metrics_client_fetches_and_reuses_connection(server: tuple[str, type[_Handler]]) -> None:
    url, handler = server
    handler.routes = {
        "/metrics": (200, "text/plain; version=0.0.4", PAGE),
        "/health": (200, "text/plain", ""),
    }
    client = MetricsClient(url)
    try:
        snapshot = parse(client.fetch())
        assert snapshot.kv_cache_usage == 1.0
        assert client.fetch() == PAGE
        assert client.health() == 200
    finally:
        client.close()
    assert handler.hits == ["/metrics", "/metrics", "/health"]


def test_metrics_client_typed_errors(server: tuple[str, type[_Handler]]) -> None:
    url, handler = server
    handler.routes = {"/metrics": (503, "text/plain", "engine dead"), "/health": (503, "text/plain", "")}
    client = MetricsClient(url)
    with pytest.raises(ScrapeError) as caught:
        client.fetch()
    assert caught.value.kind == "http"
    assert client.health() == 503
    client.close()
    refused = MetricsClient("http://127.0.0.1:9", timeout=1.0)
    with pytest.raises(ScrapeError) as caught:
        refused.fetch()
    assert caught.value.kind == "refused"
    assert refused.health() is None
    refused.close()


def test_sim_gpu_source_reads_the_contract_object(server: tuple[str, type[_Handler]]) -> None:
    url, handler = server
    handler.routes = {"/sim/gpu": (200, "application/json", json.dumps(SIM_GPU))}
    source = SimGpuSource(url)
    reading = source.sample()
    source.close()
    assert reading.status == "ok"
    assert reading.details["time"] == 123.5
    gpu = reading.gpus[0]
    assert gpu.memory_reserved_bytes is None
    assert gpu.processes[0].used_bytes == 21_500_000_000
    # an object without the processes' `kind` (a simulator before issue 17) still reads
    [process] = SIM_GPU["gpus"][0]["processes"]
    assert reading.to_dict()["gpus"][0] == {
        **SIM_GPU["gpus"][0],
        "processes": [{**process, "kind": None}],
        "unattributed_bytes": 22_000_000_000 - 21_500_000_000,
        "status": "ok",
        "error": None,
    }


def test_sim_gpu_source_bad_answers_are_statuses(server: tuple[str, type[_Handler]]) -> None:
    url, handler = server
    handler.routes = {"/sim/gpu": (200, "application/json", '{"gpus": [{"index": "zero"}]}')}
    assert SimGpuSource(url).sample().status == "error"
    handler.routes = {}
    assert SimGpuSource(url).sample().status == "error"  # 404
    assert SimGpuSource("http://127.0.0.1:9", timeout=1.0).sample().status == "driver_gone"


def test_inspect_metrics_live_url(server: tuple[str, type[_Handler]]) -> None:
    url, handler = server
    handler.routes = {"/metrics": (200, "text/plain", PAGE)}
    result = subprocess.run(
        [sys.executable, "-m", "tunerd", "inspect", "metrics", url, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["num_requests_waiting_capacity"] == 2
