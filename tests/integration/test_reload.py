"""SIGHUP reloads `tunerd run`'s config and policies (real processes, the simulator, the status
API): a bad policy file keeps the running policies and says why with file and line; a good one
takes effect, and a policy that stays keeps its state (a pending `for` hold goes on counting)."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.cli import TunerdRun, run_tunerd
from tests.integration.sim_daemon import kill_recorded_engine, sim_config

pytestmark = pytest.mark.slow
# pending from the first tick on, for an hour: its "since" shows whether the state survived
WATCH = {"name": "watch-uptime", "when": {"metric": "engine_up", "above": 0.5, "for": "1h"}, "then": [{"notify": {"severity": "info"}}]}  # fmt: skip
EXTRA = {"name": "watch-pool", "when": {"metric": "kv_cache_usage", "above": 0.95}, "then": [{"notify": {"severity": "warning"}}]}  # fmt: skip


def _policies(socket: Path) -> dict[str, dict[str, Any]]:
    done = run_tunerd("status", "--json", "--socket", str(socket))
    assert done.returncode == 0, done.stderr
    return {p["name"]: p for p in json.loads(done.stdout)["engines"][0]["policies"]}


def test_sighup_keeps_the_old_policies_on_a_bad_file_and_takes_a_good_one(tmp_path: Path) -> None:
    socket = tmp_path / "tunerd.sock"
    policy_file = tmp_path / "policies.yaml"
    policy_file.write_text(yaml.safe_dump({"version": 1, "policies": [WATCH]}, sort_keys=False))
    config, _ = sim_config(
        tmp_path,
        listen={"status": str(socket), "metrics": "127.0.0.1:0"},
        policies=[str(policy_file)],
        metrics={"interval": "300ms"},
    )
    run = TunerdRun(config)
    try:
        run.event("engine_reconciled")
        deadline = time.monotonic() + 30
        while (before := _policies(socket))["watch-uptime"]["state"] != "pending":
            assert time.monotonic() < deadline, before
            time.sleep(0.2)
        since = before["watch-uptime"]["since"]

        policy_file.write_text(policy_file.read_text().replace("for: 1h", "for: banana"))
        run.process.send_signal(signal.SIGHUP)
        failed = run.event("reload_failed")
        assert len(failed["problems"]) == 1
        assert failed["problems"][0].startswith(f"{policy_file}:")
        assert "invalid duration 'banana'" in failed["problems"][0]
        assert failed["kept"] == "the running config and policies"
        assert _policies(socket)["watch-uptime"]["state"] == "pending"  # still evaluated

        policy_file.write_text(yaml.safe_dump({"version": 1, "policies": [WATCH, EXTRA]}, sort_keys=False))
        run.process.send_signal(signal.SIGHUP)
        reloaded = run.event("reloaded")
        assert reloaded["policies"] == ["watch-uptime", "watch-pool"]
        assert reloaded["needs_restart"] == []
        time.sleep(1)  # a tick or two with the new set
        after = _policies(socket)
        assert set(after) == {"watch-uptime", "watch-pool"}
        assert after["watch-uptime"]["state"] == "pending"
        assert after["watch-uptime"]["since"] == since  # its hold kept counting through the reload
        assert run.process.poll() is None
    finally:
        run.process.send_signal(signal.SIGTERM)
        run.process.wait(timeout=30)
        kill_recorded_engine(tmp_path / "state")
