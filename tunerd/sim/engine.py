"""The simulated engine: vLLM V1's scheduler and memory, on a simulated GPU, in simulated time.

Pure: every method takes the simulated time (``now``, seconds); nothing here sleeps, reads a
clock or does I/O (``tunerd.sim.server`` does). The weights and the KV bytes per token are
the model's arithmetic (:mod:`tunerd.planner.bills`); what the box holds besides — its CUDA
context, non-torch memory, the real activation working set, the graph pool, the allocator's
fragmentation, the driver's reserve — is the :class:`~tunerd.sim.box.Box`'s hidden truth: the
planner's assumptions by default, drawn from a seed with ``--box-seed``.

**Start-up** sizes the pool with vLLM's arithmetic (:func:`tunerd.planner.bills.kv_pool`) from
the box's own bills and fails
the way vLLM fails: free memory short of ``ceil(total × utilization)`` (neighbours included),
no room for the cache, or a pool that cannot hold one ``max_model_len`` sequence.

**Serving** follows vLLM V1: continuous batching of up to ``max_num_seqs`` requests, a token
budget of ``max_num_batched_tokens`` per step spent on decodes first and then prefill chunks
(chunked prefill), 16-token blocks, and preemption by recompute (the newest running request
gives its blocks back and starts over) when a running request needs a block and none is free.
Requests that cannot be admitted wait for capacity.

**Memory** while serving, per DESIGN §1 and §6: the engine holds its CUDA context, weights,
workspaces, the CUDA graph pool and the KV pool from start-up; the activation working set is
taken back by the first large step and kept (the caching allocator's ratchet). Steps of new
shapes fragment the allocator, so the kept working set creeps above the profiled peak by up to
``frag_max`` of it; ``prompt_logprobs`` on long prompts allocate fp32 logits for every prompt
token of the chunk (the profile never saw them); ``drift`` leaks slowly; neighbours take memory
too. An allocation that does not fit in the GPU's free memory is a CUDA OOM
(:class:`CudaOutOfMemory`), with the numbers vLLM's text carries.

**Time** comes from a roofline: a step reads the weights and every running sequence's KV at
the GPU's bandwidth, and computes ``2 × params × tokens`` at its bf16 throughput.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from tunerd.gpu import COMPUTE, GpuProcess, GpuSample
from tunerd.planner.bills import (
    BLOCK_SIZE,
    KvPool,
    count_weights,
    kv_bytes_per_token,
    kv_pool,
    sequence_blocks,
)
from tunerd.planner.gpus import GpuProfile
from tunerd.planner.shapes import ModelShape
from tunerd.sim.box import Box, default_box
from tunerd.units import GIB

__all__ = [
    "CudaOutOfMemory",
    "EngineSettings",
    "Neighbour",
    "Request",
    "SimEngine",
    "SimGpu",
    "StartupFailure",
]

#: Fragmentation of the caching allocator: how many distinct step sizes (in 64-token buckets)
#: it takes to reach ``frag_max`` above the profiled working set.
FRAG_BUCKET_TOKENS = 64
FRAG_SHAPES = 16
#: Roofline efficiencies and the fixed cost of a step (graph launch or eager Python).
BANDWIDTH_EFFICIENCY = 0.8
COMPUTE_EFFICIENCY = 0.6
STEP_OVERHEAD_S = 0.002
EAGER_STEP_OVERHEAD_S = 0.006


class StartupFailure(Exception):
    """vLLM would refuse to start: ``kind`` (DESIGN §4.4) and the lines it would print."""

    def __init__(self, kind: str, lines: list[str]) -> None:
        super().__init__(lines[-1])
        self.kind = kind
        self.lines = lines


class CudaOutOfMemory(Exception):
    """An allocation the GPU could not satisfy, with the figures of torch's OOM text."""

    def __init__(
        self,
        tried_bytes: int,
        free_bytes: int,
        *,
        total_bytes: int,
        own_bytes: int,
        others: list[GpuProcess],
        what: str,
    ) -> None:
        super().__init__(f"CUDA out of memory while allocating {tried_bytes} bytes for {what}")
        self.tried_bytes = tried_bytes
        self.free_bytes = max(free_bytes, 0)
        self.total_bytes = total_bytes
        self.own_bytes = own_bytes
        self.others = others
        self.what = what


