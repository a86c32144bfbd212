"""vLLM /metrics normalization (DESIGN §4.3) on recorded pages and older-version excerpts."""

from __future__ import annotations

from pathlib import Path

import pytest

from tunerd.sources.vllm_metrics import CounterRates, MetricsSnapshot, parse

DATA = Path(__file__).parents[2] / "data"
EXCERPTS = DATA / "vllm-excerpts"

# Two data-parallel engines in vLLM 0.33's line formats (labels sorted, `engine` per rank,
# num_gpu_blocks summed over ranks as vLLM reports it). Built for this test from the formats
# of reference/vllm-facts.md §1; not a recording.
DP_PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 5.0
vllm:num_requests_waiting{engine="0",model_name="m"} 0.0
vllm:num_requests_waiting{engine="1",model_name="m"} 4.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 0.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="deferred"} 0.0
vllm:num_requests_waiting_by_reason{engine="1",model_name="m",reason="capacity"} 3.0
vllm:num_requests_waiting_by_reason{engine="1",model_name="m",reason="deferred"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.41
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.97
vllm:num_preemptions_total{engine="0",model_name="m"} 2.0
vllm:num_preemptions_created{engine="0",model_name="m"} 1.7537953269353123e+09
vllm:num_preemptions_total{engine="1",model_name="m"} 40.0
vllm:prompt_tokens_total{engine="0",model_name="m"} 1000.0
vllm:prompt_tokens_total{engine="1",model_name="m"} 3000.0
vllm:generation_tokens_total{engine="0",model_name="m"} 10.0
vllm:generation_tokens_total{engine="1",model_name="m"} 30.0
vllm:cache_config_info{block_size="16",cache_dtype="fp8",engine="0",gpu_memory_utilization="0.92",kv_cache_size_tokens="None",num_gpu_blocks="20000"} 1.0
vllm:cache_config_info{block_size="16",cache_dtype="fp8",engine="1",gpu_memory_utilization="0.92",kv_cache_size_tokens="None",num_gpu_blocks="20000"} 1.0
"""


def _excerpt(name: str) -> MetricsSnapshot:
    return parse((EXCERPTS / name).read_text())


class TestOlderVersions:
    def test_parse_v1_early_no_engine_label_old_usage_name(self) -> None:
        """production-stack#318 (early V1): no `engine` label, `vllm:gpu_cache_usage_perc`."""
        snapshot = _excerpt("m3-early-v1-no-engine-label.txt")
        assert snapshot.ok
        assert snapshot.engine_count == 1
        assert snapshot.engines[0].engine == "0"
        assert (snapshot.kv_cache_usage, snapshot.num_requests_running, snapshot.num_requests_waiting) == (
            0.0,
            0,
            0,
        )
        assert snapshot.num_requests_waiting_capacity is None  # the family did not exist yet
        assert snapshot.kv_cache_size_tokens is None

    def test_parse_v0_capacity_from_blocks(self) -> None:
        """PR #3100 (v0.3): capacity = num_gpu_blocks × block_size."""
        snapshot = _excerpt("m1-v0.3-cache-config.txt")
        assert snapshot.kv_cache_size_tokens == 24188 * 16
        assert (snapshot.num_gpu_blocks, snapshot.block_size) == (24188, 16)
        assert snapshot.gpu_memory_utilization == 0.9
        assert snapshot.cache_dtype == "auto"

    def test_parse_blocks_none_capacity_null(self) -> None:
        snapshot = _excerpt("m4-v0.8-cache-config-blocks-none.txt")
        assert snapshot.num_gpu_blocks is None
        assert snapshot.kv_cache_size_tokens is None
        assert snapshot.gpu_memory_utilization == 0.85

    def test_parse_created_series_ignored(self) -> None:
        snapshot = _excerpt("m5-v0.10-created-and-prefix.txt")
        assert snapshot.kv_cache_usage == pytest.approx(9.75010481363281e-06)
        assert snapshot.num_preemptions_total is None

    def test_parse_v011_cache_config_with_engine(self) -> None:
        snapshot = _excerpt("m6-v0.11-cache-config.txt")
        assert snapshot.kv_cache_size_tokens == 9271 * 16
        assert snapshot.gpu_memory_utilization == 0.65

    def test_parse_docs_sample(self) -> None:
        snapshot = _excerpt("m7-v1-docs.txt")
        assert snapshot.num_requests_running == 8
        assert snapshot.generation_tokens_total == 27453
        assert snapshot.model_name == "meta-llama/Llama-3.1-8B-Instruct"

    def test_parse_page_without_needed_families_reported(self) -> None:
        snapshot = _excerpt("m2-v0.5.3-counters.txt")
        assert not snapshot.ok
        assert snapshot.problems == (
            "no vLLM metrics on the page (is this vLLM's /metrics, with log stats on?)",
        )

    def test_parse_both_usage_names_new_wins(self) -> None:
        """v0.10 emitted the deprecated name next to the new one."""
        page = 'vllm:gpu_cache_usage_perc{engine="0"} 0.1\nvllm:kv_cache_usage_perc{engine="0"} 0.7\n'
        assert parse(page).kv_cache_usage == 0.7
        assert parse("\n".join(reversed(page.splitlines()))).kv_cache_usage == 0.7


class TestDataParallel:
    def test_parse_several_engines_sum_max_and_per_engine_capacity(self) -> None:
        snapshot = parse(DP_PAGE)
        assert snapshot.ok
        assert snapshot.engine_count == 2
        assert snapshot.num_requests_running == 8
        assert snapshot.num_requests_waiting == 4
        assert snapshot.num_requests_waiting_capacity == 3
        assert snapshot.kv_cache_usage == 0.97  # the hot engine, not the mean
        assert snapshot.num_preemptions_total == 42
        assert [e.kv_cache_size_tokens for e in snapshot.engines] == [160_000, 160_000]
        assert snapshot.kv_cache_size_tokens == 320_000
        assert snapshot.cache_dtype == "fp8"

    def test_parse_label_escapes_and_order(self) -> None:
        page = 'vllm:num_requests_running{model_name="a \\"quoted\\" \\\\ name",engine="2"} 1\n'
        snapshot = parse(page)
        assert snapshot.model_name == 'a "quoted" \\ name'
        assert snapshot.engines[0].engine == "2"


class TestJunk:
    @pytest.mark.parametrize(
        "page",
        [
            "<html><body>502 Bad Gateway</body></html>",
            'vllm:num_requests_running{engine="0" 3.0',
            'vllm:num_requests_running{engine="0"} three',
            'vllm:kv_cache_usage_perc{engine="0"} 0.5 123 456',
            "\x00\x01\x02",
        ],
    )
    def test_parse_junk_reported_not_raised(self, page: str) -> None:
        snapshot = parse(page)
        assert not snapshot.ok
        assert snapshot.problems

    def test_parse_nan_gauge_is_none(self) -> None:
        assert parse('vllm:kv_cache_usage_perc{engine="0"} NaN\n').kv_cache_usage is None

    def test_parse_openmetrics_page(self) -> None:
        page = (
            "# TYPE vllm:num_preemptions counter\n"
            'vllm:num_preemptions_total{engine="0",model_name="m"} 7.0\n'
            'vllm:num_preemptions_created{engine="0",model_name="m"} 1.7e+09\n'
            "# EOF\n"
        )
        snapshot = parse(page)
        assert snapshot.ok
        assert snapshot.num_preemptions_total == 7


class TestRates:
    def _snap(self, preemptions: float, prompt: float) -> MetricsSnapshot:
        return parse(
            f'vllm:num_preemptions_total{{engine="0"}} {preemptions}\n'
            f'vllm:prompt_tokens_total{{engine="0"}} {prompt}\n'
        )

    def test_rates_per_second_within_generation(self) -> None:
        rates = CounterRates()
        assert rates.update(self._snap(0, 100), now=10.0, generation=1)["prompt_tokens_total"] is None
        second = rates.update(self._snap(4, 1100), now=12.0, generation=1)
        assert second["prompt_tokens_total"] == 500.0
        assert second["num_preemptions_total"] == 2.0
        assert second["generation_tokens_total"] is None  # absent on the page

    def test_rates_never_span_generations(self) -> None:
        rates = CounterRates()
        rates.update(self._snap(10, 5000), now=10.0, generation=1)
        after_restart = rates.update(self._snap(0, 50), now=12.0, generation=2)
        assert after_restart == dict.fromkeys(after_restart)
        assert rates.update(self._snap(1, 150), now=14.0, generation=2)["prompt_tokens_total"] == 50.0

    def test_rates_counter_going_down_is_a_reset(self) -> None:
        rates = CounterRates()
        rates.update(self._snap(10, 5000), now=10.0, generation=1)
        assert rates.update(self._snap(0, 10), now=12.0, generation=1)["num_preemptions_total"] is None


def test_rates_between_two_recorded_pages() -> None:
    """Two scrapes of one engine under load, requested 1.708 s apart (PROVENANCE.md)."""
    vllm = DATA / "vllm"
    rates = CounterRates()
    rates.update(parse((vllm / "metrics-0.32-load.txt").read_text()), now=100.0, generation=1)
    second = rates.update(parse((vllm / "metrics-0.32-load-2.txt").read_text()), now=101.708, generation=1)
    assert second["prompt_tokens_total"] == pytest.approx((7217 - 6015) / 1.708)
    assert second["generation_tokens_total"] == pytest.approx((4137 - 3039) / 1.708)
    assert second["num_preemptions_total"] == pytest.approx(1 / 1.708)


def _line(name: str, value: str, engine: str = "0") -> str:
    return f'{name}{{engine="{engine}",model_name="m"}} {value}\n'


class TestOutOfRange:
    """Values no engine reports (usage outside [0, 1], negative counts, NaN, ±Inf, counts past
    2**63) passed through to the policies (issue 16, item 14): each is dropped — the field is
    null — and counted by reason in ``dropped``."""

    @pytest.mark.parametrize(
        ("name", "value", "field", "reason"),
        [
            ("vllm:kv_cache_usage_perc", "1.5", "kv_cache_usage", "outside [0, 1]"),
            ("vllm:kv_cache_usage_perc", "-0.01", "kv_cache_usage", "outside [0, 1]"),
            ("vllm:gpu_cache_usage_perc", "7", "kv_cache_usage", "outside [0, 1]"),
            ("vllm:kv_cache_usage_perc", "NaN", "kv_cache_usage", "not finite"),
            ("vllm:num_requests_waiting", "-3", "num_requests_waiting", "negative"),
            ("vllm:num_requests_running", "-1", "num_requests_running", "negative"),
            ("vllm:num_requests_running", "nan", "num_requests_running", "not finite"),
            ("vllm:num_preemptions_total", "-2", "num_preemptions_total", "negative"),
            ("vllm:prompt_tokens_total", "1e300", "prompt_tokens_total", "above 2**63"),
            ("vllm:generation_tokens_total", "NaN", "generation_tokens_total", "not finite"),
        ],
    )
    def test_parse_out_of_range_value_dropped_and_counted(
        self, name: str, value: str, field: str, reason: str
    ) -> None:
        snapshot = parse(_line(name, value))
        assert getattr(snapshot, field) is None
        assert snapshot.engine_count == 1  # the engine answered; one of its values is unusable
        assert snapshot.dropped == {f"{name}: {reason}": 1}
        assert snapshot.to_dict()["dropped"] == {f"{name}: {reason}": 1}

    def test_parse_waiting_capacity_negative_dropped(self) -> None:
        page = 'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} -4\n'
        snapshot = parse(page)
        assert snapshot.num_requests_waiting_capacity is None
        assert snapshot.dropped == {"vllm:num_requests_waiting_by_reason: negative": 1}

    def test_parse_infinite_value_still_a_problem_and_counted(self) -> None:
        snapshot = parse(_line("vllm:kv_cache_usage_perc", "+Inf") + _line("vllm:num_requests_running", "2"))
        assert snapshot.kv_cache_usage is None
        assert snapshot.problems
        assert snapshot.dropped == {"vllm:kv_cache_usage_perc: not finite": 1}

    def test_parse_data_parallel_hot_engine_out_of_range_not_the_maximum(self) -> None:
        page = DP_PAGE.replace('engine="1",model_name="m"} 0.97', 'engine="1",model_name="m"} 97.0')
        snapshot = parse(page)
        assert snapshot.kv_cache_usage == 0.41
        assert snapshot.engines[1].kv_cache_usage is None
        assert snapshot.dropped == {"vllm:kv_cache_usage_perc: outside [0, 1]": 1}

    def test_parse_counters_past_2_63_cannot_sum_to_infinity(self) -> None:
        page = _line("vllm:prompt_tokens_total", "1.7e308") + _line(
            "vllm:prompt_tokens_total", "1.7e308", "1"
        )
        snapshot = parse(page)
        assert snapshot.prompt_tokens_total is None
        assert snapshot.dropped == {"vllm:prompt_tokens_total: above 2**63": 2}

    @pytest.mark.parametrize(
        ("labels", "field", "dropped"),
        [
            ('gpu_memory_utilization="1.5"', "gpu_memory_utilization", "outside (0, 1]"),
            ('gpu_memory_utilization="0"', "gpu_memory_utilization", "outside (0, 1]"),
            ('gpu_memory_utilization="inf"', "gpu_memory_utilization", "not finite"),
            ('num_gpu_blocks="1e300",block_size="16"', "num_gpu_blocks", "above 2**63"),
            ('kv_cache_size_tokens="-4096"', "kv_cache_size_tokens", "negative"),
        ],
    )
    def test_parse_cache_config_label_out_of_range_dropped(
        self, labels: str, field: str, dropped: str
    ) -> None:
        key = labels.split("=", maxsplit=1)[0]
        snapshot = parse(f'vllm:cache_config_info{{engine="0",{labels}}} 1.0\n')
        assert getattr(snapshot, field) is None
        assert snapshot.kv_cache_size_tokens is None
        assert snapshot.dropped == {f"vllm:cache_config_info {key}: {dropped}": 1}

    @pytest.mark.parametrize("value", ["1_000", "٣", "１", "0x1F", "infinity_", "1e", "--1"])
    def test_parse_value_not_a_prometheus_number_is_a_problem(self, value: str) -> None:
        """float() takes 1_000 and non-ASCII digits; the exposition format does not."""
        snapshot = parse(_line("vllm:num_requests_running", value))
        assert snapshot.num_requests_running is None
        assert snapshot.problems

    def test_parse_recorded_pages_drop_nothing(self) -> None:
        pages = sorted(EXCERPTS.glob("*.txt")) + sorted((DATA / "vllm").glob("metrics-*.txt"))
        assert pages
        for page in pages:
            assert parse(page.read_text()).dropped == {}, page.name
