"""The simulated box's hidden truth and the simulator's own safe maximum (tunerd.sim.box,
tunerd.sim.truth): drawn within real cards' ranges, different from the planner, and judged by
running the simulator itself."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tunerd.gpu import GRAPHICS
from tunerd.planner.gpus import gpu_profile
from tunerd.planner.shapes import builtin_model
from tunerd.sim.box import RANGES, Box, default_box, draw_box
from tunerd.sim.engine import EngineSettings, Neighbour, SimEngine, SimGpu, StartupFailure
from tunerd.sim.truth import TruthLoad, safe_max, survives

MIB = 1024**2
SHAPE = builtin_model("llama-3.1-8b")
RTX4090 = gpu_profile("rtx4090")
SEED_LOAD = TruthLoad(concurrency=4, prompt_tokens=28000, max_tokens=512)
GREEDY = EngineSettings(
    gpu_memory_utilization=0.97,
    max_model_len=32768,
    max_num_seqs=16,
    max_num_batched_tokens=8192,
    kv_cache_dtype="fp16",
)


def _card(box: Box) -> SimGpu:
    desktop = [Neighbour(4_194_305, "Xorg", box.desktop_bytes, kind=GRAPHICS)] if box.desktop_bytes else []
    reserve = None if box.seed is None else box.driver_reserve_bytes
    return SimGpu(RTX4090, desktop, driver_reserve_bytes=reserve)


def _factory(box: Box, *, worst_case: bool = True):  # type: ignore[no-untyped-def]
    card = _card(box)
    return lambda settings: SimEngine(SHAPE, card, "awq", settings, pid=1, box=box, worst_case=worst_case)


class TestDraw:
    def test_the_same_seed_draws_the_same_box_and_others_differ(self) -> None:
        assert draw_box(7, RTX4090) == draw_box(7, RTX4090)
        assert len({draw_box(seed, RTX4090) for seed in range(1, 21)}) == 20

    @pytest.mark.parametrize("seed", range(1, 21))
    def test_every_parameter_lies_in_its_range(self, seed: int) -> None:
        box = draw_box(seed, RTX4090).to_dict()
        for name, (low, high) in RANGES.items():
            if name == "desktop_bytes" and box[name] == 0:
                continue  # a headless box
            assert low - MIB <= box[name] <= high + MIB, name

    def test_some_consumer_boxes_have_a_desktop_and_data_centre_cards_never(self) -> None:
        desktops = [draw_box(seed, RTX4090).desktop_bytes > 0 for seed in range(1, 21)]
        assert 0 < sum(desktops) < 20
        assert all(draw_box(seed, gpu_profile("h100-80g")).desktop_bytes == 0 for seed in range(1, 21))

    def test_the_default_box_is_the_engine_without_one(self) -> None:
        """Without a seed the simulator is what it always was (its pool is the planner's:
        tests/unit/sim/test_engine.py::TestStartup::test_pool_is_the_planners)."""
        card = _card(default_box(RTX4090))
        plain = SimEngine(SHAPE, card, "awq", GREEDY, pid=1, frag_max=0.3)
        boxed = SimEngine(SHAPE, card, "awq", GREEDY, pid=1, box=default_box(RTX4090, frag_max=0.3))
        assert (plain.pool, plain.runtime, plain.profiled) == (boxed.pool, boxed.runtime, boxed.profiled)

    def test_a_drawn_box_is_not_the_planners(self) -> None:
        """With a seed the planner's pool is wrong: tunerd must measure the box."""
        planned = SimEngine(
            SHAPE, _card(default_box(RTX4090)), "awq", replace(GREEDY, gpu_memory_utilization=0.9), pid=1
        )
        pools = {
            SimEngine(
                SHAPE, _card(box), "awq", replace(GREEDY, gpu_memory_utilization=0.9), pid=1
            ).pool.tokens
            for box in (draw_box(seed, RTX4090) for seed in range(1, 11))
        }
        assert planned.pool.tokens not in pools
        assert len(pools) == 10

    def test_the_drivers_reserve_is_what_nvml_reports(self) -> None:
        box = draw_box(5, RTX4090)
        sample = SimEngine(
            SHAPE, _card(box), "awq", replace(GREEDY, gpu_memory_utilization=0.9), pid=1
        ).gpu_sample(0.0)
        assert sample.memory_reserved_bytes == box.driver_reserve_bytes
        assert sample.memory_total_bytes == 24564 * MIB


class TestSafeMax:
    @pytest.mark.parametrize("seed", [None, 1, 2, 3])
    def test_the_safe_maximum_survives_and_one_step_above_does_not(self, seed: int | None) -> None:
        box = default_box(RTX4090, desktop_bytes=300 * MIB) if seed is None else draw_box(seed, RTX4090)
        factory = _factory(box)
        found = safe_max(factory, GREEDY, SEED_LOAD)
        assert found is not None
        assert survives(factory(found.settings), SEED_LOAD)
        above = replace(found.settings, gpu_memory_utilization=found.settings.gpu_memory_utilization + 0.001)
        try:
            engine = factory(above)
        except StartupFailure:
            return
        assert not survives(engine, SEED_LOAD)

    def test_smaller_steps_are_safe_higher_and_a_bigger_load_lower(self) -> None:
        factory = _factory(draw_box(4, RTX4090))
        big = safe_max(factory, GREEDY, SEED_LOAD)
        small = safe_max(factory, replace(GREEDY, max_num_batched_tokens=2048), SEED_LOAD)
        assert big is not None
        assert small is not None
        assert small.kv_cache_tokens > big.kv_cache_tokens
        light = safe_max(factory, GREEDY, TruthLoad(1, 1000, 16))
        assert light is not None
        assert light.kv_cache_tokens >= big.kv_cache_tokens

    def test_the_worst_case_allocator_is_what_makes_it_safe(self) -> None:
        """A fresh allocator (few step shapes seen) survives a little above the truth; the
        truth holds against the fragmented one that hours of traffic leave."""
        box = replace(draw_box(6, RTX4090), frag_max=0.35)
        found = safe_max(_factory(box), GREEDY, SEED_LOAD)
        assert found is not None
        lenient = safe_max(_factory(box, worst_case=False), GREEDY, SEED_LOAD)
        assert lenient is not None
        assert lenient.settings.gpu_memory_utilization > found.settings.gpu_memory_utilization
