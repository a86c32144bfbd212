"""``tunerd history``: every recorded action with its evidence, newest first (DESIGN §4.8).

Reads the state database read-only, so it works while the daemon is down (and never blocks
it). The state directory comes from ``--state-dir``, else ``state_dir`` in ``--config``, else
``/var/lib/tunerd``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from tunerd.commands import summary
from tunerd.commands.common import EXIT_OK, Parser, UsageError, examples, positive_int
from tunerd.paths import DEFAULT_CONFIG, DEFAULT_STATE_DIR
from tunerd.state import State, StateError
from tunerd.yamlfile import YamlError, load_yaml

__all__ = ["add_state_arguments", "register", "state_dir_of"]


def register(subparsers: argparse._SubParsersAction[Parser]) -> None:
    parser = subparsers.add_parser(
        "history",
        help=summary("history"),
        description="Show what tunerd did (or proposed), newest first, from its state database.",
    )
    parser.add_argument("--json", action="store_true", help='one JSON object: {"actions": [...]}')
    parser.add_argument("--engine", metavar="NAME", help="only this engine")
    parser.add_argument(
        "--limit", type=positive_int, default=50, metavar="N", help="at most N records (default 50)"
    )
    add_state_arguments(parser)
    parser.set_defaults(handler=_run, prog=parser.prog)
    examples(
        parser,
        """\
examples:
  tunerd history
  tunerd history --engine llama31-8b --limit 20
  tunerd history --json | jq '.actions[] | select(.kind == "tune")'

exit status: 0 shown (also when nothing is recorded yet), 2 bad usage.
""",
    )


def add_state_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--state-dir",
        metavar="DIR",
        help=f"the state directory (default: from the config, else {DEFAULT_STATE_DIR})",
    )
    parser.add_argument("--config", metavar="FILE", help=f"the daemon's config (default {DEFAULT_CONFIG})")


def state_dir_of(args: argparse.Namespace) -> str:
    """``--state-dir``, else ``state_dir`` in ``--config``, else the default."""
    if args.state_dir:
        return str(args.state_dir)
    config = args.config or DEFAULT_CONFIG
    try:
        data = load_yaml(config).data
    except YamlError as error:
        if args.config:  # asked for explicitly: it must be readable
            raise UsageError(str(error).splitlines()[0]) from None
        return DEFAULT_STATE_DIR
    state_dir = data.get("state_dir") if isinstance(data, dict) else None
    return str(state_dir) if state_dir else DEFAULT_STATE_DIR


def _value(value: Any) -> str:
    """A knob's value for people: an unset knob is vLLM's default, never ``None``."""
    return "default" if value is None else str(value)


def _text(actions: list[dict[str, Any]]) -> str:
    if not actions:
        return "no actions recorded\n"
    lines = []
    for action in actions:
        before, after = action["from_settings"], action["to_settings"] or {}
        if before is None:  # nothing ran before (a first start): what it started with
            diff = (
                "with " + ", ".join(f"{knob} {_value(value)}" for knob, value in after.items())
                if after
                else ""
            )
        else:
            diff = ", ".join(
                f"{knob} {_value(before.get(knob))}→{_value(after.get(knob))}"
                for knob in sorted(set(before) | set(after))
                if before.get(knob) != after.get(knob)
            )
        lines.append(
            f"#{action['id']} {action['time']} {action['engine']} {action['kind']} ({action['mode']}) "
            f"{action['outcome']}{' — ' + diff if diff else ''}"
        )
        asked = action["kind"] in ("pin", "resume") or action["evidence"].get("asked_by")
        who = action["policy"] or ("by hand" if asked else "tunerd")
        reason = str(action["reason"]).removeprefix(f"{who}: ")  # a policy's reasons name it already
        lines.append(f"    {who}: {reason}")
    return "\n".join(lines) + "\n"


def _run(args: argparse.Namespace) -> int:
    state_dir = state_dir_of(args)
    try:
        state = State.open(state_dir, readonly=True)
    except StateError:
        actions: list[dict[str, Any]] = []
        print(f"{args.prog}: no state in {state_dir} yet", file=sys.stderr)
    else:
        try:
            actions = state.history(engine=args.engine, limit=args.limit)
        finally:
            state.close()
    if args.json:
        sys.stdout.write(json.dumps({"actions": actions}, indent=2) + "\n")
    else:
        sys.stdout.write(_text(actions))
    return EXIT_OK
