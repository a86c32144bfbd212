"""Fuzz tier (issue 16) of the loaders of what people write: the config, policy files and
policy test files.

Inputs are structural mutations of the shipped and documented files (:func:`tests.fuzzing.mutated`:
docs/config.md's example, the Kubernetes example, a config with every field, policies/*.yaml,
the policy files the docs show, tests/policies/*.yaml), random YAML built from Hypothesis'
recursive strategies over the fields these files have, and random values grafted into a good
file at a random place. Only the documented error may escape: :class:`ConfigError` from
:func:`load_config`, :class:`PolicyError` from the policy loader and the policy test loader.
What loads must then work: a config's engines give an argv, its sinks targets, its
``listen.metrics`` an exporter; loaded policies evaluate; a loaded policy test runs.
``make test`` runs 100 cases each; ``make fuzz`` 10,000.
"""

from __future__ import annotations

import copy
import functools
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzzing import NASTY, fuzz_settings, mutated
from tunerd.config import Config, ConfigError, load_config, notify_targets
from tunerd.engine.args import engine_argv
from tunerd.exporter import Exporter
from tunerd.outcomes import Mode
from tunerd.policy.engine import EngineContext, evaluate, new_states
from tunerd.policy.schema import MAX_DURATION_S, PolicyError, PolicyFile, load_policy_file
from tunerd.policy.testrun import evaluations, load_test_file, run_tests
from tunerd.signals import SIGNALS
from tunerd.store import Store
from tunerd.tune import TUNABLES, validate_value
from tunerd.yamlfile import dump_yaml

pytestmark = pytest.mark.fuzz

ROOT = Path(__file__).parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md"))
CONFIG_PATH = ROOT / "tunerd.yaml"  # never written: its relative policy globs find policies/*.yaml
ENVIRON = {
    "TUNERD_FEISHU_URL": "https://open.feishu.cn/open-apis/bot/v2/hook/t0ken",
    "TUNERD_FEISHU_SECRET": "s",
}


def _yaml_blocks(path: Path) -> list[str]:
    return re.findall(r"```yaml\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.S)


EVERY_FIELD = """\
engines:
  - name: chat
    control: supervise
    command: [vllm, serve, /srv/models/chat, --port, "8001"]
    env: {HF_HUB_OFFLINE: "1", CUDA_VISIBLE_DEVICES: "0"}
    url: http://127.0.0.1:8001
    gpus: [0, GPU-8f2a]
    settings: {gpu_memory_utilization: 0.45, max_model_len: 16384, max_num_seqs: 8,
               max_num_batched_tokens: 4096, kv_cache_dtype: auto, kv_cache_memory_bytes: 6442450944,
               enable_chunked_prefill: true, enable_prefix_caching: false, enforce_eager: false}
    bounds: {gpu_memory_utilization: [0.40, 0.60], max_num_seqs: [4, 16], kv_cache_dtype: [auto, fp8]}
    ladders: {max_num_seqs: [4, 8, 12, 16]}
    model: {name: llama-3.1-8b, weights: awq}
    hooks: {pre_stop: [/usr/local/bin/lb-drain, chat], post_start: [/usr/local/bin/lb-add, chat]}
    drain: 30s
    startup_timeout: 10m
    probation: 1m
    hook_timeout: 20s
    gpu_wait: 1m
    log_passthrough: all
  - name: embed
    control: systemd
    unit: vllm-embed.service
    url: "http://[::1]:8002"
    gpus: [0]
gpu: {source: sim, url: "http://sim_host:8000", interval: 250ms}
metrics: {interval: 2s}
clock: {source: sim, url: "http://127.0.0.1:8000"}
mode: act
policies: []
guards: {max_restarts: 3, window: 1h, on_exhausted: skip, settle: 15m,
         quiet: {max_running: 0, for: 2m, within: 1h}, shared_gpu_max: 0.95}
notify:
  - {name: ops, kind: feishu, url_env: TUNERD_FEISHU_URL, secret_env: TUNERD_FEISHU_SECRET, language: zh}
  - {name: hook, kind: webhook, url: "https://user@hooks.example.com:8443/x?y=1", min_severity: warning,
     rate: 20/1m}
state_dir: /var/lib/tunerd
listen: {status: /run/tunerd/tunerd.sock, metrics: "[::1]:9464"}
"""
KUBERNETES = next(
    document
    for document in yaml.safe_load_all((ROOT / "contrib/kubernetes/tunerd-daemonset.yaml").read_text())
    if document["kind"] == "ConfigMap"
)["data"]["tunerd.yaml"]
CONFIGS = [_yaml_blocks(ROOT / "docs" / "config.md")[0], KUBERNETES, EVERY_FIELD]
POLICIES = [path.read_text() for path in sorted((ROOT / "policies").rglob("*.yaml"))]
POLICIES += [block for doc in DOCS for block in _yaml_blocks(doc) if block.startswith("version: 1")]
TEST_DIR = ROOT / "tests" / "policies"
POLICY_TESTS = [path.read_text() for path in sorted(TEST_DIR.glob("*.yaml"))]

# The words these files are made of, so that random YAML reaches past the first check.
WORDS = sorted(
    {
        *Config.model_fields,
        "engine",
        "name",
        "control",
        "command",
        "env",
        "unit",
        "url",
        "gpus",
        "settings",
        "bounds",
        "ladders",
        "hooks",
        "drain",
        "probation",
        "source",
        "interval",
        "for",
        "within",
        "window",
        "kind",
        "url_env",
        "secret_env",
        "rate",
        "status",
        "metrics",
        "supervise",
        "systemd",
        "sim",
        "act",
        "advise",
        "observe",
        "pre_stop",
        "post_start",
        "version",
        "policies",
        "when",
        "then",
        "metric",
        "signal",
        "event",
        "no_event",
        "all",
        "any",
        "not",
        "above",
        "below",
        "tune",
        "first_of",
        "restart",
        "rollback",
        "hold",
        "notify",
        "severity",
        "cooldown",
        "step_down",
        "step_up",
        "halve",
        "double",
        "tests",
        "series",
        "events",
        "expect",
        "at",
        "engine_crash",
        "expect_no_actions",
        "http://127.0.0.1:8000",
        "10m",
        "0s",
        "30d",
        "31d",
        *TUNABLES,
        *SIGNALS,
    }
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**40), 10**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=16),
    st.sampled_from(NASTY),
    st.sampled_from(WORDS),
)
KEYS = st.one_of(st.sampled_from(WORDS), st.text(max_size=8), st.integers(-3, 3), st.booleans())
DATA = st.recursive(
    SCALARS,
    lambda children: st.one_of(st.lists(children, max_size=5), st.dictionaries(KEYS, children, max_size=5)),
    max_leaves=20,
)


