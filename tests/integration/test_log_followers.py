"""Following an engine log: a growing and rotating file, a pipe, journalctl (a stand-in on PATH)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tunerd.sources.engine_log import FileFollower, JournalFollower, LogTail, PipeReader


def _eventually(read: Callable[[], list[str]], count: int, timeout: float = 5.0) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while len(lines) < count and time.monotonic() < deadline:
        lines += read()
        if len(lines) < count:
            time.sleep(0.02)
    return lines


class TestFileFollower:
    def test_file_follower_reads_appended_lines_only(self, tmp_path: Path) -> None:
        log = tmp_path / "engine.log"
        log.write_text("old line\n")
        follower = FileFollower(log)
        assert follower.read_lines() == []
        with log.open("a") as handle:
            handle.write("INFO first\nINFO sec")
        assert follower.read_lines() == ["INFO first"]
        with log.open("a") as handle:
            handle.write("ond\n")
        assert follower.read_lines() == ["INFO second"]
        follower.close()

    def test_file_follower_from_start(self, tmp_path: Path) -> None:
        log = tmp_path / "engine.log"
        log.write_text("a\nb\n")
        assert FileFollower(log, from_start=True).read_lines() == ["a", "b"]

    def test_file_follower_survives_rotation(self, tmp_path: Path) -> None:
        """logrotate's create mode: the file is renamed and a new one appears at the path."""
        log = tmp_path / "engine.log"
        log.write_text("")
        follower = FileFollower(log)
        with log.open("a") as handle:
            handle.write("before rotation\n")
        assert follower.read_lines() == ["before rotation"]
        with log.open("a") as handle:
            handle.write("last words of the old file\n")
        log.rename(tmp_path / "engine.log.1")
        log.write_text("first of the new file\n")
        assert follower.read_lines() == ["last words of the old file", "first of the new file"]

    def test_file_follower_survives_truncation(self, tmp_path: Path) -> None:
        log = tmp_path / "engine.log"
        log.write_text("")
        follower = FileFollower(log)
        log.write_text("a long line before copytruncate\n")
        assert follower.read_lines() == ["a long line before copytruncate"]
        log.write_text("")  # truncated in place
        with log.open("a") as handle:
            handle.write("x\n")
        assert follower.read_lines() == ["x"]

    def test_file_follower_waits_for_missing_file(self, tmp_path: Path) -> None:
        log = tmp_path / "not-yet.log"
        follower = FileFollower(log)
        assert follower.read_lines() == []
        log.write_text("hello\n")
        # a file that appears later is read from its start, like `tail -F`
        assert follower.read_lines() == ["hello"]
        with log.open("a") as handle:
            handle.write("world\n")
        assert follower.read_lines() == ["world"]


def test_pipe_reader_never_blocks_and_bounds_memory() -> None:
    read_end, write_end = os.pipe()
    reader = PipeReader(os.fdopen(read_end, "rb"), max_lines=3)
    assert reader.read_lines() == []
    with os.fdopen(write_end, "wb") as writer:
        writer.write(b"".join(f"line {n}\n".encode() for n in range(5)))
    assert reader.closed.wait(5)
    assert reader.read_lines() == ["line 2", "line 3", "line 4"]
    assert reader.dropped == 2


def test_journal_follower_runs_journalctl_argv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in journalctl on PATH records its argv and prints what a unit would log."""
    record = tmp_path / "argv.txt"
    script = tmp_path / "journalctl"
    script.write_text(
        f"#!{sys.executable}\n"
        "import sys, time\n"
        f"open({str(record)!r}, 'w').write(' '.join(sys.argv[1:]))\n"
        "print('INFO Model loading took 5.35 GiB memory and 3.1 seconds', flush=True)\n"
        "print('INFO GPU KV cache size: 259,136 tokens', flush=True)\n"
        "time.sleep(30)\n"
    )
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    follower = JournalFollower("vllm-llama31.service")
    try:
        lines = _eventually(follower.read_lines, 2)
        assert lines == [
            "INFO Model loading took 5.35 GiB memory and 3.1 seconds",
            "INFO GPU KV cache size: 259,136 tokens",
        ]
        assert follower.alive
    finally:
        follower.close()
    assert record.read_text() == "-u vllm-llama31.service -f -o cat -n 0"
    assert not follower.alive


def test_log_tail_keeps_last_lines_without_colours() -> None:
    tail = LogTail(size=2)
    tail.extend(["one\n", "\x1b[1;31mtwo\x1b[0m\n", "three\r\n"])
    assert tail.lines() == ["two", "three"]
