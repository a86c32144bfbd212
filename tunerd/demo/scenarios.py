"""The stories ``tunerd demo`` plays on the simulator, and how each is judged (pure data).

Each scenario is a start (the engine's settings and bounds, the simulated world), a load, a
time scale, and what must come out of it. ``seed`` is the seed write-up's box: an 8B Llama with
AWQ weights on an RTX 4090 under four 28K-token conversations, started greedy (0.97
utilization, 8,192 batched tokens, 16-bit KV, 16 sequences) — the start that OOMs minutes into
real traffic. The others show one policy each, with the shipped ``policies/default.yaml``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["SCENARIOS", "Load", "Scenario", "scenario"]

#: What a story must end in: stable after tuning, or a person's attention.
Expect = Literal["converged", "alerted", "rolled_back", "held", "tuned_up"]


@dataclass(frozen=True)
class Load:
    """``tunerd sim load``: N clients, each sending the next request when the last finished."""

    concurrency: int
    prompt_tokens: int
    max_tokens: int
    requests: int | None = None  # then quiet; None: for as long as the story lasts
    start_after: float = 0.0  # simulated seconds after the demo starts (0: once it serves)


@dataclass(frozen=True)
class Scenario:
    name: str
    title: dict[str, str]  # language → one line: what it shows
    settings: dict[str, Any]
    bounds: dict[str, list[Any]]
    load: Load | None
    expect: Expect
    time_scale: float = 50.0
    sim_args: tuple[str, ...] = ()
    model: str = "llama-3.1-8b"
    weights: str = "awq"
    gpu: str = "rtx4090"
    #: For ``alerted``: the policy whose alert the story is about.
    alert_policy: str | None = None
    #: Shipped policies whose ``mode`` the demo overrides (the operator's choice, said aloud).
    policy_modes: dict[str, str] = field(default_factory=dict)
    #: Play it with the computed moves (``fit``) taken out of the policies: what tunerd does
    #: with nothing calibrated (said aloud).
    notches_only: bool = False
    #: Simulated seconds without a change (crash, restart, tune) that count as stable.
    stable_for: float = 600.0
    #: Simulated seconds after which a story that has not ended is a failure.
    deadline: float = 3 * 3600.0


#: The seed write-up's working settings (DESIGN §1): what the planner recommends, too.
_SEED = {
    "gpu_memory_utilization": 0.92,
    "max_model_len": 32768,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 2048,
    "kv_cache_dtype": "fp8",
}
_GREEDY = {
    "gpu_memory_utilization": 0.97,
    "max_model_len": 32768,
    "max_num_seqs": 16,
    "max_num_batched_tokens": 8192,
    "kv_cache_dtype": "float16",
}
_SEED_LOAD = Load(concurrency=4, prompt_tokens=28000, max_tokens=512)

SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            name="seed",
            title={
                "en": "the seed's 24 GiB box from an unsafe start: tuned down until it holds",
                "zh": "种子文档里的 24 GiB 机器，从不安全的配置起步：调低直到稳定",
            },
            settings=_GREEDY,
            bounds={"gpu_memory_utilization": [0.80, 0.97], "max_num_batched_tokens": [1024, 8192]},
            load=_SEED_LOAD,
            expect="converged",
        ),
        Scenario(
            name="saturation",
            title={
                "en": "a KV pool that stays full while requests wait: one sequence slot fewer",
                "zh": "KV 池长期占满、请求排队：减少并发序列数",
            },
            settings={**_SEED, "kv_cache_dtype": "float16"},
            bounds={"max_num_seqs": [2, 16]},
            load=Load(concurrency=8, prompt_tokens=17000, max_tokens=512),
            expect="converged",
            stable_for=1200.0,
        ),
        Scenario(
            name="neighbour",
            title={
                "en": "another process grows on the GPU and the engine dies: alert, tune nothing",
                "zh": "同一张卡上别的进程涨内存把引擎挤死：告警，不调参",
            },
            settings={**_SEED, "gpu_memory_utilization": 0.90},
            bounds={"gpu_memory_utilization": [0.80, 0.90]},
            # a notebook takes 2 GiB, the engine's slack, two minutes after each engine start;
            # the traffic arrives after it (the first long prefill needs that slack)
            load=Load(concurrency=4, prompt_tokens=28000, max_tokens=512, start_after=240),
            expect="alerted",
            alert_policy="oom-neighbour",
            sim_args=("--sim-neighbor", "2GiB@2m:notebook"),
        ),
        Scenario(
            name="startup-failure",
            title={
                "en": "tuned settings that do not start (notches, uncalibrated): back to the last that did",
                "zh": "调整后的配置启动失败（仅按档位调整、未校准）：回滚到上一次能用的配置",
            },
            # the model's whole context (131,072 tokens) must fit the pool: at 0.96 it does,
            # at 0.93 it does not — which only a start can tell tunerd
            settings={
                **_GREEDY,
                "gpu_memory_utilization": 0.96,
                "max_model_len": 131072,
                "max_num_seqs": 4,
                "max_num_batched_tokens": 4096,
            },
            bounds={"gpu_memory_utilization": [0.80, 0.96], "max_num_batched_tokens": [1024, 4096]},
            # a burst of eight long requests once tunerd's settle period after the start is over
            load=Load(concurrency=4, prompt_tokens=28000, max_tokens=512, requests=8, start_after=960),
            expect="rolled_back",
            # calibrated, tunerd would not take that step (its fit checks the pool still holds
            # the model's context): the notches alone show what the rollback guard is for
            notches_only=True,
        ),
        Scenario(
            name="crash-loop",
            title={
                "en": "an engine that leaks and crashes again and again: hold and page a person",
                "zh": "引擎泄漏、反复崩溃：停止调参，呼叫值班的人",
            },
            settings=_SEED,
            bounds={"gpu_memory_utilization": [0.80, 0.92], "max_num_batched_tokens": [1024, 2048]},
            load=_SEED_LOAD,
            expect="held",
            sim_args=("--sim-drift", "30GiB/h"),
        ),
        Scenario(
            name="over-conservative",
            title={
                "en": "a cautious start on a quiet box: one careful step up after a calm day",
                "zh": "过于保守的配置、空闲的机器：平稳一天后小心地上调一步",
            },
            settings={**_SEED, "gpu_memory_utilization": 0.85, "max_num_seqs": 2},
            bounds={"max_num_seqs": [2, 8]},
            load=None,
            expect="tuned_up",
            time_scale=1000.0,
            policy_modes={"pool-underused": "act"},
            deadline=40 * 3600.0,
        ),
    )
}


def scenario(name: str) -> Scenario:
    try:
        return SCENARIOS[name]
    except KeyError:
        raise ValueError(f"unknown scenario '{name}' (one of {', '.join(SCENARIOS)})") from None
