"""``tunerd plan``: the VRAM planner on the command line (DESIGN §4.2)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from typing import Any

from tunerd.commands import summary
from tunerd.commands.common import (
    EXIT_NO,
    EXIT_OK,
    Parser,
    UsageError,
    positive_int,
    size,
    token_count,
    utilization,
)
from tunerd.commands.history import state_dir_of
from tunerd.config import ConfigError, load_config
from tunerd.planner.bills import KV_DTYPES, VLLM_KV_DTYPE, VLLM_VERSION, WEIGHT_FORMATS
from tunerd.planner.calibration import (
    PLAN_UTILIZATIONS,
    Observation,
    calibrate,
    calibrated_plan,
    render_calibrated,
)
from tunerd.planner.gpus import GPU_PROFILES, GpuProfile, custom_gpu, gpu_profile
from tunerd.planner.recommend import PlanRequest, make_plan, safe_utilization
from tunerd.planner.report import plan_to_dict, render_text
from tunerd.planner.shapes import (
    BUILTIN_MODELS,
    ModelShape,
    builtin_model,
    load_model_config,
    shape_from_config,
)
from tunerd.state import State, StateError
from tunerd.units import format_size

__all__ = ["register", "run"]

_PLAN_DESCRIPTION = """\
Will this model, at this precision, serve this many requests of this context on this GPU?
Counts the four bills of a vLLM engine (weights from the model's shapes, the KV cache, the
activation peak of one step, the CUDA runtime), sizes the KV pool the way vLLM 0.33 does
at start-up, says whether the workload fits, and recommends vLLM flags that do.

Give --concurrency and --context to check a workload; give only one of them to ask the
inverse question (the longest context for that many requests, or the most requests of that
context). With --tensor-parallel N every byte figure is per GPU.
"""

_PLAN_EPILOG = """\
examples:
  tunerd plan --model llama-3.1-8b --weights awq --kv-dtype fp8 --gpu rtx4090 \\
              --concurrency 4 --context 32768
  tunerd plan --model qwen2.5-7b --gpu rtx4090 --concurrency 8          # longest context?
  tunerd plan --model-config ./config.json --gpu-mem 24GiB --context 32K --json
  tunerd plan --model llama-3.1-8b --gpu h100-80g --context 131072 --concurrency 16 --check
  tunerd plan --list                                                     # models and GPUs
  tunerd plan --list --json
  tunerd plan --calibrated main --gpu-memory-utilization 0.90            # on this box, measured