@dataclass(frozen=True)
class Neighbour:
    """Another process on the GPU: ``size`` from ``start`` (sim seconds), growing by
    ``growth_bytes_per_s`` until the GPU is full."""

    pid: int
    name: str
    size: int
    start: float = 0.0
    growth_bytes_per_s: float = 0.0
    #: how the driver lists it: a desktop's display server is a graphics client, in NVML's
    #: graphics list and not its compute one (nvidia-smi's type G)
    kind: str = COMPUTE

    def wanted(self, now: float) -> int:
        if now < self.start:
            return 0
        return int(self.size + self.growth_bytes_per_s * (now - self.start))


@dataclass
class SimGpu:
    """A simulated card: NVML's total, the driver's reservation, the neighbours."""

    profile: GpuProfile
    neighbours: list[Neighbour] = field(default_factory=list)
    peers: list[Neighbour] = field(default_factory=list)  # other simulated engines on this card
    index: int = 0
    uuid: str = "GPU-5e1a7ed0-0000-4000-8000-000000000000"
    #: what the driver keeps of NVML's total (a box's draw); None: the profile's CUDA total
    driver_reserve_bytes: int | None = None

    @property
    def cuda_total_bytes(self) -> int:
        if self.driver_reserve_bytes is None:
            return self.profile.total_bytes
        return self.nvml_total_bytes - self.driver_reserve_bytes

    @property
    def nvml_total_bytes(self) -> int:
        return max(self.profile.nvidia_smi_total_mib * 1024**2, self.profile.total_bytes)

    @property
    def reserved_bytes(self) -> int:
        return self.nvml_total_bytes - self.cuda_total_bytes

    def neighbour_bytes(self, now: float, engine_bytes: int) -> list[tuple[Neighbour, int]]:
        """What each neighbour holds: it wants more as it grows, but cannot take what the
        engine already holds (its own allocations would fail first)."""
        room = self.cuda_total_bytes - engine_bytes
        held = []
        for neighbour in [*self.peers, *self.neighbours]:  # engines first: they hold what they took
            amount = max(0, min(neighbour.wanted(now), room))
            room -= amount
            held.append((neighbour, amount))
        return held


@dataclass(frozen=True)
class EngineSettings:
    """The vLLM flags the simulator honours (tunerd's words; vLLM's values)."""

    gpu_memory_utilization: float = 0.92
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    kv_cache_dtype: str = "auto"  # auto | fp16 | bf16 | fp8
    kv_cache_memory_bytes: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    enforce_eager: bool = False


@dataclass
class Request:
    """One completion request moving through the scheduler."""

    id: str
    prompt_tokens: int
    max_tokens: int
    arrival: float
    ignore_eos: bool = False
    prompt_logprobs: int | None = None
    output_target: int = 0  # tokens it will generate (max_tokens, or an early EOS)
    computed: int = 0  # tokens whose KV is in the cache (prompt + generated, after recompute)
    generated: int = 0
    blocks: int = 0
    scheduled_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    finish_reason: str | None = None
    preemptions: int = 0
    error: str | None = None

    @property
    def context(self) -> int:
        """Tokens the request's KV must hold once it is fully computed."""
        return self.prompt_tokens + self.generated

    @property
    def done(self) -> bool:
        return self.finished_at is not None


@dataclass
class StepResult:
    duration: float
    tokens: int
    finished: list[Request]
    first_tokens: list[Request]


