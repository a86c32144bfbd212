"""Acting by mode (tunerd.acting): what each mode does with a plan that changes settings
(DESIGN §4.8) — observe records it, advise proposes the exact flag diff and the command that
applies it, act begins the saga (see tests/integration/test_run_stories.py). The plan is built
by hand; the state is real SQLite."""

from __future__ import annotations

from pathlib import Path

import pytest

from tunerd.alerting import Acted, Did
from tunerd.config import load_config
from tunerd.daemon import Daemon
from tunerd.policy.engine import ActionPlan
from tunerd.policy.schema import RestartSpec
from tunerd.sources.gpu import NoGpuSource
from tunerd.tune import TuneResult

SEED = {"gpu_memory_utilization": 0.92, "max_model_len": 32768, "max_num_seqs": 8}


def _daemon(tmp_path: Path, mode: str) -> Daemon:
    config = tmp_path / "tunerd.yaml"
    config.write_text(
        f"engine:\n  name: main\n  command: [vllm, serve, /srv/llama]\n  settings: {SEED}\n"
        f"mode: {mode}\npolicies: []\nstate_dir: {tmp_path / 'state'}\n"
    )
    return Daemon(load_config(config), gpu=NoGpuSource(), say=lambda *a, **k: None)


def _plan(mode: str) -> ActionPlan:
    after = {**SEED, "max_num_seqs": 6}
    return ActionPlan(
        engine="main",
        time=100.0,
        policies=("kv-pool-saturated",),
        mode=mode,
        before=SEED,
        after=after,
        tunes=(TuneResult("max_num_seqs", 8, 6, "step_down"),),
        restart=RestartSpec(),
        reasons=("kv-pool-saturated: max_num_seqs 8 → 6",),
    )


def test_advise_records_the_flag_diff_and_the_command(tmp_path: Path) -> None:
    daemon = _daemon(tmp_path, "advise")
    try:
        done = daemon.actor.act(daemon.engines[0], _plan("advise"), None, now=100.0)
        [record] = daemon.state.history()
    finally:
        daemon.close()
    assert done == Acted(Did.PROPOSED)
    assert done.text() == "proposed, not applied"
    assert (record["kind"], record["mode"], record["outcome"]) == ("tune", "advise", "proposed")
    assert "proposed --max-num-seqs 6" in record["reason"]
    assert (
        "to apply: vllm serve /srv/llama --gpu-memory-utilization 0.92 --max-model-len 32768 --max-num-seqs 6"
        in record["reason"]
    )
    assert record["to_settings"]["max_num_seqs"] == 6


def test_observe_records_and_changes_nothing(tmp_path: Path) -> None:
    daemon = _daemon(tmp_path, "observe")
    try:
        done = daemon.actor.act(daemon.engines[0], _plan("observe"), None, now=100.0)
        [record] = daemon.state.history()
    finally:
        daemon.close()
    assert done == Acted(Did.OBSERVED)
    assert done.text() == "observed, not applied"
    assert (record["mode"], record["outcome"]) == ("observe", "skipped")


def test_a_second_daemon_on_the_same_state_is_refused(tmp_path: Path) -> None:
    first = _daemon(tmp_path, "advise")
    try:
        with pytest.raises(Exception, match="one tunerd per host"):
            _daemon(tmp_path, "advise")
    finally:
        first.close()


def test_a_raise_that_would_overbook_a_shared_gpu_is_refused(tmp_path: Path) -> None:
    """Two engines on GPU 0 at 0.45 each: raising one to 0.55 would book 1.0 of it (limit 0.95);
    nothing restarts, the refusal is recorded. (Lowering is never refused.)"""
    config = tmp_path / "tunerd.yaml"
    half = {"gpu_memory_utilization": 0.45, "max_num_seqs": 8}
    config.write_text(
        "engines:\n"
        f"  - {{name: chat, command: [vllm, serve, /srv/a], url: 'http://127.0.0.1:1', settings: {half}}}\n"
        f"  - {{name: embed, command: [vllm, serve, /srv/b], url: 'http://127.0.0.1:2', settings: {half}}}\n"
        f"mode: act\npolicies: []\nstate_dir: {tmp_path / 'state'}\n"
    )
    daemon = Daemon(load_config(config), gpu=NoGpuSource(), say=lambda *a, **k: None)
    try:
        for name in ("chat", "embed"):
            daemon.state.set_running(name, daemon.state.add_version(name, half, "initial", now=0.0))
        raised = ActionPlan(
            engine="chat",
            time=100.0,
            policies=("pool-underused",),
            mode="act",
            before=half,
            after={**half, "gpu_memory_utilization": 0.55},
            tunes=(TuneResult("gpu_memory_utilization", 0.45, 0.55, "+0.1"),),
            restart=RestartSpec(),
            reasons=("pool-underused: gpu_memory_utilization 0.45 → 0.55",),
        )
        done = daemon.actor.act(daemon.engines[0], raised, None, now=100.0)
        [record] = daemon.state.history()
    finally:
        daemon.close()
    assert done.did is Did.REFUSED
    assert done.text() == "not applied: GPU 0 would be 1 booked (chat 0.55 beside embed 0.45; limit 0.95)"
    assert (record["kind"], record["outcome"]) == ("tune", "skipped")
    assert "GPU 0 would be 1 booked" in record["reason"]


def test_a_plan_made_in_act_is_only_proposed_once_a_reload_lowered_the_mode(tmp_path: Path) -> None:
    """A plan that waited (a quiet period, a busy GPU) through a reload to advise must not
    restart a healthy engine: acting caps its mode by the mode in force."""
    daemon = _daemon(tmp_path, "advise")
    try:
        done = daemon.actor.act(daemon.engines[0], _plan("act"), None, now=100.0)
        [record] = daemon.state.history()
    finally:
        daemon.close()
    assert done == Acted(Did.PROPOSED)
    assert (record["mode"], record["outcome"]) == ("advise", "proposed")
