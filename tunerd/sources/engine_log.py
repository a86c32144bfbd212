"""Following an engine's log — a growing (and rotating) file, a pipe, or
``journalctl -u UNIT -f -o cat`` — and which of its lines pass into tunerd's own log.

What the lines *say* (start-up figures, a crash) is :mod:`tunerd.diagnosis`'s, which is pure;
this module does the reading. :class:`LogTail` keeps a bounded tail for alerts.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import threading
from collections import deque
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO

from tunerd.diagnosis import strip_ansi

__all__ = ["PASSTHROUGH", "FileFollower", "JournalFollower", "LogTail", "PipeReader", "passed_through"]


# vLLM's logger prefix: "(APIServer pid=123) WARNING 11-29 17:58:22 [file.py:12] …", the
# process tag optional; or uvicorn's, which vLLM's API server also prints: "INFO:     Started…"
_LEVEL = re.compile(r"^(?:\([^)]*\)\s+)?(DEBUG|INFO|WARNING|ERROR|CRITICAL)(?:\s+\d\d-\d\d\s|:\s)")
PASSTHROUGH = ("warnings", "all", "none")


def passed_through(line: str, mode: str) -> str | None:
    """The level an engine log line is passed into tunerd's log at, or None when ``mode``
    (:data:`PASSTHROUGH`) keeps it out. ``warnings`` passes all but vLLM's DEBUG and INFO
    lines — a line without vLLM's prefix (an uncaught traceback, a raw print to stderr) is
    passed as a warning."""
    if mode == "none" or not line.strip():
        return None
    match = _LEVEL.match(strip_ansi(line))
    level = match.group(1).lower() if match else "warning"
    if mode == "warnings" and level in ("debug", "info"):
        return None
    return level


class LogTail:
    """The last ``size`` lines, for alerts and crash evidence; fixed memory."""

    def __init__(self, size: int = 200) -> None:
        self._lines: deque[str] = deque(maxlen=size)

    def extend(self, lines: Iterable[str]) -> None:
        self._lines.extend(strip_ansi(line).rstrip("\r\n") for line in lines)

    def lines(self) -> list[str]:
        return list(self._lines)


class FileFollower:
    """Reads what was appended to a file since the last call; survives truncation and
    rotation (a new inode at the path is read from its start). Non-blocking.

    Like ``tail -F``: a file that exists when the follower is made is followed from its end
    (``from_start`` reads it whole); one that appears later is read from its start.
    """

    def __init__(
        self, path: str | os.PathLike[str], from_start: bool = False, max_read: int = 1 << 20
    ) -> None:
        self._path = Path(path)
        self._max_read = max_read
        self._file: IO[bytes] | None = None
        self._inode: int | None = None
        self._partial = b""
        self.error: str | None = None
        handle = self._open()
        if handle is not None and not from_start:
            handle.seek(0, os.SEEK_END)

    def _open(self) -> IO[bytes] | None:
        try:
            handle = self._path.open("rb")
        except OSError as error:  # missing, or not readable (yet): try again next poll
            self.error = f"{self._path}: {error.strerror}"
            return None
        self.error = None
        self._file, self._inode = handle, os.fstat(handle.fileno()).st_ino
        return handle

    def read_lines(self) -> list[str]:
        if self._file is None and self._open() is None:
            return []
        assert self._file is not None
        lines = self._drain()
        try:
            stat = self._path.stat()
        except OSError:
            return lines  # rotated away and not yet recreated: keep reading the old one
        if stat.st_ino != self._inode:
            while more := self._drain():  # finish the old file before switching
                lines += more
            if self._partial:
                lines.append(self._partial.decode("utf-8", "replace"))
            self._file.close()
            self._file = None
            self._partial = b""
            if self._open() is not None:
                lines += self._drain()
        elif stat.st_size < self._file.tell():  # truncated in place (copytruncate)
            self._file.seek(0)
            self._partial = b""
            lines += self._drain()
        return lines

    def _drain(self) -> list[str]:
        assert self._file is not None
        data = self._partial + self._file.read(self._max_read)
        *complete, self._partial = data.split(b"\n")
        if len(self._partial) > self._max_read:  # a "line" without an end: pass it on in pieces
            complete.append(self._partial)
            self._partial = b""
        return [line.decode("utf-8", "replace") for line in complete]

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class PipeReader:
    """Reads lines from a pipe in one background thread; :meth:`read_lines` never blocks.

    At most ``max_lines`` are kept between reads (the oldest are dropped and counted), so a
    flood cannot grow memory.
    """

    def __init__(self, stream: IO[bytes], max_lines: int = 10_000) -> None:
        self._stream = stream
        self._lines: deque[str] = deque(maxlen=max_lines)
        self._lock = threading.Lock()
        self.dropped = 0
        self.closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tunerd-log-pipe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for raw in iter(self._stream.readline, b""):
                line = raw.decode("utf-8", "replace").rstrip("\r\n")
                with self._lock:
                    if len(self._lines) == self._lines.maxlen:
                        self.dropped += 1
                    self._lines.append(line)
        except (OSError, ValueError):
            pass
        finally:
            self.closed.set()

    def read_lines(self) -> list[str]:
        with self._lock:
            lines = list(self._lines)
            self._lines.clear()
        return lines

    def close(self) -> None:
        """Close the pipe once its writer has ended it. Closing a pipe that the reader thread
        is blocked on would hang, so while the writer lives this does nothing: the owner ends
        the writer (as :class:`JournalFollower` does) and the thread ends at end of file."""
        if self.closed.wait(timeout=1.0):
            with contextlib.suppress(OSError):
                self._stream.close()


class JournalFollower:
    """``journalctl -u UNIT -f -o cat -n 0`` (argv, no shell), read through a :class:`PipeReader`."""

    def __init__(self, unit: str, journalctl: str = "journalctl", extra: Sequence[str] = ()) -> None:
        self.argv = [journalctl, "-u", unit, "-f", "-o", "cat", "-n", "0", *extra]
        self._process = subprocess.Popen(
            self.argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL
        )
        assert self._process.stdout is not None
        self._reader = PipeReader(self._process.stdout)

    @property
    def alive(self) -> bool:
        return self._process.poll() is None

    def read_lines(self) -> list[str]:
        return self._reader.read_lines()

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=2)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._reader.close()
