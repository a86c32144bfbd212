"""``tunerd advise ENGINE``: right-size an engine's flags from what it served and what the box
showed (DESIGN §9.2): for ``max_model_len``, ``max_num_seqs``, ``max_num_batched_tokens``,
``gpu_memory_utilization`` and ``kv_cache_dtype`` a target, a lower and an upper bound, the
reason and the predicted pool.

What it reads: the engine's request histograms from its ``/metrics`` (the config's URL, or
``--url``, or a saved page with ``--metrics-file``); the box as tunerd's state has it (the
engine's last calibrated start) and the engine's bounds and settings from the config; or, with
no state, a start-up log (``--log``) for the pool and ``max_model_len``. Changes nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tunerd.commands import summary
from tunerd.commands.common import EXIT_OK, Parser, UsageError, positive_int
from tunerd.commands.history import state_dir_of
from tunerd.config import ConfigError, EngineConfig, load_config
from tunerd.diagnosis import diagnose
from tunerd.paths import DEFAULT_CONFIG
from tunerd.planner.calibration import DEFAULT_CREEP, DEFAULT_MARGIN_BYTES, Observation, calibrate
from tunerd.planner.rightsize import MIN_REQUESTS, Workload, advice_to_dict, advise, render_advice
from tunerd.sources.vllm_metrics import MetricsClient, ScrapeError, histograms, parse
from tunerd.state import State, StateError

__all__ = ["register"]

_EPILOG = """\
examples:
  tunerd advise main                                  the engine in /etc/tunerd/config.yaml
  tunerd advise main --config ./tunerd.yaml --json
  tunerd advise tiny --metrics-file page.txt --log engine.log   a saved page and start-up log
  tunerd advise main --min-requests 5                 size to fewer requests than 20

exit status: 0 advised, 2 bad input or nothing to read.
"""

#: The largest page or log read (a real vLLM page is about 50 KiB).
MAX_READ_BYTES = 64 * 1024 * 1024


def register(subparsers: argparse._SubParsersAction[Parser]) -> None:
    parser = subparsers.add_parser(
        "advise",
        help=summary("advise"),
        description=(
            "Right-size an engine's sizing flags from the requests it served (its /metrics "
            "histograms) and the box as tunerd measured it: target, lower and upper bound, the "
            "reason and the predicted KV pool for each. Changes nothing."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "engine", metavar="ENGINE", help="the engine's name (the config's, or any with --log)"
    )
    parser.add_argument("--config", metavar="FILE", help=f"tunerd's config (default {DEFAULT_CONFIG})")
    parser.add_argument("--state-dir", metavar="DIR", help="tunerd's state directory (default: the config's)")
    parser.add_argument("--url", help="the engine's base URL (default: the config's)")
    parser.add_argument("--metrics-file", metavar="FILE", help="a saved /metrics page instead of scraping")
    parser.add_argument(
        "--log", metavar="FILE", help="the engine's start-up log (its pool and max_model_len)"
    )
    parser.add_argument(
        "--min-requests",
        type=positive_int,
        default=MIN_REQUESTS,
        metavar="N",
        help=f"requests served before lengths are sized to them (default {MIN_REQUESTS})",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.set_defaults(handler=_run, prog=parser.prog)


def _read(path: str, what: str) -> str:
    try:
        with Path(path).open("rb") as handle:
            return handle.read(MAX_READ_BYTES).decode("utf-8", errors="replace")
    except OSError as error:
        raise UsageError(f"cannot read the {what} {path}: {error.strerror or error}") from None


def _engine_config(args: argparse.Namespace) -> tuple[EngineConfig | None, Any]:
    """The engine's config and the fit settings; none without a config to read (a config
    named on the command line must load)."""
    path = args.config or DEFAULT_CONFIG
    if not Path(path).exists():
        if args.config:
            raise UsageError(f"no config at {path}")
        return None, None
    try:
        config = load_config(path)
    except ConfigError as error:
        raise UsageError(str(error).splitlines()[0]) from None
    engine = next((item for item in config.engines if item.name == args.engine), None)
    if engine is None:
        names = ", ".join(item.name for item in config.engines)
        raise UsageError(f"no engine '{args.engine}' in {path} (engines: {names})")
    return engine, config.fit


def _observation(args: argparse.Namespace) -> Observation | None:
    if args.state_dir is None and args.config is None and args.log:
        return None  # a saved log and page: nothing of tunerd's to read
    directory = state_dir_of(args)
    if not (Path(directory) / "tunerd.db").exists():
        return None
    try:
        state = State.open(directory, readonly=True)
        try:
            found = state.observations(args.engine, limit=5)
        finally:
            state.close()
    except StateError:
        return None
    for item in found:
        observation = Observation.from_dict(item)
        if observation is not None and calibrate(observation) is not None:
            return observation
    return None


def _run(args: argparse.Namespace) -> int:
    engine, fit = _engine_config(args)
    if args.metrics_file:
        page = _read(args.metrics_file, "metrics page")
    else:
        url = args.url or (engine.url if engine is not None else None)
        if url is None:
            raise UsageError("give --config (the engine's URL), --url or --metrics-file")
        client = MetricsClient(url)
        try:
            page = client.fetch()
        except ScrapeError as error:
            raise UsageError(f"cannot read the engine's /metrics: {error}") from None
        finally:
            client.close()
    snapshot = parse(page)
    if snapshot.engine_count == 0:
        raise UsageError("no vLLM metrics on the page: is it a vLLM engine's /metrics?")
    workload = Workload.from_histograms(histograms(page))
    observation = _observation(args)
    settings: dict[str, Any] = dict(engine.settings) if engine is not None else {}
    pool = snapshot.kv_cache_size_tokens
    if args.log:
        figures = diagnose(_read(args.log, "log").splitlines())
        if figures.max_model_len is not None:
            settings.setdefault("max_model_len", figures.max_model_len)
        pool = pool or figures.kv_cache_size_tokens
    if observation is not None:
        settings = {**settings, **observation.settings}
        pool = pool or observation.kv_cache_tokens
    if snapshot.gpu_memory_utilization is not None:
        settings.setdefault("gpu_memory_utilization", snapshot.gpu_memory_utilization)
    if snapshot.cache_dtype is not None:
        settings.setdefault("kv_cache_dtype", snapshot.cache_dtype)
    advice = advise(
        settings,
        workload,
        pool_tokens=pool,
        observation=observation,
        bounds=dict(engine.bounds) if engine is not None else {},
        creep=fit.creep if fit is not None else DEFAULT_CREEP,
        margin=fit.margin if fit is not None else DEFAULT_MARGIN_BYTES,
        min_requests=args.min_requests,
        block_size=snapshot.block_size or 16,
    )
    if args.json:
        document = {
            "engine": args.engine,
            "requests": workload.requests,
            "kv_cache_tokens": pool,
            "calibrated": observation is not None,
            "recommendation": advice_to_dict(advice),
        }
        sys.stdout.write(json.dumps(document, indent=2) + "\n")
    else:
        sys.stdout.write(render_advice(args.engine, advice, workload))
        if observation is None:
            sys.stdout.write(
                "\n  (nothing calibrated: utilization and batched tokens are kept; tunerd measures the "
                "box once it has seen the engine serve)\n"
            )
    return EXIT_OK
