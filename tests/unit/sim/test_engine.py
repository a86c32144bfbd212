"""The simulated engine, pure: vLLM's pool sizing, scheduler invariants, memory and time."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tunerd.commands.common import UsageError
from tunerd.commands.sim import gc_threshold
from tunerd.planner.gpus import gpu_profile
from tunerd.planner.recommend import PlanRequest, make_plan
from tunerd.planner.shapes import builtin_model, load_model_config, shape_from_config
from tunerd.sim.engine import (
    CudaOutOfMemory,
    EngineSettings,
    Neighbour,
    Request,
    SimEngine,
    SimGpu,
    StartupFailure,
)

GIB = 1024**3
MIB = 1024**2
SEED = EngineSettings(
    gpu_memory_utilization=0.92,
    max_model_len=32768,
    max_num_seqs=8,
    max_num_batched_tokens=2048,
    kv_cache_dtype="fp8",
)
DISPLAY = Neighbour(4_194_305, "Xorg", 300 * MIB)


def _engine(
    settings: EngineSettings = SEED,
    *,
    gpu: str = "rtx4090",
    neighbours: list[Neighbour] | None = None,
    model: str = "llama-3.1-8b",
    weights: str = "awq",
    **extra: object,
) -> SimEngine:
    card = SimGpu(gpu_profile(gpu), [DISPLAY] if neighbours is None else neighbours)
    return SimEngine(builtin_model(model), card, weights, settings, pid=1000, **extra)  # type: ignore[arg-type]


def _run(engine: SimEngine, requests: list[Request], limit: float = 3600.0) -> float:
    now = 0.0
    for request in requests:
        engine.submit(request)
    while engine.has_work and now < limit:
        result = engine.step(now)
        engine.tick(now)
        now += result.duration or 0.01
    return now


class TestStartup:
    def test_pool_is_the_planners(self) -> None:
        """One memory model: the simulator's pool is the planner's prediction."""
        plan = make_plan(
            PlanRequest(
                shape=builtin_model("llama-3.1-8b"),
                gpu=gpu_profile("rtx4090"),
                weights="awq",
                kv_dtype="fp8",
                concurrency=4,
                context=32768,
            )
        )
        engine = _engine()
        assert engine.pool.tokens == plan.recommendation.scenario.pool.tokens
        assert engine.weights.bytes == plan.recommendation.scenario.weights.bytes

    @pytest.mark.parametrize(
        ("settings", "neighbours", "kind"),
        [
            (EngineSettings(max_model_len=32768), None, "invalid_config"),  # llama-3-8b: 8,192 positions
            (
                EngineSettings(
                    gpu_memory_utilization=0.92, max_model_len=8192, kv_cache_memory_bytes=GIB // 64
                ),
                None,
                "max_model_len_exceeds_kv",
            ),
            (
                EngineSettings(gpu_memory_utilization=0.92),
                [Neighbour(1, "big", 3 * GIB)],
                "insufficient_free_memory",
            ),
            (EngineSettings(gpu_memory_utilization=0.3), None, "no_kv_cache_memory"),
            (
                EngineSettings(max_model_len=8192, max_num_batched_tokens=2048, enable_chunked_prefill=False),
                None,
                "invalid_config",
            ),
        ],
    )
    def test_startup_failures(
        self, settings: EngineSettings, neighbours: list[Neighbour] | None, kind: str
    ) -> None:
        with pytest.raises(StartupFailure) as caught:
            _engine(settings, neighbours=neighbours, model="llama-3-8b", weights="bf16")
        assert caught.value.kind == kind

    def test_estimated_max_model_len_in_text(self) -> None:
        with pytest.raises(StartupFailure) as caught:
            _engine(EngineSettings(max_model_len=32768, kv_cache_memory_bytes=GIB))
        assert "estimated maximum model length is 8192" in caught.value.lines[0]  # 1 GiB of 128 KiB tokens


class TestScheduler:
    @settings(max_examples=40, deadline=None)
    @given(
        st.lists(st.tuples(st.integers(1, 6000), st.integers(1, 300)), min_size=1, max_size=12),
        st.integers(1, 6),
        st.sampled_from([256, 512, 2048]),
    )
    def test_invariants_hold_and_everything_finishes(
        self, shapes: list[tuple[int, int]], seqs: int, step: int
    ) -> None:
        """Blocks are never lost or double-counted, the token budget and the slots are
        respected, and every request finishes with exactly its output."""
        engine = _engine(
            EngineSettings(
                max_model_len=8192,
                max_num_seqs=seqs,
                max_num_batched_tokens=step,
                kv_cache_memory_bytes=GIB,  # 8,192 tokens of 128 KiB
            ),  # 8,192 fp8... tokens
            gpu="h100-80g",
            neighbours=[],
        )
        requests = [Request(f"r{n}", p, o, 0.0, ignore_eos=True) for n, (p, o) in enumerate(shapes)]
        for request in requests:
            engine.submit(request)
        now = 0.0
        for _ in range(100_000):
            if not engine.has_work:
                break
            result = engine.step(now)
            assert result.tokens <= step
            assert len(engine.running) <= seqs
            held = sum(r.blocks for r in engine.running)
            assert held + engine.free_blocks == engine.num_blocks - 1
            now += result.duration or 0.01
        assert all(r.done and r.generated == r.max_tokens for r in requests)
        assert engine.free_blocks == engine.num_blocks - 1

    def test_small_pool_preempts_and_recovers(self) -> None:
        engine = _engine(
            EngineSettings(
                max_model_len=4096,
                max_num_seqs=8,
                max_num_batched_tokens=2048,
                kv_cache_memory_bytes=6000 * 128 * 1024,
            ),
            gpu="h100-80g",
            neighbours=[],
            weights="bf16",
        )
        requests = [Request(f"r{n}", 1500, 600, 0.0, ignore_eos=True) for n in range(6)]
        _run(engine, requests)
        assert engine.preemptions_total > 0
        assert all(r.done for r in requests)
        assert engine.prompt_tokens_total == 6 * 1500  # counted once per request, as V1 does
        assert engine.generation_tokens_total == 6 * 600

    def test_queueing_for_capacity(self) -> None:
        engine = _engine(
            EngineSettings(max_model_len=4096, max_num_seqs=2, max_num_batched_tokens=2048),
            gpu="h100-80g",
            neighbours=[],
        )
        for n in range(5):
            engine.submit(Request(f"r{n}", 100, 50, 0.0, ignore_eos=True))
        engine.step(0.0)
        assert (len(engine.running), len(engine.waiting)) == (2, 3)

    def test_eos_lengths_are_seeded(self) -> None:
        def lengths(seed: int) -> list[int]:
            engine = _engine(seed=seed)
            requests = [Request(f"r{n}", 10, 200, 0.0) for n in range(10)]
            for request in requests:
                engine.submit(request)
            return [r.output_target for r in requests]

        assert lengths(7) == lengths(7)
        assert lengths(7) != lengths(8)
        assert all(1 <= n <= 200 for n in lengths(7))


class TestMemoryAndTime:
    def test_first_step_takes_the_working_set_and_keeps_it(self) -> None:
        engine = _engine()
        assert engine.activation_held == 0
        _run(engine, [Request("a", 5000, 10, 0.0, ignore_eos=True)])
        held = engine.activation_held
        assert held > 0
        _run(engine, [Request("b", 10, 10, 0.0, ignore_eos=True)])
        assert engine.activation_held == held  # the ratchet: a small step gives nothing back

    def test_prompt_logprobs_allocate_beyond_the_profile(self) -> None:
        plain = _engine()
        _run(plain, [Request("a", 8000, 4, 0.0, ignore_eos=True)])
        with_logprobs = _engine()
        _run(with_logprobs, [Request("a", 8000, 4, 0.0, ignore_eos=True, prompt_logprobs=1)])
        extra = with_logprobs.activation_held - plain.activation_held
        assert extra == pytest.approx(2048 * 128256 * 4, rel=0.01)  # one chunk of fp32 logits

    def test_growing_neighbour_ooms_the_engine_and_is_named(self) -> None:
        notebook = Neighbour(4_194_306, "notebook", 256 * MIB, start=0.0, growth_bytes_per_s=50 * MIB)
        engine = _engine(
            EngineSettings(
                gpu_memory_utilization=0.95,
                max_model_len=32768,
                max_num_seqs=8,
                max_num_batched_tokens=2048,
                kv_cache_dtype="fp8",
            ),
            neighbours=[DISPLAY, notebook],
        )
        with pytest.raises(CudaOutOfMemory) as caught:
            _run(engine, [Request(f"r{n}", 20000, 200, float(n), ignore_eos=True) for n in range(40)])
        assert engine.dead
        assert {p.pid for p in caught.value.others} == {4_194_305, 4_194_306}
        assert caught.value.free_bytes < caught.value.tried_bytes

    def test_drift_ooms_even_when_idle(self) -> None:
        engine = _engine(
            EngineSettings(
                gpu_memory_utilization=0.97,
                max_model_len=32768,
                max_num_seqs=8,
                max_num_batched_tokens=2048,
                kv_cache_dtype="fp8",
            ),
            drift_bytes_per_s=GIB / 3600,
        )

        def idle_for_two_hours() -> None:
            for second in range(0, 7200, 5):
                engine.tick(float(second))

        with pytest.raises(CudaOutOfMemory) as caught:
            idle_for_two_hours()
        assert caught.value.what == "a leak"

    def test_decode_step_time_is_the_roofline(self) -> None:
        engine = _engine()
        engine.submit(Request("a", 28000, 2, 0.0, ignore_eos=True))
        now = 0.0
        while not engine.running or engine.running[0].generated == 0:
            now += engine.step(now).duration
        decode = engine.step(now).duration
        read = engine.weights.bytes + 28001 * engine.kv_bytes_per_token
        assert decode == pytest.approx(read / (1008e9 * 0.8) + 0.002, rel=0.01)

    def test_gpu_sample_is_nvml_shaped(self) -> None:
        engine = _engine()
        sample = engine.gpu_sample(0.0)
        assert sample.memory_total_bytes == 24564 * MIB
        assert sample.memory_reserved_bytes == (24564 - 24084) * MIB
        assert sample.memory_used_bytes == engine.static_bytes + 300 * MIB
        assert (
            sample.memory_free_bytes == 24564 * MIB - sample.memory_reserved_bytes - sample.memory_used_bytes
        )
        assert [p.pid for p in sample.processes or ()] == [1000, 4_194_305]
        assert math.isclose(engine.kv_cache_usage, 0.0)


def test_sliding_window_model_frees_blocks_outside_the_window() -> None:
    """Review finding: a pool sized by the window rule, served as full attention, livelocked."""
    config = Path(__file__).parents[2] / "data" / "model_configs" / "mistral-7b-v0.1.json"
    shape = shape_from_config(load_model_config(config))
    card = SimGpu(gpu_profile("h100-80g"), [])
    engine = SimEngine(
        shape,
        card,
        "bf16",
        EngineSettings(
            max_model_len=8192,
            max_num_seqs=4,
            max_num_batched_tokens=2048,
            kv_cache_memory_bytes=450 * 16 * 131072,
        ),
        pid=1,
    )
    request = Request("r", 8000, 100, 0.0, ignore_eos=True)
    _run(engine, [request], limit=600.0)
    assert request.done
    assert engine.preemptions_total == 0


def _peaks(engine: SimEngine, prompts: int) -> tuple[int, int, int]:
    """(memory before, the most during, after) of ``prompts`` 20K prefills one after another."""
    before = most = engine.engine_bytes()
    now = 0.0
    for n in range(prompts):
        engine.submit(Request(f"p{n}", 20_000, 64, now, ignore_eos=True))
        while engine.has_work:
            now += engine.step(now).duration or 0.01
            most = max(most, engine.engine_bytes())
    return before, most, engine.engine_bytes()


def test_the_caching_allocator_keeps_a_prefills_peak_unless_told_to_give_it_back() -> None:
    """vLLM's memory as nvidia-smi shows it: the default allocator keeps what the first large
    step took (the ratchet); with ``garbage_collection_threshold`` below what the process holds
    it reclaims the unused blocks once decoding needs less — a rectangle per prefill — and
    never below the threshold."""
    before, most, after = _peaks(_engine(), 2)
    assert most - before >= 64 * MIB
    assert after == most
    before, most, after = _peaks(_engine(gc_threshold=0.6), 2)
    assert most - before >= 64 * MIB
    assert after - before < 16 * MIB
    engine = _engine(gc_threshold=0.99)  # above what the process holds: nothing to reclaim
    before, most, after = _peaks(engine, 1)
    assert after == most


@pytest.mark.parametrize(
    ("conf", "threshold"),
    [
        (None, None),
        ("", None),
        ("expandable_segments:True", None),
        ("expandable_segments:True,garbage_collection_threshold:0.6", 0.6),
        (" garbage_collection_threshold:0.8 ,max_split_size_mb:128", 0.8),
    ],
)
def test_the_simulator_reads_the_threshold_as_pytorch_does(conf: str | None, threshold: float | None) -> None:
    assert gc_threshold(conf) == threshold


@pytest.mark.parametrize("value", ["0", "1", "1.5", "-0.2", "nan", "lots", ""])
def test_a_threshold_outside_zero_to_one_is_pytorchs_start_up_error(value: str) -> None:
    with pytest.raises(UsageError, match=r"garbage_collect_threshold is invalid, set it in \(0\.0, 1\.0\)"):
        gc_threshold(f"garbage_collection_threshold:{value}")
