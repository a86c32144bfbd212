"""Hooks through the daemon (issue 7): a restart a policy asks for meets a failing `pre_stop`;
the restart is aborted, the engine serves on, and a person is paged. (The order of hooks around
a restart is in test_saga.py.)"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
import yaml

from tests.integration.sim_daemon import BEFORE, close_daemon, sim_daemon, started, ticked

pytestmark = pytest.mark.slow


def test_a_failing_pre_stop_aborts_the_restart_and_pages(tmp_path: Path) -> None:
    policy = tmp_path / "policies.yaml"
    policy.write_text(
        yaml.safe_dump(
            {
                "version": 1,
                "policies": [
                    {
                        "name": "fewer-seqs",
                        "description": "an idle engine: fewer sequences (a test policy that fires at once)",
                        "when": {"metric": "num_requests_running", "below": 1},
                        "then": [{"tune": {"max_num_seqs": "step_down"}}, {"restart": {"drain": "0s"}}],
                    }
                ],
            }
        )
    )
    refuse = [sys.executable, "-c", "import sys; print('lb: pool busy, not removed'); sys.exit(4)"]
    daemon = sim_daemon(
        tmp_path,
        policies=(str(policy),),
        bounds={"max_num_seqs": [4, 8]},
        hooks={"pre_stop": refuse},
    )
    try:
        started(daemon)
        pid = daemon.state.engine("main").pid
        ticked(daemon)
        alert, tune = daemon.state.history(limit=2)
        assert (tune["kind"], tune["outcome"], tune["policy"]) == ("tune", "failed", "fewer-seqs")
        assert "pre_stop hook failed (exit 4 in" in tune["reason"]
        assert "lb: pool busy, not removed): the old engine still serves" in tune["reason"]
        assert alert["kind"] == "notify"
        assert alert["reason"].startswith(
            "critical firing: main: the change fewer-seqs asked for did not take (failed)"
        )
        assert "restart failed: pre_stop hook failed" in alert["reason"]
        record = daemon.state.engine("main")
        assert record.pid == pid
        assert daemon.engines[0].supervisor.running_settings() == BEFORE
        assert httpx.get(daemon.config.engines[0].url + "/health", timeout=5).status_code == 200
    finally:
        close_daemon(daemon, kill=True)
