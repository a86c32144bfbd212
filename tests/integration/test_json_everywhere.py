"""Issue 21: every command that reports is scriptable — `--json` prints one object a script can
read, and the exit status says the same as the words; as a script runs them, in a child process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.cli import run_tunerd
from tests.integration.notify_receiver import Answer, receiver
from tunerd.state import State

SHIPPED = Path(__file__).parents[2] / "policies" / "default.yaml"
pytestmark = pytest.mark.slow


def _json(*args: str, code: int = 0) -> dict[str, object]:
    done = run_tunerd(*args)
    assert done.returncode == code, done.stdout + done.stderr
    found = json.loads(done.stdout)
    assert isinstance(found, dict)
    return found


def test_config_check_and_policy_check_and_test(tmp_path: Path) -> None:
    config = tmp_path / "tunerd.yaml"
    config.write_text(
        f"engine: {{name: main, command: [vllm, serve, m]}}\npolicies: [{SHIPPED}]\n"
        f"state_dir: {tmp_path / 'state'}\n"
    )
    checked = _json("config", "check", "--config", str(config), "--json")
    assert checked["ok"] is True
    assert checked["engines"] == ["main"]
    assert "oom" in checked["policies"]  # type: ignore[operator]
    config.write_text("engine: {name: main, command: [vllm, serve, m]}\nmode: sometimes\n")
    refused = _json("config", "check", "--config", str(config), "--json", code=2)
    assert refused["ok"] is False
    assert any("mode" in problem for problem in refused["problems"])  # type: ignore[attr-defined]

    policies = _json("policy", "check", str(SHIPPED), "--json")
    assert policies["ok"] is True
    assert policies["files"][0]["policies"][:2] == ["oom-neighbour", "oom"]  # type: ignore[index]
    broken = tmp_path / "broken.yaml"
    broken.write_text("version: 1\npolicies:\n  - name: x\n    when: {metric: kv_cache_usage, above: lots}\n")
    bad = _json("policy", "check", str(broken), "--json", code=2)
    assert bad["files"][0]["ok"] is False  # type: ignore[index]
    assert bad["files"][0]["problems"][0].startswith(f"{broken}:3: policy 'x'")  # type: ignore[index]

    tests = tmp_path / "t_test.yaml"
    tests.write_text(
        f"policies: [{SHIPPED}]\ninterval: 30s\ntests:\n"
        "  - name: a quiet box does nothing\n"
        "    series: {kv_cache_usage: '0.3x20'}\n    expect_no_actions: true\n"
        "  - name: wrongly expects a restart\n"
        "    series: {kv_cache_usage: '0.3x20'}\n"
        "    expect:\n      - {at: 5m, restart: true}\n"
    )
    good = tmp_path / "good_test.yaml"
    good.write_text(
        f"policies: [{SHIPPED}]\ninterval: 30s\ntests:\n  - name: quiet\n"
        "    series: {kv_cache_usage: '0.3x20'}\n    expect_no_actions: true\n"
    )
    mixed = run_tunerd("policy", "test", str(good), str(broken))  # a bad file after a good one
    assert mixed.returncode == 2
    assert f"PASS {good}: quiet" in mixed.stdout  # what the good file said is not lost
    ran = _json("policy", "test", str(tests), "--json", code=1)
    assert ran["ok"] is False
    assert [(t["name"], t["passed"]) for t in ran["tests"]] == [  # type: ignore[attr-defined]
        ("a quiet box does nothing", True),
        ("wrongly expects a restart", False),
    ]
    assert ran["tests"][1]["failures"]  # type: ignore[index]


def test_plan_list_notify_test_and_a_persons_words(tmp_path: Path) -> None:
    known = _json("plan", "--list", "--json")
    assert known["models"]["llama-3.1-8b"]["num_key_value_heads"] == 8  # type: ignore[index]
    assert known["gpus"]["rtx4090"]["total_bytes"] > 20 * 2**30  # type: ignore[index]

    with receiver("slack") as slack, receiver("slack") as refusing:
        refusing.answer(Answer(403, b"invalid_token"))
        config = tmp_path / "notify.yaml"
        config.write_text(
            json.dumps(
                {
                    "engine": {"name": "main", "command": ["vllm", "serve", "m"]},
                    "policies": [],
                    "notify": [
                        {"name": "chat", "kind": "slack", "url": slack.url},
                        {"name": "old", "kind": "slack", "url": refusing.url},
                    ],
                    "state_dir": str(tmp_path / "state"),
                }
            )
        )
        sent = _json("notify", "test", "--config", str(config), "--json", code=1)
    assert sent["ok"] is False
    assert sent["accepted"] == 1
    assert [(s["name"], s["outcome"]) for s in sent["sinks"]] == [("chat", "ok"), ("old", "permanent")]  # type: ignore[attr-defined]

    state = State.open(tmp_path / "words")
    state.set_running("main", state.add_version("main", {"max_num_seqs": 8}, "initial", now=0.0))
    state.close()
    where = ["--state-dir", str(tmp_path / "words"), "--socket", str(tmp_path / "none.sock")]
    pinned = _json("pin", "main", *where, "--json")
    assert pinned == {
        "engine": "main",
        "done": "pinned",
        "said": "main: pinned; `tunerd resume main` lets tunerd tune it again",
        "woken": False,
    }
    resumed = _json("resume", "main", *where, "--json")
    assert resumed["done"] == "resumed"
    nothing = run_tunerd("rollback", "main", *where, "--json")
    assert nothing.returncode == 2  # nothing to roll back: said in words, on stderr
    assert "nothing to roll back" in nothing.stderr
