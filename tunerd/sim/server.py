"""``tunerd sim serve``: the simulated engine behind vLLM's HTTP API, on a simulated clock.

The engine (:mod:`tunerd.sim.engine`) is pure; this module gives it a clock, a thread that
runs its steps, an HTTP server with vLLM's endpoints (plus ``/sim/gpu`` and ``/sim/clock``),
a Prometheus registry with vLLM 0.33's metric names, and vLLM's log lines on stderr.

Simulated time is the process's monotonic time multiplied by ``--time-scale`` (start-up,
steps, drift, neighbours and ``--shutdown-timeout`` all follow it). Like vLLM, the port opens
only when start-up has finished; a CUDA OOM kills the engine (``/health`` answers 503 for a
few seconds, then the process exits 1); SIGTERM drains requests in flight for up to
``--shutdown-timeout`` and exits 0.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import IO, Any
from urllib.parse import parse_qsl

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tunerd.planner.bills import KV_DTYPE_WORDS, VLLM_KV_DTYPE
from tunerd.sim.board import GpuBoard
from tunerd.sim.box import Box
from tunerd.sim.engine import (
    CudaOutOfMemory,
    EngineSettings,
    Neighbour,
    Request,
    SimEngine,
    SimGpu,
    StartupFailure,
)
from tunerd.sim.exposition import RequestMetrics
from tunerd.sim.logtext import VLLM_VERSION, LogFormat, gib, oom_lines, startup_failure_lines
from tunerd.sim.truth import TruthLoad, safe_max
from tunerd.units import GIB

__all__ = ["ServeOptions", "SimClock", "SimServer"]

STATS_INTERVAL_S = 10.0  # VLLM_LOG_STATS_INTERVAL, in simulated seconds
BOARD_INTERVAL_S = 0.05  # how often a shared card's board is read and written (wall seconds)
DEATH_LINGER_S = 5.0  # the API server's watchdog notices a dead engine within 5 s


class SimClock:
    """Simulated seconds since start: monotonic wall time × ``scale``."""

    def __init__(self, scale: float, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.scale = scale
        self._monotonic = monotonic
        self._start = monotonic()

    def now(self) -> float:
        return (self._monotonic() - self._start) * self.scale

    def sleep(self, simulated_seconds: float, interrupt: threading.Event | None = None) -> None:
        """Sleep; an ``interrupt`` that is set wakes it early (a SIGTERM during start-up)."""
        if simulated_seconds <= 0:
            return
        if interrupt is None:
            time.sleep(simulated_seconds / self.scale)
        else:
            interrupt.wait(simulated_seconds / self.scale)


@dataclass(frozen=True)
class ServeOptions:
    host: str
    port: int
    served_model_name: str
    model: str
    shutdown_timeout: float
    startup_seconds: float
    non_default_args: dict[str, Any]
    #: vLLM 0.32+'s admission control (``--max-num-queued-reqs/-tokens``): None, no limit
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None


class _Metrics(Collector):
    """vLLM 0.33's gauges and counters, read from the engine at scrape time."""

    def __init__(self, server: SimServer) -> None:
        self._server = server

    def collect(self) -> Iterator[Any]:
        server = self._server
        engine = server.engine
        labels = ["engine", "model_name"]
        values = ["0", server.options.served_model_name]
        with server.lock:
            running = len(engine.running)
            waiting = len(engine.waiting)
            usage = engine.kv_cache_usage
            counters = (engine.preemptions_total, engine.prompt_tokens_total, engine.generation_tokens_total)
        for name, doc, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.", running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage),
        ):
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            yield family
        by_reason = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason",
            "Number of requests waiting, by reason.",
            labels=[*labels, "reason"],
        )
        by_reason.add_metric([*values, "capacity"], waiting)
        by_reason.add_metric([*values, "deferred"], 0)
        yield by_reason
        for name, doc, value in zip(
            ("vllm:num_preemptions", "vllm:prompt_tokens", "vllm:generation_tokens"),
            (
                "Cumulative number of preemption from the engine.",
                "Number of prefill tokens processed.",
                "Number of generation tokens processed.",
            ),
            counters,
            strict=True,
        ):
            counter = CounterMetricFamily(name, doc, labels=labels)
            counter.add_metric(values, value)
            yield counter
        # 0.32 v1/metrics/loggers.py:847: model_name and reason only, no engine label
        rejections = CounterMetricFamily(
            "vllm:admission_rejections",
            "Number of admission attempts rejected by a queue limit, by reason.",
            labels=["model_name", "reason"],
        )
        for reason, count in sorted(server.admission_rejections.items()):
            rejections.add_metric([server.options.served_model_name, reason], count)
        yield rejections
        info = server.cache_config_labels()
        cache = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=sorted(info)
        )
        cache.add_metric([info[key] for key in sorted(info)], 1)
        yield cache


