"""``tunerd notify test`` as a person runs it, against local receivers playing the services."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.cli import run_tunerd
from tests.integration.notify_receiver import Answer, receiver

pytestmark = pytest.mark.slow


def _config(tmp_path: Path, notify: list[dict[str, str]]) -> Path:
    config = tmp_path / "tunerd.yaml"
    config.write_text(
        json.dumps(
            {
                "engine": {"name": "main", "command": ["vllm", "serve", "m"]},
                "policies": [],
                "notify": notify,
                "state_dir": str(tmp_path / "state"),
            }
        )
    )
    return config


def test_every_sink_gets_the_sample_and_each_outcome_is_printed(tmp_path: Path) -> None:
    with receiver("feishu") as feishu, receiver("dingtalk") as dingtalk:
        dingtalk.answer(Answer(200, b'{"errcode":310000,"errmsg":"keywords not in content"}'))
        config = _config(
            tmp_path,
            [
                {
                    "name": "ops",
                    "kind": "feishu",
                    "url_env": "TUNERD_OPS_URL",
                    "secret_env": "TUNERD_OPS_SECRET",
                },
                {"name": "oncall", "kind": "dingtalk", "url_env": "TUNERD_ONCALL_URL", "language": "zh"},
            ],
        )
        env = {
            "TUNERD_OPS_URL": feishu.url,
            "TUNERD_OPS_SECRET": "feishu-signing-secret",
            "TUNERD_ONCALL_URL": dingtalk.url + "?access_token=tok-123456789",
        }
        done = run_tunerd("notify", "test", "--config", str(config), env=env)
        assert [len(feishu.got), len(dingtalk.got)] == [1, 1]
    assert done.returncode == 1, done.stderr
    assert done.stdout.splitlines() == [
        "ops (feishu): accepted: code 0",
        "oncall (dingtalk): refused: errcode 310000: keywords not in content",
        "1 of 2 sinks accepted the test alert",
    ]
    card = feishu.got[0].json()["card"]
    assert card["header"]["title"]["content"].startswith("tunerd [test alert] warning: ")
    assert "测试告警" in dingtalk.got[0].json()["markdown"]["title"]
    for secret in env.values():
        assert secret not in done.stdout + done.stderr


def test_all_accepted_is_exit_0_and_no_sinks_is_a_usage_error(tmp_path: Path) -> None:
    with receiver("slack") as slack:
        config = _config(tmp_path, [{"name": "chat", "kind": "slack", "url": slack.url}])
        done = run_tunerd("notify", "test", "--config", str(config))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1] == "1 of 1 sinks accepted the test alert"
    empty = run_tunerd("notify", "test", "--config", str(_config(tmp_path, [])))
    assert empty.returncode == 2
    assert "no notify sinks configured" in empty.stderr
    missing = run_tunerd(
        "notify",
        "test",
        "--config",
        str(_config(tmp_path, [{"name": "x", "kind": "slack", "url_env": "TUNERD_NO_URL"}])),
    )
    assert missing.returncode == 2
    assert "notify[0].url_env: TUNERD_NO_URL is not set in tunerd's environment" in missing.stderr


def test_a_test_alert_looks_like_a_test_and_names_the_configured_engines(tmp_path: Path) -> None:
    """Issue 21: labelled a test for Alertmanager (and in the chat title), about the engines the
    config names (not a made-up one), resolved at once where an alert stays open, and with a
    generatorURL when tunerd's /metrics is reachable from elsewhere."""
    with receiver("alertmanager") as manager, receiver("slack") as chat:
        config = tmp_path / "tunerd.yaml"
        config.write_text(
            json.dumps(
                {
                    "engines": [
                        {"name": "qwen-a", "command": ["vllm", "serve", "a"]},
                        {"name": "qwen-b", "command": ["vllm", "serve", "b"], "url": "http://127.0.0.1:8001"},
                    ],
                    "policies": [],
                    "notify": [
                        {"name": "am", "kind": "alertmanager", "url": manager.url.rsplit("/hook", 1)[0]},
                        {"name": "chat", "kind": "slack", "url": chat.url},
                    ],
                    "listen": {"metrics": "0.0.0.0:9464"},
                    "state_dir": str(tmp_path / "state"),
                }
            )
        )
        done = run_tunerd("notify", "test", "--config", str(config))
        posts = manager.wait_for(2)
    assert done.returncode == 0, done.stdout + done.stderr
    firing, resolved = (post.json()[0] for post in posts)
    assert firing["labels"]["test"] == "true"
    assert firing["labels"]["engine"] == "qwen-a"
    assert "engines: qwen-a, qwen-b" in firing["annotations"]["summary"]
    assert firing["generatorURL"].endswith(":9464/metrics")
    assert resolved["labels"] == firing["labels"]
    assert resolved["endsAt"] < firing["endsAt"]  # closed now, not held open for minutes
    [message] = chat.got
    assert "[test alert]" in message.json()["text"]
    assert "llama31-8b" not in message.json()["text"]
