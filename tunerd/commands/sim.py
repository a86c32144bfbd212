"""``tunerd sim serve`` and ``tunerd sim load``: the simulated GPU + vLLM engine, and load.

``serve`` takes the vLLM flags tunerd uses, spelled as vLLM spells them, so the daemon can
start it exactly as it starts ``vllm serve``; anything else (``--swap-space``) fails as vLLM's
parser fails: ``error: unrecognized arguments``, exit 2. The ``--sim-*`` flags, ``--time-scale``
and ``--seed`` describe the simulated world.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from dataclasses import replace

from tunerd.commands import summary
from tunerd.commands.common import (
    EXIT_NO,
    EXIT_OK,
    Parser,
    UsageError,
    examples,
    positive_int,
    size,
    utilization,
)
from tunerd.gpu import GRAPHICS
from tunerd.planner.bills import KV_DTYPE_WORDS, WEIGHT_FORMATS
from tunerd.planner.gpus import GPU_PROFILES, custom_gpu, gpu_profile
from tunerd.planner.shapes import ModelShape, builtin_model, load_model_config, shape_from_config
from tunerd.sim.board import GpuBoard
from tunerd.sim.box import default_box, draw_box
from tunerd.sim.engine import EngineSettings, Neighbour, SimEngine, SimGpu
from tunerd.sim.load import LoadOptions, run_load
from tunerd.sim.server import ServeOptions, SimClock, SimServer
from tunerd.units import UnitError, parse_duration, parse_size, parse_token_count

__all__ = ["register"]

#: Synthetic PIDs for simulated neighbours: above Linux's largest pid_max (2**22), so they can
#: never be a real process on the host.
NEIGHBOUR_PID_BASE = 4_194_305
#: A desktop's display server on consumer cards (Xorg + compositor), the seed's 4090 setting.
DISPLAY_NEIGHBOUR = "300MiB"
_NEIGHBOUR = re.compile(
    r"^(?P<size>[^@+:]+)@(?P<start>[^+:]+)(?:\+(?P<grow>[^/:]+)/(?P<per>[^:]+))?(?::(?P<name>.+))?$"
)

_SERVE_EPILOG = """\
simulated world:
  --sim-neighbor SIZE@TIME[+SIZE/DURATION][:NAME]  another process on the GPU, e.g.
      2GiB@60s:notebook (appears after 60 simulated seconds), 512MiB@0s+256MiB/1m (grows)
  --sim-drift 0.2GiB/h                                the engine leaks this much
  --box-seed 7                                        a box whose truth tunerd must discover
  consumer cards (rtx4090, rtx3090) have a display server using 300MiB (--sim-display 0 for none)

examples:
  tunerd sim serve --sim-model llama-3.1-8b --sim-weights awq --sim-gpu rtx4090 \\
      --gpu-memory-utilization 0.92 --max-model-len 32768 --max-num-seqs 8 \\
      --max-num-batched-tokens 2048 --kv-cache-dtype fp8 --time-scale 20 --port 8000
  tunerd sim load --url http://127.0.0.1:8000 --concurrency 4 --prompt-tokens 28000 \\
      --max-tokens 512 --requests 8

exit status (serve): 0 stopped by SIGTERM or SIGINT (it drains, as vLLM does), non-zero when
the engine fails — a start that does not fit, an OOM — with vLLM's text for it.
"""


def _display(text: str) -> int:
    """A display server's memory: a size with its unit (``300MiB``), or 0 for none."""
    return 0 if text.strip() == "0" else size(text)


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except UnitError:
        pass
    try:
        return parse_token_count(text)  # vLLM's human-readable bytes: 8G, 4194304
    except UnitError as error:
        raise argparse.ArgumentTypeError(f"invalid size '{text}'") from error


def _model_len(text: str) -> int:
    if text in {"-1", "auto"}:
        return -1
    try:
        return parse_token_count(text)
    except UnitError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _rate(text: str) -> float:
    """``0.2GiB/h`` → bytes per simulated second."""
    size, _, per = text.partition("/")
    try:
        return parse_size(size) / parse_duration("1" + per if per and per[0].isalpha() else per or "1s")
    except UnitError as error:
        raise argparse.ArgumentTypeError(f"invalid rate '{text}': {error}") from None


