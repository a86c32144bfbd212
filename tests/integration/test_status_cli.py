"""`tunerd status` against a running `tunerd run` over the simulator (real processes, the
status API on a unix socket): every contract field (DESIGN §4.8) with live values, and a
human view that fits 100 columns."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.cli import TunerdRun
from tests.integration.cli import run_tunerd as _tunerd
from tests.integration.sim_daemon import BEFORE, kill_recorded_engine, sim_config

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]
ENGINE_FIELDS = {
    "name", "state", "generation", "settings", "pid", "healthy", "last_known_good", "bills",
    "metrics", "policies", "guards", "last_actions",
}  # fmt: skip


def _status(socket: Path, deadline: float) -> dict[str, Any]:
    """The status once the engine is up and scraped (the first start takes a moment)."""
    while True:
        done = _tunerd("status", "--json", "--socket", str(socket))
        if done.returncode == 0:
            status = json.loads(done.stdout)
            engine = status["engines"][0]
            # the GPU sampler starts before the engine: its first readings find no simulator
            seen = engine["healthy"] and engine["metrics"] and engine["bills"]["weights"] and status["gpus"]
            # the observation opens at the start; its bills once the log and a reading while
            # answering are in (the calibration block says None until then: not a failure)
            calibration = engine.get("calibration") or {}
            bills = calibration.get("bills") or {}
            if seen and bills.get("headroom_bytes") is not None and engine.get("recommendation"):
                return status
        if time.monotonic() > deadline:
            raise AssertionError(f"no live status: {done.stdout}{done.stderr}")
        time.sleep(0.3)


def test_status_json_has_every_contract_field_and_the_human_view_fits(tmp_path: Path) -> None:
    socket = tmp_path / "run" / "tunerd.sock"
    config, _ = sim_config(
        tmp_path,
        listen={"status": str(socket), "metrics": "127.0.0.1:0"},
        policies=[str(ROOT / "policies" / "default.yaml")],
        metrics={"interval": "500ms"},
    )
    run = TunerdRun(config)
    try:
        status = _status(socket, time.monotonic() + 120)
        assert stat.S_IMODE(socket.stat().st_mode) == 0o660

        assert status["mode"] == "advise"
        (gpu,) = status["gpus"]
        assert set(gpu) >= {"index", "uuid", "name", "used_bytes", "total_bytes", "free_bytes"}
        assert gpu["name"].startswith("NVIDIA GeForce RTX 4090")
        assert gpu["used_bytes"] + gpu["free_bytes"] <= gpu["total_bytes"]
        (engine,) = status["engines"]
        assert set(engine) >= ENGINE_FIELDS
        assert engine["name"] == "main"
        assert engine["state"] == "running"
        assert engine["healthy"] is True
        assert engine["settings"] == engine["last_known_good"] == BEFORE
        assert engine["generation"] >= 1
        state = _tunerd("history", "--json", "--state-dir", str(tmp_path / "state"))
        assert json.loads(state.stdout)["actions"][0]["kind"] == "restart"  # the first start
        assert engine["last_actions"][0]["kind"] == "restart"
        bills = engine["bills"]
        assert set(bills) == {"weights", "kv_pool", "engine_other", "other_processes", "free", "total"}
        assert all(isinstance(value, int) for value in bills.values()), bills
        # the simulator's figures: AWQ 8B weights ~5.4 GiB, the pool what 0.92 leaves; Xorg is the other
        assert 4 << 30 < bills["weights"] < 7 << 30
        assert bills["kv_pool"] > 10 << 30
        assert bills["other_processes"] > 0
        assert bills["free"] == gpu["free_bytes"]
        assert engine["metrics"]["kv_cache_usage"] is not None
        assert {"kv_cache_usage", "num_requests_running", "num_requests_waiting"} <= set(engine["metrics"])
        names = {p["name"] for p in engine["policies"]}
        assert "kv-pool-saturated" in names
        assert all(set(p) == {"name", "state", "since", "health", "last_error"} for p in engine["policies"])
        assert engine["guards"] == {"restarts_in_window": 1, "budget_left": 2, "held": False}
        # issue 18: the box as measured from this start, and the right-sizing block
        calibration = engine["calibration"]
        assert calibration is not None
        assert calibration["bills"]["weights_bytes"] == pytest.approx(bills["weights"], abs=8 << 20)
        assert calibration["bills"]["headroom_bytes"] is not None
        assert calibration["fits"]["gpu_memory_utilization"]["value"] is not None
        assert [item["name"] for item in calibration["neighbours"].values()] == ["Xorg"]  # per PID
        recommendation = engine["recommendation"]
        assert set(recommendation) == {
            "requests", "gpu_memory_utilization", "max_num_batched_tokens", "max_model_len", "max_num_seqs",
            "kv_cache_dtype",
        }  # fmt: skip
        assert set(recommendation["max_num_seqs"]) == {
            "current", "target", "lower", "upper", "reason", "predicted_kv_cache_tokens"
        }  # fmt: skip

        human = _tunerd("status", "--socket", str(socket), env={"NO_COLOR": "1"})
        assert human.returncode == 0, human.stderr
        lines = human.stdout.splitlines()
        assert max(len(line) for line in lines) <= 100, human.stdout
        assert "\033[" not in human.stdout
        assert lines[0].startswith("tunerd — mode advise")
        assert any(line.startswith("main  running  generation") for line in lines)
        assert any("[WWW" in line for line in lines)  # the bills as a bar, weights first
        # tunerd's own /metrics: the same numbers for Prometheus
        address = run.event("metrics_listening")["address"]
        page = httpx.get(f"http://{address}/metrics", timeout=10).text
        samples = {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(page)
            for sample in family.samples
        }
        assert samples[("tunerd_memory_bytes", (("bill", "weights"), ("engine", "main")))] > 4 << 30
        assert samples[("tunerd_engine_state", (("engine", "main"), ("state", "running")))] == 1.0
        assert samples[("tunerd_engine_state", (("engine", "main"), ("state", "held")))] == 0.0
        assert samples[("tunerd_kv_cache_usage", (("engine", "main"),))] == 0.0
        assert samples[("tunerd_engine_up", (("engine", "main"),))] == 1.0
        assert samples[("tunerd_restart_budget_left", (("engine", "main"),))] == 2.0
        assert samples[("tunerd_calibrated_headroom_bytes", (("engine", "main"),))] > 0
        first_start = (("engine", "main"), ("kind", "restart"), ("outcome", "succeeded"), ("policy", ""))
        assert samples[("tunerd_actions_total", first_start)] == 1.0
        saturated = (("engine", "main"), ("policy", "kv-pool-saturated"), ("state", "inactive"))
        assert samples[("tunerd_policy_state", saturated)] == 1.0
        assert 0 <= samples[("tunerd_sampling_lag_seconds", ())] < 5
        assert not any(name.startswith(("process_", "python_")) for name, _ in samples)  # its own registry
    finally:
        run.stop()
        kill_recorded_engine(tmp_path / "state")
    assert not socket.exists()  # removed on the way out


def test_status_without_a_daemon_says_where_it_looked(tmp_path: Path) -> None:
    done = _tunerd("status", "--socket", str(tmp_path / "none.sock"))
    assert done.returncode == 3  # no daemon answered: not a usage error (2)
    assert f"no status socket at {tmp_path / 'none.sock'}: is tunerd running?" in done.stderr


def test_advise_mode_posts_the_right_sizing_when_it_changes(tmp_path: Path) -> None:
    """Issue 18: after the engine has served 24 requests of about 3K tokens, advise mode posts
    the recommendation (an info alert in history) — once, not at every tick."""
    socket = tmp_path / "run" / "tunerd.sock"
    config, url = sim_config(
        tmp_path, listen={"status": str(socket), "metrics": "127.0.0.1:0"}, metrics={"interval": "500ms"}
    )
    run = TunerdRun(config)
    try:
        _status(socket, time.monotonic() + 120)
        load = subprocess.run(
            [sys.executable, "-m", "tunerd", "sim", "load", "--url", url, "--concurrency", "4",
             "--prompt-tokens", "3000", "--max-tokens", "64", "--requests", "24"],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert load.returncode == 0, load.stdout + load.stderr
        deadline = time.monotonic() + 30
        posted: list[dict[str, Any]] = []
        while time.monotonic() < deadline and not posted:
            history = json.loads(_tunerd("history", "--json", "--state-dir", str(tmp_path / "state")).stdout)
            posted = [
                a for a in history["actions"] if a["kind"] == "notify" and a["policy"] == "right-sizing"
            ]
            time.sleep(0.5)
        assert posted, history
        assert "right-sizing for main" in posted[0]["reason"]
        assert "max_model_len 32768 → 5120" in posted[0]["reason"]  # 5,000 + 100 (the buckets), to 1,024
        time.sleep(2)  # the last requests' histograms are in; from here nothing moves

        def count() -> int:
            history = json.loads(_tunerd("history", "--json", "--state-dir", str(tmp_path / "state")).stdout)
            return len([a for a in history["actions"] if a["policy"] == "right-sizing"])

        settled = count()
        time.sleep(3)  # a few more ticks with nothing served: nothing posted again
        assert count() == settled
        status = json.loads(_tunerd("status", "--json", "--socket", str(socket)).stdout)
        assert status["engines"][0]["recommendation"]["requests"] >= 24
    finally:
        run.stop()
        kill_recorded_engine(tmp_path / "state")