exit status: 0 planned (fits or not), 1 does not fit (only with --check), 2 bad input.
The assumptions behind each bill are printed by --explain and documented in docs/planner.md.
"""


def register(subparsers: argparse._SubParsersAction[Parser]) -> None:
    parser = subparsers.add_parser(
        "plan",
        help=summary("plan"),
        description=_PLAN_DESCRIPTION,
        epilog=_PLAN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model = parser.add_argument_group("model (one of)")
    model.add_argument(
        "--model", metavar="NAME", help=f"a built-in shape: {', '.join(sorted(BUILTIN_MODELS))}"
    )
    model.add_argument(
        "--model-config",
        metavar="PATH",
        help="a Hugging Face config.json (explicit head_dim wins over hidden_size / num_attention_heads)",
    )
    precision = parser.add_argument_group("precision")
    precision.add_argument(
        "--weights",
        choices=WEIGHT_FORMATS,
        metavar="FORMAT",
        help=f"how the checkpoint stores its weights: {', '.join(WEIGHT_FORMATS)} "
        f"(default: what the model ships in; int8/int4/awq/gptq/fp8 mean "
        f"a pre-quantized checkpoint)",
    )
    precision.add_argument(
        "--kv-dtype",
        choices=KV_DTYPES,
        default="auto",
        metavar="DTYPE",
        help=f"KV cache dtype: {', '.join(KV_DTYPES)} (default auto: the model's 16-bit dtype)",
    )
    gpu = parser.add_argument_group("GPU (one of, or both to override the total)")
    gpu.add_argument("--gpu", metavar="NAME", help=f"a GPU profile: {', '.join(GPU_PROFILES)}")
    gpu.add_argument(
        "--gpu-mem",
        type=size,
        metavar="SIZE",
        help="the CUDA-visible total, e.g. 23.5GiB (what torch reports, not the box)",
    )
    workload = parser.add_argument_group("workload (at least one)")
    workload.add_argument(
        "--concurrency",
        type=positive_int,
        metavar="N",
        help="requests served at once, each up to --context tokens",
    )
    workload.add_argument(
        "--context",
        type=token_count,
        metavar="TOKENS",
        help="tokens per request, prompt plus output (32768, 32K = 32,768)",
    )
    engine = parser.add_argument_group("engine settings (default: the recommended ones)")
    engine.add_argument(
        "--gpu-memory-utilization",
        type=utilization,
        metavar="F",
        help="vLLM's budget as a share of the GPU (default: the safe maximum "
        "for the card, 0.92 on 24 GiB cards)",
    )
    engine.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        metavar="N",
        help="tokens per step (default 2048 on consumer cards, else vLLM's)",
    )
    engine.add_argument(
        "--max-num-seqs", type=positive_int, metavar="N", help="sequence slots (default 2 × concurrency)"
    )
    engine.add_argument(
        "--tensor-parallel",
        type=positive_int,
        default=1,
        metavar="N",
        help="GPUs the model is split across (bytes are then per GPU)",
    )
    engine.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no CUDA graphs (drops the graph memory, costs decode speed)",
    )
    engine.add_argument(
        "--vllm-version",
        type=_vllm_version,
        default=VLLM_VERSION,
        metavar="X.Y",
        help="the vLLM to plan for (default 0.33): before 0.17 its start-up profile sorts the "
        "sampler's logits (about 2.7× the memory per sequence), before 0.21 the CUDA graphs "
        "live outside its budget",
    )
    engine.add_argument(
        "--quantization",
        metavar="METHOD",
        help="pass vLLM an explicit --quantization METHOD; leave unset for "
        "AWQ/GPTQ checkpoints, which vLLM detects (an explicit 'awq' "
        "forces the slow kernel)",
    )
    box = parser.add_argument_group("calibrated: the box as a running engine showed it")
    box.add_argument(
        "--calibrated",
        metavar="ENGINE",
        help="plan from what ENGINE's last start showed of this box (tunerd's state: the log's "
        "weights and pool, the GPU's readings) instead of the model and GPU profiles; the engine "
        "settings flags then ask 'what would this give here' (default: a range of utilizations)",
    )
    box.add_argument(
        "--state-dir",
        metavar="DIR",
        help="tunerd's state directory (default: from --config, else its default)",
    )
    box.add_argument(
        "--config", metavar="FILE", help="tunerd's config, for its state_dir and the engine's bounds"
    )
    output = parser.add_argument_group("output")
    output.add_argument("--json", action="store_true", help="one JSON object on stdout")
    output.add_argument("--explain", action="store_true", help="show the arithmetic")
    output.add_argument("--check", action="store_true", help="exit 1 when the workload does not fit")
    output.add_argument(
        "--list", action="store_true", help="list the built-in models and GPU profiles, then exit"
    )
    parser.set_defaults(handler=run, prog=parser.prog)


def _vllm_version(text: str) -> tuple[int, int]:
    """``0.33`` or ``0.33.1`` (a ``+cpu`` local version is fine) → (0, 33)."""
    parts = text.strip().split("+", maxsplit=1)[0].split(".")
    if len(parts) < 2 or not all(part.isdecimal() for part in parts[:2]):
        raise argparse.ArgumentTypeError(f"expected a vLLM version such as 0.33, got '{text}'")
    return int(parts[0]), int(parts[1])


def _resolve_shape(args: argparse.Namespace) -> ModelShape:
    if args.model and args.model_config:
        raise UsageError("give --model or --model-config, not both")
    if args.model_config:
        return shape_from_config(load_model_config(args.model_config), name=args.model_config)
    if args.model:
        return builtin_model(args.model)
    raise UsageError("give --model NAME or --model-config PATH")


def _resolve_gpu(args: argparse.Namespace) -> GpuProfile:
    if args.gpu is None and args.gpu_mem is None:
        raise UsageError("give --gpu NAME or --gpu-mem SIZE")
    if args.gpu is None:
        return custom_gpu(args.gpu_mem)
    try:
        profile = gpu_profile(args.gpu)
    except ValueError as error:
        raise UsageError(str(error)) from None
    if args.gpu_mem is None:
        return profile
    return replace(profile, total_bytes=args.gpu_mem, reported=f"--gpu-mem {format_size(args.gpu_mem)}")


def _known_json() -> dict[str, Any]:
    """``plan --list --json``: the built-in models' shapes and the GPU profiles."""
    return {
        "models": {
            name: {
                "num_hidden_layers": shape.num_hidden_layers,
                "num_key_value_heads": shape.num_key_value_heads,
                "head_dim": shape.head_dim,
                "max_position_embeddings": shape.max_position_embeddings,
            }
            for name, shape in sorted(BUILTIN_MODELS.items())
        },
        "gpus": {
            name: {
                "total_bytes": profile.total_bytes,
                "safe_gpu_memory_utilization": round(safe_utilization(profile), 4),
                "description": profile.description,
            }
            for name, profile in GPU_PROFILES.items()
        },
    }


