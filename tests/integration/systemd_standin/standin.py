"""Stand-ins for ``systemctl`` and ``journalctl``: enough of systemd to run tunerd's systemd
mode for real on a machine (or a CI container) where tunerd may not drive the real one.

They hold unit state under ``$STANDIN_SYSTEMD_DIR``::

    units/UNIT            the unit file, in systemd's syntax ([Service] ExecStart=…)
    run/UNIT.json         MainPID, InvocationID, ActiveState, ExecMainCode, ExecMainStatus
    run/UNIT.job          the job systemd is running on the unit (start, stop, restart), while it runs
    journal/UNIT.jsonl    every output line: {"inv": InvocationID, "t": time, "m": line}
    calls.log             every systemctl call, one argv a line

and really start the unit's ``ExecStart`` (here: the simulator). What they keep of systemd's
behaviour, as its man pages say (systemd.service(5), systemd.exec(5), systemd.kill(5),
systemctl(1), journalctl(1)) and as checked against systemd 252 on this machine's
``systemd-analyze``:

- ``EnvironmentFile=-PATH``: ``KEY=value`` / ``KEY="value"`` lines, ``#`` comments; the leading
  ``-`` makes a missing file no error;
- in ``ExecStart``, an unbraced ``$NAME`` becomes the variable's value split at whitespace
  (nothing when empty), ``${NAME}`` one word;
- each start gets a new ``InvocationID``; the main process is the session leader of its group;
- ``systemctl restart`` = stop, then start; it returns once the new main process runs;
- stop with ``KillMode=mixed``: SIGTERM to the main process only, SIGKILL to what is left of
  the unit after it exits or after ``TimeoutStopSec`` (default 90 s);
- ``systemctl show UNIT -p A -p B`` (or ``--property=A,B``) prints ``A=…`` lines; MainPID is 0
  when nothing runs; ExecMainCode is 1 (exited) or 2 (killed), ExecMainStatus the exit code or
  signal; ``Job`` is the id of the job in progress on the unit (a ``systemctl restart``, even
  between the old main process's exit and the new one's start), empty when there is none —
  systemctl prints the D-Bus property ``Job (uo)``'s id this way (not checked here: no running
  systemd on this machine);
- ``journalctl -u UNIT [-f] -o cat [_SYSTEMD_INVOCATION_ID=ID]`` prints the messages only.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(os.environ.get("STANDIN_SYSTEMD_DIR", "/nonexistent"))


def _state_path(unit: str) -> Path:
    return ROOT / "run" / f"{unit}.json"


def _read_state(unit: str) -> dict[str, Any]:
    try:
        return dict(json.loads(_state_path(unit).read_text()))
    except (OSError, ValueError):
        return {
            "MainPID": 0,
            "ActiveState": "inactive",
            "ExecMainCode": 0,
            "ExecMainStatus": 0,
            "InvocationID": "",
        }


def _write_state(unit: str, state: dict[str, Any]) -> None:
    path = _state_path(unit)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(state))
    temporary.replace(path)


def _unit(unit: str) -> dict[str, str]:
    path = ROOT / "units" / unit
    if not path.exists():
        sys.exit(f"Unit {unit} not found.")  # systemctl's words, exit 1
    service: dict[str, str] = {}
    section = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        if section == "Service":
            service[key.strip()] = value.strip()
    return service


def _unit_properties(unit: str) -> dict[str, Any]:
    """What ``systemctl show`` says of the unit file itself (systemd's defaults where unset);
    a unit that does not exist shows ``LoadState=not-found``, as systemctl does (exit 0)."""
    if not (ROOT / "units" / unit).exists():
        return {"LoadState": "not-found"}
    service = _unit(unit)
    stop = _seconds(service.get("TimeoutStopSec", ""), 90.0)
    minutes, seconds = divmod(int(stop), 60)
    span = " ".join(
        part for part in (f"{minutes}min" if minutes else "", f"{seconds}s" if seconds else "") if part
    )
    return {
        "LoadState": "loaded",
        "KillMode": service.get("KillMode", "control-group"),
        "Restart": service.get("Restart", "no"),
        "TimeoutStopUSec": span or "0",
    }


def _environment(service: dict[str, str]) -> dict[str, str]:
    found: dict[str, str] = {}
    path = service.get("EnvironmentFile", "")
    optional = path.startswith("-")
    path = path.removeprefix("-")
    if not path:
        return found
    try:
        text = Path(path).read_text()
    except OSError:
        if optional:
            return found
        raise
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")) or "=" not in line:
            continue
        key, _, value = line.partition("=")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        found[key.strip()] = value
    return found


def _exec_argv(service: dict[str, str], env: dict[str, str]) -> list[str]:
    argv: list[str] = []
    for word in shlex.split(service["ExecStart"]):
        braced = re.fullmatch(r"\$\{(\w+)\}", word)
        bare = re.fullmatch(r"\$(\w+)", word)
        if braced:
            argv.append(env.get(braced.group(1), ""))
        elif bare:
            argv.extend(env.get(bare.group(1), "").split())
        else:
            argv.append(word)
    return argv


def _alive(pid: int) -> bool:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] not in ("Z", "X")


def _wait(condition: Any, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _seconds(value: str, default: float) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(s|min|ms)?", value.strip()) if value else None
    if not match:
        return default
    number = float(match.group(1))
    return {"ms": number / 1000, "min": number * 60}.get(match.group(2) or "s", number)


def start(unit: str) -> int:
    service = _unit(unit)
    state = _read_state(unit)
    if state["MainPID"] and _alive(int(state["MainPID"])):
        return 0
    argv = _exec_argv(service, _environment(service))
    invocation = uuid.uuid4().hex
    subprocess.Popen(
        [sys.executable, __file__, "_manage", unit, invocation, *argv],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env={**os.environ, "STANDIN_SYSTEMD_DIR": str(ROOT)},
    )
    if not _wait(lambda: _read_state(unit).get("InvocationID") == invocation, 10):
        print(f"Job for {unit} failed.", file=sys.stderr)
        return 1
    return 0


def stop(unit: str) -> int:
    service = _unit(unit)
    state = _read_state(unit)
    pid = int(state.get("MainPID") or 0)
    if not pid or not _alive(pid):
        return 0
    os.kill(pid, signal.SIGTERM)  # KillMode=mixed: the main process only
    _wait(lambda: not _alive(pid), _seconds(service.get("TimeoutStopSec", ""), 90.0))
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)  # then whatever is left of the unit
    _wait(lambda: _read_state(unit).get("ActiveState") != "active", 10)
    return 0


def manage(unit: str, invocation: str, argv: list[str]) -> None:
    """systemd's part while the unit runs: start the main process, journal its output, record
    how it ended."""
    journal = ROOT / "journal" / f"{unit}.jsonl"
    journal.parent.mkdir(parents=True, exist_ok=True)
    base = {"InvocationID": invocation, "ExecMainCode": 0, "ExecMainStatus": 0}
    try:
        child = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    except OSError as error:
        _write_state(
            unit, {**base, "MainPID": 0, "ActiveState": "failed", "ExecMainCode": 1, "ExecMainStatus": 203}
        )
        with journal.open("a") as out:
            out.write(
                json.dumps(
                    {"inv": invocation, "t": time.time(), "m": f"Failed to execute {argv[0]}: {error}"}
                )
                + "\n"
            )
        return
    _write_state(unit, {**base, "MainPID": child.pid, "ActiveState": "active"})
    assert child.stdout is not None
    with journal.open("a") as out:
        for line in child.stdout:
            out.write(
                json.dumps(
                    {"inv": invocation, "t": time.time(), "m": line.decode(errors="replace").rstrip("\n")}
                )
                + "\n"
            )
            out.flush()
    code = child.wait()
    killed = code < 0
    _write_state(
        unit,
        {
            **base,
            "MainPID": 0,
            "ActiveState": "failed" if code else "inactive",
            "ExecMainCode": 2 if killed else 1,
            "ExecMainStatus": -code if killed else code,
        },
    )


def _job_path(unit: str) -> Path:
    return ROOT / "run" / f"{unit}.job"


def systemctl(args: list[str]) -> int:
    with (ROOT / "calls.log").open("a") as calls:
        calls.write(shlex.join(["systemctl", *args]) + "\n")
    if not args:
        return 1
    verb, rest = args[0], args[1:]
    if verb in ("start", "stop", "restart"):
        unit = rest[0]
        job = _job_path(unit)
        job.parent.mkdir(parents=True, exist_ok=True)
        job.write_text(f"{os.getpid()} {verb}\n")  # the job, while systemd works on it
        try:
            if verb in ("stop", "restart"):
                stop(unit)
            return 0 if verb == "stop" else start(unit)
        finally:
            job.unlink(missing_ok=True)
    if verb == "show":
        unit, props = rest[0], []
        it = iter(rest[1:])
        for arg in it:
            if arg == "-p":
                props += next(it).split(",")
            elif arg.startswith("--property="):
                props += arg.removeprefix("--property=").split(",")
        state = {**_read_state(unit), **_unit_properties(unit)}
        job = _job_path(unit)
        state["Job"] = job.read_text().split()[0] if job.exists() else ""
        if state["MainPID"] and not _alive(int(state["MainPID"])):  # between exit and the record
            state = {**state, "ActiveState": "deactivating"}
        for prop in props or list(state):
            print(f"{prop}={state.get(prop, '')}")
        return 0
    if verb == "is-active":
        state = _read_state(rest[0])
        print(state["ActiveState"])
        return 0 if state["ActiveState"] == "active" else 3
    print(f"stand-in systemctl: unknown verb {verb}", file=sys.stderr)
    return 1


def journalctl(args: list[str]) -> int:
    unit, follow, invocation = "", False, ""
    it = iter(args)
    for arg in it:
        if arg == "-u":
            unit = next(it)
        elif arg == "-f":
            follow = True
        elif arg.startswith("_SYSTEMD_INVOCATION_ID="):
            invocation = arg.partition("=")[2]
        elif arg == "-o":
            next(it)  # only "cat" is kept: the message alone
    path = ROOT / "journal" / f"{unit}.jsonl"
    offset = 0
    while True:
        try:
            with path.open() as journal:
                journal.seek(offset)
                for line in journal:
                    if not line.endswith("\n"):
                        break
                    offset += len(line.encode())
                    entry = json.loads(line)
                    if not invocation or entry["inv"] == invocation:
                        print(entry["m"], flush=True)
        except OSError:
            pass
        if not follow:
            return 0
        time.sleep(0.1)


if __name__ == "__main__":
    if sys.argv[1] == "_manage":
        manage(sys.argv[2], sys.argv[3], sys.argv[4:])
    elif sys.argv[1] == "systemctl":
        sys.exit(systemctl(sys.argv[2:]))
    else:
        sys.exit(journalctl(sys.argv[2:]))
