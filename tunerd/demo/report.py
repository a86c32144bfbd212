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


#: the report's and the summary's words, by language (the narration's are the story's)
WORDS: dict[str, dict[str, str]] = {
    "en": {
        "bill": "bill (GiB)",
        "before": "before",
        "after": "after",
        "weights": "weights",
        "pool": "KV cache pool",
        "activations": "activations (peak)",
        "runtime": "CUDA runtime + graphs",
        "total": "total",
        "free": "free of the GPU",
        "tokens": "KV pool (tokens)",
        "start": "start",
        "final": "final",
        "met": "met",
        "not_met": "NOT MET",
        "target": "target",
        "memory": "GPU memory (simulated)",
        "engine": "the engine (vLLM's processes)",
        "others": "everything else on the GPU",
        "budget": "the engine's budget (gpu_memory_utilization × total)",
        "card": "the card's total",
        "marks": "Marks",
        "happened": "What happened",
        "summary": "Summary",
        "page": "tunerd demo",
    },
    "zh": {
        "bill": "账单（GiB）",
        "before": "之前",
        "after": "之后",
        "weights": "权重",
        "pool": "KV 缓存池",
        "activations": "激活（峰值）",
        "runtime": "CUDA 运行时 + 图",
        "total": "合计",
        "free": "GPU 剩余",
        "tokens": "KV 池（token）",
        "start": "起始",
        "final": "最终",
        "met": "达标",
        "not_met": "未达标",
        "target": "目标",
        "memory": "GPU 显存（模拟）",
        "engine": "引擎（vLLM 的进程）",
        "others": "GPU 上的其他占用",
        "budget": "引擎的预算（gpu_memory_utilization × 总量）",
        "card": "显卡总量",
        "marks": "标记",
        "happened": "经过",
        "summary": "小结",
        "page": "tunerd 演示",
    },
}
#: the DESIGN-§8 checks' names in Chinese (their English names are the JSON's)
CHECK_NAMES_ZH = {
    "restarts to converge": "收敛所需的重启次数",
    "OOMs after converging": "收敛后的 OOM 次数",
    "final KV pool / planner's safe maximum": "最终 KV 池 / 规划器的安全上限",
    "final KV pool / the box's true safe maximum": "最终 KV 池 / 机器真实的安全上限",
}


def words(language: str) -> dict[str, str]:
    return WORDS.get(language, WORDS["en"])


def bill_table(
    scenario: Scenario, before: Mapping[str, Any], after: Mapping[str, Any], language: str = "en"
) -> list[str]:
    """The four bills as vLLM holds them (the KV bill is the pool it allocates), before → after."""
    old, new = price(scenario, before), price(scenario, after)
    said = words(language)

    def rows(priced: Priced) -> list[tuple[str, float]]:
        pool = max(priced.pool.available_bytes, 0)
        used = priced.weights.bytes + pool + priced.activation.bytes + priced.runtime.bytes
        return [
            (said["weights"], priced.weights.bytes / GIB),
            (said["pool"], pool / GIB),
            (said["activations"], priced.activation.bytes / GIB),
            (said["runtime"], priced.runtime.bytes / GIB),
            (said["total"], used / GIB),
            (said["free"], (priced.gpu_bytes - used) / GIB),
        ]

    lines = [
        f"  {_pad(said['bill'], 24)}{_pad(said['before'], 9, right=True)}{_pad(said['after'], 9, right=True)}"
    ]
    for (name, a), (_, b) in zip(rows(old), rows(new), strict=True):
        lines.append(f"  {_pad(name, 24)}{a:>9.2f}{b:>9.2f}")
    lines.append(f"  {_pad(said['tokens'], 24)}{old.pool.tokens:>9,}{new.pool.tokens:>9,}")
    return lines


def check_lines(measured: Sequence[Check], language: str = "en") -> list[str]:
    """The checks as the summary prints them."""
    said = words(language)
    out = []
    for check in measured:
        name = CHECK_NAMES_ZH.get(check.name, check.name) if language == "zh" else check.name
        verdict = said["met"] if check.met else said["not_met"]
        out.append(f"  {_pad(verdict, 8)}{name}: {check.value} ({said['target']} {check.target})")
    return out


def _pad(text: str, width: int, right: bool = False) -> str:
    """``text`` aligned in ``width`` terminal columns (a CJK character takes two)."""
    room = " " * max(0, width - sum(2 if ord(ch) > 0x2E7F else 1 for ch in text))
    return room + text if right else text + room


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
    said = words(story.language)
    times = [s.time for s in samples]
    engine = [float(s.engine_bytes) if s.engine_bytes > 0 else None for s in samples]
    panel = chart.Panel(
        title=said["memory"],
        unit="bytes",
        times=times,
        layers=[
            chart.Layer(said["engine"], "#5c6bc0", engine),
            chart.Layer(
                said["others"],
                "#e57373",
                [float(max(0, s.used_bytes - s.engine_bytes)) for s in samples],
            ),
        ],
        lines=[
            chart.Line(
                said["budget"],
                "#1b5e20",
                [float(s.budget_bytes) if s.budget_bytes is not None else None for s in samples],
                dashed=True,
            )
        ],
        ceiling=(said["card"], float(max(s.total_bytes for s in samples))) if samples else None,
        height=320,
        fit_rows=[value is not None for value in engine]
        if any(value is not None for value in engine)
        else None,
    )
    marks = [chart.Mark(mark.time, mark.kind, mark.label) for mark in story.marks]
    return chart.svg([panel], marks, clock="elapsed", language=story.language)


def render_html(
    story: Story,
    samples: Sequence[Sample],
    narration: Sequence[str],
    summary: Sequence[str],
    verdict: str,
) -> str:
    """A self-contained page: the curve with its marks, the narration, the summary."""
    scenario = story.scenario
    said = words(story.language)
    marks = [chart.Mark(mark.time, mark.kind, mark.label) for mark in story.marks]
    return chart.page(
        f"{said['page']} · {scenario.name}",
        [
            scenario.title.get(story.language, scenario.title["en"]),
            verdict,
            f"{said['start']}: {settings_text(scenario.settings)}",
        ],
        curve(samples, story) if samples else "<p>(no GPU readings)</p>",
        [
            (said["marks"], chart.mark_list(marks, clock="elapsed")),
            (said["happened"], "\n".join(narration)),
            (said["summary"], "\n".join(summary)),
        ],
        language=story.language,
    )