@functools.cache
def _parsed(text: str) -> Any:
    return yaml.safe_load(text)


@st.composite
def grafted(draw: st.DrawFn, corpus: Sequence[str]) -> str:
    """A good file with a random value put at a random place: every field gets every type."""
    tree = copy.deepcopy(_parsed(draw(st.sampled_from(list(corpus)))))
    value = draw(DATA)
    node: Any = tree
    while True:
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        if not keys:
            break
        key = draw(st.sampled_from(keys))
        child = node[key]
        if isinstance(child, dict | list) and child and draw(st.booleans()):
            node = child
            continue
        node[key] = value
        break
    return dump_yaml(tree, sort_keys=False)


def _located(problems: list[str], file: str) -> None:
    """A refusal says at least one thing, each naming its file first."""
    assert problems
    assert all(problem.startswith(file) for problem in problems), problems


# -- the config -----------------------------------------------------------------------------


def _config(text: str) -> Config | None:
    """The loaded config, or None when refused; nothing else may escape. What loads works."""
    try:
        config = load_config(CONFIG_PATH, text)
    except ConfigError as error:
        _located(error.problems, str(CONFIG_PATH))
        return None
    for engine in config.engines:
        if engine.control == "supervise":
            engine_argv(engine.command, engine.settings, engine.drain)  # raises ArgsError if not
        for knob, bounds in engine.bounds.items():
            assert all(validate_value(knob, value) is None for value in bounds)
        for seconds in (engine.drain, engine.startup_timeout, engine.probation, engine.gpu_wait):
            assert math.isfinite(seconds)
            assert 0 <= seconds <= MAX_DURATION_S
    assert 0 < config.metrics.interval <= MAX_DURATION_S
    assert 0 < config.guards.window <= MAX_DURATION_S
    notify_targets(config, ENVIRON)
    config.policy_files()
    config.status_socket()
    if "metrics" in config.listen:
        Exporter(config.listen["metrics"], lambda: None)  # parses; binds nothing
    return config


@pytest.fixture(autouse=True)
def _sinks_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in ENVIRON.items():
        monkeypatch.setenv(key, value)


