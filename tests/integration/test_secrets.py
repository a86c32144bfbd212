"""Secrets the config names stay in tunerd (issue 16): a variable a notify sink names as its
``url_env`` or ``secret_env`` — any name, not only ``TUNERD_*`` — is taken out of the
environment of the engines and hooks tunerd starts (read back from ``/proc/PID/environ`` and
from what a hook saw), and the names a reloaded config adds apply from the next start on."""

from __future__ import annotations

import json
import secrets
import socket
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import files_holding
from tests.integration.sim_daemon import close_daemon, sim_daemon, started, ticked
from tunerd.config import load_config
from tunerd.daemon import secret_names
from tunerd.engine.process import EngineProcess, HookRun, ProcessRunner

DUMP_ENV = "import json, os, sys; json.dump(dict(os.environ), open(sys.argv[1], 'w'))"


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if item)
    return {key: value for key, _, value in pairs}


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def dingtalk(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """A DingTalk robot's URL (its token inside) and signing secret in tunerd's environment,
    under names of the operator's choosing."""
    values = {
        "DINGTALK_WEBHOOK": f"http://127.0.0.1:{_closed_port()}/robot/send?access_token={secrets.token_hex(16)}",
        "DINGTALK_SECRET": f"SEC{secrets.token_hex(24)}",
    }
    for key, value in values.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("KEEP_ME", "an ordinary variable")
    return values


SINK = {"name": "dt", "kind": "dingtalk", "url_env": "DINGTALK_WEBHOOK", "secret_env": "DINGTALK_SECRET"}


def test_secret_names_are_the_variables_the_sinks_name(tmp_path: Path, dingtalk: dict[str, str]) -> None:
    daemon = sim_daemon(
        tmp_path, top={"notify": [SINK, {"name": "hook", "kind": "webhook", "url": "http://x"}]}
    )
    try:
        assert secret_names(daemon.config) == frozenset({"DINGTALK_WEBHOOK", "DINGTALK_SECRET"})
    finally:
        daemon.close()


def test_a_spawned_engine_and_a_hook_never_see_a_named_secret(
    tmp_path: Path, dingtalk: dict[str, str]
) -> None:
    names = frozenset(dingtalk)
    engine = EngineProcess.spawn(
        [sys.executable, "-c", "import time; time.sleep(30)"],
        tmp_path / "engines" / "main.log",
        secret_names=names,
    )
    try:
        seen = _environ(engine.pid)
    finally:
        engine.kill_group()
    assert not names & set(seen)
    assert seen["KEEP_ME"] == "an ordinary variable"
    dump = tmp_path / "hook-env.json"
    hook = HookRun(
        "pre_stop",
        [sys.executable, "-c", DUMP_ENV, str(dump)],
        timeout=20,
        log_path=tmp_path / "engines" / "main.hooks.log",
        env={"TUNERD_HOOK": "pre_stop"},
        secret_names=names,
    )
    deadline = time.monotonic() + 20
    while hook.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    hooked = json.loads(dump.read_text())
    assert not names & set(hooked)
    assert (hooked["KEEP_ME"], hooked["TUNERD_HOOK"]) == ("an ordinary variable", "pre_stop")


@pytest.mark.slow
def test_the_daemon_keeps_the_sinks_secrets_from_its_engine_and_hooks(
    tmp_path: Path, dingtalk: dict[str, str]
) -> None:
    """Through the daemon: the config's notify sink names ``DINGTALK_*``; the engine it starts
    and the ``pre_stop`` hook of the restart a policy asks for run without them."""
    policy = tmp_path / "policies.yaml"
    policy.write_text(
        yaml.safe_dump(
            {
                "version": 1,
                "policies": [
                    {
                        "name": "fewer-seqs",
                        "description": "a test policy that fires at once",
                        "when": {"metric": "num_requests_running", "below": 1},
                        "then": [{"tune": {"max_num_seqs": "step_down"}}, {"restart": {"drain": "0s"}}],
                    }
                ],
            }
        )
    )
    dump = tmp_path / "hook-env.json"
    daemon = sim_daemon(
        tmp_path,
        policies=(str(policy),),
        bounds={"max_num_seqs": [4, 8]},
        hooks={"pre_stop": [sys.executable, "-c", DUMP_ENV + "; sys.exit(4)", str(dump)]},
        top={"notify": [SINK]},
    )
    try:
        started(daemon)
        record = daemon.state.engine("main")
        assert record is not None
        assert record.pid
        seen = _environ(record.pid)
        assert not set(dingtalk) & set(seen)
        assert seen["KEEP_ME"] == "an ordinary variable"
        ticked(daemon)  # the policy's restart: pre_stop runs (and refuses: the engine serves on)
        hooked = json.loads(dump.read_text())
        assert not set(dingtalk) & set(hooked)
        assert hooked["TUNERD_HOOK"] == "pre_stop"
        assert files_holding(tmp_path / "state", list(dingtalk.values())) == []
    finally:
        close_daemon(daemon, kill=True)


def test_a_reload_applies_the_names_the_new_config_gives(
    tmp_path: Path, dingtalk: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPS_HOOK_TOKEN_VAR", f"tok-{secrets.token_hex(16)}")
    daemon = sim_daemon(tmp_path, top={"notify": [SINK]})
    try:
        config = tmp_path / "tunerd.yaml"
        raw = yaml.safe_load(config.read_text())
        raw["notify"].append(
            {
                "name": "ops",
                "kind": "webhook",
                "url": "http://127.0.0.1:9/x",
                "secret_env": "OPS_HOOK_TOKEN_VAR",
            }
        )
        config.write_text(yaml.safe_dump(raw))
        assert secret_names(load_config(config)) == {
            "DINGTALK_WEBHOOK",
            "DINGTALK_SECRET",
            "OPS_HOOK_TOKEN_VAR",
        }
        assert daemon.reload()
        supervisor = daemon.engines[0].supervisor
        assert supervisor.secret_names == {"DINGTALK_WEBHOOK", "DINGTALK_SECRET", "OPS_HOOK_TOKEN_VAR"}
        assert isinstance(supervisor.runner, ProcessRunner)
        engine = supervisor.runner.spawn([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            seen = _environ(engine.pid)
        finally:
            engine.kill_group()
        assert not {"DINGTALK_WEBHOOK", "DINGTALK_SECRET", "OPS_HOOK_TOKEN_VAR"} & set(seen)
        assert seen["KEEP_ME"] == "an ordinary variable"
    finally:
        daemon.close()
