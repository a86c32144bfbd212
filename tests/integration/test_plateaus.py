"""The seed's "prefill plateau" that falls back, seen the user's way: `tunerd run` over the
simulator with the allocator told to give memory back (``PYTORCH_CUDA_ALLOC_CONF=
garbage_collection_threshold:0.6`` in the engine's environment, as an operator sets it), long
prompts sent with `tunerd sim load`, and what tunerd says of each rectangle nvidia-smi would
draw: a ``transient_plateau`` line in its journal, the rises in ``tunerd status --json`` and
the plateau line of the status screen (real processes on loopback)."""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.cli import TunerdRun
from tests.integration.cli import run_tunerd as _tunerd
from tests.integration.sim_daemon import kill_recorded_engine, sim_config
from tunerd.units import GIB, MIB

pytestmark = pytest.mark.slow
PROMPT_TOKENS = 20_000  # ten chunks of 2,048 a prefill: seconds of simulated time at the peak


def _config(tmp_path: Path, socket: Path) -> tuple[Path, str]:
    """The docs' simulator config, its engine given the allocator's threshold, time ×5 and a
    tick every 250 ms (1.25 simulated seconds) so a prefill's few seconds are seen."""
    path, url = sim_config(
        tmp_path,
        listen={"status": str(socket), "metrics": "127.0.0.1:0"},
        metrics={"interval": "250ms"},
    )
    config = yaml.safe_load(path.read_text())
    engine = config["engine"]
    command = engine["command"]
    command[command.index("--time-scale") + 1] = "5"
    engine["env"] = {"PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.6"}
    path.write_text(yaml.safe_dump(config))
    return path, url


def _status(socket: Path) -> dict[str, Any]:
    done = _tunerd("status", "--json", "--socket", str(socket))
    assert done.returncode == 0, done.stderr
    status: dict[str, Any] = json.loads(done.stdout)
    return status


def test_a_prefill_plateau_that_falls_back_is_reported_with_what_was_in_flight(tmp_path: Path) -> None:
    socket = tmp_path / "run" / "tunerd.sock"
    config, url = _config(tmp_path, socket)
    run = TunerdRun(config)
    try:
        deadline = time.monotonic() + 90
        while True:  # the engine serving and its memory read
            done = _tunerd("status", "--json", "--socket", str(socket))
            engine = json.loads(done.stdout)["engines"][0] if done.returncode == 0 else {}
            if engine.get("healthy") and engine.get("plateaus") is not None:
                break
            assert time.monotonic() < deadline, done.stdout + done.stderr
            time.sleep(0.3)
        assert engine["plateaus"] == []
        assert (
            "prefill plateau (memory_ratchet): none in the last 10 min"
            in _tunerd("status", "--socket", str(socket), env={"NO_COLOR": "1"}).stdout
        )

        load = _tunerd(
            "sim", "load", "--url", url, "--concurrency", "1", "--prompt-tokens", str(PROMPT_TOKENS),
            "--max-tokens", "256", "--requests", "3", timeout=180,
        )  # fmt: skip
        assert load.returncode == 0, load.stdout + load.stderr
        deadline = time.monotonic() + 30
        while len(run.events("transient_plateau")) < 2:
            assert time.monotonic() < deadline, "\n".join(run.lines[-30:])
            time.sleep(0.3)

        said = run.events("transient_plateau")
        for event in said:
            # a prefill's working set, given back once decoding needs less: the simulator's own
            # activation peak for 2,048-token chunks is a few hundred MiB
            assert 64 * MIB <= event["height_bytes"] < 2 * GIB, event
            assert event["kind"] == "transient"
            assert event["end"] > event["at"]
            assert 0 < event["duration_s"] < 60, event
            assert event["prompt_tokens"] >= PROMPT_TOKENS // 4, event  # the prefill in flight meanwhile
            assert event["running"] >= 1, event
        assert len({event["at"] for event in said}) == len(said)  # each said once

        status = _status(socket)
        plateaus = status["engines"][0]["plateaus"]
        transients = [p for p in plateaus if p["kind"] == "transient"]
        assert {p["at"] for p in transients} >= {event["at"] for event in said}
        screen = _tunerd("status", "--socket", str(socket), env={"NO_COLOR": "1"}).stdout
        rows = screen.splitlines()
        first = next(index for index, row in enumerate(rows) if row.startswith("  plateaus"))
        block = [rows[first]]
        block += list(itertools.takewhile(lambda row: row.startswith(" " * 12), rows[first + 1 :]))
        line = " ".join(row.strip() for row in block)
        assert "transient" in line
        assert "fell back" in line
        assert "prompt tokens prefilled" in line
        assert all(len(row) <= 100 for row in screen.splitlines())
    finally:
        run.stop()
        kill_recorded_engine(tmp_path / "state")
