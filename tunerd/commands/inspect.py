"""``tunerd inspect metrics|log|gpu``: what tunerd sees, for debugging a box by hand.

Each prints the normalized object (``--json``, DESIGN §4.3/§4.4) or a short human summary.
Exit status: 0 read fine; 1 read but unusable (junk on a metrics page, an unreachable URL,
no GPU or driver); 2 bad input (a missing file, a bad flag).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tunerd.commands import summary
from tunerd.commands.common import EXIT_NO, EXIT_OK, Parser, UsageError, examples, positive_int
from tunerd.diagnosis import LogDiagnosis, diagnose
from tunerd.gpu import GpuReading, GpuUnavailable, require_gpus
from tunerd.sources.gpu import GpuSource
from tunerd.sources.select import gpu_source
from tunerd.sources.vllm_metrics import MetricsClient, MetricsSnapshot, ScrapeError, parse
from tunerd.units import format_size

__all__ = ["register"]

GPU_SOURCES = ("nvml", "nvidia-smi", "sim", "none")

_EPILOG = """\
examples:
  tunerd inspect metrics http://127.0.0.1:8000 --json     # a live engine (adds /metrics)
  tunerd inspect metrics saved-page.txt                   # a saved page
  tunerd inspect log /var/log/vllm.log --json             # start-up figures and the crash
  journalctl -u vllm -o cat | tunerd inspect log -        # from a pipe
  tunerd inspect gpu --source nvidia-smi
  tunerd inspect gpu --source sim --url http://127.0.0.1:8000 --json

exit status: 0 read fine, 1 read but unusable (junk, unreachable, no GPU), 2 bad input.
"""


def register(subparsers: argparse._SubParsersAction[Parser]) -> None:
    parser = subparsers.add_parser(
        "inspect",
        help=summary("inspect"),
        description="Read one source the way the daemon does and print what it makes of it.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(handler=lambda _args: _missing_target(parser), prog=parser.prog)
    targets = parser.add_subparsers(title="what", dest="target", metavar="WHAT", parser_class=Parser)

    metrics = targets.add_parser(
        "metrics",
        help="parse a vLLM /metrics page (file or URL) into the normalized snapshot",
        description="Parse one vLLM /metrics page (vLLM 0.33 and older) into DESIGN §4.3's snapshot.",
    )
    metrics.add_argument(
        "source", metavar="SRC", help="a file, '-' for stdin, or http(s)://HOST:PORT[/metrics]"
    )
    metrics.add_argument(
        "--timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="for a URL: give up after this long (default 5)",
    )
    metrics.add_argument("--json", action="store_true", help="one JSON object on stdout")
    metrics.set_defaults(handler=_run_metrics, prog=metrics.prog)
    examples(
        metrics,
        """\
examples:
  tunerd inspect metrics http://127.0.0.1:8000/metrics
  curl -s http://127.0.0.1:8000/metrics | tunerd inspect metrics -
  tunerd inspect metrics saved-page.txt --json

exit status: 0 read, 1 the page held junk (reported, never raised), 2 bad usage.
""",
    )

    log = targets.add_parser(
        "log",
        help="parse a vLLM log into start-up figures and a crash diagnosis",
        description="Read a vLLM log (file or '-') for its start-up memory figures and why it died.",
    )
    log.add_argument("source", metavar="SRC", help="a log file, or '-' for stdin")
    log.add_argument(
        "--exit-code",
        type=int,
        metavar="N",
        help="the engine's exit status, if known: a non-zero exit nothing explains is 'unknown'",
    )
    log.add_argument("--json", action="store_true", help="one JSON object on stdout")
    log.set_defaults(handler=_run_log, prog=log.prog)
    examples(
        log,
        """\
examples:
  tunerd inspect log /var/lib/tunerd/engines/llama31-8b.log.1
  journalctl -u vllm --since "1 hour ago" -o cat | tunerd inspect log - --exit-code 1
  tunerd inspect log engine.log --json