class _HttpServer(ThreadingHTTPServer):
    """The API server's socket: uvicorn's listen backlog (2048), not socketserver's 5, which
    reset connections when 64 clients connected at once (measured: 5–25 in 2,000 requests)."""

    request_queue_size = 2048


class SimServer:
    """One simulated vLLM engine: start-up, serving, death and drain."""

    def __init__(
        self,
        engine_factory: Callable[[float], SimEngine],
        options: ServeOptions,
        clock: SimClock,
        log_stream: IO[str] = sys.stderr,
        *,
        board: GpuBoard | None = None,
        gpu: SimGpu | None = None,
        box: Box | None = None,
        truth_engine: Callable[[EngineSettings, float, int], SimEngine] | None = None,
    ) -> None:
        self._engine_factory = engine_factory
        self._board = board  # a card shared with other simulated engines (with ``gpu``)
        self._gpu = gpu
        self.box = box
        #: makes a worst-case engine of given settings on this box (``/sim/truth``)
        self._truth_engine = truth_engine
        #: the largest load seen: (unfinished requests at once, prompt tokens, max_tokens)
        self.load_seen = (0, 0, 0)
        self.options = options
        self.clock = clock
        self.pid = os.getpid()
        self.log = LogFormat(api_pid=self.pid, engine_pid=self.pid)
        self._stream = log_stream
        self.lock = threading.Condition()
        self.engine: SimEngine = None  # type: ignore[assignment]  # set by run()
        self._requests: dict[str, Request] = {}
        self._stopping = threading.Event()
        self._arrived = threading.Event()  # a request came: an idle engine loop steps at once
        self._draining = False
        self.exit_code = 0
        #: reason → requests refused by admission control (vllm:admission_rejections_total)
        self.admission_rejections = {"max_num_queued_reqs": 0, "max_num_queued_tokens": 0}
        self.registry = CollectorRegistry(auto_describe=False)
        #: the request and step histograms and counters; made once the engine's max_model_len
        #: is known (the token histograms' buckets end there)
        self.metrics: RequestMetrics | None = None
        self.httpd: ThreadingHTTPServer | None = None

    # -- logging --------------------------------------------------------------------------
    def emit(self, *lines: str) -> None:
        for line in lines:
            self._stream.write(line + "\n")
        self._stream.flush()

    # -- start-up -------------------------------------------------------------------------
    def _start(self) -> bool:
        options = self.options
        # 0.32/0.33 entrypoints/serve/utils/api_utils.py:327 (plain: VLLM_DISABLE_LOG_LOGO)
        self.emit(
            self.log.line(
                f"vLLM server version {VLLM_VERSION}, serving model {options.model} (tunerd simulator)",
                source="api_utils.py:327",
            )
        )
        self.emit(self.log.line(f"non-default args: {options.non_default_args}", source="api_utils.py:286"))
        try:
            self.engine = self._engine_factory(self.clock.now())
        except StartupFailure as failure:
            if failure.kind == "invalid_config":
                self.emit(*(self.log.line(line, level="ERROR") for line in failure.lines))
            else:
                self.clock.sleep(options.startup_seconds * 0.5, self._stopping)  # loads and profiles first
                self.emit(*startup_failure_lines(self.log, failure.lines))
            return False
        engine = self.engine
        self.metrics = RequestMetrics(self.registry, options.served_model_name, engine.max_model_len)
        self.emit(
            self.log.engine(
                f"Initializing a V1 LLM engine (v{VLLM_VERSION}) with config: "
                f"model='{options.model}', max_seq_len={engine.max_model_len}, "
                f"kv_cache_dtype={engine.settings.kv_cache_dtype}"
            )
        )
        self.clock.sleep(options.startup_seconds * 0.4, self._stopping)
        if self._stopping.is_set():
            return False
        self.emit(
            self.log.engine(
                f"Model loading took {gib(engine.weights.bytes)} GiB memory and "
                f"{options.startup_seconds * 0.4:.6f} seconds",
                source="gpu_model_runner.py:5089",
            )
        )
        self.clock.sleep(options.startup_seconds * 0.2, self._stopping)
        if self._stopping.is_set():
            return False
        if not engine.settings.enforce_eager:
            self.emit(
                self.log.engine(
                    f"Estimated CUDA graph memory: {engine.runtime.cuda_graph_bytes / GIB:.2f} GiB total",
                    source="gpu_model_runner.py:6410",
                )
            )
        if engine.settings.kv_cache_memory_bytes is not None:
            self.emit(
                self.log.engine(
                    f"reserved {gib(engine.pool.available_bytes)} GiB memory for KV Cache as specified by "
                    f"kv_cache_memory_bytes config and skipped memory profiling.",
                    source="gpu_worker.py:300",
                )
            )
        else:
            self.emit(
                self.log.engine(
                    f"Available KV cache memory: {gib(engine.pool.available_bytes)} GiB",
                    source="gpu_worker.py:773",
                )
            )
        self.emit(
            self.log.engine(
                f"GPU KV cache size: {engine.pool.tokens:,} tokens, Maximum concurrency for "
                f"{engine.max_model_len:,} tokens per request: {engine.pool.max_concurrency:.2f}x",
                source="kv_cache_utils.py:1148",
            )
        )
        self.clock.sleep(options.startup_seconds * 0.4, self._stopping)
        if self._stopping.is_set():
            return False
        if not engine.settings.enforce_eager:
            self.emit(
                self.log.engine(
                    f"Graph capturing finished in {options.startup_seconds * 0.3:.0f} secs, took "
                    f"{engine.runtime.cuda_graph_bytes / GIB:.2f} GiB",
                    source="gpu_model_runner.py:6517",
                )
            )
        self.emit(
            self.log.engine(
                f"init engine (profile, create kv cache, warmup model) took "
                f"{options.startup_seconds:.2f} seconds",
                source="core.py:402",
            )
        )
        return True

    # -- serving --------------------------------------------------------------------------
    def submit(self, request: Request) -> None:
        with self.lock:
            self._requests[request.id] = request
            self.engine.submit(request)
            engine = self.engine
            at_once, prompt, out = self.load_seen
            self.load_seen = (
                max(at_once, len(engine.running) + len(engine.waiting)),
                max(prompt, request.prompt_tokens),
                max(out, request.max_tokens),
            )
            self.lock.notify_all()
        self._arrived.set()

    def _engine_loop(self) -> None:
        next_stats = self.clock.now() + STATS_INTERVAL_S
        last_prompt = last_generation = 0
        while not self._stopping.is_set():
            duration = 0.0
            with self.lock:
                now = self.clock.now()
                try:
                    self.engine.tick(now)
                    result = self.engine.step(now) if self.engine.has_work else None
                except CudaOutOfMemory as oom:
                    self._die(oom)
                    return
                if result is not None:
                    duration = result.duration
                    self._observe_step(result.tokens)
                    for request in result.finished:
                        self._observe(request)
                    self.lock.notify_all()
                if now >= next_stats:
                    engine = self.engine
                    elapsed = STATS_INTERVAL_S
                    prompt_rate = (engine.prompt_tokens_total - last_prompt) / elapsed
                    generation_rate = (engine.generation_tokens_total - last_generation) / elapsed
                    self.emit(
                        self.log.line(
                            f"Engine 000: Avg prompt throughput: {prompt_rate:.1f} tokens/s, Avg generation "
                            f"throughput: {generation_rate:.1f} tokens/s, "
                            f"Running: {len(engine.running)} reqs, "
                            f"Waiting: {len(engine.waiting)} reqs, GPU KV cache usage: "
                            f"{engine.kv_cache_usage * 100:.1f}%, Prefix cache hit rate: 0.0%",
                            source="loggers.py:257",
                        )
                    )
                    last_prompt, last_generation = engine.prompt_tokens_total, engine.generation_tokens_total
                    next_stats = now + STATS_INTERVAL_S
            if duration > 0:
                self.clock.sleep(duration)
            else:  # idle: wake for the next request at once (vLLM's busy loop does), else soon
                self.clock.sleep(0.05 * self.clock.scale / 20, self._arrived)
                self._arrived.clear()  # a request that came meanwhile is found by the next step

    def _observe(self, request: Request) -> None:
        if self.metrics is not None:
            self.metrics.finished(request)

    def _observe_step(self, tokens: int) -> None:
        if self.metrics is not None:
            self.metrics.step(tokens)

    def _die(self, oom: CudaOutOfMemory) -> None:
        """Called with the lock held: print vLLM's OOM text, fail everything, exit soon."""
        self.emit(*oom_lines(self.log, oom))
        self.engine.abort_all("EngineCore encountered an issue. See stack trace (above) for the root cause.")
        self.lock.notify_all()
        self.exit_code = 1
        threading.Thread(target=self._exit_after_death, daemon=True).start()

    def _exit_after_death(self) -> None:
        self.clock.sleep(DEATH_LINGER_S)
        self.emit(
            self.log.line(
                "[shutdown] API server: engine dead, shutting down", level="ERROR", source="launcher.py:110"
            )
        )
        self._shutdown_http()

    def cache_config_labels(self) -> dict[str, str]:
        """``vllm:cache_config_info``'s labels: vLLM 0.32's whole set (the CPU build's recorded
        page, tests/data/vllm/metrics-0.32-load.txt), at a GPU engine's values."""
        engine = self.engine
        settings = engine.settings
        memory_bytes = settings.kv_cache_memory_bytes
        return {
            "_block_size_resolved": "True",
            "block_size": "16",
            "cache_dtype": VLLM_KV_DTYPE.get(settings.kv_cache_dtype, settings.kv_cache_dtype),
            "cache_hit_alignment_tokens": "None",
            "effective_attention_block_size": "16",
            "enable_mamba_shared_prefix_checkpoint": "False",
            "enable_prefix_caching": str(settings.enable_prefix_caching),
            "engine": "0",
            "gpu_memory_utilization": str(settings.gpu_memory_utilization),
            "hash_block_size": "None",
            "is_attention_free": "False",
            "kv_cache_dtype_skip_layers": "[]",
            "kv_cache_layout": "None",
            "kv_cache_max_concurrency": str(round(engine.pool.max_concurrency, 2)),
            "kv_cache_memory_bytes": str(memory_bytes) if memory_bytes is not None else "None",
            "kv_cache_size_tokens": str(int(engine.pool.max_concurrency * engine.max_model_len)),
            "kv_offloading_backend": "native",
            "kv_offloading_size": "None",
            "kv_sharing_fast_prefill": "False",
            "mamba_block_size": "None",
            "mamba_cache_dtype": "auto",
            "mamba_cache_mode": "none",
            "mamba_page_size_padded": "None",
            "mamba_ssm_cache_dtype": "float32",
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(engine.num_blocks),
            "num_gpu_blocks_override": "None",
            "prefix_cache_retention_interval": "0",
            "prefix_caching_hash_algo": "sha256",
            "prefix_match_unit": "None",
            "replayssm_buffer_len": "16",
            "skip_page_size_padded": "None",
            "sliding_window": "None",
            "swa_bounded_replay": "True",
            "use_kda_recoverssm": "False",
            "use_replayssm": "False",
            "user_specified_block_size": "False",
        }

    # -- HTTP -----------------------------------------------------------------------------
    def _shutdown_http(self) -> None:
        self._stopping.set()
        if self.httpd is not None:
            threading.Thread(target=self.httpd.shutdown, daemon=True).start()

    def drain(self) -> None:
        """SIGTERM: refuse new requests, finish those in flight within the timeout, stop."""
        if self._draining:
            return
        self._draining = True
        if self.httpd is None:  # still starting: nothing to drain, stop now
            self._stopping.set()
            return
        threading.Thread(target=self._drain, daemon=True, name="tunerd-sim-drain").start()

    def _drain(self) -> None:
        timeout = self.options.shutdown_timeout
        with self.lock:
            count = len(self.engine.running) + len(self.engine.waiting) if self.engine else 0
        self.emit(
            self.log.line("[shutdown] API server: shutdown triggered", source="launcher.py:254"),
            self.log.line(
                f"[shutdown] API server: stopping engine client mode="
                f"{'drain' if timeout > 0 else 'abort'} timeout={timeout:g}s",
                source="launcher.py:270",
            ),
            self.log.engine("[shutdown] EngineCore: trigger received signal=SIGTERM", source="core.py:1454"),
        )
        if timeout > 0 and count:
            self.emit(
                self.log.engine(
                    f"[shutdown] EngineCore: draining in-flight requests count={count} timeout={timeout:g}s",
                    source="core.py:1655",
                )
            )
            deadline = self.clock.now() + timeout
            with self.lock:
                while self.engine.has_work and self.clock.now() < deadline and not self.engine.dead:
                    self.lock.wait(timeout=0.05)
        with self.lock:
            if self.engine is not None and self.engine.has_work:
                self.engine.abort_all("the server is shutting down")
            self.lock.notify_all()
        self.emit(
            self.log.engine(
                "[shutdown] EngineCore: request processing complete; starting resource teardown",
                source="core.py:1666",
            )
        )
        self._shutdown_http()

    def run(self) -> int:
        """Start (or fail like vLLM), serve until death or SIGTERM; the process exit code."""
        signal.signal(signal.SIGTERM, lambda *_: self.drain())
        signal.signal(signal.SIGINT, lambda *_: self.drain())
        if self._board is None:
            return self._run()
        self._share()  # the start-up check sees the other engines on the card
        threading.Thread(target=self._share_loop, name="tunerd-sim-board", daemon=True).start()
        try:
            return self._run()
        finally:
            self._stopping.set()
            self._board.leave()

    def _share(self) -> None:
        """Post what this engine holds on the shared card; take in what the others hold."""
        assert self._board is not None
        assert self._gpu is not None
        with self.lock:
            mine = self.engine.engine_bytes() if self.engine is not None else 0
        held = self._board.exchange(mine)
        with self.lock:
            self._gpu.peers = [Neighbour(pid, "python3", size) for pid, size in sorted(held.items())]

    def _share_loop(self) -> None:
        while not self._stopping.wait(BOARD_INTERVAL_S):
            self._share()

    def _run(self) -> int:
        started = self._start()
        if self._stopping.is_set():  # SIGTERM during start-up: a clean stop
            self.emit(self.log.line("[shutdown] API server: shutdown triggered", source="launcher.py:254"))
            return 0
        if not started:
            return 1
        self.registry.register(_Metrics(self))
        handler = type("Handler", (_Handler,), {"server_ref": self})
        try:
            self.httpd = _HttpServer((self.options.host, self.options.port), handler)
        except OSError as error:
            self.emit(
                self.log.line(
                    f"OSError: [Errno {error.errno}] {error.strerror}: could not bind "
                    f"{self.options.host}:{self.options.port}",
                    level="ERROR",
                )
            )
            return 1
        self.httpd.daemon_threads = True
        loop = threading.Thread(target=self._engine_loop, name="tunerd-sim-engine", daemon=True)
        loop.start()
        self.emit(
            self.log.line(
                f"Starting vLLM server on http://{self.options.host}:{self.options.port}",
                source="entry.py:140",
            )
        )
        self.emit("INFO:     Application startup complete.")
        self.httpd.serve_forever(poll_interval=0.1)
        self._stopping.set()
        loop.join(timeout=5)
        self.httpd.server_close()
        self.emit("INFO:     Shutting down" if self.exit_code == 0 else "INFO:     Finished server process")
        return self.exit_code

    # -- request handling (called from HTTP threads) --------------------------------------
    def _admission(self) -> str | None:
        """vLLM's ``AsyncLLM.check_admission`` (0.32 ``v1/engine/async_llm.py:316``): refuse
        a request when the unfinished ones (waiting + running) would pass
        ``max_num_queued_reqs``, or the prompt tokens still in prefill reach
        ``max_num_queued_tokens`` (the whole prompt counts until its prefill is done); the
        texts are ``QueueOverflowError``'s and ``MaxQueuedTokensError``'s (``vllm/exceptions.py``).
        Called with the lock held."""
        options = self.options
        unfinished = [*self.engine.running, *self.engine.waiting]
        prefilling = sum(r.prompt_tokens for r in unfinished if r.computed < r.prompt_tokens)
        if options.max_num_queued_reqs is not None and len(unfinished) + 1 > options.max_num_queued_reqs:
            self.admission_rejections["max_num_queued_reqs"] += 1
            return (
                "The engine is currently busy and cannot accept new requests. "
                "Please try again later or on a different instance."
            )
        if options.max_num_queued_tokens is not None and prefilling >= options.max_num_queued_tokens:
            self.admission_rejections["max_num_queued_tokens"] += 1
            return (
                "The engine has reached its prefill token backlog limit. "
                "Please try again later or on a different instance."
            )
        return None

    def completion(
        self,
        body: dict[str, Any],
        write_event: Callable[[dict[str, Any] | None], None] | None,
        *,
        chat: bool = False,
        gone: Callable[[], bool] | None = None,
    ) -> tuple[int, dict[str, Any]]:
        """Run one /v1/completions (``chat``: /v1/chat/completions) request; with
        ``write_event`` stream it (SSE chunks). A client that goes away aborts the request, as
        vLLM does: a stream notices on its next write, a plain request through ``gone``."""
        if self._draining or self.engine.dead:
            return 503, _error(
                "The server is shutting down."
                if self._draining
                else "EngineCore encountered an issue. See stack trace (above) for the root cause.",
                "ServiceUnavailableError",
                503,
            )
        limit = self.engine.max_model_len
        try:
            prompt_tokens = chat_prompt_tokens(body) if chat else _prompt_tokens(body)
            if chat:  # vLLM's chat default: the rest of the context
                asked = body.get("max_completion_tokens", body.get("max_tokens"))
                max_tokens = int(asked) if asked is not None else max(1, limit - prompt_tokens)
            else:
                max_tokens = int(body.get("max_tokens", 16))
            logprobs = body.get("prompt_logprobs")
            prompt_logprobs = int(logprobs) if logprobs is not None else None
            if max_tokens < 1:
                raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        except (TypeError, ValueError) as error:
            return 400, _error(str(error), "BadRequestError", 400)
        if prompt_tokens + max_tokens > limit:
            return 400, _error(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the "
                f"completion). Please reduce the length of the messages or completion.",
                "BadRequestError",
                400,
            )
        request = Request(
            id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}",
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            arrival=self.clock.now(),
            ignore_eos=bool(body.get("ignore_eos", False)),
            prompt_logprobs=prompt_logprobs,
        )
        with self.lock:  # admitted and queued at once: two requests cannot both take the last slot
            refused = self._admission()
            if refused is None:
                self.submit(request)
        if refused is not None:
            return 503, _error(refused, "Service Unavailable", 503)
        sent = 0
        with self.lock:
            while not request.done and request.error is None:
                self.lock.wait(timeout=0.2)
                if write_event is None and gone is not None and gone():
                    return self._abandoned(request)
                if write_event is not None and request.generated > sent:
                    text = " tok" * (request.generated - sent)
                    first, sent = sent == 0, request.generated
                    self.lock.release()
                    try:
                        write_event(self._chunk(request, text, None, chat=chat, first=first))
                    except OSError:  # the client went away: abort the request, as vLLM does
                        self.lock.acquire()
                        return self._abandoned(request)
                    self.lock.acquire()
            self._requests.pop(request.id, None)
        if request.error is not None:
            return 500, _error(request.error, "InternalServerError", 500)
        usage = {
            "prompt_tokens": request.prompt_tokens,
            "completion_tokens": request.generated,
            "total_tokens": request.prompt_tokens + request.generated,
        }
        if write_event is not None:
            if request.generated > sent:
                write_event(
                    self._chunk(
                        request, " tok" * (request.generated - sent), None, chat=chat, first=sent == 0
                    )
                )
            write_event(self._chunk(request, "", request.finish_reason, chat=chat, first=False))
            options = body.get("stream_options")
            if isinstance(options, dict) and options.get("include_usage"):
                write_event({**self._envelope(request, chat, stream=True), "choices": [], "usage": usage})
            write_event(None)
            return 200, {}
        text = " tok" * request.generated
        choice: dict[str, Any] = (
            {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None}
            if chat
            else {"index": 0, "text": text, "logprobs": None, "prompt_logprobs": None}
        )
        choice.update(finish_reason=request.finish_reason, stop_reason=None)
        return 200, {**self._envelope(request, chat, stream=False), "choices": [choice], "usage": usage}

    def _abandoned(self, request: Request) -> tuple[int, dict[str, Any]]:
        """The client went away: abort its request (vLLM counts it as
        ``request_success_total{finished_reason="abort"}``). Called with the lock held."""
        self.engine.abort(request, "client disconnected")
        self._observe(request)
        self._requests.pop(request.id, None)
        self.lock.notify_all()
        return 499, {}

    def _envelope(self, request: Request, chat: bool, *, stream: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if stream else "chat.completion") if chat else "text_completion"
        return {
            "id": request.id,
            "object": kind,
            "created": int(time.time()),
            "model": self.options.served_model_name,
        }

    def _chunk(
        self, request: Request, text: str, finish: str | None, *, chat: bool, first: bool
    ) -> dict[str, Any]:
        if chat:
            delta: dict[str, Any] = {"content": text}
            if first:
                delta = {"role": "assistant", **delta}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "logprobs": None}
        choice.update(finish_reason=finish, stop_reason=None)
        return {**self._envelope(request, chat, stream=True), "choices": [choice]}

    def tokenize(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """``POST /tokenize`` as vLLM answers it: ``prompt`` (the completions' count) or
        ``messages`` (the chat template applied, :func:`chat_prompt_tokens`)."""
        try:
            count = chat_prompt_tokens(body) if "messages" in body else _prompt_tokens(body)
        except (TypeError, ValueError) as error:
            return 400, _error(str(error), "BadRequestError", 400)
        return 200, {
            "count": count,
            "max_model_len": self.engine.max_model_len,
            "tokens": [(i * 7919) % 32000 for i in range(count)],
            "token_strs": None,
        }

    def truth(self, query: Mapping[str, str]) -> tuple[int, dict[str, Any]]:
        """``GET /sim/truth``: the box's hidden parameters and the safe maximum for a load
        (``concurrency``, ``prompt_tokens``, ``max_tokens``; by default the largest seen) at
        the engine's settings, any of ``max_num_batched_tokens``, ``max_num_seqs``,
        ``max_model_len`` and ``kv_cache_dtype`` replaced by the query's. For tests and
        benchmarks: tunerd never reads it."""
        if self._truth_engine is None or self.box is None:
            return 404, {"detail": "this simulator has no box truth"}
        with self.lock:
            now = self.clock.now()
            settings = self.engine.settings
            engine_bytes = self.engine.engine_bytes()
            max_model_len = self.engine.max_model_len
            at_once, prompt, out = self.load_seen
        try:
            load = TruthLoad(
                concurrency=int(query.get("concurrency", at_once)),
                prompt_tokens=int(query.get("prompt_tokens", prompt)),
                max_tokens=int(query.get("max_tokens", out)),
            )
            changed: dict[str, Any] = {
                knob: int(query[knob])
                for knob in ("max_num_batched_tokens", "max_num_seqs", "max_model_len")
                if knob in query
            }
            if "kv_cache_dtype" in query:
                changed["kv_cache_dtype"] = KV_DTYPE_WORDS[query["kv_cache_dtype"]]
        except (ValueError, KeyError) as error:
            return 400, {"detail": f"bad query: {error}"}
        if min(load.concurrency, load.prompt_tokens, load.max_tokens) < 1:
            return 400, {"detail": "no load seen yet: give concurrency, prompt_tokens and max_tokens"}
        numbers = [load.prompt_tokens, load.max_tokens, *changed_ints(changed)]
        if load.concurrency > 4096 or max(numbers) > 2**31 - 1 or min(numbers) < 1:
            return 400, {"detail": "bad query: 1 to 4,096 requests, settings and tokens 1 to 2**31 - 1"}
        wanted = replace(settings, max_model_len=max_model_len, **changed)
        found = safe_max(lambda s: self._truth_engine(s, now, engine_bytes), wanted, load)  # type: ignore[misc]
        return 200, {
            "box_seed": self.box.seed,
            "box": self.box.to_dict(),
            "load": load.to_dict(),
            "safe_max": None if found is None else found.to_dict(),
        }

    def gpu_object(self) -> dict[str, Any]:
        with self.lock:
            now = self.clock.now()
            sample = self.engine.gpu_sample(now)
        gpu = sample.to_dict()
        gpu.pop("status")
        gpu.pop("error")
        return {"gpus": [gpu], "time": now}


def changed_ints(changed: Mapping[str, Any]) -> list[int]:
    """The whole-number settings a ``/sim/truth`` query replaced (checked against their caps)."""
    return [value for value in changed.values() if isinstance(value, int)]


def _prompt_tokens(body: dict[str, Any]) -> int:
    """Tokens in the request: ``prompt_tokens`` (the simulator's load-test shortcut), a list of
    token ids, or text, where each whitespace-separated word counts as one token."""
    if "prompt_tokens" in body:
        count = int(body["prompt_tokens"])
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list):
            prompt = prompt[0] if prompt and isinstance(prompt[0], str) else prompt
        if isinstance(prompt, list):
            count = len(prompt)
        elif isinstance(prompt, str):
            count = len(prompt.split())
        else:
            raise ValueError("prompt must be a string, a list of token ids, or give prompt_tokens")
    if count < 1:
        raise ValueError("the prompt must hold at least one token")
    return count


