"""``tunerd gate``: serve the KV-aware admission proxy of every engine with a ``gate:`` block.

Its own process (``systemd/tunerd-gate.service``), so clients keep their connections while
tunerd restarts; tunerd tells it over the control socket to hold new requests across an
engine restart and to change its limits (docs/gate.md). ``tunerd gate status`` asks a running
gate what it holds. Exit 0 after SIGTERM or Ctrl-C (requests in flight finish first, up to
30 s), 2 for a bad config or no gated engine, 1 when it cannot listen.
"""

from __future__ import annotations

import argparse
import json
import sys

from tunerd import logs
from tunerd.commands import summary
from tunerd.commands.common import EXIT_NO_DAEMON, EXIT_OK, Parser, UsageError, examples
from tunerd.commands.config import load_or_usage_error
from tunerd.config import Config
from tunerd.gate.client import GateClient
from tunerd.gate.proxy import run_gate
from tunerd.paths import DEFAULT_CONFIG

__all__ = ["register"]


def register(subparsers: argparse._SubParsersAction[Parser]) -> None:
    parser = subparsers.add_parser(
        "gate",
        help=summary("gate"),
        description=(
            "Serve an OpenAI-compatible proxy in front of each engine that has a gate: block. "
            "Requests are admitted while their KV need (prompt tokens, counted by the engine's own "
            "tokenizer, plus max_tokens) fits target_fraction of the engine's pool; long prompts run "
            "in their own lane; the rest wait in a bounded queue (429 with Retry-After when it is "
            "full, 503 after max_wait). tunerd holds new requests here while it restarts the engine."
        ),
    )
    examples(
        parser,
        """\
examples:
  tunerd gate --config /etc/tunerd/tunerd.yaml          serve (systemd runs this; docs/gate.md)
  tunerd gate status --config /etc/tunerd/tunerd.yaml   ask a running gate

exit status: 0 stopped, 2 a bad config or no engine with a gate: block.
""",
    )
    parser.add_argument(
        "--config", default=DEFAULT_CONFIG, help=f"the config file (default {DEFAULT_CONFIG})"
    )
    actions = parser.add_subparsers(dest="action", metavar="[status]", title="without an action it serves")
    status = actions.add_parser(
        "status", help="what a running gate holds: per engine its pool, queue, limits, decisions"
    )
    # SUPPRESS: `tunerd gate --config F status` keeps F (a sub-command's default would replace it)
    status.add_argument(
        "--config", default=argparse.SUPPRESS, help=f"the config file (default {DEFAULT_CONFIG})"
    )
    status.add_argument("--json", action="store_true", help="the control socket's answer as it is")
    examples(
        status,
        """\
examples:
  tunerd gate status --config /etc/tunerd/tunerd.yaml
  tunerd gate status --json

exit status: 0 shown, 2 bad usage or config, 3 no gate answered on its control socket.
""",
    )
    parser.set_defaults(handler=_gate, prog=parser.prog)


def _gate(args: argparse.Namespace) -> int:
    config = load_or_usage_error(args.config)
    if args.action == "status":
        return _status(config, args.json)
    if not config.gated():
        raise UsageError(f"{args.config}: no engine has a gate: block (docs/gate.md shows one)")
    logs.configure()
    return run_gate(config)


def _status(config: Config, as_json: bool) -> int:
    path = config.gate_control()
    reply = GateClient(path, deadline=5.0).status()
    if not reply.ok:
        print(
            f"tunerd gate status: no gate answers at {path}: {reply.error}; is tunerd gate running?",
            file=sys.stderr,
        )
        return EXIT_NO_DAEMON
    data = reply.data
    if as_json:
        print(json.dumps(data, indent=2))
        return EXIT_OK
    for name, gate in data.get("engines", {}).items():
        limits = gate.get("limits", {})
        held = f"HELD ({gate.get('hold_reason')})" if gate.get("held") else "open"
        print(
            f"{name}  {held}  listen {gate.get('listen')} → {gate.get('upstream')}  "
            f"engine {'up' if gate.get('engine_up') else 'down'}"
        )
        pool = gate.get("pool_tokens")
        print(
            f"  pool {pool if pool is None else f'{pool:,}'} tokens · budget {gate.get('budget_tokens')} "
            f"(target {limits.get('target_fraction')}) · long ≥ {limits.get('long_threshold')} "
            f"lane {limits.get('long_lane')} · max concurrency {limits.get('max_concurrency') or 'pool'}"
        )
        print(
            f"  in flight {gate.get('in_flight')} ({gate.get('in_flight_tokens'):,} tokens) · "
            f"queued {gate.get('queued')} ({gate.get('queued_tokens'):,} tokens)"
        )
        decisions = gate.get("decisions") or {}
        if decisions:
            print("  decisions: " + ", ".join(f"{k} {v}" for k, v in decisions.items()))
    return EXIT_OK
