"""SIGHUP reloads `tunerd run`'s config and policies (real processes, the simulator, the status
API): a bad policy file keeps the running policies and says why with file and line; a good one
takes effect, and a policy that stays keeps its state (a pending `for` hold goes on counting).
Any problem at all — a value of the wrong type, a glob that matches nothing, a bug — is
`reload_failed`, and the running config and policies stay."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.cli import TunerdRun, run_tunerd
from tests.integration.sim_daemon import close_daemon, kill_recorded_engine, sim_config, sim_daemon
from tunerd import daemon as daemon_module

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


WATCH_FILE = {"version": 1, "policies": [WATCH]}


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        # a value of the wrong type raised TypeError in the loader: `job_failed`, not reload_failed
        (
            {"notify": [{"name": [], "kind": "slack", "url": "http://x"}]},
            "notify[0].name: Input should be a valid string",
        ),
        (
            {"notify": [{"name": "t", "kind": "teams", "url": 5}]},
            "notify[0].url: Input should be a valid string",
        ),
        ({"policies": ["nowhere/*.yaml"]}, "policies[0]: 'nowhere/*.yaml' matches no file"),
        ({"guards": {"window": "0s"}}, "guards.window: duration '0s' must be more than zero"),
    ],
)
def test_a_reload_with_any_config_problem_is_reload_failed_and_keeps_the_running_set(
    tmp_path: Path, change: dict[str, Any], problem: str
) -> None:
    policy_file = tmp_path / "policies.yaml"
    policy_file.write_text(yaml.safe_dump(WATCH_FILE, sort_keys=False))
    said: list[dict[str, Any]] = []
    daemon = sim_daemon(tmp_path, policies=(str(policy_file),), said=said)
    try:
        config = tmp_path / "tunerd.yaml"
        config.write_text(yaml.safe_dump({**yaml.safe_load(config.read_text()), **change}))
        before = daemon.config
        assert daemon.reload() is False
        [failed] = [event for event in said if event["event"] in ("reload_failed", "reloaded")]
        assert failed["event"] == "reload_failed"
        assert len(failed["problems"]) == 1, failed
        assert failed["problems"][0].startswith(f"{config}:")
        assert problem in failed["problems"][0]
        assert failed["kept"] == "the running config and policies"
        assert daemon.config is before
        assert [policy.name for policy in daemon.policies] == ["watch-uptime"]
    finally:
        close_daemon(daemon, kill=True)


def test_a_reload_that_a_loader_bug_stops_is_reload_failed_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not a job failure: whatever goes wrong while the files are read, the running set stays."""
    policy_file = tmp_path / "policies.yaml"
    policy_file.write_text(yaml.safe_dump(WATCH_FILE, sort_keys=False))
    said: list[dict[str, Any]] = []
    daemon = sim_daemon(tmp_path, policies=(str(policy_file),), said=said)
    try:

        def broken(paths: object) -> None:
            raise TypeError("unhashable type: 'list'")

        monkeypatch.setattr(daemon_module, "load_policy_files", broken)
        assert daemon.reload() is False
        [failed] = [event for event in said if event["event"] == "reload_failed"]
        assert failed["problems"] == [
            f"{tmp_path / 'tunerd.yaml'}: could not be reloaded: TypeError: unhashable type: 'list'"
        ]
        assert [policy.name for policy in daemon.policies] == ["watch-uptime"]
    finally:
        close_daemon(daemon, kill=True)
