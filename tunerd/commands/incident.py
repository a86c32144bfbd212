"""``tunerd incident``, ``tunerd record`` and ``tunerd replay`` (docs/incidents.md).

``incident list|show`` read the state database read-only (they work while the daemon is down,
and after a crash loop: each incident was written before its restart began). ``record
--incident ID FILE`` writes an incident's recording as a file; ``replay FILE --policies P…``
runs policies over a recording and prints what they would have decided, beside what was.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tunerd.commands import summary
from tunerd.commands.common import EXIT_BAD_INPUT, EXIT_OK, Parser, UsageError, positive_int
from tunerd.commands.history import add_state_arguments, state_dir_of
from tunerd.incident import html_page, postmortem, render, unpack
from tunerd.policy.schema import PolicyError, load_policy_files
from tunerd.recording import Recording, RecordingError, compare, iter_json_lines, parse_lines, replay
from tunerd.state import State, StateError

__all__ = ["read_recording", "register"]

MAX_RECORDING_BYTES = 512 << 20  # a file larger than this is not a recording of tunerd's

_INCIDENT_EPILOG = """\
examples:
  tunerd incident list
  tunerd incident list --engine main --json
  tunerd incident show 12                  the post-mortem: what filled the GPU, who grew, what tunerd did
  tunerd incident show 12 --json
  tunerd incident show 12 --html oom.html  and the chart, on one page to open in a browser

