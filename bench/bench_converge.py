"""Convergence on the seed scenario (DESIGN §8): from the unsafe start, ≤ 3 restarts, no OOM
afterwards, final KV capacity ≥ 90 % of what the planner says is the safe maximum.

Runs ``tunerd demo --scenario seed --json`` RUNS times (each a fresh daemon, simulated engine
and load; the simulator's run-to-run differences are thread timing) and reports the median
restarts, the most OOMs after converging, the median KV share, and how many runs converged.

    python bench/bench_converge.py [RUNS]     # default 3
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import figure


def main(runs: int) -> int:
    results = []
    for run in range(runs):
        with tempfile.TemporaryDirectory(prefix="tunerd-bench-converge-") as tmp:
            done = subprocess.run(
                [sys.executable, "-m", "tunerd", "demo", "--scenario", "seed", "--json",
                 "--report", str(Path(tmp) / "report.html"), "--workdir", str(Path(tmp) / "work")],
                check=False, capture_output=True, text=True, timeout=400,
            )  # fmt: skip
        result = json.loads(done.stdout)
        checks = {check["name"]: check for check in result["checks"]}
        share = f"{result['kv_cache_tokens']:,} of {result['planner_safe_kv_tokens']:,}"
        print(
            f"run {run + 1}: {'converged' if result['ok'] else 'did NOT converge'} "
            f"in {result['wall_seconds']:.0f} s "
            f"wall ({result['simulated_seconds'] / 60:.0f} simulated min): {result['restarts']} restarts, "
            f"KV {share}; final {result['final_settings']}"
        )
        results.append((result, checks))
    restarts = statistics.median(r["restarts"] for r, _ in results)
    ooms = max(int(c["OOMs after converging"]["value"]) for _, c in results)
    share = statistics.median(r["kv_cache_tokens"] / r["planner_safe_kv_tokens"] for r, _ in results)
    converged = sum(1 for r, _ in results if r["ok"])
    print(f"seed scenario over {runs} runs:")
    figure("seed: runs that converged", f"{converged}/{runs}", f"{runs}/{runs}", converged == runs)
    figure("seed: restarts to converge (median)", f"{restarts:g}", "≤ 3", restarts <= 3)
    figure("seed: OOMs after converging (most)", str(ooms), "0", ooms == 0)
    figure("seed: final KV / planner's safe max (median)", f"{share:.0%}", "≥ 90%", share >= 0.90)
    return 0 if converged == runs else 1


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 3))
