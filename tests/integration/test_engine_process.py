"""Supervise mode's engine process with real processes: spawn, drain, kill, adopt, logs.

The engine is `tunerd sim serve` at a high time scale, or a few lines of Python shaped like
vLLM's process tree (an API server whose engine-core child ignores SIGTERM from outside, as
vLLM's does while its parent drains), where the test needs that shape.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tunerd.engine.process import (
    EngineProcess,
    Identity,
    engine_environment,
    find_spawned,
    process_tree,
    read_identity,
    rotate,
    runs_as,
)

pytestmark = pytest.mark.slow

SEED = [
    "--sim-model", "llama-3.1-8b", "--sim-weights", "awq", "--sim-gpu", "rtx4090",
    "--gpu-memory-utilization", "0.92", "--max-model-len", "32768", "--max-num-seqs", "8",
    "--max-num-batched-tokens", "2048", "--kv-cache-dtype", "fp8",
]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _sim_argv(port: int, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "tunerd", "sim", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--time-scale", "50", "--sim-startup-seconds", "10", *SEED, *extra,
    ]  # fmt: skip


def _wait_healthy(url: str, process: EngineProcess, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.alive(), process.log_path.read_text()
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError("engine did not become healthy:\n" + process.log_path.read_text())


def _script(tmp_path: Path, name: str, body: str) -> list[str]:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return [sys.executable, str(path)]


def test_spawned_engine_serves_logs_and_drains_on_stop(tmp_path: Path) -> None:
    port = _free_port()
    log = tmp_path / "engines" / "main.log"
    engine = EngineProcess.spawn(_sim_argv(port, "--shutdown-timeout", "600"), log)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, engine)
        assert engine.identity.argv == tuple(_sim_argv(port, "--shutdown-timeout", "600"))
        assert os.getpgid(engine.pid) == engine.pid  # its own group
        assert os.getsid(engine.pid) == engine.pid  # and session: no terminal ties it to tunerd
        answers: list[int] = []

        def one() -> None:
            response = httpx.post(
                url + "/v1/completions",
                json={"prompt_tokens": 20_000, "max_tokens": 4000, "ignore_eos": True},
                timeout=60,
            )
            answers.append(response.status_code)

        client = threading.Thread(target=one)
        client.start()
        # the request is in flight once the engine counts it (a fixed sleep lost the race on a
        # loaded machine: the SIGTERM came first and the request found the port closed)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                if httpx.get(url + "/load", timeout=2).json()["server_load"] >= 1:
                    break
            time.sleep(0.05)
        result = engine.stop(timeout=60)
        client.join(timeout=60)
    finally:
        if engine.alive():
            engine.kill_group()
    assert answers == [200]  # the in-flight request finished during the drain
    assert result.how == "exited"
    assert result.returncode == 0
    text = log.read_text()
    assert "vLLM server version" in text  # the simulator's start line, as vLLM 0.32/0.33's
    assert "draining in-flight requests count=1" in text
    assert engine.members() == []


def test_engine_environment_drops_tunerd_secrets(tmp_path: Path) -> None:
    argv = _script(
        tmp_path,
        "env.py",
        """
        import json, os
        print(json.dumps({k: v for k, v in os.environ.items() if k.startswith(("TUNERD_", "VLLM_", "KEEP"))}))
        """,
    )
    base = {"PATH": os.environ["PATH"], "TUNERD_FEISHU_SECRET": "s3cret", "KEEP_ME": "1"}
    engine = EngineProcess.spawn(
        argv, tmp_path / "env.log", base_env=base, env={"VLLM_LOGGING_LEVEL": "INFO"}
    )
    assert engine.wait_exit(20)
    assert json.loads(engine.log_path.read_text()) == {"KEEP_ME": "1", "VLLM_LOGGING_LEVEL": "INFO"}
    assert engine_environment({"TUNERD_X": "1", "A": "2"}, {"B": "3"}) == {"A": "2", "B": "3"}


API_SERVER_WITH_CORE = r"""
import signal, subprocess, sys, time
# Like vLLM: the API server starts an engine core in its group. A SIGTERM reaching the core
# would abort vLLM's drain; this core says so if it gets one, and stays until killed.
core = subprocess.Popen([sys.executable, "-c",
    "import signal, time\n"
    "signal.signal(signal.SIGTERM, lambda *_: print('core got SIGTERM', flush=True))\n"
    "print('core up', flush=True)\n"
    "while True: time.sleep(1)"])