def _list_known() -> str:
    lines = ["Built-in models:"]
    for name, shape in sorted(BUILTIN_MODELS.items()):
        lines.append(
            f"  {name:<16} {shape.num_hidden_layers:>3} layers  {shape.num_key_value_heads:>2} KV heads"
            f"  head_dim {shape.head_dim:<4} {shape.max_position_embeddings:>7,} positions"
        )
    lines.append("GPU profiles (CUDA-visible total; safe gpu_memory_utilization):")
    for name, profile in GPU_PROFILES.items():
        lines.append(
            f"  {name:<10} {format_size(profile.total_bytes):>11}  "
            f"{safe_utilization(profile):.2f}  {profile.description}"
        )
    return "\n".join(lines) + "\n"


def _calibrated(args: argparse.Namespace) -> int:
    """``--calibrated ENGINE``: the planner on the box's own bills (tunerd's state)."""
    directory = state_dir_of(args)
    try:
        state = State.open(directory, readonly=True)
    except StateError as error:
        raise UsageError(f"cannot read tunerd's state in {directory}: {error}") from None
    try:
        found = [Observation.from_dict(item) for item in state.observations(args.calibrated, limit=5)]
    except StateError as error:
        raise UsageError(f"cannot read tunerd's state in {directory}: {error}") from None
    finally:
        state.close()
    observation = next((item for item in found if item is not None and calibrate(item) is not None), None)
    if observation is None:
        raise UsageError(
            f"nothing calibrated for engine '{args.calibrated}' in {directory}: tunerd has not seen it "
            "serve (its start-up figures and GPU readings) yet"
        )
    base = dict(observation.settings)
    asked = {
        knob: value
        for knob, value in (
            ("gpu_memory_utilization", args.gpu_memory_utilization),
            ("max_num_batched_tokens", args.max_num_batched_tokens),
            ("max_num_seqs", args.max_num_seqs),
        )
        if value is not None
    }
    if args.kv_dtype != "auto":
        asked["kv_cache_dtype"] = VLLM_KV_DTYPE.get(args.kv_dtype, args.kv_dtype)
    if asked:
        wanted = [{**base, **asked}]
    else:
        wanted = [{**base, "gpu_memory_utilization": u} for u in PLAN_UTILIZATIONS]
    bounds: dict[str, Any] = {}
    if args.config:
        try:
            config = load_config(args.config)
        except ConfigError as error:
            raise UsageError(str(error).splitlines()[0]) from None
        engine = next((e for e in config.engines if e.name == args.calibrated), None)
        bounds = dict(engine.bounds) if engine is not None else {}
        plan = calibrated_plan(observation, wanted, bounds, creep=config.fit.creep, margin=config.fit.margin)
    else:
        plan = calibrated_plan(observation, wanted, bounds)
    assert plan is not None
    if args.json:
        sys.stdout.write(json.dumps(plan, indent=2) + "\n")
    else:
        sys.stdout.write(render_calibrated(plan))
    return EXIT_OK


def run(args: argparse.Namespace) -> int:
    if args.list:
        sys.stdout.write(json.dumps(_known_json(), indent=2) + "\n" if args.json else _list_known())
        return EXIT_OK
    if args.calibrated:
        return _calibrated(args)
    shape = _resolve_shape(args)
    gpu = _resolve_gpu(args)
    if args.concurrency is None and args.context is None:
        raise UsageError("give --concurrency N, --context TOKENS, or both")
    weights = args.weights or shape.native_weights  # a Hub name's quantization included
    request = PlanRequest(
        shape=shape,
        gpu=gpu,
        weights=weights,
        kv_dtype=args.kv_dtype,
        concurrency=args.concurrency,
        context=args.context,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        tensor_parallel=args.tensor_parallel,
        enforce_eager=args.enforce_eager,
        quantization=args.quantization,
        vllm_version=args.vllm_version,
    )
    plan = make_plan(request)
    for warning in plan.warnings:
        print(f"tunerd plan: warning: {warning}", file=sys.stderr)
    if args.json:
        sys.stdout.write(json.dumps(plan_to_dict(plan), indent=2) + "\n")
    else:
        sys.stdout.write(render_text(plan, explain=args.explain))
    if args.check and not plan.scenario.fits:
        return EXIT_NO
    return EXIT_OK