class SimEngine:
    """A simulated vLLM engine on a :class:`SimGpu`. Raises :class:`StartupFailure` from the
    constructor when vLLM would not start."""

    def __init__(
        self,
        shape: ModelShape,
        gpu: SimGpu,
        weights_format: str,
        settings: EngineSettings,
        *,
        pid: int,
        now: float = 0.0,
        drift_bytes_per_s: float = 0.0,
        frag_max: float = 0.3,
        seed: int = 0,
        box: Box | None = None,
        worst_case: bool = False,
        gc_threshold: float | None = None,
    ) -> None:
        self.shape = shape
        self.gpu = gpu
        self.settings = settings
        self.pid = pid
        self.started_at = now
        self.drift_bytes_per_s = drift_bytes_per_s
        #: the box's hidden truth; without one, the planner's assumptions (and ``frag_max``)
        self.box = box if box is not None else default_box(gpu.profile, frag_max=frag_max)
        self.frag_max = self.box.frag_max
        #: the allocator fragmented to its ceiling from the first step (the truth search's view
        #: of hours of traffic)
        self.worst_case = worst_case
        #: ``PYTORCH_CUDA_ALLOC_CONF=garbage_collection_threshold:T``: past T of the card the
        #: caching allocator gives unused cached blocks back to the driver
        self.gc_threshold = gc_threshold
        self._random = random.Random(seed)
        self.max_model_len = settings.max_model_len or shape.max_position_embeddings
        self._check_config()
        self.weights = count_weights(shape, weights_format)
        self.kv_bytes_per_token = kv_bytes_per_token(shape, settings.kv_cache_dtype)
        self.runtime = self.box.runtime(shape, settings.max_num_seqs, settings.enforce_eager)
        self.profiled = self.box.working_set(
            shape,
            settings.max_num_batched_tokens,
            min(settings.max_num_seqs, settings.max_num_batched_tokens),
        )
        self._check_free_memory(now)
        self.pool = self._size_pool()
        self.block_bytes = BLOCK_SIZE * self.kv_bytes_per_token
        self.num_blocks = self.pool.num_blocks
        self.free_blocks = self.num_blocks - 1  # vLLM keeps one null block
        self.activation_held = 0
        self._shapes_seen: set[int] = set()
        self._drift_held = 0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preemptions_total = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.dead = False

    # -- start-up checks (vLLM's texts live in tunerd.sim.logtext) ----------------------
    def _check_config(self) -> None:
        positions = self.shape.max_position_embeddings
        if self.max_model_len > positions:
            raise StartupFailure(
                "invalid_config",
                [
                    "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig",
                    f"  Value error, User-specified max_model_len ({self.max_model_len}) is greater than "
                    f"the derived max_model_len (max_position_embeddings={positions} or "
                    f"model_max_length=None in model's config.json). To allow overriding this maximum, "
                    f"set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1. VLLM_ALLOW_LONG_MAX_MODEL_LEN must "
                    f"be used with extreme caution.",
                ],
            )
        if (
            not self.settings.enable_chunked_prefill
            and self.settings.max_num_batched_tokens < self.max_model_len
        ):
            raise StartupFailure(
                "invalid_config",
                [
                    "pydantic_core._pydantic_core.ValidationError: 1 validation error for SchedulerConfig",
                    f"  Value error, max_num_batched_tokens ({self.settings.max_num_batched_tokens}) is "
                    f"smaller than max_model_len ({self.max_model_len}). This effectively limits the "
                    f"maximum sequence length to max_num_batched_tokens and makes vLLM reject longer "
                    f"sequences. Please increase max_num_batched_tokens or decrease max_model_len.",
                ],
            )

    @property
    def budget_bytes(self) -> int:
        return math.ceil(self.gpu.cuda_total_bytes * self.settings.gpu_memory_utilization)

    def _check_free_memory(self, now: float) -> None:
        context = self.runtime.outside_budget_bytes
        others = sum(held for _, held in self.gpu.neighbour_bytes(now, context))
        free = self.gpu.cuda_total_bytes - others - context
        if self.settings.kv_cache_memory_bytes is None and free < self.budget_bytes:
            raise StartupFailure(
                "insufficient_free_memory",
                [
                    f"ValueError: Free memory on device cuda:{self.gpu.index} "
                    f"({free / GIB:.2f}/{self.gpu.cuda_total_bytes / GIB:.2f} GiB) on startup is less than "
                    f"desired GPU memory utilization ({self.settings.gpu_memory_utilization}, "
                    f"{self.budget_bytes / GIB:.2f} GiB). Decrease GPU memory utilization or reduce GPU "
                    f"memory used by other processes.",
                ],
            )

    def _size_pool(self) -> KvPool:
        settings = self.settings
        blocks_per_request = sequence_blocks(self.shape, self.max_model_len, settings.max_num_batched_tokens)
        non_kv = self.weights.bytes + self.profiled + self.runtime.inside_budget_bytes
        total, utilization = self.gpu.cuda_total_bytes, settings.gpu_memory_utilization
        if settings.kv_cache_memory_bytes is not None:
            # vLLM skips profiling-based sizing and takes the bytes as given.
            total, utilization = non_kv + settings.kv_cache_memory_bytes, 1.0
        pool = kv_pool(
            total_bytes=total,
            gpu_memory_utilization=utilization,
            non_kv_bytes=non_kv,
            bytes_per_token=self.kv_bytes_per_token,
            blocks_per_request=blocks_per_request,
            max_model_len=self.max_model_len,
        )
        if pool.available_bytes <= 0 or pool.num_blocks == 0:
            raise StartupFailure(
                "no_kv_cache_memory",
                [
                    "ValueError: No available memory for the cache blocks. Try increasing "
                    "`gpu_memory_utilization` when initializing the engine. See "
                    "https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details.",
                ],
            )
        if not pool.fits_one_request:
            needed = blocks_per_request * BLOCK_SIZE * self.kv_bytes_per_token
            estimate = pool.num_blocks * BLOCK_SIZE
            raise StartupFailure(
                "max_model_len_exceeds_kv",
                [
                    f"ValueError: To serve at least one request with the model's max seq len "
                    f"({self.max_model_len}), ({needed / GIB:.2f} GiB KV cache is needed, which is larger "
                    f"than the available KV cache memory ({pool.available_bytes / GIB:.2f} GiB). Based on "
                    f"the available memory, the estimated maximum model length is {estimate}. Try "
                    f"increasing `gpu_memory_utilization` or decreasing `max_model_len` when initializing "
                    f"the engine. See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ "
                    f"for more details.",
                ],
            )
        return pool

    # -- memory --------------------------------------------------------------------------
    @property
    def static_bytes(self) -> int:
        """Context, weights, workspaces, graphs and the KV pool: held from start-up."""
        return self.runtime.bytes + self.weights.bytes + self.pool.num_blocks * self.block_bytes

    def engine_bytes(self) -> int:
        if self.dead:
            return 0
        return self.static_bytes + self.activation_held + self._drift_held

    def processes(self, now: float) -> list[GpuProcess]:
        mine = self.engine_bytes()
        listed = [GpuProcess(self.pid, "python3", mine, COMPUTE)] if mine else []
        for neighbour, held in self.gpu.neighbour_bytes(now, mine):
            if held:
                listed.append(GpuProcess(neighbour.pid, neighbour.name, held, neighbour.kind))
        return listed

    def gpu_sample(self, now: float) -> GpuSample:
        """DESIGN §4.3's GPU object as NVML (v2) would report the simulated card."""
        processes = self.processes(now)
        used = sum(p.used_bytes or 0 for p in processes)
        gpu = self.gpu
        busy = 0.95 if self.running else 0.0
        return GpuSample(
            index=gpu.index,
            uuid=gpu.uuid,
            name=f"{gpu.profile.description} (simulated)",
            memory_total_bytes=gpu.nvml_total_bytes,
            memory_used_bytes=used,
            memory_free_bytes=gpu.nvml_total_bytes - gpu.reserved_bytes - used,
            memory_reserved_bytes=gpu.reserved_bytes,
            utilization_ratio=busy,
            processes=tuple(processes),
        )

    def _allocate(self, amount: int, now: float, what: str) -> None:
        """Take ``amount`` more bytes from the GPU or raise CUDA OOM."""
        if amount <= 0:
            return
        mine = self.engine_bytes()
        others = [
            GpuProcess(n.pid, n.name, held, n.kind) for n, held in self.gpu.neighbour_bytes(now, mine) if held
        ]
        free = self.gpu.cuda_total_bytes - mine - sum(p.used_bytes or 0 for p in others)
        if amount > free:
            self.dead = True
            raise CudaOutOfMemory(
                amount, free, total_bytes=self.gpu.cuda_total_bytes, own_bytes=mine, others=others, what=what
            )

    def _ratchet(self, step_tokens: int, requests: int, logprob_tokens: int, now: float) -> None:
        """Grow the kept activation working set if this step needs more than it holds."""
        self._shapes_seen.add(step_tokens // FRAG_BUCKET_TOKENS)
        seen = 1.0 if self.worst_case else min(1.0, len(self._shapes_seen) / FRAG_SHAPES)
        fragmentation = 1 + self.frag_max * seen
        working = self.box.working_set(self.shape, step_tokens, requests)
        wanted = int(working * fragmentation) + logprob_tokens * self.shape.vocab_size * 4
        if wanted > self.activation_held:
            self._allocate(wanted - self.activation_held, now, "activations")
            self.activation_held = wanted
        elif self.gc_threshold is not None and wanted < self.activation_held:
            # with a garbage-collection threshold the allocator reclaims the cached blocks a
            # smaller step leaves unused while the process holds more than the threshold of the
            # card, and stops below it: the prefill's peak falls back (the seed's rectangle in
            # nvidia-smi). PyTorch reclaims at its next allocation that misses the cache; the
            # simulator at the next step that needs less.
            above = self.engine_bytes() - int(self.gc_threshold * self.gpu.cuda_total_bytes)
            self.activation_held -= max(0, min(self.activation_held - wanted, above))

    def tick(self, now: float) -> None:
        """Let time pass: the leak drifts (and may OOM even when idle)."""
        if self.drift_bytes_per_s <= 0:
            return
        wanted = int(self.drift_bytes_per_s * (now - self.started_at))
        if wanted - self._drift_held >= 2 * 1024**2:  # the allocator takes 2 MiB segments
            self._allocate(wanted - self._drift_held, now, "a leak")
            self._drift_held = wanted

    # -- requests -------------------------------------------------------------------------
    def submit(self, request: Request) -> None:
        if request.ignore_eos or request.max_tokens <= 1:
            request.output_target = request.max_tokens
        else:
            # Without ignore_eos the model stops somewhere: a seeded, mostly long answer.
            request.output_target = max(
                1, min(request.max_tokens, int(self._random.expovariate(1.0) * request.max_tokens) + 1)
            )
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - 1 - self.free_blocks

    @property
    def kv_cache_usage(self) -> float:
        return 1 - self.free_blocks / (self.num_blocks - 1) if self.num_blocks > 1 else 0.0

    def _blocks_for(self, request: Request, tokens: int) -> int:
        held = math.ceil((request.computed + tokens) / BLOCK_SIZE)
        if self.shape.sliding_window is not None:
            # Blocks that slid out of the window are freed: a request holds at most the
            # window's worth (vLLM's SlidingWindowSpec), the same bound the pool was sized by.
            held = min(
                held, sequence_blocks(self.shape, request.context, self.settings.max_num_batched_tokens)
            )
        return max(0, held - request.blocks)

    def abort(self, request: Request, reason: str) -> None:
        """A client went away: free the request's slot and blocks, as vLLM aborts it."""
        if request in self.running:
            self.running.remove(request)
            self.free_blocks += request.blocks
            request.blocks = 0
        elif request in self.waiting:
            self.waiting.remove(request)
        request.error = reason

    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self.free_blocks += victim.blocks
        victim.blocks = 0
        victim.computed = 0  # recompute: its prompt and what it generated are prefilled again
        victim.preemptions += 1
        self.preemptions_total += 1
        self.waiting.appendleft(victim)

    def step(self, now: float) -> StepResult:
        """One scheduler step starting at ``now``; returns how long it takes (sim seconds).

        Every scheduled request computes some of its pending tokens (a prefill chunk, or the
        one token sampled last step); one that has computed its whole context samples a token.
        """
        budget = self.settings.max_num_batched_tokens
        scheduled: dict[str, tuple[Request, int]] = {}
        preempted = False
        # Running requests first, oldest first.
        for request in list(self.running):
            if request not in self.running or budget <= 0:
                continue
            tokens = min(request.context - request.computed, budget)
            needed = self._blocks_for(request, tokens)
            while needed > self.free_blocks and request in self.running:
                victim = self.running[-1]  # the newest gives its blocks back
                self._preempt(victim)
                preempted = True
                dropped = scheduled.pop(victim.id, None)
                if dropped is not None:
                    budget += dropped[1]
            if request not in self.running:
                continue
            self.free_blocks -= needed
            request.blocks += needed
            scheduled[request.id] = (request, tokens)
            budget -= tokens
        # Then admit waiting requests while slots, budget and blocks allow; not in a step that
        # had to preempt (vLLM V1 admits nothing new then, or it would thrash).
        while (
            not preempted and self.waiting and budget > 0 and len(self.running) < self.settings.max_num_seqs
        ):
            request = self.waiting[0]
            pending = request.context - request.computed
            if not self.settings.enable_chunked_prefill and pending > budget:
                break
            tokens = min(pending, budget)
            needed = self._blocks_for(request, tokens)
            if needed > self.free_blocks:
                break  # waits for capacity
            self.waiting.popleft()
            self.free_blocks -= needed
            request.blocks += needed
            if request.scheduled_at is None:
                request.scheduled_at = now
            self.running.append(request)
            scheduled[request.id] = (request, tokens)
            budget -= tokens
        if not scheduled:
            return StepResult(duration=0.0, tokens=0, finished=[], first_tokens=[])
        work = list(scheduled.values())
        step_tokens = sum(tokens for _, tokens in work)
        logprob_tokens = sum(
            max(0, min(r.computed + t, r.prompt_tokens) - r.computed)
            for r, t in work
            if r.prompt_logprobs is not None and r.first_token_at is None
        )
        self._ratchet(step_tokens, len(work), logprob_tokens, now)
        duration = self._duration(work)
        done_at = now + duration
        finished: list[Request] = []
        first_tokens: list[Request] = []
        for request, tokens in work:
            request.computed += tokens
            if request.computed < request.context:
                continue  # more prefill chunks to go
            request.generated += 1  # the step that completes the context samples a token
            self.generation_tokens_total += 1
            if request.first_token_at is None:
                request.first_token_at = done_at
                self.prompt_tokens_total += request.prompt_tokens
                first_tokens.append(request)
            if request.generated >= request.output_target:
                request.finished_at = done_at
                request.finish_reason = "length" if request.generated >= request.max_tokens else "stop"
                self.running.remove(request)
                self.free_blocks += request.blocks
                request.blocks = 0
                finished.append(request)
        return StepResult(duration=duration, tokens=step_tokens, finished=finished, first_tokens=first_tokens)

    def _duration(self, scheduled: Iterable[tuple[Request, int]]) -> float:
        profile = self.gpu.profile
        scheduled = list(scheduled)
        kv_read = sum(r.computed for r, _ in scheduled) * self.kv_bytes_per_token
        memory_s = (self.weights.bytes + kv_read) / (profile.bandwidth_bytes_per_s * BANDWIDTH_EFFICIENCY)
        tokens = sum(t for _, t in scheduled)
        active_params = self.weights.params_total
        if self.shape.is_moe:
            active_params = int(active_params * self.shape.num_experts_per_tok / self.shape.num_experts) + (
                self.weights.embedding_params
            )
        compute_s = 2 * active_params * tokens / (profile.bf16_flops * COMPUTE_EFFICIENCY)
        overhead = EAGER_STEP_OVERHEAD_S if self.settings.enforce_eager else STEP_OVERHEAD_S
        return max(memory_s, compute_s) + overhead

    def abort_all(self, reason: str) -> list[Request]:
        """The engine died: every request in flight fails."""
        failed = list(self.running) + list(self.waiting)
        for request in failed:
            request.error = reason
        self.running.clear()
        self.waiting.clear()
        self.dead = True
        return failed
