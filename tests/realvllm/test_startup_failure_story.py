"""A change the real vLLM refuses to start with is rolled back, and never tried again.

The story, with one tunerd:

1. tunerd starts the engine with ``max_model_len 1024`` and a 2 MiB pool
   (``--kv-cache-memory-bytes 2097152``: 2,048 tokens of which vLLM can promise 1,920);
2. a test policy (``grow-context``: an idle pool offers longer contexts) doubles
   ``max_model_len`` to 2048;
3. vLLM exits during start-up with its own ``estimated maximum model length is 1920`` error
   (DESIGN §7);
4. the saga rolls back: the engine serves again with 1024 (argv, /metrics), history says
   ``rolled_back`` with vLLM's text, and the policy, still firing, does not try 2048 again.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.realvllm.harness import (
    ENGINE,
    REALVLLM,
    Tunerd,
    cmdline,
    engine_record,
    free_port,
    history,
    kill_engine,
    wait_healthy,
    write_config,
)
from tunerd.engine.args import settings_from_argv, settings_from_cache_config
from tunerd.sources.vllm_metrics import parse

pytestmark = REALVLLM

SETTINGS = {
    "max_model_len": 1024,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 512,
    "kv_cache_memory_bytes": 2097152,
}
GROW_CONTEXT = {
    "name": "grow-context",
    "description": "the pool idles: offer longer contexts (a test policy; vLLM refuses the result)",
    "when": {"metric": "kv_cache_usage", "below": 0.4, "for": "5s"},
    "then": [{"tune": {"max_model_len": "step_up"}}, {"restart": {"drain": "0s"}}],
}


@dataclass
class Story:
    tmp: Path
    url: str
    tunerd: Tunerd

    @property
    def state_dir(self) -> Path:
        return self.tmp / "state"


@pytest.fixture(scope="module")
def story(vllm: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Story]:
    tmp = tmp_path_factory.mktemp("startup-failure")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    config = write_config(
        tmp,
        python=vllm,
        model=tiny_model,
        port=port,
        settings=SETTINGS,
        bounds={"max_model_len": [1024, 4096]},
        policies=[GROW_CONTEXT],
    )
    story = Story(tmp, url, Tunerd(config))
    try:
        story.tunerd.wait_event("restart_finished", timeout=300, where=lambda e: e["kind"] == "first_start")
        story.tunerd.wait_event("engine_tuned", timeout=420)
        time.sleep(10)  # the policy keeps firing (the pool is idle): give it the chance to retry
        yield story
    finally:
        story.tunerd.stop()
        kill_engine(story.state_dir)


def test_the_change_is_rolled_back_with_vllms_reason(story: Story) -> None:
    tuned = story.tunerd.events("engine_tuned")[0]
    assert tuned["outcome"] == "rolled_back", story.tunerd.output()
    assert tuned["changes"] == {"max_model_len": [1024, 2048]}
    tunes = [h for h in history(story.state_dir) if h["kind"] == "tune"]
    assert len(tunes) == 1, tunes  # 2048 failed: not tried again
    assert tunes[0]["outcome"] == "rolled_back"
    assert "estimated maximum model length is 1920" in tunes[0]["reason"]
    assert tunes[0]["to_settings"] == {**SETTINGS, "max_model_len": 2048}
    # the policy asks for no alert; a change that did not take pages a person anyway
    alerts = [h for h in history(story.state_dir) if h["kind"] == "notify"]
    assert len(alerts) == 1, alerts
    assert alerts[0]["reason"].startswith(
        "critical firing: tiny: the change grow-context asked for did not start; rolled back to the last good settings"
    )
    assert "restart rolled_back" in alerts[0]["reason"]
    failed_log = story.state_dir / "engines" / f"{ENGINE}.log.1"
    assert "estimated maximum model length is 1920" in failed_log.read_text(errors="replace")


def test_the_engine_serves_last_known_good_again(story: Story) -> None:
    wait_healthy(story.url, timeout=10)
    record = engine_record(story.state_dir)
    assert record.running == record.last_known_good
    assert settings_from_argv(cmdline(record.pid))["max_model_len"] == 1024
    snapshot = parse(httpx.get(story.url + "/metrics", timeout=10).text)
    assert snapshot.cache_config is not None
    assert settings_from_cache_config(snapshot.cache_config)["kv_cache_memory_bytes"] == 2097152
    models = httpx.get(story.url + "/v1/models", timeout=10).json()
    assert models["data"][0]["max_model_len"] == 1024
