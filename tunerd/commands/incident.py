"""``tunerd incident``, ``tunerd record`` and ``tunerd replay`` (docs/incidents.md).

``incident list|show`` read the state database read-only (they work while the daemon is down,
and after a crash loop: each incident was written before its restart began). ``record
--incident ID FILE`` writes an incident's recording as a file, ``record ENGINE --for D FILE``
the next D of the running daemon (``--last D``: the last it holds, over its status socket);
``replay FILE --policies P…`` runs policies over a recording and prints what they would have
decided, beside what was.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

from tunerd.commands import summary
from tunerd.commands.common import (
    EXIT_BAD_INPUT,
    EXIT_OK,
    NoDaemon,
    Parser,
    UsageError,
    examples,
    positive_int,
)
from tunerd.commands.history import add_state_arguments, state_dir_of
from tunerd.commands.status import add_socket_argument, ask, socket_of
from tunerd.incident import html_page, postmortem, render, unpack
from tunerd.policy.schema import PolicyError, load_policy_files
from tunerd.recording import Recording, RecordingError, compare, iter_json_lines, parse_lines, replay
from tunerd.state import State, StateError
from tunerd.units import format_duration, parse_duration

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

_RECORD_EPILOG = """\
examples:
  tunerd record --incident 12 oom.jsonl      an incident's recording, from the state
  tunerd record main --for 1h main.jsonl     the next hour, from the running daemon
  tunerd record main --last 10m now.jsonl    the ten minutes just past

A recording from the daemon is written again at each poll (every 5 to 60 s), so an
interrupted one keeps what it had; a daemon busy for a while (a restart step) is asked
again. Replay it with tunerd replay FILE --policies P.yaml.

