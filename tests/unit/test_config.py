"""The config file: DESIGN §4.8's example loads; every mistake is located."""

from __future__ import annotations

import os
import typing
from pathlib import Path

import pytest

from tunerd.config import ConfigError, NotifyConfig, load_config, notify_targets, rate_of
from tunerd.notify.sinks import KINDS

DESIGN_EXAMPLE = """\
engines:
  - name: llama31-8b
    control: supervise
    command: [vllm, serve, /srv/models/Llama-3.1-8B-Instruct-AWQ]
    env: {HF_HUB_OFFLINE: "1"}
    url: http://127.0.0.1:8000
    gpus: [0]
    settings: {gpu_memory_utilization: 0.92, max_model_len: 32768, max_num_seqs: 8,
               max_num_batched_tokens: 2048, kv_cache_dtype: fp8}
    bounds: {gpu_memory_utilization: [0.80, 0.95], max_num_seqs: [4, 16],
             max_num_batched_tokens: [512, 8192]}
    model: {name: llama-3.1-8b, weights: awq}
    hooks: {pre_stop: [/usr/local/bin/lb-drain, llama31]}
gpu: {source: nvml, interval: 250ms}
metrics: {interval: 2s}
clock: {source: system}
mode: advise
policies: [policies/*.yaml]
guards: {max_restarts: 3, window: 1h, on_exhausted: hold, quiet: {max_running: 0, for: 2m}}
notify:
  - {name: ops, kind: feishu, url_env: TUNERD_FEISHU_URL, secret_env: TUNERD_FEISHU_SECRET}
state_dir: /var/lib/tunerd
listen: {metrics: 127.0.0.1:9464, status: /run/tunerd/tunerd.sock}
"""


def test_the_design_example_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the service's EnvironmentFile holds the sink's URL and secret
    monkeypatch.setenv("TUNERD_FEISHU_URL", "https://open.feishu.cn/open-apis/bot/v2/hook/t0ken")
    monkeypatch.setenv("TUNERD_FEISHU_SECRET", "feishu-secret-value")
    (tmp_path / "policies").mkdir()
    for name in ("b.yaml", "a.yaml"):
        (tmp_path / "policies" / name).write_text("version: 1\npolicies: []\n")
    path = tmp_path / "tunerd.yaml"
    path.write_text(DESIGN_EXAMPLE)
    config = load_config(path)
    [engine] = config.engines
    assert engine.settings["kv_cache_dtype"] == "fp8"
    assert engine.drain == 120.0
    assert config.gpu.interval == 0.25
    assert config.guards.window == 3600.0
    assert config.guards.quiet is not None
    assert config.guards.quiet.for_ == 120.0
    assert config.mode == "advise"
    assert config.policy_files() == [tmp_path / "policies" / "a.yaml", tmp_path / "policies" / "b.yaml"]


def test_a_single_engine_block_is_shorthand(tmp_path: Path) -> None:
    text = "engine:\n  name: one\n  command: [vllm, serve, m]\n  settings: {max_num_seqs: 4}\n"
    config = load_config(tmp_path / "c.yaml", text)
    assert [e.name for e in config.engines] == ["one"]


def _problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load_config("c.yaml", text)
    return caught.value.problems


def test_every_problem_is_located() -> None:
    problems = _problems(
        "engines:\n"
        "  - name: a\n"
        "    command: [vllm, serve, m, --max-num-seqs, '8', --disable-log-stats]\n"  # line 3
        "    settings:\n"
        "      gpu_memory_utilization: 1.5\n"  # line 5
        "      swap_space: 4\n"  # line 6
        "    bounds: {max_num_seqs: [4, zero]}\n"  # line 7
        "  - name: a\n"  # line 8
        "    command: vllm serve m\n"  # line 9
        "mode: yolo\n"  # line 10
        "colour: blue\n"  # line 11
    )
    text = "\n".join(problems)
    assert "c.yaml:3: engines[0].command[3]: --max-num-seqs is tuned by tunerd" in text
    assert "c.yaml:3: engines[0].command[5]: --disable-log-stats is not allowed in command" in text
    assert (
        "c.yaml:5: engines[0].settings.gpu_memory_utilization: gpu_memory_utilization must be in (0, 1]"
        in text
    )
    assert "c.yaml:6: engines[0].settings.swap_space: not a tunable" in text
    assert "c.yaml:7: engines[0].bounds.max_num_seqs[1]: max_num_seqs takes a number" in text
    assert "c.yaml:8: engines[1].name: duplicate engine name (first at engines[0])" in text
    assert "c.yaml:9: engines[1].command: an argv list, never a shell string" in text
    assert any(p.startswith("c.yaml:10: mode:") for p in problems)
    assert "c.yaml:11: colour: unknown field" in text


def test_systemd_control_needs_a_unit_and_engines_are_required() -> None:
    problems = _problems("engine: {name: a, control: systemd, command: [x], env: {A: b}}\n")
    assert any("unit: systemd control needs" in p for p in problems)
    assert any("command: systemd control: the command is the unit's ExecStart" in p for p in problems)
    assert any("env: systemd control: set the environment in the unit" in p for p in problems)
    assert (
        load_config("c.yaml", "engine: {name: a, control: systemd, unit: vllm-a.service}\n").engines[0].unit
    )
    assert any("command: the engine's argv list" in p for p in _problems("engine: {name: a}\n"))
    assert any("engines" in p for p in _problems("mode: act\n"))
    assert any("not both" in p for p in _problems("engine: {name: a, command: [x]}\nengines: []\n"))


