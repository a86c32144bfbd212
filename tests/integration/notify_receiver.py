"""A local HTTP receiver on loopback that plays each chat service for the notify tests: it
answers as the service does (Feishu's ``code`` and DingTalk's ``errcode`` in an HTTP 200,
Slack's plain ``ok``, Discord's 204…), or as told — a status, a body, a ``Retry-After``, a delay,
a body sent a byte at a time (``drip``) or not at all after the headers (``stall``) — and records
every request it got."""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

__all__ = ["SUCCESS", "Answer", "Got", "Receiver", "receiver"]

# what each service answers when it took the message (reference/integrations-facts.md §1)
SUCCESS: dict[str, tuple[int, bytes]] = {
    "feishu": (200, b'{"code":0,"msg":"success","data":{},"StatusCode":0,"StatusMessage":"success"}'),
    "dingtalk": (200, b'{"errcode":0,"errmsg":"ok"}'),
    "wecom": (200, b'{"errcode":0,"errmsg":"ok"}'),
    "slack": (200, b"ok"),
    "teams": (202, b""),
    "discord": (204, b""),
    "webhook": (200, b'{"ok":true}'),
    "alertmanager": (200, b""),
}


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0  # before anything is sent
    drip: float = 0.0  # the body one byte at a time, this many seconds apart
    stall: float = 0.0  # after the headers, before the body


@dataclass(frozen=True)
class Got:
    at: float  # monotonic
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class Receiver(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, kind: str) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.kind = kind
        self.got: list[Got] = []
        self.plan: deque[Answer] = deque()  # answers to give first, in order; then success
        self.release = threading.Event()  # ends every delay at once (teardown)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/hook/secret-token-path"

    def answer(self, *answers: Answer) -> None:
        self.plan.extend(answers)

    def wait_for(self, count: int, timeout: float = 10.0) -> list[Got]:
        deadline = time.monotonic() + timeout
        while len(self.got) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        return list(self.got)


class _Handler(BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length)
        parts = urlsplit(self.path)
        self.server.got.append(
            Got(time.monotonic(), parts.path, parse_qs(parts.query), dict(self.headers.items()), body)
        )
        answer = self.server.plan.popleft() if self.server.plan else Answer(*SUCCESS[self.server.kind])
        if answer.delay:
            self.server.release.wait(answer.delay)
        try:
            self.send_response(answer.status)
            for key, value in answer.headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(answer.body)))
            self.end_headers()
            self.wfile.flush()
            if answer.stall:
                self.server.release.wait(answer.stall)
            if not answer.drip:
                self.wfile.write(answer.body)
            for byte in answer.body if answer.drip else b"":
                if self.server.release.wait(answer.drip):
                    break
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
        except OSError:
            pass  # the client gave up (a timeout test)

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextmanager
def receiver(kind: str) -> Iterator[Receiver]:
    server = Receiver(kind)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.release.set()
        server.shutdown()
        server.server_close()
