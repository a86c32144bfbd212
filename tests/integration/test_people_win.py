"""People win (DESIGN §4.9), with a real daemon on a simulated engine (real processes on
loopback, real SQLite): `tunerd rollback` undoes the last change through the saga; settings a
person wrote in the config, or an engine they started by hand, become the new base; every time
tuning pauses."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.cli import run_tunerd as _tunerd
from tests.integration.sim_daemon import BEFORE, close_daemon, free_port, running, sim_daemon, started, ticked
from tunerd.engine.guards import may_change
from tunerd.engine.process import find_listener

pytestmark = pytest.mark.slow
AFTER = {**BEFORE, "max_num_seqs": 6}


def test_rollback_undoes_the_last_change_and_pauses_tuning(tmp_path: Path) -> None:
    state_dir = str(tmp_path / "state")
    daemon = sim_daemon(tmp_path)
    try:
        started(daemon)
        nothing = _tunerd("rollback", "main", "--state-dir", state_dir)
        assert nothing.returncode == 2
        assert "nothing to roll back" in nothing.stderr
        supervisor = daemon.engines[0].supervisor
        tuned = supervisor.restart(AFTER, reason="kv-pool-saturated: max_num_seqs 8 → 6")
        assert tuned.outcome == "succeeded"

        asked = _tunerd("rollback", "main", "--state-dir", state_dir, "--reason", "latency doubled")
        assert asked.returncode == 0, asked.stderr
        assert "--max-num-seqs 8" in asked.stdout
        assert "tuning paused" in asked.stdout
        ticked(daemon)  # the daemon finds the request and carries it out

        assert supervisor.running_settings() == BEFORE
        assert supervisor.process is not None
        assert "--max-num-seqs 8" in " ".join(supervisor.process.identity.argv)
        assert supervisor.healthy()
        record = daemon.state.engine("main")
        assert record is not None
        assert record.running == record.last_known_good
        assert record.paused == "rolled back by a person: latency doubled"
        refusal = may_change(supervisor.facts(), supervisor.guards, daemon.clock.now(), settle=False)
        assert refusal is not None
        assert "paused" in refusal.reason
        rollback = daemon.state.history(limit=1)[0]
        assert (rollback["kind"], rollback["outcome"]) == ("rollback", "succeeded")
        assert (rollback["from_settings"], rollback["to_settings"]) == (AFTER, BEFORE)
        assert "latency doubled" in rollback["reason"]
        assert rollback["evidence"]["undoes"] == tuned.action_id
        ticked(daemon)
        assert daemon.state.history(limit=1)[0]["id"] == rollback["id"]  # carried out once
        shown = _tunerd("history", "--state-dir", state_dir).stdout
        assert (
            f"main rollback (act) succeeded — max_num_seqs 6→8\n    by hand: latency doubled (undoes #{tuned.action_id})"
            in shown
        )
    finally:
        close_daemon(daemon, kill=True)


def test_settings_a_person_wrote_in_the_config_win_and_tuning_pauses(tmp_path: Path) -> None:
    port = free_port()
    first = sim_daemon(tmp_path, port)
    started(first)
    old_pid = first.state.engine("main").pid
    close_daemon(first, kill=False)  # tunerd stops; the engine serves on

    mine = {**BEFORE, "max_num_seqs": 4}
    second = sim_daemon(tmp_path, port, settings=mine)  # a person edited tunerd.yaml
    try:
        started(second)
        supervisor = second.engines[0].supervisor
        assert supervisor.running_settings() == mine
        assert supervisor.process is not None
        assert supervisor.process.pid != old_pid
        assert "--max-num-seqs 4" in " ".join(supervisor.process.identity.argv)
        record = second.state.engine("main")
        assert record.paused.startswith("the config was changed by a person (max_num_seqs 8→4)")
        assert second.state.base_settings("main") == mine
        notify, adopt = second.state.history(limit=2)
        assert (adopt["kind"], adopt["outcome"]) == ("adopt", "succeeded")
        assert (adopt["from_settings"], adopt["to_settings"]) == (BEFORE, mine)
        assert notify["kind"] == "notify"
        assert "adopted as the new base" in notify["reason"]
        pid = supervisor.process.pid
    finally:
        close_daemon(second, kill=False)

    third = sim_daemon(tmp_path, port, settings=mine)  # the same config again: nothing to adopt
    try:
        started(third)
        assert third.engines[0].supervisor.process.pid == pid
        assert third.state.history(limit=1)[0]["kind"] == "notify"  # no new record
    finally:
        close_daemon(third, kill=True)


def test_an_engine_a_person_started_by_hand_is_adopted_not_replaced(tmp_path: Path) -> None:
    """tunerd is down, its engine gone; a person starts one by hand on the same port with other
    flags. The next tunerd finds it by its listening socket and adopts it: their flags are the
    new base, tuning pauses, an alert says so — and nothing is restarted."""
    port = free_port()
    first = sim_daemon(tmp_path, port)
    started(first)
    close_daemon(first, kill=True)

    theirs = {**BEFORE, "max_num_seqs": 4}
    argv = [
        sys.executable, "-m", "tunerd", "sim", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--time-scale", "50", "--sim-startup-seconds", "10", "--sim-model", "llama-3.1-8b",
        "--sim-weights", "awq", "--sim-gpu", "rtx4090", "--gpu-memory-utilization", "0.92",
        "--max-model-len", "32768", "--max-num-seqs", "4",
    ]  # fmt: skip
    by_hand = subprocess.Popen(
        argv,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    second = sim_daemon(tmp_path, port)  # the config is unchanged
    try:
        deadline = time.monotonic() + 30
        while find_listener(port) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        started(second)
        supervisor = second.engines[0].supervisor
        assert supervisor.process is not None
        assert supervisor.process.pid == by_hand.pid
        assert supervisor.running_settings() == theirs
        record = second.state.engine("main")
        assert record.running == record.last_known_good
        assert record.paused.startswith(
            f"the engine was started outside tunerd (pid {by_hand.pid}; max_num_seqs 8→4)"
        )
        assert second.state.base_settings("main") == BEFORE  # the config's word is unchanged
        notify, adopt = second.state.history(limit=2)
        assert (adopt["kind"], adopt["outcome"]) == ("adopt", "succeeded")
        assert adopt["evidence"]["asked_by"] == "by hand"
        assert notify["kind"] == "notify"
        assert "adopted as the new base" in notify["reason"]
        assert [h["kind"] for h in second.state.history(limit=10)].count(
            "restart"
        ) == 1  # the first start only
    finally:
        close_daemon(second, kill=False)
        os.killpg(by_hand.pid, signal.SIGKILL)
        by_hand.wait()


def test_a_rollback_wakes_the_running_daemon_instead_of_waiting_for_its_tick(tmp_path: Path) -> None:
    """DESIGN §4.1: `rollback` (like `pin` and `resume`) takes `--socket`: after writing its word
    to the state it wakes the daemon there, which acts at once — not at its next tick, 30 s on."""
    socket_path = tmp_path / "tunerd.sock"
    daemon = sim_daemon(
        tmp_path,
        top={
            "metrics": {"interval": "30s"},
            "listen": {"status": str(socket_path), "metrics": "127.0.0.1:0"},
        },
    )
    supervisor = daemon.engines[0].supervisor

    def tuned() -> None:  # a change that took, before the daemon's jobs run
        assert (
            supervisor.restart(AFTER, reason="kv-pool-saturated: max_num_seqs 8 → 6").outcome == "succeeded"
        )

    with running(daemon, prepare=tuned):
        asked = _tunerd(
            "rollback", "main", "--state-dir", str(tmp_path / "state"), "--socket", str(socket_path),
            "--reason", "latency doubled",
        )  # fmt: skip
        assert asked.returncode == 0, asked.stderr
        assert "no tunerd answered" not in asked.stdout
        asked_at = time.monotonic()
        while supervisor.running_settings() != BEFORE and time.monotonic() < asked_at + 20:
            time.sleep(0.1)
        assert supervisor.running_settings() == BEFORE
        assert time.monotonic() - asked_at < 15  # the next tick was 30 s away


def test_a_command_changed_in_the_config_is_a_persons_change(tmp_path: Path) -> None:
    """The config's command is compared with the command tunerd recorded with the config — not
    with /proc's text — so an edit of the command (here a seed for the simulator) is found and
    nothing else is."""
    port = free_port()
    first = sim_daemon(tmp_path, port)
    started(first)
    old_pid = first.state.engine("main").pid
    assert first.state.base("main").command == first.config.engines[0].command
    close_daemon(first, kill=False)

    second = sim_daemon(tmp_path, port, command=[*first.config.engines[0].command, "--seed", "7"])
    try:
        started(second)
        supervisor = second.engines[0].supervisor
        assert supervisor.process is not None
        assert supervisor.process.pid != old_pid
        assert "--seed 7" in " ".join(supervisor.process.identity.argv)
        record = second.state.engine("main")
        assert record.paused.startswith("the config was changed by a person (command)")
        adopt = next(h for h in second.state.history() if h["kind"] == "adopt")
        assert (adopt["outcome"], adopt["mode"]) == ("succeeded", "act")
    finally:
        close_daemon(second, kill=True)


def test_in_advise_mode_a_persons_config_waits_for_the_engines_next_start(tmp_path: Path) -> None:
    """Modes mean what they say: in advise, settings a person wrote in the config do not
    restart a healthy engine. The change is proposed (history, alert) and tuning pauses; the
    next time tunerd has to start the engine, it starts it with them."""
    port = free_port()
    first = sim_daemon(tmp_path, port, top={"mode": "advise"})
    started(first)
    pid = first.state.engine("main").pid
    assert first.state.history()[0]["mode"] == "advise"  # the first start, in the mode in force
    close_daemon(first, kill=False)

    mine = {**BEFORE, "max_num_seqs": 4}
    second = sim_daemon(tmp_path, port, settings=mine, top={"mode": "advise"})
    try:
        started(second)
        assert second.engines[0].supervisor.process.pid == pid  # not restarted
        assert second.engines[0].supervisor.running_settings() == BEFORE
        notify, adopt = second.state.history(limit=2)
        assert (adopt["kind"], adopt["mode"], adopt["outcome"]) == ("adopt", "advise", "proposed")
        assert "takes effect" in adopt["reason"] or "take effect" in adopt["reason"]
        assert notify["kind"] == "notify"
        assert second.state.engine("main").paused is not None
    finally:
        close_daemon(second, kill=True)  # the engine goes down with tunerd this time

    third = sim_daemon(tmp_path, port, settings=mine, top={"mode": "advise"})
    try:
        started(third)  # nothing runs: tunerd starts the engine, with the person's settings
        supervisor = third.engines[0].supervisor
        assert supervisor.running_settings() == mine
        assert "--max-num-seqs 4" in " ".join(supervisor.process.identity.argv)
        assert [h["kind"] for h in third.state.history(limit=3)].count("adopt") == 1  # proposed once
    finally:
        close_daemon(third, kill=True)
