"""systemd mode end to end (DESIGN §4.9): a real daemon drives a simulated engine that runs as
a "unit" of the stand-in ``systemctl``/``journalctl`` (``systemd_standin/``, on PATH): they
hold the unit's state and really start the simulator from the unit's ``ExecStart``, with
``$TUNERD_ARGS`` from the environment file tunerd writes.

Stories: a saturated pool → the environment file rewritten with the new flags → one
``systemctl restart`` → the engine back with them; a start failure → the previous environment
file restored and the unit restarted; tunerd restarting adopts the unit's engine without a
restart; a crash is restarted through ``systemctl restart``."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.integration.sim_daemon import free_port, sim_command, started, ticked
from tunerd.config import load_config
from tunerd.daemon import Daemon
from tunerd.engine.args import engine_argv, settings_from_argv
from tunerd.engine.process import read_identity
from tunerd.engine.unit import SystemdRunner
from tunerd.sim.load import LoadOptions, run_load
from tunerd.sources.gpu import NoGpuSource

pytestmark = pytest.mark.slow
STANDIN = Path(__file__).parent / "systemd_standin"
ROOT = Path(__file__).parents[2]
UNIT = "vllm-main.service"
GIB = 1 << 30
# the simulator's saturation setting (tests/integration/test_sim.py): 12 streams of 8K prompts
# in a 49K-token pool
SETTINGS = {
    "max_model_len": 16384,
    "max_num_seqs": 12,
    "max_num_batched_tokens": 8192,
    "kv_cache_memory_bytes": 6 * GIB,
}


class Box:
    """The stand-in systemd's folder, the unit, the daemon's config."""

    def __init__(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, policies: list[dict[str, object]]
    ) -> None:
        self.root = tmp_path / "systemd"
        self.state_dir = tmp_path / "state"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        monkeypatch.setenv("STANDIN_SYSTEMD_DIR", str(self.root))
        monkeypatch.setenv("PATH", f"{STANDIN}{os.pathsep}{os.environ['PATH']}")
        (self.root / "units").mkdir(parents=True)
        command = sim_command(self.port, "h100-80g")
        # the shipped example unit, with the simulator for vLLM and this test's paths
        (self.root / "units" / UNIT).write_text(
            "[Unit]\nDescription=a simulated vLLM engine driven by tunerd\n\n[Service]\n"
            f"EnvironmentFile=-{self.env_path}\n"
            f"ExecStart={shlex.join(command)} $TUNERD_ARGS\n"
            "Restart=no\nKillMode=mixed\nTimeoutStopSec=60\n"
        )
        policy_file = tmp_path / "policies.yaml"
        policy_file.write_text(yaml.safe_dump({"version": 1, "policies": policies}, sort_keys=False))
        self.config = tmp_path / "tunerd.yaml"
        self.config.write_text(
            yaml.safe_dump(
                {
                    "engine": {
                        "name": "main",
                        "control": "systemd",
                        "unit": UNIT,
                        "url": self.url,
                        "settings": SETTINGS,
                        "bounds": {"max_num_seqs": [4, 12]},
                        "drain": "30s",
                        "startup_timeout": "30s",
                        "probation": "1s",
                    },
                    "gpu": {"source": "none"},
                    "metrics": {"interval": "200ms"},
                    "mode": "act",
                    "policies": [str(policy_file)],
                    "guards": {"settle": "0s"},
                    "state_dir": str(self.state_dir),
                }
            )
        )

    @property
    def env_path(self) -> Path:
        return self.state_dir / "engines" / "main.env"

    def daemon(self, said: list[dict[str, object]] | None = None) -> Daemon:
        def say(event: str, **fields: object) -> None:
            if said is not None:
                said.append({"event": event, **fields})

        return Daemon(load_config(self.config), gpu=NoGpuSource(), say=say)

    def calls(self) -> list[str]:
        return (self.root / "calls.log").read_text().splitlines()

    def unit_state(self) -> dict[str, object]:
        return dict(json.loads((self.root / "run" / f"{UNIT}.json").read_text()))

    def main_pid(self) -> int:
        return int(str(self.unit_state()["MainPID"]))

    def env_flags(self) -> list[str]:
        line = next(x for x in self.env_path.read_text().splitlines() if x.startswith("TUNERD_ARGS="))
        return line.removeprefix("TUNERD_ARGS=").strip('"').split()

    def stop_unit(self) -> None:
        pid = self.main_pid() if (self.root / "run" / f"{UNIT}.json").exists() else 0
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


@pytest.fixture
def saturation_box(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Box]:
    shipped = yaml.safe_load((ROOT / "policies" / "default.yaml").read_text())
    policy = next(p for p in shipped["policies"] if p["name"] == "kv-pool-saturated")
    policy["when"]["all"][0]["for"] = "0s"  # the shipped 10 minutes, cut for the story
    box = Box(tmp_path, monkeypatch, [policy])
    yield box
    box.stop_unit()


def _saturate(box: Box, daemon: Daemon, seconds: float) -> dict[str, object]:
    """Load the engine and tick the daemon until it tunes; the tune's history record."""
    options = LoadOptions(box.url, concurrency=12, prompt_tokens=8_000, max_tokens=512, duration=seconds)
    threading.Thread(target=run_load, args=(options,), daemon=True).start()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        ticked(daemon)
        tunes = [h for h in daemon.state.history(limit=20) if h["kind"] == "tune"]
        if tunes:
            return tunes[0]
        time.sleep(0.2)
    raise AssertionError(f"no tune within {seconds:g} s: {daemon.state.history(limit=5)}")