exit status: 0 written, 1 no such incident or nothing recorded, 2 bad usage, 3 no tunerd
answered, 130 interrupted (the file holds what was recorded).
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
    examples(
        listing,
        """\
examples:
  tunerd incident list
  tunerd incident list --engine llama31-8b --limit 10 --json

exit status: 0 listed (also when there are none), 2 bad usage or no state.
""",
    )
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
    examples(
        show,
        """\
examples:
  tunerd incident show 12
  tunerd incident show 12 --json
  tunerd incident show 12 --html /tmp/incident-12.html

exit status: 0 shown, 1 no such incident, 2 bad usage or no state.
""",
    )

    record = subparsers.add_parser(
        "record",
        help=summary("record"),
        description="Write a recording (an engine's signals, ticks and decisions, versioned JSON lines) "
        "as a file: an incident's, the next D from the running daemon, or the last D it holds.",
        epilog=_RECORD_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    record.add_argument(
        "--incident",
        dest="id",
        type=positive_int,
        metavar="ID",
        help="the incident's recording (from the state)",
    )
    how = record.add_mutually_exclusive_group()
    how.add_argument(
        "--for",
        dest="duration",
        nargs="+",  # `record ENGINE --for D FILE` (the contract's order): D, then the words after it
        metavar=("D", "FILE"),
        help="ENGINE --for D FILE: the next D (e.g. 1h) from the running daemon, written as it goes",
    )
    how.add_argument(
        "--last",
        nargs="+",
        metavar=("D", "FILE"),
        help="ENGINE --last D FILE: the last D the running daemon holds (up to 6 h; less with a "
        "metrics interval under 1.5 s)",
    )
    record.add_argument(
        "paths", nargs="*", metavar="[ENGINE] FILE", help="where to write it (JSON lines; - for stdout)"
    )
    add_socket_argument(record)
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
            {key: action.get(key) for key in ("id", "kind", "outcome", "reason", "policy", "time", "epoch")}
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
    live = args.duration or args.last
    if live:
        if args.id is not None:
            raise UsageError("say --incident ID FILE, or ENGINE --for/--last D FILE, not both")
        words = [*args.paths, *live[1:]]
        if len(words) != 2:
            raise UsageError("say ENGINE --for D FILE (or ENGINE --last D FILE)")
        try:
            span = parse_duration(live[0])
        except ValueError as error:
            raise UsageError(f"--{'for' if args.duration else 'last'} {live[0]!r}: {error}") from None
        if span <= 0:
            raise UsageError("the duration must be more than nothing")
        return _record_live(args, engine=words[0], file=words[1], span=span, ahead=bool(args.duration))
    if args.id is None:
        raise UsageError("say --incident ID FILE, or ENGINE --for D FILE, or ENGINE --last D FILE")
    if len(args.paths) != 1:
        raise UsageError("with --incident, name one FILE")
    args.file = args.paths[0]
    found = _incident(args)
    if found is None:
        print(f"{args.prog}: no incident {args.id} (tunerd incident list shows them)", file=sys.stderr)
        return 1
    incident = found[0]
    recording = unpack(incident["recording"], f"incident {args.id}")
    _write(args.file, [recording.header, *recording.lines])
    if args.file != "-":
        print(
            f"wrote {args.file}: incident {args.id} ({incident['engine']}, {incident['kind']}), "
            f"{recording.ticks} ticks",
            file=sys.stderr,
        )
    return EXIT_OK


LIVE_POLL_S = 5.0  # a live recording asks the daemon at least this often (real seconds), rewriting its file
LIVE_POLL_MAX_S = 60.0  # … and at most this seldom: a long one is cut less often (the daemon's loop cuts it)
LIVE_TRIES = 6  # polls in a row the daemon may miss (a restart step holding its loop) before giving up
LIVE_MAX_BYTES = 256 << 20  # an hour at 4 Hz is some tens of MiB of JSON


def _record_live(args: argparse.Namespace, *, engine: str, file: str, span: float, ahead: bool) -> int:
    """The next (``ahead``) or the last ``span`` seconds of ``engine`` from the daemon's socket."""
    path = socket_of(args)
    quoted = quote(engine, safe="")
    held = ask(path, f"/recording?engine={quoted}&probe=1", 30.0, 1 << 20, what="a recording")
    capacity = float(held["capacity_s"])
    if span > capacity:
        raise UsageError(
            f"tunerd keeps the last {format_duration(capacity)} of {engine}'s ticks: record at most that "
            "(for longer, several files one after the other)"
        )
    now = float(held["now"])
    start, end = (now, now + span) if ahead else (now - span, now)
    pace = min(LIVE_POLL_MAX_S, max(LIVE_POLL_S, span / 60))  # ~60 cuts however long, never spinning
    lines: list[dict[str, Any]] = []
    found: dict[str, Any] = held
    missed = 0
    try:
        while True:
            try:
                found = ask(
                    path,
                    f"/recording?engine={quoted}&since={start!r}&until={end!r}",
                    60.0,
                    LIVE_MAX_BYTES,
                    what="a recording",
                )
            except NoDaemon as error:
                missed += 1
                if not ahead or missed >= LIVE_TRIES:
                    if lines and file == "-":
                        _write(file, lines)
                    raise NoDaemon(f"{error}; {file} holds what was recorded before") from None
                print(f"recording {engine}: {error}; trying again", file=sys.stderr)
                time.sleep(pace)
                continue
            missed = 0
            lines = list(found.get("lines") or [])
            ticks = sum(1 for line in lines if line.get("tick"))
            if lines and file != "-":
                _write(file, lines)
            done = float(found["now"]) >= end
            if ahead:
                got = min(span, max(0.0, float(found["now"]) - start))
                print(
                    f"recording {engine}: {format_duration(got)} of {format_duration(span)}, {ticks:,} ticks",
                    file=sys.stderr,
                )
            if done or not ahead:
                break
            time.sleep(pace)
    except KeyboardInterrupt:
        if lines and file == "-":
            _write(file, lines)  # to stdout only now: what was recorded so far
        print(f"{args.prog}: stopped; {file} holds what was recorded so far", file=sys.stderr)
        return 130
    if not lines:
        print(
            f"{args.prog}: no ticks of {engine} in that window (is it running under tunerd?)", file=sys.stderr
        )
        return 1
    if file == "-":
        _write(file, lines)
    oldest = found.get("oldest")
    if not ahead and isinstance(oldest, (int, float)) and oldest > start:
        print(
            f"tunerd held only the last {format_duration(now - oldest)} of {engine}: wrote that",
            file=sys.stderr,
        )
    if file != "-":
        ticks = sum(1 for line in lines if line.get("tick"))
        print(f"wrote {file}: {engine}, {ticks:,} ticks from the running daemon", file=sys.stderr)
    return EXIT_OK


def _write(file: str, lines: list[dict[str, Any]]) -> None:
    """The recording's lines to ``file`` (``-``: stdout), replacing it whole (a reader never
    sees half of one)."""
    text = iter_json_lines(lines)
    if file == "-":
        sys.stdout.writelines(text)
        return
    target = Path(file)
    partial = target.with_name(f".{target.name}.partial")
    try:
        partial.write_text("".join(text), encoding="utf-8")
        os.replace(partial, target)
    except OSError as error:
        raise UsageError(f"cannot write {file}: {error.strerror or error}") from None


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
