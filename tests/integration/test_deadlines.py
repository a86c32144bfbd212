"""Every outbound read has a total deadline and a byte cap (tunerd.sources.http), against real
servers on loopback that trickle their answers: one byte every 0.5 s — a pace no per-read
timeout ever trips — or headers and then nothing.

- ``/metrics``: the fetch ends within its deadline (2 s) with a timeout, and a page over 8 MiB
  is an error, not a page;
- a running daemon whose one engine's ``/metrics`` trickles keeps ticking: its status answers
  and the other engine is sampled every tick (before the deadline, one tick held the loop
  thread for as long as the trickle lasted);
- ``tunerd status``'s client gives up on a daemon socket that trickles at its deadline.

(The webhooks' deadline is in test_notify_delivery.py; the watchdog that a stalled loop
silences in test_systemd_notify.py.)"""

from __future__ import annotations

import contextlib
import os
import signal
import socketserver
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.sim_daemon import free_port, settle
from tunerd.commands.common import UsageError
from tunerd.commands.status import fetch
from tunerd.config import load_config
from tunerd.daemon import Daemon
from tunerd.sources.gpu import NoGpuSource
from tunerd.sources.vllm_metrics import MetricsClient, ScrapeError

PAGE_FILE = Path(__file__).parents[1] / "data" / "vllm" / "metrics-0.32-load.txt"
PAGE = PAGE_FILE.read_bytes()
TRICKLE_BYTES = 40  # at 0.5 s a byte: 20 s, then the server closes (a test of the old code ends)

# An engine for the daemon to supervise: /health answers at once; /metrics answers "ok", or
# trickles its body ("drip"), or sends its headers and then nothing ("stall"). Only the standard
# library, so it is up in a moment; the settings' flags tunerd appends are ignored.
ENGINE = r"""
import sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
port, mode, page = int(sys.argv[1]), sys.argv[2], open(sys.argv[3], "rb").read()

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_GET(self):
        body = page if self.path == "/metrics" else b""
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.flush()
        if self.path != "/metrics" or mode == "ok":
            self.wfile.write(body)
            return
        if mode == "stall":
            time.sleep(0.5 * 40)
        for byte in body[:40] if mode == "drip" else b"":
            time.sleep(0.5)
            self.wfile.write(bytes([byte]))
            self.wfile.flush()
        self.close_connection = True

ThreadingHTTPServer.daemon_threads = True
server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
print("INFO GPU KV cache size: 100,000 tokens", flush=True)  # what tunerd waits for, with /health
server.serve_forever()
"""