def test_saturation_rewrites_the_env_file_and_restarts_the_unit_once(saturation_box: Box) -> None:
    box = saturation_box
    daemon = box.daemon()
    try:
        started(daemon)  # the first start is the unit's: env file, then systemctl restart
        assert box.env_flags() == engine_argv((), SETTINGS, 30)
        first_pid = box.main_pid()
        calls_before = len(box.calls())

        tune = _saturate(box, daemon, seconds=60)

        assert tune["outcome"] == "succeeded", tune
        assert tune["policy"] == "kv-pool-saturated"
        after = dict(tune["to_settings"])  # type: ignore[call-overload]
        assert after["max_num_seqs"] < 12
        assert {k: v for k, v in after.items() if k != "max_num_seqs"} == {
            k: v for k, v in SETTINGS.items() if k != "max_num_seqs"
        }
        # the environment file holds the new flags, whole; no drop-in, no daemon-reload
        assert box.env_flags() == engine_argv((), after, 30)
        assert box.env_path.read_text().startswith("# written by tunerd")
        restarts = [c for c in box.calls()[calls_before:] if not c.startswith("systemctl show")]
        assert restarts == [f"systemctl restart {UNIT}"]
        # the engine the unit runs now was started with them (its own argv says so)
        pid = box.main_pid()
        assert pid != first_pid
        live = read_identity(pid)
        assert live is not None
        assert settings_from_argv(live.argv)["max_num_seqs"] == after["max_num_seqs"]
        # its output reached tunerd's log through journalctl: vLLM's own non-default args line
        log = (box.state_dir / "engines" / "main.log").read_text()
        assert f"'max_num_seqs': {after['max_num_seqs']}" in log
        assert "'max_num_seqs': 12" not in log  # the old engine's lines stayed in the old run's log
        record = daemon.state.engine("main")
        assert record is not None
        assert record.pid == pid
        assert record.running == record.last_known_good
    finally:
        daemon.close()


def test_a_start_failure_restores_the_env_file_and_restarts_the_unit(saturation_box: Box) -> None:
    box = saturation_box
    daemon = box.daemon()
    try:
        started(daemon)
        before = box.env_path.read_text()
        good_pid = box.main_pid()
        calls_before = len(box.calls())
        supervisor = daemon.engines[0].supervisor
        # more context than the pool holds: the simulator refuses it at start-up, as vLLM does
        bad = {**SETTINGS, "max_model_len": 131072, "kv_cache_memory_bytes": GIB}
        result = supervisor.restart(bad, reason="a test asks for too long a context")

        assert result.outcome == "rolled_back", result
        assert "estimated maximum model length" in result.reason
        assert box.env_path.read_text() == before  # the previous flags, restored
        restarts = [c for c in box.calls()[calls_before:] if not c.startswith("systemctl show")]
        assert restarts == [f"systemctl restart {UNIT}"] * 2  # the new flags, then the old
        assert box.main_pid() not in (0, good_pid)
        assert supervisor.healthy()
        record = daemon.state.engine("main")
        assert record is not None
        assert daemon.state.version(record.running or 0).settings == SETTINGS
        tune = daemon.state.history(limit=1)[0]
        assert (tune["kind"], tune["outcome"]) == ("tune", "rolled_back")
    finally:
        daemon.close()


