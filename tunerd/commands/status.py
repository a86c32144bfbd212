"""``tunerd status``: what the running daemon knows now (DESIGN §4.8), from its status API.

The socket is ``--socket``; else ``listen.status`` in ``--config``; else
``/run/tunerd/tunerd.sock`` when ``/run/tunerd`` exists (the service); else
``STATE_DIR/tunerd.sock`` — the daemon's own rule (:meth:`tunerd.config.Config.status_socket`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import httpx

from tunerd.commands import summary
from tunerd.commands.common import EXIT_OK, NoDaemon, Parser, UsageError
from tunerd.commands.history import add_state_arguments, state_dir_of
from tunerd.paths import DEFAULT_CONFIG, RUN_DIR
from tunerd.sources.http import DeadlineExceeded, ResponseTooLarge, exchange
from tunerd.status import render
from tunerd.yamlfile import YamlError, load_yaml

__all__ = ["register"]


_EPILOG = """\
examples:
  tunerd status
  tunerd status --json | jq '.engines[] | {name, state}'
  tunerd status --socket /run/tunerd/tunerd.sock

exit status: 0 shown, 2 bad usage, 3 no tunerd answered (not running, or not yet started).
"""


def register(subparsers: argparse._SubParsersAction[Parser]) -> None:
    parser = subparsers.add_parser(
        "status",
        help=summary("status"),
        description=(
            "Ask the running tunerd for its status: each GPU's memory; per engine its state, "
            "settings, the memory bills (weights, KV pool, engine other, other processes, free), "
            "the pool, policy states, the restart budget and the last actions. One screen, or "
            "--json with every field of the contract. Colour only on a terminal; NO_COLOR turns "
            "it off."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", action="store_true", help="the status as one JSON object")
    add_socket_argument(parser)
    add_state_arguments(parser)
    parser.set_defaults(handler=_run, prog=parser.prog)


def socket_of(args: argparse.Namespace) -> Path:
    if args.socket:
        return Path(args.socket)
    try:
        data = load_yaml(args.config or DEFAULT_CONFIG).data
    except YamlError:
        data = None
    listen = data.get("listen") if isinstance(data, dict) else None
    if isinstance(listen, dict) and isinstance(listen.get("status"), str):
        return Path(listen["status"])
    if RUN_DIR.is_dir():
        return RUN_DIR / "tunerd.sock"
    return Path(state_dir_of(args)) / "tunerd.sock"


STATUS_MAX_BYTES = 16 << 20  # the status of many engines is tens of KiB
_WAKE_MAX_BYTES = 64 << 10


def fetch(path: Path, timeout: float = 10.0) -> dict[str, Any]:
    """The daemon's status from its socket, all of it within ``timeout`` seconds and
    :data:`STATUS_MAX_BYTES`; :class:`UsageError` saying why otherwise."""
    return ask(path, "/status", timeout, STATUS_MAX_BYTES, what="a status")


def ask(path: Path, resource: str, timeout: float, max_bytes: int, what: str) -> dict[str, Any]:
    """``GET resource`` of the daemon's socket: its JSON object, all of it within ``timeout``
    seconds and ``max_bytes``; :class:`UsageError` saying why otherwise (``what`` names the
    answer expected)."""
    if not path.exists():
        raise NoDaemon(f"no status socket at {path}: is tunerd running? (systemctl status tunerd)")
    try:
        reply = exchange(
            "GET",
            f"http://tunerd{resource}",
            deadline=timeout,
            max_bytes=max_bytes,
            transport=httpx.HTTPTransport(uds=str(path)),
        )
    except DeadlineExceeded:
        raise NoDaemon(f"tunerd did not answer on {path} within {timeout:g} s") from None
    except ResponseTooLarge:
        raise UsageError(f"tunerd's answer on {path} is over {max_bytes:,} bytes: ask for less") from None
    except httpx.HTTPError as error:
        raise NoDaemon(f"tunerd did not answer on {path}: {type(error).__name__}: {error}") from None
    text = reply.body.decode("utf-8", "replace")
    try:
        found = json.loads(text)
    except (ValueError, RecursionError):
        found = None
    if reply.status != 200:
        said = found.get("error") if isinstance(found, dict) else None
        problem = NoDaemon if reply.status == 503 else UsageError  # starting, or its loop busy
        raise problem(f"tunerd answered {reply.status}: {str(said or text.strip())[:500]}")
    if not isinstance(found, dict):
        raise UsageError(f"tunerd on {path} answered something that is not {what}: {text[:100]!r}")
    return found


def wake(path: Path) -> bool:
    """Ask the daemon on ``path`` to look at its state now; False when none answers (within
    5 s)."""
    if not path.exists():
        return False
    try:
        reply = exchange(
            "POST",
            "http://tunerd/wake",
            deadline=5.0,
            max_bytes=_WAKE_MAX_BYTES,
            transport=httpx.HTTPTransport(uds=str(path)),
        )
    except (httpx.HTTPError, OSError, ResponseTooLarge):
        return False
    return reply.status == 202


def add_socket_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--socket", metavar="PATH", help="the daemon's status socket (default: listen.status in --config)"
    )


def _run(args: argparse.Namespace) -> int:
    status = fetch(socket_of(args))
    if args.json:
        sys.stdout.write(json.dumps(status, indent=2) + "\n")
        return EXIT_OK
    color = sys.stdout.isatty() and not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb"
    sys.stdout.write(render(status, color=color))
    return EXIT_OK