#: the simulated model's chat template: each message is ``<|role|> content <|end|>`` (two
#: tokens around its words); the generation prompt ``<|assistant|>`` is one more
CHAT_TOKENS_PER_MESSAGE = 2
CHAT_GENERATION_PROMPT_TOKENS = 1


def chat_prompt_tokens(body: Mapping[str, Any]) -> int:
    """Tokens of a chat request's prompt with the simulated model's template applied: one per
    word of each message's text (a string, or ``text`` parts), two around each message, one
    for the generation prompt (unless ``add_generation_prompt`` is false)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content}")
    count = 0
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError("each message must be an object with a role")
        content = message.get("content")
        if isinstance(content, str):
            words = len(content.split())
        elif isinstance(content, list):
            words = sum(
                len(part["text"].split())
                for part in content
                if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            )
        elif content is None:
            words = 0
        else:
            raise ValueError("a message's content must be a string or a list of parts")
        count += words + CHAT_TOKENS_PER_MESSAGE
    if body.get("add_generation_prompt", True):
        count += CHAT_GENERATION_PROMPT_TOKENS
    return count


def _error(message: str, kind: str, code: int) -> dict[str, Any]:
    return {"object": "error", "message": message, "type": kind, "param": None, "code": code}


class _Handler(BaseHTTPRequestHandler):
    server_ref: SimServer
    protocol_version = "HTTP/1.1"
    # TCP_NODELAY, as uvicorn sets it: without it the body, written after the headers, waits
    # for the client's delayed ACK (40 ms a request on Linux)
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: Any) -> None:
        if self.path.split("?", 1)[0] not in {"/metrics", "/health", "/sim/gpu", "/sim/clock", "/sim/truth"}:
            self.server_ref.emit(
                f'INFO:     {self.client_address[0]}:{self.client_address[1]} - "{self.requestline}" '
                f"{args[1] if len(args) > 1 else ''}"
            )

    def handle(self) -> None:
        """A client that went away mid-request (a timeout, a closed stream, a cut body) ends
        its connection quietly, as uvicorn does — not with a traceback in the engine's log."""
        try:
            super().handle()
        except (ConnectionError, TimeoutError):
            self.close_connection = True

    def _send(self, status: int, body: bytes, kind: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, data: Any) -> None:
        self._send(status, json.dumps(data).encode())

    def do_GET(self) -> None:
        server = self.server_ref
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        if path in {"/health", "/ping"}:
            self._send(503 if server.engine.dead else 200, b"", "text/plain")
        elif path == "/metrics":
            self._send(200, generate_latest(server.registry), "text/plain; version=0.0.4; charset=utf-8")
        elif path == "/version":
            self._json(200, {"version": VLLM_VERSION})
        elif path == "/v1/models":
            self._json(
                200,
                {
                    "object": "list",
                    "data": [
                        {
                            "id": server.options.served_model_name,
                            "object": "model",
                            "created": int(time.time()),
                            "owned_by": "vllm",
                            "root": server.options.model,
                            "parent": None,
                            "max_model_len": server.engine.max_model_len,
                        }
                    ],
                },
            )
        elif path == "/sim/gpu":
            self._json(200, server.gpu_object())
        elif path == "/sim/truth":
            status, data = server.truth(dict(parse_qsl(self.path.partition("?")[2])))
            self._json(status, data)
        elif path == "/sim/clock":
            self._json(200, {"time": server.clock.now(), "time_scale": server.clock.scale})
        elif path == "/load":
            self._json(200, {"server_load": len(server._requests)})
        else:
            self._json(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        if path not in {"/v1/completions", "/v1/chat/completions", "/tokenize"}:
            self._json(404, {"detail": "Not Found"})
            return
        try:
            length = int(self.headers.get("Content-Length", "0"))
            body = json.loads(self.rfile.read(length) or b"{}")
            if not isinstance(body, dict):
                raise ValueError("expected a JSON object")
        except (ValueError, json.JSONDecodeError) as error:
            self._json(400, _error(f"invalid JSON body: {error}", "BadRequestError", 400))
            return
        if path == "/tokenize":
            self._json(*self.server_ref.tokenize(body))
            return
        chat = path == "/v1/chat/completions"
        if body.get("stream"):
            self._stream(body, chat)
            return
        status, data = self.server_ref.completion(body, None, chat=chat, gone=self._client_gone)
        if status != 499:
            self._json(status, data)

    def _client_gone(self) -> bool:
        """Whether the client closed its connection while its request runs (an EOF waiting
        to be read); a client that sends more (a pipelined request) is still there."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _stream(self, body: dict[str, Any], chat: bool) -> None:
        started = False

        def write_event(event: dict[str, Any] | None) -> None:
            nonlocal started
            if not started:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                started = True
            payload = (
                b"data: [DONE]\n\n" if event is None else b"data: " + json.dumps(event).encode() + b"\n\n"
            )
            self.wfile.write(f"{len(payload):x}\r\n".encode() + payload + b"\r\n")
            if event is None:
                self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

        status, data = self.server_ref.completion(body, write_event, chat=chat)
        if status == 499:
            return  # the client is gone
        if not started:
            self._json(status, data)
        elif status != 200:
            # Headers are gone: report the failure as an error event, as vLLM does mid-stream.
            error = json.dumps({"error": data}).encode()
            payload = b"data: " + error + b"\n\n"
            self.wfile.write(f"{len(payload):x}\r\n".encode() + payload + b"\r\n0\r\n\r\n")