class Trickling(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Metrics)
        self.gone = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Metrics(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Trickling

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        mode = self.path.strip("/").split("/")[0]  # /drip/metrics: the mode, then the page
        body = b"x" * (9 << 20) if mode == "huge" else PAGE
        if mode == "drip-headers":
            self._drip(f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n\r\n".encode())
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.flush()
        if mode == "stall":
            self.server.gone.wait(0.5 * TRICKLE_BYTES)
        elif mode == "drip":
            self._drip(body)
        else:
            self.wfile.write(body)
        self.close_connection = True

    def _drip(self, data: bytes) -> None:
        with contextlib.suppress(OSError):
            for byte in data[:TRICKLE_BYTES]:
                if self.server.gone.wait(0.5):
                    return
                self.wfile.write(bytes([byte]))
                self.wfile.flush()


@contextlib.contextmanager
def served(server: Any) -> Iterator[Any]:
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.gone.set()
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("mode", ["drip", "drip-headers", "stall"])
def test_a_trickled_metrics_page_ends_within_its_deadline(mode: str) -> None:
    with served(Trickling()) as server:
        client = MetricsClient(server.url + "/" + mode)
        started = time.monotonic()
        with pytest.raises(ScrapeError) as caught:
            client.fetch()
        took = time.monotonic() - started
        client.close()
    assert caught.value.kind == "timeout", caught.value
    assert took < 5, took  # its deadline is 2 s; the trickle lasts 20 s


def test_a_page_over_the_cap_is_an_error_not_a_page() -> None:
    with served(Trickling()) as server:
        client = MetricsClient(server.url + "/huge")
        with pytest.raises(ScrapeError, match="larger than 8 MiB") as caught:
            client.fetch()
        client.close()
    assert caught.value.kind == "error"


def _engine(name: str, port: int, mode: str, gpu: int) -> dict[str, Any]:
    return {
        "name": name,
        "command": [sys.executable, "-c", ENGINE, str(port), mode, str(PAGE_FILE)],
        "url": f"http://127.0.0.1:{port}",
        "gpus": [gpu],
        "settings": {"max_num_seqs": 8},
        "startup_timeout": "30s",
        "probation": "0s",
        "drain": "5s",
    }


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["drip", "stall"])
def test_a_daemon_keeps_ticking_while_one_engines_metrics_trickle(tmp_path: Path, mode: str) -> None:
    config = tmp_path / "tunerd.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "engines": [_engine("fast", free_port(), "ok", 0), _engine("slow", free_port(), mode, 1)],
                "mode": "observe",
                "policies": [],
                "metrics": {"interval": "1s"},
                "state_dir": str(tmp_path / "state"),
                "listen": {"metrics": "127.0.0.1:0", "status": str(tmp_path / "s.sock")},
            }
        )
    )
    daemon = Daemon(load_config(config), gpu=NoGpuSource(), say=lambda event, **fields: None)
    stop = threading.Event()
    runner = threading.Thread(target=daemon.run, args=(stop,))
    pids: list[int] = []
    try:
        daemon.start()
        settle(daemon, 30)
        pids = [
            record.pid for name in ("fast", "slow") if (record := daemon.state.engine(name)) and record.pid
        ]
        runner.start()
        deadline = time.monotonic() + 12
        while daemon.ticks < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert daemon.ticks >= 4, f"{daemon.ticks} ticks in 12 s: a trickling page held the loop"
        asked = time.monotonic()
        status = fetch(tmp_path / "s.sock", timeout=5)  # the real client, over the socket
        assert time.monotonic() - asked < 5
        engines = {engine["name"]: engine for engine in status["engines"]}
        assert engines["fast"]["healthy"] is True
        assert engines["slow"]["healthy"] is False
        fast = daemon.store.latest("engine_up", "fast")
        assert fast is not None
        assert fast.value == 1.0
        assert daemon.scrape_errors.get("slow", 0) >= 2
        assert "fast" not in daemon.scrape_errors
    finally:
        stop.set()
        for pid in pids:  # first: with the old code a tick still reads the trickle
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        if runner.is_alive():
            runner.join(30)
        daemon.close()


class _Trickle(socketserver.StreamRequestHandler):
    server: _UnixTrickling

    def handle(self) -> None:
        self.rfile.readline()  # the request line; the rest is not waited for
        with contextlib.suppress(OSError):
            for byte in b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"engines": []}'[:TRICKLE_BYTES]:
                if self.server.gone.wait(0.5):
                    return
                self.wfile.write(bytes([byte]))
                self.wfile.flush()


class _UnixTrickling(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def __init__(self, path: Path) -> None:
        super().__init__(str(path), _Trickle)
        self.gone = threading.Event()


def test_the_status_client_gives_up_on_a_trickling_daemon_at_its_deadline(tmp_path: Path) -> None:
    """Its per-read timeout was 10 s: a daemon socket sending a byte every 0.5 s held
    ``tunerd status`` (and ``pin``'s wake) for as long as it liked."""
    path = tmp_path / "t.sock"
    with served(_UnixTrickling(path)):
        started = time.monotonic()
        with pytest.raises(UsageError, match=r"did not answer on .* within 2 s"):
            fetch(path, timeout=2.0)
        took = time.monotonic() - started
    assert took < 5, took


def test_the_status_client_refuses_an_answer_that_is_not_a_status(tmp_path: Path) -> None:
    path = tmp_path / "j.sock"
    answers: dict[str, bytes] = {"body": b"[1, 2]"}

    class Handler(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            while self.rfile.readline() not in (b"\r\n", b""):
                pass
            body = answers["body"]
            self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))

    class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
        daemon_threads = True
        gone = threading.Event()

    with served(Server(str(path), Handler)):
        for body in (b"[1, 2]", b"not json", b"[" * 100_000):
            answers["body"] = body
            with pytest.raises(UsageError, match="not a status"):
                fetch(path, timeout=5.0)