exit status: 0 read, 2 bad usage or a file that cannot be read.
""",
    )

    gpu = targets.add_parser(
        "gpu",
        help="take one GPU sample through a chosen backend",
        description="Take one sample of every GPU through NVML, nvidia-smi or the simulator.",
    )
    gpu.add_argument("--source", choices=GPU_SOURCES, default="nvml", help="the backend (default nvml)")
    gpu.add_argument("--url", metavar="URL", help="the simulator's base URL (with --source sim)")
    gpu.add_argument("--json", action="store_true", help="one JSON object on stdout")
    gpu.add_argument(
        "--timeout",
        type=positive_int,
        default=5,
        metavar="SECONDS",
        help="nvidia-smi and sim: give up after this long (default 5)",
    )
    gpu.set_defaults(handler=_run_gpu, prog=gpu.prog)
    examples(
        gpu,
        """\
examples:
  tunerd inspect gpu
  tunerd inspect gpu --source nvidia-smi --json
  tunerd inspect gpu --source sim --url http://127.0.0.1:8000

exit status: 0 sampled, 1 no GPU or no driver, 2 bad usage.
""",
    )


def _missing_target(parser: Parser) -> int:
    parser.error("say what to inspect: metrics, log or gpu")


def _read_text(source: str) -> str:
    if source == "-":
        return sys.stdin.read()
    path = Path(source)
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        raise UsageError(f"{source}: no such file") from None
    except IsADirectoryError:
        raise UsageError(f"{source}: is a directory") from None
    except OSError as error:
        raise UsageError(f"{source}: cannot read: {error.strerror}") from None


def _print_json(data: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


# -- metrics --------------------------------------------------------------------------------


def _run_metrics(args: argparse.Namespace) -> int:
    source: str = args.source
    if source.startswith(("http://", "https://")):
        base = source.removesuffix("/").removesuffix("/metrics")
        client = MetricsClient(base, timeout=args.timeout)
        try:
            text = client.fetch()
        except ScrapeError as error:
            if error.kind == "invalid_url":
                raise UsageError(str(error)) from None
            print(f"{args.prog}: {error}", file=sys.stderr)
            return EXIT_NO
        finally:
            client.close()
    else:
        text = _read_text(source)
    snapshot = parse(text)
    if args.json:
        _print_json(snapshot.to_dict())
    else:
        sys.stdout.write(_metrics_text(snapshot))
    for problem in snapshot.problems:
        print(f"{args.prog}: {problem}", file=sys.stderr)
    return EXIT_OK if snapshot.ok else EXIT_NO


def _show(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _metrics_text(snapshot: MetricsSnapshot) -> str:
    rows = [
        ("model", snapshot.model_name),
        ("engines", snapshot.engine_count),
        ("KV cache usage", f"{snapshot.kv_cache_usage:.1%}" if snapshot.kv_cache_usage is not None else None),
        ("KV capacity (tokens)", snapshot.kv_cache_size_tokens),
        ("running", snapshot.num_requests_running),
        ("waiting", snapshot.num_requests_waiting),
        ("waiting for capacity", snapshot.num_requests_waiting_capacity),
        ("preemptions (total)", snapshot.num_preemptions_total),
        ("prompt tokens (total)", snapshot.prompt_tokens_total),
        ("generation tokens (total)", snapshot.generation_tokens_total),
        ("gpu_memory_utilization", snapshot.gpu_memory_utilization),
        ("cache dtype", snapshot.cache_dtype),
        ("blocks × block size", f"{_show(snapshot.num_gpu_blocks)} × {_show(snapshot.block_size)}"),
    ]
    lines = [f"  {name:<27}{_show(value)}" for name, value in rows]
    if snapshot.engine_count > 1:
        lines.append("  per engine:")
        for engine in snapshot.engines:
            usage = "-" if engine.kv_cache_usage is None else f"{engine.kv_cache_usage:.1%}"  # as the total's
            lines.append(
                f"    engine {engine.engine}: usage {usage}, running "
                f"{_show(engine.num_requests_running)}, waiting {_show(engine.num_requests_waiting)}, "
                f"capacity {_show(engine.kv_cache_size_tokens)} tokens"
            )
    return "\n".join(lines) + "\n"


# -- log ------------------------------------------------------------------------------------


def _run_log(args: argparse.Namespace) -> int:
    text = _read_text(args.source)
    result = diagnose(text.splitlines(), exit_code=args.exit_code)
    if args.json:
        _print_json(result.to_dict())
    else:
        sys.stdout.write(_log_text(result))
    return EXIT_OK


def _log_text(result: LogDiagnosis) -> str:
    missing = "not in the log"

    def quantity(value: Any, unit: str) -> str:  # a figure the log lacks: said so, never "- GiB"
        return missing if value is None else f"{_show(value)} {unit}"

    concurrency = missing
    if result.max_concurrency is not None:
        concurrency = f"{_show(result.max_concurrency)}x"
        if result.max_model_len is not None:
            concurrency += f" at {_show(result.max_model_len)} tokens"
    lines = [
        f"  model loading          {quantity(result.model_loading_gib, 'GiB')}",
        f"  available KV memory    {quantity(result.available_kv_cache_gib, 'GiB')}",
        f"  KV cache size          {quantity(result.kv_cache_size_tokens, 'tokens')}",
        f"  max concurrency        {concurrency}",
        f"  server came up         {'yes' if result.ready else 'no'}",
        f"  shutdown requested     {'yes' if result.shutdown_requested else 'no'}",
    ]
    crash = result.crash
    if crash is None:
        lines.append("  crash                  none")
    else:
        lines.append(f"  crash                  {crash.kind} ({crash.phase})")
        lines.append(f"    {crash.message}")
        if crash.estimated_max_model_len is not None:
            lines.append(f"    vLLM estimates the maximum model length at {crash.estimated_max_model_len:,}")
        if crash.tried_to_allocate_bytes is not None:
            lines.append(f"    tried to allocate {format_size(crash.tried_to_allocate_bytes)}")
        for pid, used in crash.other_processes:
            lines.append(f"    process {pid} held {format_size(used)}")
    return "\n".join(lines) + "\n"


# -- gpu ------------------------------------------------------------------------------------


def _gpu_source(args: argparse.Namespace) -> GpuSource:
    if args.source == "sim" and not args.url:
        raise UsageError("--source sim needs --url (the simulator's base URL)")
    if args.url and args.source != "sim":
        raise UsageError("--url is only for --source sim")
    try:
        return gpu_source(args.source, args.url, timeout=float(args.timeout))
    except ValueError as error:
        raise UsageError(f"--source {args.source}: {error}") from None


def _run_gpu(args: argparse.Namespace) -> int:
    source = _gpu_source(args)
    try:
        reading = source.sample()
    finally:
        source.close()
    try:
        require_gpus(reading)
    except GpuUnavailable as error:
        print(f"{args.prog}: {error}", file=sys.stderr)
        return EXIT_NO
    if args.json:
        _print_json(reading.to_dict())
    else:
        sys.stdout.write(_gpu_text(reading))
    return EXIT_OK


_KIND_MARK = {"compute": "C", "graphics": "G", "compute+graphics": "C+G"}  # as nvidia-smi marks them


def _gpu_text(reading: GpuReading) -> str:
    lines = []
    for gpu in reading.gpus:
        used = format_size(gpu.memory_used_bytes) if gpu.memory_used_bytes is not None else "-"
        total = format_size(gpu.memory_total_bytes) if gpu.memory_total_bytes is not None else "-"
        free = format_size(gpu.memory_free_bytes) if gpu.memory_free_bytes is not None else "-"
        utilization = f"{gpu.utilization_ratio:.0%}" if gpu.utilization_ratio is not None else "-"
        lines.append(f"GPU {gpu.index} {gpu.name or '?'} {gpu.uuid or ''}".rstrip())
        if gpu.status != "ok":
            lines.append(f"  {gpu.status}: {gpu.error}")
            continue
        lines.append(f"  used {used} of {total}, free {free}, busy {utilization}")
        if gpu.processes is None:
            lines.append("  processes: cannot be read (no permission, or another PID namespace)")
        for process in gpu.processes or ():
            size = format_size(process.used_bytes) if process.used_bytes is not None else "-"
            mark = _KIND_MARK.get(process.kind or "", "?")
            lines.append(f"  pid {process.pid:<8} {mark:<3} {size:>11}  {process.name or '?'}")
        unattributed = gpu.unattributed_bytes
        if unattributed is not None:
            lines.append(f"  unattributed {format_size(unattributed):>11}  (held by no listed process)")
    lacking = reading.details.get("unsupported")
    if lacking:
        lines.append(f"not available from this driver or GPU: {lacking}")
    fallbacks = reading.details.get("process_calls")
    if fallbacks:
        lines.append(f"read through older calls: {fallbacks}")
    return "\n".join(lines) + "\n"