exit status: 0 shown, 1 no such incident, 2 bad usage or no state.
"""

_REPLAY_EPILOG = """\
examples:
  tunerd record --incident 12 oom.jsonl
  tunerd replay oom.jsonl --policies /etc/tunerd/policies/*.yaml
  tunerd replay oom.jsonl --policies edited.yaml --json

Each decision is marked: = the same as recorded, + only the replayed policies decided it,
- only the recorded run did. The replay is open-loop: the recorded signals stand, whatever
the replayed policies would have changed (docs/incidents.md).

exit status: 0 replayed (whether or not the decisions differ), 2 a bad file or policy.
"""


def register(subparsers: argparse._SubParsersAction[Parser]) -> None:
    parser = subparsers.add_parser(
        "incident",
        help=summary("incident"),
        description="Post-mortems of every crash and action: list them, show one.",
        epilog=_INCIDENT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(handler=lambda _args: parser.error("say list or show"), prog=parser.prog)
    commands = parser.add_subparsers(
        title="what", dest="incident_command", metavar="WHAT", parser_class=Parser
    )
    listing = commands.add_parser("list", help="the incidents, newest first")
    listing.add_argument("--engine", metavar="NAME", help="only this engine")
    listing.add_argument("--limit", type=positive_int, default=50, metavar="N", help="at most N (default 50)")
    listing.add_argument("--json", action="store_true", help='one JSON object: {"incidents": [...]}')
    add_state_arguments(listing)
    listing.set_defaults(handler=_list, prog=listing.prog)
    show = commands.add_parser("show", help="one incident's post-mortem")
    show.add_argument("id", type=positive_int, metavar="ID")
    shown = show.add_mutually_exclusive_group()
    shown.add_argument("--json", action="store_true", help="the post-mortem as JSON")
    shown.add_argument(
        "--html",
        metavar="FILE",
        help="also write one HTML page: the chart (memory by bill, KV use, requests, every mark) "
        "and the post-mortem; nothing fetched, no scripts",
    )
    add_state_arguments(show)
    show.set_defaults(handler=_show, prog=show.prog)

    record = subparsers.add_parser(
        "record",
        help=summary("record"),
        description="Write an incident's recording (the signals, ticks and decisions around it) as a file.",
        epilog=_REPLAY_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    record.add_argument(
        "--incident", dest="id", type=positive_int, metavar="ID", help="the incident to write"
    )
    record.add_argument(
        "--for",
        dest="duration",
        nargs="+",  # `record ENGINE --for D FILE` (the contract's order) parses, and is answered
        metavar="D",
        help="ENGINE --for D FILE: the next D from the running daemon (not built yet)",
    )
    record.add_argument(
        "paths", nargs="+", metavar="[ENGINE] FILE", help="where to write it (JSON lines; - for stdout)"
    )
    add_state_arguments(record)
    record.set_defaults(handler=_record, prog=record.prog)

    again = subparsers.add_parser(
        "replay",
        help=summary("replay"),
        description="Run policies over a recording: what they would have decided, beside what was decided.",
        epilog=_REPLAY_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    again.add_argument("file", metavar="FILE", help="a recording (tunerd record)")
    again.add_argument("--policies", nargs="+", required=True, metavar="P", help="policy files")
    again.add_argument("--json", action="store_true", help='one JSON object: {"decisions": [...]}')
    again.set_defaults(handler=_replay, prog=again.prog)


def _open(args: argparse.Namespace) -> State:
    state_dir = state_dir_of(args)
    try:
        return State.open(state_dir, readonly=True)
    except StateError as error:
        raise UsageError(str(error)) from None


def _list(args: argparse.Namespace) -> int:
    state = _open(args)
    try:
        incidents = state.incidents(engine=args.engine, limit=args.limit)
    finally:
        state.close()
    if args.json:
        keys = ("id", "engine", "kind", "at", "summary", "action_ids", "complete")
        sys.stdout.write(
            json.dumps({"incidents": [{k: i[k] for k in keys} for i in incidents]}, indent=2) + "\n"
        )
        return EXIT_OK
    if not incidents:
        sys.stdout.write("no incidents recorded\n")
    for incident in incidents:
        actions = ", ".join(f"#{i}" for i in incident["action_ids"])
        sys.stdout.write(
            f"{incident['id']:>4}  {incident['at']}  {incident['engine']}  {incident['kind']:<8} "
            f"{incident['summary']}{'  (' + actions + ')' if actions else ''}\n"
        )
    return EXIT_OK


def _incident(
    args: argparse.Namespace,
) -> tuple[dict[str, Any], Recording | None, list[dict[str, Any]]] | None:
    state = _open(args)
    try:
        incident = state.incident(args.id)
        actions = [a for i in (incident or {}).get("action_ids", []) if (a := state.action(i)) is not None]
    finally:
        state.close()
    if incident is None:
        return None
    try:
        recording = unpack(incident["recording"], f"incident {args.id}")
    except RecordingError as error:
        print(f"{args.prog}: {error}", file=sys.stderr)
        recording = None
    return incident, recording, actions


def _show(args: argparse.Namespace) -> int:
    found = _incident(args)
    if found is None:
        print(f"{args.prog}: no incident {args.id} (tunerd incident list shows them)", file=sys.stderr)
        return 1
    incident, recording, actions = found
    report = postmortem(incident, recording)
    if actions:  # their outcome now, not when the incident was written
        report["actions"] = [
            {key: action.get(key) for key in ("id", "kind", "outcome", "reason", "policy", "time")}
            for action in actions
        ]
    if args.json:
        sys.stdout.write(json.dumps(report, indent=2, default=str) + "\n")
        return EXIT_OK
    sys.stdout.write(render(report) + "\n")
    if args.html:
        try:
            Path(args.html).write_text(html_page(report, incident, recording), encoding="utf-8")
        except OSError as error:
            print(f"{args.prog}: cannot write {args.html}: {error.strerror or error}", file=sys.stderr)
            return EXIT_BAD_INPUT
        print(f"wrote {args.html}: the chart and this post-mortem")
    return EXIT_OK


def _record(args: argparse.Namespace) -> int:
    if args.id is None or args.duration:
        raise UsageError(
            "recording from the running daemon (ENGINE --for D FILE) is not built yet; "
            "write an incident's recording with --incident ID FILE (tunerd incident list shows them)"
        )
    if len(args.paths) != 1:
        raise UsageError("with --incident, name one FILE")
    args.file = args.paths[0]
    found = _incident(args)
    if found is None:
        print(f"{args.prog}: no incident {args.id} (tunerd incident list shows them)", file=sys.stderr)
        return 1
    incident = found[0]
    recording = unpack(incident["recording"], f"incident {args.id}")
    lines = iter_json_lines([recording.header, *recording.lines])
    if args.file == "-":
        sys.stdout.writelines(lines)
    else:
        Path(args.file).write_text("".join(lines), encoding="utf-8")
        print(
            f"wrote {args.file}: incident {args.id} ({incident['engine']}, {incident['kind']}), "
            f"{recording.ticks} ticks",
            file=sys.stderr,
        )
    return EXIT_OK


def read_recording(path: str) -> Recording:
    """A recording file, checked. :class:`RecordingError` names the file and line."""
    file = Path(path)
    try:
        size = file.stat().st_size
        if size > MAX_RECORDING_BYTES:
            raise RecordingError(f"{path}: {size:,} bytes; a recording is at most {MAX_RECORDING_BYTES:,}")
        with file.open(encoding="utf-8", errors="replace") as handle:
            return parse_lines(handle, path)
    except OSError as error:
        raise RecordingError(f"{path}: {error.strerror or error}") from None


def _replay(args: argparse.Namespace) -> int:
    try:
        recording = read_recording(args.file)
        policies = load_policy_files(args.policies)
    except RecordingError as error:
        print(f"{args.prog}: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except PolicyError as error:
        for problem in error.problems:
            print(problem, file=sys.stderr)
        return EXIT_BAD_INPUT
    decisions = compare(recording, replay(recording, policies))
    if args.json:
        sys.stdout.write(json.dumps({"decisions": [d.to_dict() for d in decisions]}, indent=2) + "\n")
        return EXIT_OK
    start = float(recording.header.get("from") or 0.0)
    same = sum(1 for d in decisions if d.recorded and d.replayed)
    print(
        f"{args.file}: {recording.engine}, {recording.ticks} ticks; "
        f"{same} decisions as recorded, {len(decisions) - same} different"
    )
    for decision in decisions:
        mark = "=" if decision.recorded and decision.replayed else ("+" if decision.replayed else "-")
        actions = ", ".join(decision.actions) or "nothing"
        print(f"  {mark} +{decision.at - start:8.2f}s  {decision.policy}: {actions}")
    return EXIT_OK
