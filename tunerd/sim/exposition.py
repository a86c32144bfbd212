"""The simulator's request and step metrics: every ``vllm:`` family vLLM 0.32's API server
exposes besides the scheduler gauges (``tunerd.sim.server``'s collector), with vLLM's names,
types, label sets and bucket boundaries — so a page of the simulator and a page of the real
engine have the same families (``tests/integration/test_sim.py`` diffs them against a page
recorded from the CPU build under load).

Mirrors vLLM 0.32.0 ``v1/metrics/loggers.py`` (``PrometheusStatLogger``) and
``v1/metrics/buckets.py`` (the bucket families). What the simulator does not model — prefix
cache hits, KV transfer, multi-modal caches, MFU estimates, sleep mode — is exported as vLLM
exports an engine that does none of it: zeros, ``awake`` 1.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tunerd.sim.engine import Request

__all__ = ["RequestMetrics", "request_token_buckets"]

# v1/metrics/buckets.py
# fmt: off
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
    960.0, 1920.0, 7680.0,
)
TIME_TO_FIRST_TOKEN_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
    80.0, 160.0, 640.0, 2560.0,
)
INTER_TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
# fmt: on
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")  # vLLM's FinishReason
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
CACHE_TIERS = ("device", "host", "disk", "p2p", "external_unspecified")
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")


def request_token_buckets(max_model_len: int) -> list[float]:
    """vLLM's ``build_1_2_5_buckets(max_model_len)``: 1, 2, 5, 10, 20, 50, … up to the
    longest request (the token histograms of a 2,048-token engine end at 2,000)."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_model_len:
                return buckets
            buckets.append(float(value))
        exponent += 1


class RequestMetrics:
    """What the engine reports of each finished request and each step, in ``registry``."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int) -> None:
        self.labels = ("0", model_name)  # engine, model_name
        names = ["engine", "model_name"]
        tokens = request_token_buckets(max_model_len)

        def histogram(name: str, doc: str, buckets: Any) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=registry)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*names, *extra], registry=registry)

        self.prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens
        )
        self.generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", tokens
        )
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            ITERATION_TOKENS_BUCKETS,
        )
        self.max_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            tokens,
        )
        self.params_n = histogram(
            "vllm:request_params_n", "Histogram of the n request parameter.", REQUEST_PARAMS_N_BUCKETS
        )
        self.params_max_tokens = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", tokens
        )
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TIME_TO_FIRST_TOKEN_BUCKETS,
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            INTER_TOKEN_LATENCY_BUCKETS,
        )
        self.tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            INTER_TOKEN_LATENCY_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.queue = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.inference = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.preemptions = histogram(
            "vllm:request_num_preemptions",
            "Histogram of the number of times a request was preempted.",
            REQUEST_NUM_PREEMPTIONS_BUCKETS,
        )
        self.prefill_kv_computed = histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            tokens,
        )
        self.success = counter(
            "vllm:request_success", "Count of successfully processed requests.", ("finished_reason",)
        )
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.by_source = counter(
            "vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", ("source",)
        )
        self.cached = counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        )
        self.cached_by_source = counter(
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them.",
            ("source",),
        )
        self.sleep_state = Gauge(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake.",
            [*names, "sleep_state"],
            registry=registry,
        )
        not_modelled = (  # kept at zero: the simulator does none of it
            ("vllm:external_prefix_cache_queries", "External prefix cache queries from KV connector."),
            ("vllm:external_prefix_cache_hits", "External prefix cache hits from KV connector."),
            ("vllm:mm_cache_queries", "Multi-modal cache queries, in terms of number of queried items."),
            ("vllm:mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items."),
            ("vllm:estimated_flops_per_gpu", "Estimated number of floating point operations per GPU."),
            ("vllm:estimated_read_bytes_per_gpu", "Estimated number of bytes read from memory per GPU."),
            ("vllm:estimated_write_bytes_per_gpu", "Estimated number of bytes written to memory per GPU."),
        )
        for name, doc in not_modelled:
            counter(name, doc).labels(*self.labels)
        # vLLM creates every labelled child at start-up: the page lists them before any request
        for reason in FINISH_REASONS:
            self.success.labels(*self.labels, reason)
        for source in PROMPT_SOURCES:
            self.by_source.labels(*self.labels, source)
        for tier in CACHE_TIERS:
            self.cached_by_source.labels(*self.labels, tier)
        self.cached.labels(*self.labels)
        self.prefix_hits.labels(*self.labels)
        for state in SLEEP_STATES:
            self.sleep_state.labels(*self.labels, state).set(1 if state == "awake" else 0)
        for family in self._histograms():
            family.labels(*self.labels)

    def _histograms(self) -> Iterator[Histogram]:
        yield from (value for value in vars(self).values() if isinstance(value, Histogram))

    def step(self, tokens: int) -> None:
        """One engine step that scheduled ``tokens`` tokens."""
        if tokens > 0:
            self.iteration_tokens.labels(*self.labels).observe(tokens)

    def finished(self, request: Request) -> None:
        """A request that ended: its phases, its tokens, its finish reason."""
        labels = self.labels
        reason = request.finish_reason or ("abort" if request.error else "stop")
        self.success.labels(*labels, reason if reason in FINISH_REASONS else "error").inc()
        self.prompt_tokens.labels(*labels).observe(request.prompt_tokens)
        self.generation_tokens.labels(*labels).observe(request.generated)
        self.max_generation_tokens.labels(*labels).observe(request.max_tokens)
        self.params_max_tokens.labels(*labels).observe(request.max_tokens)
        self.params_n.labels(*labels).observe(1)
        self.preemptions.labels(*labels).observe(request.preemptions)
        self.prefix_queries.labels(*labels).inc(request.prompt_tokens)
        self.by_source.labels(*labels, "local_compute").inc(request.prompt_tokens)
        if request.scheduled_at is not None:
            self.prefill_kv_computed.labels(*labels).observe(request.prompt_tokens)
            self.queue.labels(*labels).observe(request.scheduled_at - request.arrival)
        if request.first_token_at is not None:
            self.ttft.labels(*labels).observe(request.first_token_at - request.arrival)
            if request.scheduled_at is not None:
                self.prefill.labels(*labels).observe(request.first_token_at - request.scheduled_at)
        if request.finished_at is None:
            return
        self.e2e.labels(*labels).observe(request.finished_at - request.arrival)
        if request.scheduled_at is not None:
            self.inference.labels(*labels).observe(request.finished_at - request.scheduled_at)
        if request.first_token_at is not None:
            decode = request.finished_at - request.first_token_at
            self.decode.labels(*labels).observe(decode)
            if request.generated > 1:
                per_token = decode / (request.generated - 1)
                self.tpot.labels(*labels).observe(per_token)
                itl = self.itl.labels(*labels)
                for _ in range(request.generated - 1):
                    itl.observe(per_token)