def test_the_corpus_loads() -> None:
    """The mutations start from good files: each loads as it is."""
    for text in CONFIGS:
        assert _config(text) is not None
    for text in POLICIES:
        load_policy_file("p.yaml", text)
    for text in POLICY_TESTS:
        load_test_file(TEST_DIR / "fuzz_test.yaml", text)


@fuzz_settings()
@given(mutated(CONFIGS))
def test_config_mutations_load_or_are_refused(text: str) -> None:
    _config(text)


@fuzz_settings()
@given(grafted(CONFIGS))
def test_config_with_any_value_anywhere_loads_or_is_refused(text: str) -> None:
    _config(text)


@fuzz_settings()
@given(DATA)
def test_random_yaml_is_no_config_or_is_refused(data: Any) -> None:
    _config(dump_yaml(data))


@fuzz_settings()
@given(st.dictionaries(st.sampled_from(WORDS), DATA, max_size=6))
def test_random_config_shaped_yaml_is_refused(data: dict[str, Any]) -> None:
    _config(dump_yaml({"engine": {"name": "a", "command": ["vllm", "serve", "m"], **data}}))
    _config(dump_yaml({"engines": [{"name": "a", "command": ["x"]}], **data}))


@fuzz_settings()
@given(st.text())
def test_random_text_is_no_config(text: str) -> None:
    _config(text)


# -- policies and policy tests --------------------------------------------------------------


def _policies(text: str) -> PolicyFile | None:
    """The loaded file, or None when refused; what loads evaluates over a few ticks."""
    try:
        loaded = load_policy_file("p.yaml", text)
    except PolicyError as error:
        _located(error.problems, "p.yaml")
        return None
    store = Store(capacity=64, max_events=16)
    context = EngineContext(
        name="e",
        settings={"max_num_seqs": 8, "gpu_memory_utilization": 0.9, "kv_cache_dtype": "auto"},
        bounds={
            "max_num_seqs": [4, 16],
            "gpu_memory_utilization": [0.8, 0.95],
            "kv_cache_dtype": ["auto", "fp8"],
        },
        mode=Mode.ACT,
    )
    states = new_states(loaded.policies)
    for tick in range(4):
        for index, signal in enumerate(sorted(SIGNALS)):
            store.record(signal, "e", float(tick), float((index + tick) % 3))
        states, _ = evaluate(loaded.policies, states, store, context, float(tick))
    return loaded


@fuzz_settings()
@given(mutated(POLICIES))
def test_policy_mutations_load_or_are_refused(text: str) -> None:
    _policies(text)


@fuzz_settings()
@given(grafted(POLICIES))
def test_policy_with_any_value_anywhere_loads_or_is_refused(text: str) -> None:
    _policies(text)


@fuzz_settings()
@given(st.lists(st.dictionaries(st.sampled_from(WORDS), DATA, max_size=5), max_size=2))
def test_random_policy_shaped_yaml_is_refused(policies: list[dict[str, Any]]) -> None:
    _policies(dump_yaml({"version": 1, "policies": policies}))


@fuzz_settings()
@given(st.one_of(DATA, st.text()))
def test_random_yaml_or_text_is_no_policy_file(data: Any) -> None:
    _policies(data if isinstance(data, str) else dump_yaml(data))


def _policy_test(text: str) -> None:
    """A test file beside the shipped ones (its policies found as theirs are): loaded or
    refused; a loaded one runs (the tests short enough for a fuzz case)."""
    try:
        loaded = load_test_file(TEST_DIR / "fuzz_test.yaml", text)
    except PolicyError as error:
        _located(error.problems, "")
        return
    short = [test for test in loaded.tests if evaluations(test, loaded.interval) <= 60][:1]
    for outcome in run_tests(
        type(loaded)(loaded.path, loaded.policies, loaded.engine, loaded.interval, short)
    ):
        assert outcome.passed in (True, False)


@fuzz_settings()
@given(mutated(POLICY_TESTS))
def test_policy_test_mutations_load_or_are_refused(text: str) -> None:
    _policy_test(text)


@fuzz_settings()
@given(grafted(POLICY_TESTS))
def test_policy_test_with_any_value_anywhere_loads_or_is_refused(text: str) -> None:
    _policy_test(text)


@fuzz_settings()
@given(st.one_of(DATA, st.text()))
def test_random_yaml_or_text_is_no_policy_test(data: Any) -> None:
    _policy_test(data if isinstance(data, str) else dump_yaml(data))