def gc_threshold(conf: str | None) -> float | None:
    """``garbage_collection_threshold`` of a ``PYTORCH_CUDA_ALLOC_CONF`` value (``key:value``
    pairs, comma-separated), as PyTorch reads it: None when it is not set; outside (0, 1) is
    PyTorch's own start-up error."""
    for part in (conf or "").split(","):
        key, _, value = part.partition(":")
        if key.strip() != "garbage_collection_threshold":
            continue
        try:
            threshold = float(value)
        except ValueError:
            threshold = math.nan
        if not 0.0 < threshold < 1.0:
            raise UsageError(
                f"PYTORCH_CUDA_ALLOC_CONF: garbage_collect_threshold is invalid, set it in (0.0, 1.0) "
                f"(got {value.strip()[:20]!r})"
            )
        return threshold
    return None


def _neighbour_spec(text: str) -> tuple[int, float, float, str | None]:
    match = _NEIGHBOUR.match(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(
            f"invalid neighbour '{text}': expected SIZE@TIME[+SIZE/DURATION][:NAME]"
        )
    try:
        size = parse_size(match["size"])
        start = parse_duration(match["start"])
        growth = parse_size(match["grow"]) / parse_duration(match["per"]) if match["grow"] else 0.0
    except UnitError as error:
        raise argparse.ArgumentTypeError(f"invalid neighbour '{text}': {error}") from None
    return size, start, growth, match["name"]


def register(subparsers: argparse._SubParsersAction[Parser]) -> None:
    parser = subparsers.add_parser(
        "sim",
        help=summary("sim"),
        description="Run a simulated vLLM engine on a simulated GPU, or send it load.",
    )
    parser.set_defaults(handler=lambda _args: parser.error("say serve or load"), prog=parser.prog)
    examples(
        parser,
        """\
examples:
  tunerd sim serve meta-llama/Llama-3.1-8B-Instruct --port 8000 --gpu-memory-utilization 0.92
  tunerd sim load --url http://127.0.0.1:8000 --concurrency 4 --prompt-tokens 2000 --duration 60s
""",
    )
    commands = parser.add_subparsers(title="what", dest="sim_command", metavar="WHAT", parser_class=Parser)
    _add_serve(commands)
    _add_load(commands)


def _add_serve(commands: argparse._SubParsersAction[Parser]) -> None:
    serve = commands.add_parser(
        "serve",
        help="serve like `vllm serve`, on a simulated GPU and clock",
        description="A simulated vLLM 0.33 engine: vLLM's flags, log lines, /metrics and failures.",
        epilog=_SERVE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument(
        "model_tag", nargs="?", help="the model to serve (a name; shapes come from --sim-model)"
    )
    vllm = serve.add_argument_group("vLLM flags")
    vllm.add_argument("--model", help="same as MODEL_TAG")
    vllm.add_argument("--served-model-name", nargs="+", help="the name clients and /metrics use")
    vllm.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address to listen on (default 127.0.0.1: this machine only; vLLM's own default is "
        "0.0.0.0 — say --host 0.0.0.0 for a simulator other machines reach)",
    )
    vllm.add_argument("--port", type=int, default=8000)
    vllm.add_argument("--gpu-memory-utilization", type=utilization, default=0.92)
    vllm.add_argument("--max-model-len", type=_model_len)
    vllm.add_argument("--max-num-seqs", type=positive_int)
    vllm.add_argument("--max-num-batched-tokens", type=positive_int)
    vllm.add_argument("--kv-cache-dtype", choices=sorted(KV_DTYPE_WORDS), default="auto")
    vllm.add_argument("--kv-cache-memory-bytes", type=_size)
    vllm.add_argument(
        "--max-num-queued-reqs", type=positive_int, help="503 past this many unfinished requests"
    )
    vllm.add_argument(
        "--max-num-queued-tokens", type=positive_int, help="503 once this many prompt tokens wait in prefill"
    )
    vllm.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    vllm.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    vllm.add_argument("--enforce-eager", action="store_true")
    vllm.add_argument("--shutdown-timeout", type=float, default=0.0)
    vllm.add_argument("--dtype", default="auto")
    vllm.add_argument("--quantization", "-q")
    vllm.add_argument("--tensor-parallel-size", type=positive_int, default=1)
    sim = serve.add_argument_group("simulated world")
    sim.add_argument("--sim-gpu", default="rtx4090", help=f"a GPU profile: {', '.join(GPU_PROFILES)}")
    sim.add_argument("--sim-gpu-mem", type=size, help="a custom card of this CUDA-visible size, e.g. 24GiB")
    sim.add_argument("--sim-model", default="llama-3.1-8b", help="a built-in model shape")
    sim.add_argument("--sim-model-config", help="a Hugging Face config.json instead")
    sim.add_argument("--sim-weights", choices=WEIGHT_FORMATS, help="how the weights are stored")
    sim.add_argument("--sim-neighbor", action="append", type=_neighbour_spec, default=[], metavar="SPEC")
    sim.add_argument(
        "--sim-gpu-share",
        metavar="FILE",
        help="one simulated card for every engine started with the same FILE: each sees what the others hold",
    )
    sim.add_argument(
        "--sim-display",
        type=_display,
        help=f"display server memory, e.g. 300MiB (consumer cards: {DISPLAY_NEIGHBOUR}; 0 for none)",
    )
    sim.add_argument("--sim-drift", type=_rate, default=0.0, metavar="RATE", help="a leak, e.g. 0.2GiB/h")
    sim.add_argument(
        "--sim-frag",
        type=float,
        help="allocator fragmentation ceiling (share of the working set; default 0.3, or the box's)",
    )
    sim.add_argument("--sim-startup-seconds", type=float, default=60.0, help="simulated start-up time")
    sim.add_argument("--time-scale", type=float, default=1.0, help="simulated seconds per wall second")
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument(
        "--box-seed",
        type=int,
        metavar="N",
        help="draw the box's hidden truth (CUDA context, non-torch memory, activations, graphs, "
        "fragmentation, a desktop, the driver's reserve) from N; GET /sim/truth tells it",
    )
    serve.set_defaults(handler=_run_serve, prog=serve.prog)


def _add_load(commands: argparse._SubParsersAction[Parser]) -> None:
    load = commands.add_parser(
        "load",
        help="send completion load to the simulator or a real vLLM",
        description="Send --concurrency streams of completions; print progress and a summary.",
    )
    load.add_argument("--url", required=True, help="the engine's base URL")
    load.add_argument("--concurrency", type=positive_int, default=4)
    load.add_argument("--prompt-tokens", type=positive_int, required=True)
    load.add_argument("--max-tokens", type=positive_int, default=512)
    stop = load.add_mutually_exclusive_group(required=True)
    stop.add_argument("--duration", type=parse_duration, help="wall time to keep sending, e.g. 30s")
    stop.add_argument("--requests", type=positive_int, help="how many requests in all")
    load.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="let the model stop early (default: always generate --max-tokens)",
    )
    load.add_argument(
        "--prompt-logprobs", type=int, help="ask for prompt logprobs (memory the profile misses)"
    )
    load.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    load.add_argument(
        "--retry-refused",
        action="store_true",
        help="keep sending while the engine is down (a restart) instead of stopping at the first refusal",
    )
    load.set_defaults(handler=_run_load, prog=load.prog)
    examples(
        load,
        """\
examples:
  tunerd sim load --url http://127.0.0.1:8000 --concurrency 4 --prompt-tokens 2000 --duration 60s
  tunerd sim load --url http://127.0.0.1:8000 --prompt-tokens 30000 --requests 8 --retry-refused

exit status: 0 every request answered, 1 one failed, 2 bad usage.
""",
    )


def _shape(args: argparse.Namespace) -> ModelShape:
    if args.sim_model_config:
        return shape_from_config(load_model_config(args.sim_model_config), name=args.sim_model_config)
    return builtin_model(args.sim_model)


def _run_serve(args: argparse.Namespace) -> int:
    if args.tensor_parallel_size != 1:
        raise UsageError("the simulator runs one GPU: --tensor-parallel-size must be 1")
    if args.time_scale <= 0:
        raise UsageError("--time-scale must be positive")
    shape = _shape(args)
    try:
        profile = gpu_profile(args.sim_gpu) if args.sim_gpu_mem is None else custom_gpu(args.sim_gpu_mem)
    except ValueError as error:
        raise UsageError(str(error)) from None
    if args.box_seed is not None:
        box = draw_box(args.box_seed, profile)
        display = args.sim_display if args.sim_display is not None else box.desktop_bytes
        box = replace(
            box, desktop_bytes=display, frag_max=args.sim_frag if args.sim_frag is not None else box.frag_max
        )
    else:
        display = (
            args.sim_display
            if args.sim_display is not None
            else (parse_size(DISPLAY_NEIGHBOUR) if profile.consumer else 0)
        )
        frag = args.sim_frag if args.sim_frag is not None else 0.3
        box = default_box(profile, frag_max=frag, desktop_bytes=display)
    neighbours = [Neighbour(NEIGHBOUR_PID_BASE, "Xorg", display, kind=GRAPHICS)] if display else []
    for offset, (held, start, growth, name) in enumerate(args.sim_neighbor, start=1):
        neighbours.append(
            Neighbour(NEIGHBOUR_PID_BASE + offset, name or f"neighbour-{offset}", held, start, growth)
        )
    threshold = gc_threshold(os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
    max_len = args.max_model_len if args.max_model_len not in (None, -1) else None
    settings = EngineSettings(
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=max_len,
        max_num_seqs=args.max_num_seqs or profile.vllm_default_max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens or profile.vllm_default_max_num_batched_tokens,
        kv_cache_dtype=KV_DTYPE_WORDS[args.kv_cache_dtype],
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        enable_chunked_prefill=args.enable_chunked_prefill,
        enable_prefix_caching=args.enable_prefix_caching,
        enforce_eager=args.enforce_eager,
    )
    weights = args.sim_weights or shape.native_weights
    gpu = SimGpu(
        profile,
        neighbours,
        driver_reserve_bytes=box.driver_reserve_bytes if args.box_seed is not None else None,
    )
    clock = SimClock(args.time_scale)
    model = args.model or args.model_tag or shape.name
    served = (args.served_model_name or [model])[0]
    explicit = {
        key: value
        for key, value in vars(args).items()
        if key not in {"handler", "prog", "command", "sim_command"} and value not in (None, [], False)
    }

    def factory(now: float) -> SimEngine:
        return SimEngine(
            shape,
            gpu,
            weights,
            settings,
            pid=server.pid,
            now=now,
            drift_bytes_per_s=args.sim_drift,
            seed=args.seed,
            box=box,
            gc_threshold=threshold,
        )

    def truth_engine(wanted: EngineSettings, now: float, engine_bytes: int) -> SimEngine:
        """A fresh engine for the truth search: this box, the neighbours as they hold now,
        the allocator at its worst (``/sim/truth``)."""
        frozen = [
            replace(neighbour, size=held, start=0.0, growth_bytes_per_s=0.0)
            for neighbour, held in gpu.neighbour_bytes(now, engine_bytes)
        ]
        peers = len(gpu.peers)  # neighbour_bytes lists the other engines first
        card = SimGpu(
            profile,
            frozen[peers:],
            peers=frozen[:peers],
            driver_reserve_bytes=gpu.driver_reserve_bytes,
        )
        return SimEngine(shape, card, weights, wanted, pid=0, seed=args.seed, box=box, worst_case=True)

    options = ServeOptions(
        host=args.host,
        port=args.port,
        served_model_name=served,
        model=model,
        shutdown_timeout=args.shutdown_timeout,
        startup_seconds=args.sim_startup_seconds,
        non_default_args=explicit,
        max_num_queued_reqs=args.max_num_queued_reqs,
        max_num_queued_tokens=args.max_num_queued_tokens,
    )
    board = GpuBoard(args.sim_gpu_share, os.getpid()) if args.sim_gpu_share else None
    server = SimServer(factory, options, clock, board=board, gpu=gpu, box=box, truth_engine=truth_engine)
    return server.run()


def _run_load(args: argparse.Namespace) -> int:
    options = LoadOptions(
        url=args.url,
        concurrency=args.concurrency,
        prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens,
        duration=args.duration,
        requests=args.requests,
        ignore_eos=args.ignore_eos,
        prompt_logprobs=args.prompt_logprobs,
        timeout=args.timeout,
        retry_refused=args.retry_refused,
    )
    result = run_load(options, progress=sys.stderr)
    sys.stdout.write(result.summary() + "\n")
    return EXIT_OK if result.failed == 0 and result.ok > 0 else EXIT_NO
