"""A stand-in ``nvidia-smi`` that answers CSV queries from a recorded output.

Put a wrapper named ``nvidia-smi`` on PATH that runs this file; ``FAKE_SMI_RECORDING`` names a
JSON file: ``{"query_gpu": {"fields": [...], "file": "path.csv"}, "compute_apps": {...},
"report": {"file": "q-x.xml"}, "fail": {"exit": 9, "file": "no-driver.txt"}}`` (``report``
answers ``-q -x``). Behaviour follows the real tool as recorded
in tests/data/nvidia-smi/PROVENANCE.md: answers go to stdout; a field the recorded driver did
not report is refused with ``Field "x" is not a valid field to query.`` and exit 2 (messages on
stdout too); columns come back in the order asked. Every call is appended to
``FAKE_SMI_CALLS`` when set.
"""

from __future__ import annotations

import csv
import json
import os
import sys
from pathlib import Path


def _answer(spec: dict[str, object], asked: list[str]) -> int:
    fields = [str(field) for field in spec["fields"]]  # type: ignore[attr-defined]
    for field in asked:
        if field not in fields:
            sys.stdout.write(f'Field "{field}" is not a valid field to query.\n\n')
            return 2
    text = Path(str(spec["file"])).read_text()
    for line in text.splitlines():
        if not line.strip():
            continue
        cells = [cell.strip() for cell in next(csv.reader([line], skipinitialspace=True))]
        row = dict(zip(fields, cells, strict=True))
        sys.stdout.write(", ".join(row[field] for field in asked) + "\n")
    return 0


def main(argv: list[str]) -> int:
    calls = os.environ.get("FAKE_SMI_CALLS")
    if calls:
        with open(calls, "a") as handle:
            handle.write(" ".join(argv) + "\n")
    recording = json.loads(Path(os.environ["FAKE_SMI_RECORDING"]).read_text())
    fail = recording.get("fail")
    if fail:
        sys.stdout.write(Path(fail["file"]).read_text())
        return int(fail["exit"])
    if argv[:2] == ["-q", "-x"] and "report" in recording:  # the XML report, as recorded
        sys.stdout.write(Path(recording["report"]["file"]).read_text())
        return 0
    for arg in argv:
        for option, key in (("--query-gpu=", "query_gpu"), ("--query-compute-apps=", "compute_apps")):
            if arg.startswith(option):
                return _answer(recording[key], arg.removeprefix(option).split(","))
    sys.stdout.write("fake nvidia-smi: only --query-gpu and --query-compute-apps are recorded\n")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
