"""`make bench`'s last word: every DESIGN §8 figure the benchmarks reported, as one table.

python bench/table.py FIGURES.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(path: Path) -> int:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    width = max(len(row["bar"]) for row in rows)
    value_width = max(len("measured"), *(len(row["value"]) for row in rows))
    print(f"\nDESIGN §8 targets, measured in this run ({len(rows)} figures):")
    print(f"  {'figure':<{width}}  {'measured':<{value_width}}  {'target':<12} met")
    for row in rows:
        met = "yes" if row["met"] else "NO"
        print(f"  {row['bar']:<{width}}  {row['value']:<{value_width}}  {row['target']:<12} {met}")
    missed = [row["bar"] for row in rows if not row["met"]]
    print(
        f"\n{len(rows) - len(missed)} of {len(rows)} met"
        + (f"; not met: {', '.join(missed)}" if missed else "")
    )
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
