"""The demo's summary: the four bills before and after, the DESIGN §8 checks, and an HTML page
with the memory curve (:mod:`tunerd.chart`'s inline SVG, no scripts, nothing fetched). Pure:
it takes what the demo recorded and returns text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tunerd import chart
from tunerd.demo.scenarios import Scenario
from tunerd.demo.story import Story, settings_text
from tunerd.planner.bills import KV_DTYPE_WORDS
from tunerd.planner.gpus import gpu_profile
from tunerd.planner.recommend import Scenario as Priced
from tunerd.planner.recommend import Settings, evaluate, safe_utilization
from tunerd.planner.shapes import builtin_model
from tunerd.units import GIB

__all__ = [
    "Check",
    "Sample",
    "bill_table",
    "box_text",
    "checks",
    "curve",
    "price",
    "render_html",
    "safe_kv_tokens",
]

#: DESIGN §8: the seed scenario converges in at most this many restarts …
MAX_RESTARTS = 3
#: … ending with at least this share of the planner's safe maximum KV capacity;
MIN_KV_SHARE = 0.90
#: on a box with hidden truth (``--box-seed``), this share of the simulator's own safe maximum
#: (issue 18's bar for every box; the benchmark holds the median to 95 %).
MIN_TRUE_KV_SHARE = 0.85


@dataclass(frozen=True)
class Sample:
    """One GPU reading, for the curve."""

    time: float  # simulated seconds
    used_bytes: int
    engine_bytes: int  # the engine's processes
    total_bytes: int
    budget_bytes: int | None  # ceil(total × utilization) of the engine running then


@dataclass(frozen=True)
class Check:
    name: str
    value: str
    target: str
    met: bool


def price(scenario: Scenario, settings: Mapping[str, Any]) -> Priced:
    """The planner's four bills for ``settings`` on the scenario's card and model."""
    return _price(scenario, settings, float(settings["gpu_memory_utilization"]))


def _price(scenario: Scenario, settings: Mapping[str, Any], utilization: float) -> Priced:
    shape = builtin_model(scenario.model)
    length = int(settings.get("max_model_len") or shape.max_position_embeddings)
    return evaluate(
        shape,
        gpu_profile(scenario.gpu),
        weights_format=scenario.weights,
        kv_dtype=KV_DTYPE_WORDS[str(settings.get("kv_cache_dtype", "auto"))],
        context=length,
        concurrency=scenario.load.concurrency if scenario.load else 1,
        settings=Settings(
            gpu_memory_utilization=utilization,
            max_num_batched_tokens=int(settings.get("max_num_batched_tokens") or 2048),
            max_num_seqs=int(settings.get("max_num_seqs") or 256),
        ),
        max_model_len=length,
    )


def safe_kv_tokens(scenario: Scenario, settings: Mapping[str, Any]) -> int:
    """The planner's safe maximum KV pool for these settings: the pool at the highest
    utilization that keeps its safe slack on this card (``tunerd plan``'s recommendation)."""
    return _price(scenario, settings, safe_utilization(gpu_profile(scenario.gpu))).pool.tokens


def bill_table(scenario: Scenario, before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    """The four bills as vLLM holds them (the KV bill is the pool it allocates), before → after."""
    old, new = price(scenario, before), price(scenario, after)

    def rows(priced: Priced) -> list[tuple[str, float]]:
        pool = max(priced.pool.available_bytes, 0)
        used = priced.weights.bytes + pool + priced.activation.bytes + priced.runtime.bytes
        return [
            ("weights", priced.weights.bytes / GIB),
            ("KV cache pool", pool / GIB),
            ("activations (peak)", priced.activation.bytes / GIB),
            ("CUDA runtime + graphs", priced.runtime.bytes / GIB),
            ("total", used / GIB),
            ("free of the GPU", (priced.gpu_bytes - used) / GIB),
        ]

    lines = [f"  {'bill (GiB)':<24}{'before':>9}{'after':>9}"]
    for (name, a), (_, b) in zip(rows(old), rows(new), strict=True):
        lines.append(f"  {name:<24}{a:>9.2f}{b:>9.2f}")
    lines.append(f"  {'KV pool (tokens)':<24}{old.pool.tokens:>9,}{new.pool.tokens:>9,}")
    return lines


def checks(
    story: Story, final: Mapping[str, Any], kv_tokens: int | None, true_safe_kv_tokens: int | None = None
) -> list[Check]:
    """DESIGN §8's convergence bar, measured on this run; with the simulator's own safe
    maximum (a box with hidden truth) the final pool is judged against it, not the planner."""
    restarts = story.restarts_used()
    settled = story.settled_at()
    result = [
        Check("restarts to converge", str(restarts), f"≤ {MAX_RESTARTS}", restarts <= MAX_RESTARTS),
        Check("OOMs after converging", str(story.ooms_after(settled)), "0", story.ooms_after(settled) == 0),
    ]
    if true_safe_kv_tokens is not None:
        label, safe, bar = "the box's true safe maximum", true_safe_kv_tokens, MIN_TRUE_KV_SHARE
    else:
        label, safe, bar = "planner's safe maximum", safe_kv_tokens(story.scenario, final), MIN_KV_SHARE
    share = (kv_tokens or 0) / safe if safe else 0.0
    pool = Check(
        f"final KV pool / {label}",
        f"{kv_tokens or 0:,} / {safe:,} = {share:.0%}",
        f"≥ {bar:.0%}",
        share >= bar,
    )
    return [*result, pool]


def box_text(box: Mapping[str, Any] | None) -> str:
    """A box's hidden parameters in one line (the demo's summary, after the story)."""
    if not box:
        return "(its truth did not answer)"
    return (
        f"CUDA context {box['cuda_context_bytes'] / 2**20:.0f} MiB, non-torch "
        f"{box['non_torch_bytes'] / 2**20:.0f} MiB, activations ×{box['activation_scale']:.2f}, graphs "
        f"×{box['graph_scale']:.2f}, fragmentation ≤ {box['frag_max']:.0%}, desktop "
        f"{box['desktop_bytes'] / 2**20:.0f} MiB, driver reserve "
        f"{box['driver_reserve_bytes'] / 2**20:.0f} MiB"
    )


def curve(samples: Sequence[Sample], story: Story) -> str:
    """The run's GPU memory — the engine's, everything else on the GPU, its budget, the card's
    total — with the story's marks, drawn as every tunerd chart is (:mod:`tunerd.chart`)."""
    times = [s.time for s in samples]
    engine = [float(s.engine_bytes) if s.engine_bytes > 0 else None for s in samples]
    panel = chart.Panel(
        title="GPU memory (simulated)",
        unit="bytes",
        times=times,
        layers=[
            chart.Layer("the engine (vLLM's processes)", "#5c6bc0", engine),
            chart.Layer(
                "everything else on the GPU",
                "#e57373",
                [float(max(0, s.used_bytes - s.engine_bytes)) for s in samples],
            ),
        ],
        lines=[
            chart.Line(
                "the engine's budget (gpu_memory_utilization × total)",
                "#1b5e20",
                [float(s.budget_bytes) if s.budget_bytes is not None else None for s in samples],
                dashed=True,
            )
        ],
        ceiling=("the card's total", float(max(s.total_bytes for s in samples))) if samples else None,
        height=320,
        fit_rows=[value is not None for value in engine]
        if any(value is not None for value in engine)
        else None,
    )
    marks = [chart.Mark(mark.time, mark.kind, mark.label) for mark in story.marks]
    return chart.svg([panel], marks, clock="elapsed")


def render_html(
    story: Story,
    samples: Sequence[Sample],
    narration: Sequence[str],
    summary: Sequence[str],
    verdict: str,
) -> str:
    """A self-contained page: the curve with its marks, the narration, the summary."""
    scenario = story.scenario
    marks = [chart.Mark(mark.time, mark.kind, mark.label) for mark in story.marks]
    return chart.page(
        f"tunerd demo · {scenario.name}",
        [
            scenario.title.get(story.language, scenario.title["en"]),
            verdict,
            f"Start: {settings_text(scenario.settings)}",
        ],
        curve(samples, story) if samples else "<p>(no GPU readings)</p>",
        [
            ("Marks", chart.mark_list(marks, clock="elapsed")),
            ("What happened", "\n".join(narration)),
            ("Summary", "\n".join(summary)),
        ],
    )
