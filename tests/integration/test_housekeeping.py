"""The daemon's housekeeping with a real simulated engine: its log, past the size limit, is
copied aside and truncated while the engine keeps writing to it."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tests.integration.sim_daemon import close_daemon, sim_daemon, started

pytestmark = pytest.mark.slow


def test_a_large_engine_log_is_copied_aside_and_the_engine_writes_on(tmp_path: Path) -> None:
    said: list[tuple[str, dict[str, object]]] = []
    daemon = sim_daemon(tmp_path)
    daemon.say = lambda event, **fields: said.append((event, fields))
    try:
        started(daemon)
        log = tmp_path / "state" / "engines" / "main.log"
        size = log.stat().st_size
        assert size > 1000  # the start-up lines
        daemon.log_max_bytes = 1000
        daemon.housekeeping()

        assert (log.parent / "main.log.1").stat().st_size >= size
        assert "Maximum concurrency" in (log.parent / "main.log.1").read_text()
        assert log.stat().st_size < size
        assert ("engine_log_rotated", {"engine": "main", "path": str(log), "max_bytes": 1000}) in said
        url = daemon.config.engines[0].url
        for _ in range(3):  # the engine logs each request: the lines land in the truncated file
            httpx.post(
                url + "/v1/completions",
                json={"model": "llama-3.1-8b", "prompt": "hi", "max_tokens": 4},
                timeout=30,
            )
        deadline = time.monotonic() + 10
        while "POST /v1/completions" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        text = log.read_text()
        assert "POST /v1/completions" in text
        assert "\0" not in text  # O_APPEND: no hole where the old content was
        daemon.log_max_bytes = 1 << 20
        daemon.housekeeping()
        assert not (log.parent / "main.log.2").exists()  # under the limit: left alone
    finally:
        close_daemon(daemon, kill=True)