def test_the_simulator_sources_need_its_url_and_no_other_source_takes_one() -> None:
    engine = "engine: {name: a, command: [x]}\n"
    problems = _problems(engine + "clock: {source: sim}\ngpu: {source: nvml, url: 'http://h:1'}\n")
    assert "c.yaml:2: clock.source: source: sim needs url: (the simulator's URL)" in problems
    assert "c.yaml:3: gpu.url: url: is only for source: sim" in problems
    config = load_config("c.yaml", engine + "clock: {source: sim, url: 'http://127.0.0.1:8000'}\n")
    assert (config.clock.source, config.clock.url) == ("sim", "http://127.0.0.1:8000")


def test_hooks_are_argv_lists_with_known_names() -> None:
    problems = _problems(
        "engine:\n"
        "  name: a\n"
        "  command: [vllm, serve, m]\n"
        "  hooks:\n"
        "    pre_stop: /usr/local/bin/lb-drain a\n"  # line 5
        "    post_stop: [/usr/local/bin/lb-add, a]\n"  # line 6
        "    post_start: []\n"  # line 7
    )
    text = "\n".join(problems)
    assert "c.yaml:5: engines[0].hooks.pre_stop: an argv list, never a shell string" in text
    assert "c.yaml:6: engines[0].hooks.post_stop: not a hook (hooks: pre_stop, post_start)" in text
    assert "c.yaml:7: engines[0].hooks.post_start: an empty command" in text
    good = load_config(
        "c.yaml",
        "engine: {name: a, command: [x], hooks: {pre_stop: [lb-drain, a]}, hook_timeout: 30s}\n",
    )
    assert good.engines[0].hooks == {"pre_stop": ["lb-drain", "a"]}
    assert good.engines[0].hook_timeout == 30.0


def test_notify_sinks_are_checked_with_their_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TUNERD_FEISHU_URL", "https://open.feishu.cn/open-apis/bot/v2/hook/t0ken")
    monkeypatch.setenv("TUNERD_TEAMS_URL", "https://acme.webhook.office.com/webhookb2/x")
    monkeypatch.delenv("TUNERD_DING_URL", raising=False)
    problems = _problems(
        "engine: {name: a, command: [x]}\n"
        "notify:\n"
        "  - {name: ops, kind: feishu, url_env: TUNERD_FEISHU_URL, secret_env: TUNERD_NOPE_SECRET}\n"  # 3
        "  - {name: ops, kind: dingtalk, url_env: TUNERD_DING_URL}\n"  # 4
        "  - {name: t, kind: teams, url_env: TUNERD_TEAMS_URL}\n"  # 5
        "  - {name: p, kind: pager, url: 'http://x'}\n"  # 6
        "  - {name: w, kind: webhook, url: 'http://x', url_env: TUNERD_FEISHU_URL, rate: fast}\n"  # 7
    )
    text = "\n".join(problems)
    assert "c.yaml:3: notify[0].secret_env: TUNERD_NOPE_SECRET is not set in tunerd's environment" in text
    assert "c.yaml:4: notify[1].name: duplicate sink name 'ops'" in text
    assert "c.yaml:4: notify[1].url_env: TUNERD_DING_URL is not set in tunerd's environment" in text
    assert "c.yaml:5: notify[2].kind: Office 365 connector URLs (*.webhook.office.com) are retired" in text
    assert any(p.startswith("c.yaml:6: notify[3].kind:") for p in problems)
    assert any(p.startswith("c.yaml:7: notify[4]:") and "one of them" in p for p in problems)


def test_notify_targets_read_urls_and_secrets_from_the_environment() -> None:
    config = load_config(
        "c.yaml",
        "engine: {name: a, command: [x]}\n"
        "notify: [{name: ops, kind: dingtalk, url_env: TUNERD_CANARY_URL, secret_env: TUNERD_CANARY_SECRET,"
        " language: zh, min_severity: warning, rate: 10/1m}]\n",
    )
    [target] = notify_targets(config, os.environ)
    assert (target.name, target.kind, target.language, target.min_severity) == (
        "ops",
        "dingtalk",
        "zh",
        "warning",
    )
    assert (target.url, target.secret) == (
        os.environ["TUNERD_CANARY_URL"],
        os.environ["TUNERD_CANARY_SECRET"],
    )
    assert rate_of(config.notify[0].rate or "") == (10, 60.0)
    assert set(typing.get_args(NotifyConfig.model_fields["kind"].annotation)) == set(KINDS)


def test_ladders_as_the_examples_suggest_them() -> None:
    """policies/examples/datacenter-80g.yaml tells operators to give an engine `ladders:`; the
    config refused the field until now (found in review)."""
    config = load_config(
        "c.yaml",
        "engine:\n  name: big\n  command: [vllm, serve, m]\n"
        "  bounds: {max_num_seqs: [64, 1024]}\n"
        "  ladders: {max_num_seqs: [64, 128, 256, 512, 768, 1024]}\n",
    )
    assert config.engines[0].ladders == {"max_num_seqs": [64, 128, 256, 512, 768, 1024]}
    problems = _problems(
        "engine:\n  name: big\n  command: [vllm, serve, m]\n  ladders:\n"
        "    max_num_seqs: [64, lots]\n    swap_space: [1, 2]\n    max_model_len: []\n"
    )
    text = "\n".join(problems)
    assert "c.yaml:5: engines[0].ladders.max_num_seqs[1]: max_num_seqs takes a number" in text
    assert "c.yaml:6: engines[0].ladders.swap_space: not a tunable" in text
    assert "c.yaml:7: engines[0].ladders.max_model_len: expected a list of rungs" in text
