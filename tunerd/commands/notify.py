"""``tunerd notify test [--config F]``: send a sample alert to every configured sink and print
each sink's outcome (DESIGN §4.1, §4.8). Exit 0 only when every sink accepted it.

One try per sink, no retries and no rate limiting — the first answer is what a person wants to
see — and the outcome in the sink's own terms (``errcode 310000: keywords not in content``).
No URL or secret is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from collections.abc import Sequence

from tunerd.clock import SYSTEM_CLOCK
from tunerd.commands import summary
from tunerd.commands.common import EXIT_NO, EXIT_OK, Parser, UsageError, examples, positive_float
from tunerd.commands.config import load_or_usage_error
from tunerd.config import DEFAULT_CONFIG, notify_targets
from tunerd.notify.alert import Action, Alert, fingerprint
from tunerd.notify.dispatch import send

__all__ = ["register", "sample_alert"]


def register(subparsers: argparse._SubParsersAction[Parser]) -> None:
    parser = subparsers.add_parser("notify", help=summary("notify"))
    examples(
        parser,
        """\
examples:
  tunerd notify test --config /etc/tunerd/tunerd.yaml
""",
    )
    commands = parser.add_subparsers(dest="notify_command", metavar="COMMAND", required=True)
    test = commands.add_parser(
        "test",
        help="send a sample alert to every configured sink; exit 0 only if all accepted it",
        description=(
            "Sends one sample alert (marked as a test) to every sink under notify: in the config, "
            "once each, and prints one line per sink: its name, kind and what the service "
            "answered. Exit 0 when every sink accepted it, 1 when one did not, 2 for a bad config."
        ),
    )
    test.add_argument("--config", default=DEFAULT_CONFIG, help=f"the config file (default {DEFAULT_CONFIG})")
    test.add_argument(
        "--json",
        action="store_true",
        help='one JSON object: {"ok", "accepted", "sinks": [{"name", "kind", "outcome", "detail"}]} '
        "(outcome: ok, retry or permanent)",
    )
    test.add_argument(
        "--timeout", type=positive_float, default=10.0, metavar="SECONDS", help="per sink (default 10)"
    )
    test.set_defaults(handler=_test, prog=test.prog)
    examples(
        test,
        """\
examples:
  tunerd notify test --config /etc/tunerd/tunerd.yaml
  tunerd notify test --timeout 10 --json

exit status: 0 every sink accepted it, 1 one did not, 2 a bad config.
""",
    )


def sample_alert(now: float, host: str, engines: Sequence[str], link: str | None = None) -> Alert:
    """What a real tune alert looks like, marked as a test, about the first configured engine
    and naming them all."""
    engine = engines[0] if engines else "?"
    return Alert(
        severity="warning",
        status="firing",
        title=f"kv-pool-saturated on {engine}",
        summary=(
            f"This is a test from `tunerd notify test` on {host} (engines: {', '.join(engines) or 'none'}): "
            "nothing happened to any engine."
        ),
        engine=engine,
        host=host,
        time=now,
        policy="kv-pool-saturated",
        fingerprint=fingerprint(engine, "notify-test"),
        evidence={"signals": {"kv_cache_usage": 0.97, "num_requests_waiting": 3.0}},
        action=Action("tune", {"max_num_seqs": 16}, {"max_num_seqs": 12}, "proposed"),
        undo=f"tunerd rollback {engine}",
        test=True,
        link=link,
    )


#: sinks that keep an alert open until told otherwise: a test is resolved there at once
RESOLVED_AT_ONCE = frozenset({"alertmanager"})


def _test(args: argparse.Namespace) -> int:
    config = load_or_usage_error(args.config)
    targets = notify_targets(config, os.environ)
    if not targets:
        raise UsageError(f"{args.config}: no notify sinks configured (see docs/notify.md)")
    host = socket.gethostname()
    alert = sample_alert(
        SYSTEM_CLOCK.now(), host, [engine.name for engine in config.engines], config.metrics_link(host)
    )
    accepted = 0
    sinks = []
    for target in targets:
        outcome = send(target, [alert], SYSTEM_CLOCK.now(), args.timeout)
        if outcome.ok and target.kind in RESOLVED_AT_ONCE:  # not left open for minutes
            now = SYSTEM_CLOCK.now()
            send(target, [alert.resolved(now, "the test is over")], now, args.timeout)
        verdict = {"ok": "accepted", "retry": "not accepted (try again later)", "permanent": "refused"}[
            outcome.kind
        ]
        sinks.append(
            {"name": target.name, "kind": target.kind, "outcome": outcome.kind, "detail": outcome.detail}
        )
        if not args.json:
            print(f"{target.name} ({target.kind}): {verdict}: {outcome.detail}", flush=True)
        accepted += outcome.ok
    if args.json:
        print(json.dumps({"ok": accepted == len(targets), "accepted": accepted, "sinks": sinks}, indent=2))
    else:
        print(f"{accepted} of {len(targets)} sinks accepted the test alert")
    return EXIT_OK if accepted == len(targets) else EXIT_NO