def test_a_new_tunerd_adopts_the_units_engine_and_a_crash_restarts_the_unit(saturation_box: Box) -> None:
    box = saturation_box
    first = box.daemon()
    started(first)
    pid = box.main_pid()
    first.close()
    calls_before = len(box.calls())

    daemon = box.daemon()
    try:
        started(daemon)
        assert [c for c in box.calls()[calls_before:] if not c.startswith("systemctl show")] == []
        assert daemon.engines[0].supervisor.process is not None
        assert daemon.engines[0].supervisor.process.pid == pid

        os.kill(pid, signal.SIGKILL)  # the engine dies under the unit
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and box.main_pid() in (0, pid):
            ticked(daemon)
            time.sleep(0.1)
        assert box.main_pid() not in (0, pid)
        restarts = [c for c in box.calls()[calls_before:] if not c.startswith("systemctl show")]
        assert restarts == [f"systemctl restart {UNIT}"]
        crash = next(h for h in daemon.state.history(limit=5) if h["kind"] == "restart")
        assert crash["outcome"] == "succeeded", crash
        assert "engine crashed" in crash["reason"]
        assert crash["evidence"]["crash"]["exit_code"] == -signal.SIGKILL
    finally:
        daemon.close()


def test_a_unit_that_would_undo_the_drain_is_called_out_at_start(saturation_box: Box) -> None:
    box = saturation_box
    unit = box.root / "units" / UNIT
    unit.write_text(
        unit.read_text().replace("KillMode=mixed\n", "").replace("TimeoutStopSec=60", "TimeoutStopSec=45")
    )
    said: list[dict[str, object]] = []
    daemon = box.daemon(said)
    try:
        started(daemon)
        problems = [str(e["problem"]) for e in said if e["event"] == "unit_problem"]
        assert problems == [
            f"{UNIT}: KillMode=control-group signals vLLM's engine core directly and aborts the drain; "
            "set KillMode=mixed",
            f"{UNIT}: TimeoutStopSec=45s is shorter than the drain (30s) + 30s: systemd would kill "
            "requests vLLM is still finishing",
        ]
        assert daemon.engines[0].supervisor.healthy()  # said, not refused: the engine still starts
    finally:
        daemon.close()


def test_an_env_file_written_before_a_restart_that_never_came_is_not_the_new_engine(
    saturation_box: Box,
) -> None:
    """tunerd died between writing the environment file and ``systemctl restart``: the engine
    still runs the old flags, so it is not taken for the new one (the review found find_new
    trusting the file alone)."""
    box = saturation_box
    daemon = box.daemon()
    try:
        started(daemon)
        runner = daemon.engines[0].supervisor.runner
        assert isinstance(runner, SystemdRunner)
        new = engine_argv((), {**SETTINGS, "max_num_seqs": 9}, 30)
        runner.write_env(new)
        assert runner.find_new(new) is None
        engine = runner.spawn(new)  # the restart that was due
        try:
            found = runner.find_new(new)
            assert found is not None
            assert found.pid == engine.pid
            found.close()
        finally:
            engine.close()
    finally:
        daemon.close()


def test_a_persons_systemctl_restart_is_not_a_crash(saturation_box: Box) -> None:
    """A person runs `systemctl restart` on the engine's unit: the old main process exits and a
    new invocation starts. tunerd records a person's restart (adopting the new engine), not a
    crash: no crash event, no restart of its own, nothing toward the crash loop or the budget."""
    box = saturation_box
    said: list[dict[str, object]] = []
    daemon = box.daemon(said)
    try:
        started(daemon)
        old_pid = box.main_pid()
        calls_before = len(box.calls())
        person = subprocess.run(
            [str(STANDIN / "systemctl"), "restart", UNIT],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert person.returncode == 0, person.stderr
        new_pid = box.main_pid()
        assert new_pid not in (0, old_pid)
        deadline = time.monotonic() + 20
        supervisor = daemon.engines[0].supervisor
        while time.monotonic() < deadline and (
            supervisor.process is None or supervisor.process.pid != new_pid
        ):
            ticked(daemon)
            time.sleep(0.1)
        assert supervisor.process is not None
        assert supervisor.process.pid == new_pid
        for _ in range(5):
            ticked(daemon)
        history = daemon.state.history(limit=10)
        adopt = history[0]
        assert (adopt["kind"], adopt["outcome"]) == ("adopt", "succeeded"), history
        assert adopt["reason"].startswith(
            f"restarted by a person through its manager (pid {old_pid} → {new_pid})"
        )
        assert "crash" not in adopt["evidence"]
        assert [e for e in said if e["event"] == "engine_crash"] == []
        assert daemon.state.crashes("main", since=0) == []
        tunerds = [c for c in box.calls()[calls_before:] if not c.startswith("systemctl show")]
        assert tunerds == [f"systemctl restart {UNIT}"]  # the person's only
        assert daemon.state.engine("main").pid == new_pid  # type: ignore[union-attr]
        assert supervisor.facts().restarts == daemon.state.restart_times("main", 0)  # the first start only
        assert len(supervisor.facts().restarts) == 1
    finally:
        daemon.close()
