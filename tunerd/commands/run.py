"""``tunerd run``: the loop that watches and tunes the engines in the config (DESIGN §4.1).

Logs are JSON lines on stdout (:mod:`tunerd.logs`; a console format in a terminal). Under
systemd (``systemd/tunerd.service``, ``Type=notify``) it says ``READY=1`` once its sources
answer (before the engines start: a first start can outlast systemd's start timeout), a
one-line ``STATUS=`` each tick, ``WATCHDOG=1`` from the GPU sampling job and ``STOPPING=1`` when
it stops. SIGTERM or Ctrl-C stop tunerd and leave the engines serving; the next ``tunerd run``
adopts them. SIGHUP (or ``systemctl reload tunerd``) reloads the config and policies between
two ticks — all or nothing: a bad file keeps the running ones and says why
(:meth:`Daemon.reload`). It serves ``tunerd status`` on a unix socket and its own /metrics, and
sends alerts to the ``notify:`` sinks (docs/notify.md); the variables the config names as
secrets are redacted from the log and kept from the engines and hooks (docs/security.md).
Exit 0 when stopped, 2 for a bad config, 1 when ticks kept failing (systemd then starts a
clean one).
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
from pathlib import Path
from types import FrameType

from tunerd import __version__, logs
from tunerd.commands import summary
from tunerd.commands.common import EXIT_NO, EXIT_OK, Parser, UsageError, examples, positive_int
from tunerd.commands.config import load_or_usage_error
from tunerd.daemon import Daemon, secret_names
from tunerd.paths import DEFAULT_CONFIG
from tunerd.policy.schema import PolicyError
from tunerd.state import StateError

__all__ = ["register"]


def register(subparsers: argparse._SubParsersAction[Parser]) -> None:
    parser = subparsers.add_parser(
        "run",
        help=summary("run"),
        description=(
            "Start (or adopt) every engine in the config, then each metrics interval: read the GPU "
            "and /metrics, evaluate the policies, and act as the mode allows (observe, advise, act). "
            "SIGTERM stops tunerd and leaves the engines serving."
        ),
    )
    parser.add_argument(
        "--config", default=DEFAULT_CONFIG, help=f"the config file (default {DEFAULT_CONFIG})"
    )
    parser.add_argument(
        "--ticks", type=positive_int, metavar="N", help="stop after N ticks (for tests and demos)"
    )
    parser.set_defaults(handler=_run, prog=parser.prog)
    examples(
        parser,
        """\
examples:
  tunerd run --config /etc/tunerd/tunerd.yaml     what systemd runs (docs/install.md)
  tunerd run --config tunerd.yaml --ticks 10      ten ticks, then stop (a try-out)

exit status: 0 stopped (SIGTERM; the engines keep serving), 1 the loop kept failing, 2 a
bad config or another tunerd on this host.
""",
    )


def _run(args: argparse.Namespace) -> int:
    logs.configure()
    config = load_or_usage_error(args.config)
    logs.redact_also(secret_names(config))  # url_env/secret_env may name any variable
    try:
        daemon = Daemon(config)
    except (PolicyError, StateError, ValueError) as error:
        raise UsageError(str(error)) from None
    stop = threading.Event()

    def on_signal(number: int, frame: FrameType | None) -> None:
        stop.set()

    def on_hangup(number: int, frame: FrameType | None) -> None:
        daemon.reload_requested.set()  # the loop reloads between ticks, never inside one

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, on_hangup)
    # the first and the last line: which tunerd, with which config (a journal read months later)
    said = {"version": __version__, "config": str(Path(args.config).resolve()), "pid": os.getpid()}
    logs.say(
        "tunerd_starting",
        **said,
        mode=str(config.mode),
        engines=[engine.name for engine in config.engines],
        state_dir=str(config.state_dir),
    )
    broke: BaseException | None = None
    try:
        daemon.start()
        daemon.run(stop, ticks=args.ticks)
    except BaseException as error:
        broke = error
        raise
    finally:
        daemon.close()
        # ticks kept failing (said in the log): exit 1, so that systemd's Restart=on-failure
        # starts a clean tunerd, which reconciles the engines with the state
        if broke is not None:
            why, code = f"{type(broke).__name__}: {broke}", EXIT_NO
        else:
            why = daemon.failure or ("asked to stop" if stop.is_set() else "its ticks were done")
            code = EXIT_NO if daemon.failure else EXIT_OK
        logs.say("tunerd_stopped", **said, reason=why, exit_code=code)
    return EXIT_NO if daemon.failure else EXIT_OK
