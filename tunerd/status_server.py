"""The daemon's status API: HTTP over a unix socket (mode 0660, so the ``tunerd`` group may
read it). ``GET /status`` → DESIGN §4.8's JSON (``tunerd status`` is its client); ``POST
/wake`` asks the daemon to look at its state now rather than at its next tick (``tunerd pin``,
``resume`` and ``rollback`` write their word to the state database, then wake it); ``GET
/recording?engine=E&since=T&until=T`` → an engine's recording of that window, as the daemon's
loop thread cut it (``tunerd record ENGINE --for D`` is its client; docs/incidents.md).

The server only hands out the latest status the daemon published (after each tick and each
restart step): it never reads the daemon's state itself, so it needs no lock and a slow
client never slows the loop. A recording is asked of the loop thread, which answers between
its jobs; the handler waits for it a bounded time. A connection idle for 10 s is closed, so
silent clients cannot pile up threads.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import socketserver
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

__all__ = ["StatusServer"]


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    published: Callable[[], dict[str, Any] | None]
    wake: Callable[[], None] | None
    recording: Callable[[dict[str, str]], tuple[int, dict[str, Any]]] | None


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    # a client that connects and then sends nothing (or keeps an idle connection) frees its
    # thread after this long
    timeout = 10.0

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the daemon logs what matters; a status poll is not an event

    def do_GET(self) -> None:
        resource, _, query = self.path.partition("?")
        if resource in ("/recording", "/recording/") and self.server.recording is not None:
            self._send(*self.server.recording(dict(parse_qsl(query[:2048]))))
            return
        if resource not in ("/status", "/status/"):
            self._send(404, {"error": f"no such resource {self.path[:200]}; try /status"})
            return
        status = self.server.published()
        if status is None:
            self._send(503, {"error": "tunerd is starting: no status yet"})
            return
        self._send(200, status)

    def do_POST(self) -> None:
        if self.path.split("?", 1)[0] not in ("/wake", "/wake/") or self.server.wake is None:
            self._send(404, {"error": f"no such resource {self.path}; try POST /wake"})
            return
        self.server.wake()
        self._send(202, {"ok": True, "said": "tunerd looks at its state now"})

    def _send(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _someone_listens(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1)
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


class StatusServer:
    def __init__(
        self,
        path: str | os.PathLike[str],
        published: Callable[[], dict[str, Any] | None],
        wake: Callable[[], None] | None = None,
        recording: Callable[[dict[str, str]], tuple[int, dict[str, Any]]] | None = None,
    ) -> None:
        self.path = Path(path)
        self._published = published
        self._wake = wake
        self._recording = recording
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> StatusServer:
        """Bind (a socket file left by a dead tunerd is replaced; a live one is an error)."""
        if self.path.exists():
            if _someone_listens(self.path):
                raise OSError(f"another process already serves status at {self.path}")
            self.path.unlink()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        server = _Server(str(self.path), _Handler, bind_and_activate=False)
        server.published = self._published
        server.wake = self._wake
        server.recording = self._recording
        old_umask = os.umask(0o117)  # born 0660: no moment of a wider mode
        try:
            server.server_bind()
        finally:
            os.umask(old_umask)
        server.server_activate()
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name="tunerd-status", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
