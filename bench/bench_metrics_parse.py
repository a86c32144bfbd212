"""One /metrics tick of tunerd against prometheus_client's full parse of the same page.

DESIGN §8: a tick (scrape parse + normalize) must cost at most 10% of prometheus_client's
full parse of a real vLLM page. Both are timed in this one run, on the same page, with
``timeit``; the figures are medians of several repeats, and the ratio is what counts (it is
stable across machines where absolute times are not).

    python bench/bench_metrics_parse.py [PAGE]   # default: the recorded page under load
"""

from __future__ import annotations

import statistics
import sys
import timeit
from pathlib import Path

from common import figure
from prometheus_client.parser import text_string_to_metric_families

from tunerd.sources.vllm_metrics import CounterRates, parse

PAGE = Path(__file__).parents[1] / "tests" / "data" / "vllm" / "metrics-0.32-load.txt"
REPEATS = 15
TARGET = 0.10


def full_parse(text: str) -> int:
    """prometheus_client's classic-text parser, every sample materialized."""
    return sum(len(family.samples) for family in text_string_to_metric_families(text))


def tunerd_tick(text: str, rates: CounterRates, now: list[float]) -> None:
    """What tunerd does with a page every scrape: prefilter, parse, normalize, rates."""
    now[0] += 2.0
    rates.update(parse(text), now[0], generation=1)


def median_seconds(statement: object, number: int) -> float:
    runs = timeit.repeat(statement, number=number, repeat=REPEATS)  # type: ignore[arg-type]
    return statistics.median(runs) / number


def main() -> int:
    page = Path(sys.argv[1]) if len(sys.argv) > 1 else PAGE
    text = page.read_text()
    rates = CounterRates()
    clock = [0.0]
    full = median_seconds(lambda: full_parse(text), number=20)
    ours = median_seconds(lambda: tunerd_tick(text, rates, clock), number=200)
    ratio = ours / full
    print(f"page: {page.name}, {len(text) / 1024:.1f} KiB, {len(text.splitlines())} lines")
    print(f"prometheus_client full parse : {full * 1e3:8.3f} ms (median of {REPEATS})")
    print(f"tunerd scrape tick           : {ours * 1e3:8.3f} ms (median of {REPEATS})")
    print(f"ratio                        : {ratio:8.3f}  (target <= {TARGET})")
    figure("metrics tick / prometheus_client full parse", f"{ratio:.3f}", f"≤ {TARGET:g}", ratio <= TARGET)
    return 0 if ratio <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