def on_term(*_):
    print("api server draining", flush=True)
    time.sleep(float(sys.argv[1]))
    print("api server exiting, core left behind", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print("api server up", flush=True)
while True:
    time.sleep(1)
"""


def _wait_for_line(path: Path, text: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text():
            return
        time.sleep(0.05)
    raise AssertionError(f"{text!r} never appeared in {path}")


@pytest.fixture
def spawned() -> Iterator[list[EngineProcess]]:
    """Engines a test started; their groups are killed however the test ends."""
    engines: list[EngineProcess] = []
    yield engines
    for engine in engines:
        engine.kill_group()


def test_sigterm_reaches_the_main_process_only_and_leftovers_are_killed(
    tmp_path: Path, spawned: list[EngineProcess]
) -> None:
    engine = EngineProcess.spawn(
        [*_script(tmp_path, "api.py", API_SERVER_WITH_CORE), "0.2"], tmp_path / "e.log"
    )
    spawned.append(engine)
    _wait_for_line(engine.log_path, "core up")
    _wait_for_line(engine.log_path, "api server up")
    assert len(engine.members()) == 2
    assert process_tree(engine.pid) == engine.members()  # the cheap per-tick read finds the same two
    result = engine.stop(timeout=10, group_timeout=10)
    text = engine.log_path.read_text()
    assert "api server draining" in text  # the main process got SIGTERM and drained
    assert "api server exiting" in text
    assert "core got SIGTERM" not in text  # the drain was the main process's alone
    assert result.returncode == 0
    assert result.how == "killed"  # the core outlived its parent and was killed with the group
    assert engine.members() == []
    assert process_tree(engine.pid) == []


def test_main_process_that_outlives_the_timeout_is_killed(
    tmp_path: Path, spawned: list[EngineProcess]
) -> None:
    engine = EngineProcess.spawn(
        [*_script(tmp_path, "api.py", API_SERVER_WITH_CORE), "600"], tmp_path / "e.log"
    )
    spawned.append(engine)
    _wait_for_line(engine.log_path, "api server up")
    started = time.monotonic()
    result = engine.stop(timeout=1.0)
    assert time.monotonic() - started < 10
    assert result.how == "killed"
    assert result.returncode == -signal.SIGKILL
    assert engine.members() == []
    assert "api server draining" in engine.log_path.read_text()


FIRST_TUNERD = """
import json, sys
from tunerd.engine.process import EngineProcess
engine = EngineProcess.spawn(json.loads(sys.argv[1]), sys.argv[2])
print(json.dumps({"pid": engine.identity.pid, "start_ticks": engine.identity.start_ticks,
                  "argv": list(engine.identity.argv)}), flush=True)
import os, signal
os.kill(os.getpid(), signal.SIGKILL)  # tunerd dies hard; the engine must not notice
"""


def test_engine_outlives_tunerd_and_is_adopted_by_the_next(tmp_path: Path) -> None:
    port = _free_port()
    log = tmp_path / "engine.log"
    first = subprocess.run(
        [sys.executable, "-c", FIRST_TUNERD, json.dumps(_sim_argv(port)), str(log)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert first.returncode == -signal.SIGKILL, first.stderr
    recorded = json.loads(first.stdout)
    identity = Identity(recorded["pid"], recorded["start_ticks"], tuple(recorded["argv"]))
    engine = EngineProcess.adopt(identity, log)
    assert engine is not None
    try:
        assert engine.adopted
        _wait_healthy(f"http://127.0.0.1:{port}", engine)
        assert engine.argv_now() == identity.argv
        # The same PID with another start time is someone else: never adopted.
        assert (
            EngineProcess.adopt(Identity(identity.pid, identity.start_ticks + 1, identity.argv), log) is None
        )
        result = engine.stop(timeout=30)
    finally:
        if engine.alive():
            engine.kill_group()
    assert result.how == "exited"
    assert result.returncode is None  # not our child: its status went to init
    assert not engine.alive()
    assert EngineProcess.adopt(identity, log) is None  # gone


def test_read_identity_of_self_and_of_nobody() -> None:
    me = read_identity(os.getpid())
    assert me is not None
    assert list(me.argv) == sys.orig_argv
    assert me.start_ticks > 0
    assert read_identity(2**22 + 12345) is None


def test_a_spawned_engine_is_recorded_with_its_argv_every_time(tmp_path: Path) -> None:
    """Read right after Popen returns, /proc/PID/cmdline is empty about once in 100 spawns (the
    kernel sets the new program's arguments up after the pipe Popen waits on closes). An
    engine recorded with no argv later looks like one a person started with another command:
    tuning paused, a needless restart (seen in a full run). 600 quick spawns meet the window
    with a chance of 99.7 %."""
    argv = ["sleep", "30"]
    empty = 0
    for _ in range(600):
        process = EngineProcess.spawn(argv, tmp_path / "engine.log", keep_logs=0)
        try:
            empty += process.identity.argv != tuple(argv)
        finally:
            process.kill_group()
            while process.alive():  # reaps it
                time.sleep(0.001)
    assert empty == 0


def test_logs_rotate_at_spawn_and_copytruncate_while_running(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    for generation in range(3):
        engine = EngineProcess.spawn([sys.executable, "-c", f"print('gen {generation}')"], log, keep_logs=2)
        assert engine.wait_exit(20)
    assert log.read_text() == "gen 2\n"
    assert (tmp_path / "engine.log.1").read_text() == "gen 1\n"
    assert (tmp_path / "engine.log.2").read_text() == "gen 0\n"
    assert not (tmp_path / "engine.log.3").exists()

    writer = """
import sys, time
for i in range(400):
    print(f"line {i:04d} " + "x" * 90, flush=True)
    time.sleep(0.002)
"""
    engine = EngineProcess.spawn([sys.executable, "-c", writer], log, keep_logs=2)
    rotated = False
    while engine.alive():
        rotated = engine.rotate_log_if_large(10_000, keep=2) or rotated
        time.sleep(0.01)
    assert rotated
    current = log.read_text()
    assert "\0" not in current  # O_APPEND: after the truncate, writes land at the new end
    assert current.endswith("line 0399 " + "x" * 90 + "\n")
    assert (tmp_path / "engine.log.1").stat().st_size > 10_000


def test_rotate_keeps_the_newest(tmp_path: Path) -> None:
    path = tmp_path / "a.log"
    for n in range(4):
        path.write_text(str(n))
        rotate(path, 2)
    assert not path.exists()
    assert (tmp_path / "a.log.1").read_text() == "3"
    assert (tmp_path / "a.log.2").read_text() == "2"
    assert not (tmp_path / "a.log.3").exists()


# -- one engine, many spellings: what exec makes of a command, and finding it again --------------

SLEEPER = "import time; time.sleep(60)"


def _launchers(tmp_path: Path) -> dict[str, list[str]]:
    """The ways people write an engine's command, each ending in the same arguments: pip's
    console script (a shebang to the venv's python), a script whose shebang goes through
    ``env``, an interpreter reached through a symlink, a wrapper script that execs the real
    program, and ``python -m``. All run ``SLEEPER``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    program = bin_dir / "fake_engine.py"
    program.write_text(f"import sys\n{SLEEPER}\n")
    console = bin_dir / "fake-vllm"
    console.write_text(f"#!{sys.executable}\nimport sys\n{SLEEPER}\n")
    via_env = bin_dir / "fake-vllm-env"
    via_env.write_text(f"#!/usr/bin/env python3\nimport sys\n{SLEEPER}\n")
    wrapper = bin_dir / "vllm-wrapper"
    wrapper.write_text(f'#!/bin/sh\nexec "{console}" "$@"\n')
    linked = bin_dir / "python-link"
    linked.symlink_to(sys.executable)
    for script in (console, via_env, wrapper):
        script.chmod(0o755)
    return {
        "console script on PATH": ["fake-vllm"],
        "shebang through env": [str(via_env)],
        "wrapper script": [str(wrapper)],
        "symlinked interpreter": [str(linked), str(program)],
        "python -m": [sys.executable, "-m", "fake_engine"],
    }


def test_every_spelling_of_a_command_is_found_again_after_exec(tmp_path: Path) -> None:
    """What /proc shows is not what tunerd passed to exec (a console script shows its
    interpreter and path in front); `runs_as` tells them apart from other commands, and
    `find_spawned` finds the engine a killed tunerd had started but not yet recorded."""
    path = f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}"
    flags = ["serve", "/srv/models/tiny", "--max-num-seqs", "8", "--shutdown-timeout", "30"]
    for how, command in _launchers(tmp_path).items():
        spawned = [*command, *flags]
        env = {"PATH": path, "PYTHONPATH": str(tmp_path / "bin")}
        engine = EngineProcess.spawn(spawned, tmp_path / f"{how}.log", env=env)
        try:
            deadline = time.monotonic() + 10
            while engine.identity.argv == () and time.monotonic() < deadline:
                time.sleep(0.01)
            seen = engine.identity.argv
            assert runs_as(spawned, seen), (how, seen)
            assert not runs_as([*command, *flags[:-1], "60"], seen), how  # another drain: another engine
            found = find_spawned(spawned)
            while found is None and time.monotonic() < deadline:  # caught mid-exec (env → python)
                time.sleep(0.01)
                found = find_spawned(spawned)
            assert found is not None, how
            assert (found.pid, found.start_ticks) == (engine.pid, engine.identity.start_ticks), how
        finally:
            engine.kill_group()
            engine.wait_exit(10)
    console_seen = None
    engine = EngineProcess.spawn(["fake-vllm", *flags], tmp_path / "console.log", env={"PATH": path})
    try:
        time.sleep(0.2)
        console_seen = read_identity(engine.pid)
    finally:
        engine.kill_group()
    assert console_seen is not None
    assert console_seen.argv[:2] == (
        sys.executable,
        str(tmp_path / "bin" / "fake-vllm"),
    )  # not the config's text
