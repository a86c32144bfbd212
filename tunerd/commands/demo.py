"""``tunerd demo``: the simulator, the daemon and load — the seed's story end to end, no GPU.

It starts ``tunerd run`` in act mode with the shipped policies on the simulator's clock; the
daemon starts the simulated engine with the scenario's settings; load follows. One narration
line per event, in the terminal's language (``--lang``); at the end the final settings, the four
bills before and after, DESIGN §8's convergence checks (seed and saturation), and an HTML report
with the memory curve. Exit 0 only when the story ended as it should (converged, alerted,
rolled back, held, tuned up); 1 when it did not.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from tunerd.commands import summary
from tunerd.commands.common import EXIT_NO, EXIT_OK, Parser, UsageError
from tunerd.demo.runner import DemoOptions, run_demo, write_report
from tunerd.demo.scenarios import SCENARIOS, scenario
from tunerd.policy.schema import PolicyError, load_policy_files

__all__ = ["default_language", "register"]

#: The shipped policies, beside the package in a source checkout.
SHIPPED_POLICIES = Path(__file__).resolve().parents[2] / "policies" / "default.yaml"

_EPILOG = (
    "scenarios:\n"
    + "\n".join(f"  {name:<18}{item.title['en']}" for name, item in SCENARIOS.items())
    + """

examples:
  tunerd demo                              the seed's story (about a minute)
  tunerd demo --scenario crash-loop --lang zh
  tunerd demo --json > result.json         the outcome as one JSON object, no narration
  tunerd demo --box-seed 7                 a box whose truth tunerd must discover

exit status: 0 the story ended as it should, 1 it did not (logs kept in the work directory),
2 bad usage.
"""
)


def default_language(environ: dict[str, str] | None = None) -> str:
    """``zh`` when the terminal's locale is Chinese (LC_ALL, LC_MESSAGES, LANG), else ``en``."""
    env = os.environ if environ is None else environ
    for name in ("LC_ALL", "LC_MESSAGES", "LANG"):
        value = env.get(name)
        if value:
            return "zh" if value.lower().startswith("zh") else "en"
    return "en"


def register(subparsers: argparse._SubParsersAction[Parser]) -> None:
    parser = subparsers.add_parser(
        "demo",
        help=summary("demo"),
        description=(
            "Run a story end to end on the simulator: tunerd (act mode, the shipped policies) "
            "starts a simulated vLLM with the scenario's settings, load arrives, and tunerd does "
            "what it would on a GPU box. Narrated as it goes; a report at the end."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--scenario", default="seed", choices=sorted(SCENARIOS), help="the story (default seed)"
    )
    parser.add_argument("--lang", choices=["en", "zh"], help="narration language (default: the locale's)")
    parser.add_argument(
        "--report",
        default="demo-report.html",
        help="where to write the HTML report (default ./demo-report.html)",
    )
    parser.add_argument(
        "--policies",
        default=str(SHIPPED_POLICIES),
        help="the policy file (default: the shipped policies/default.yaml)",
    )
    parser.add_argument(
        "--workdir",
        help="keep config, state and logs here (default: a temporary folder, removed when all went well)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the outcome as one JSON object, no narration"
    )
    parser.add_argument(
        "--box-seed",
        type=int,
        metavar="N",
        help="a simulated box whose hidden truth (CUDA context, activations, fragmentation, a desktop, "
        "the driver's reserve) is drawn from N: tunerd must measure it; the final pool is judged "
        "against the simulator's own safe maximum",
    )
    parser.set_defaults(handler=_demo, prog=parser.prog)


def _demo(args: argparse.Namespace) -> int:
    chosen = scenario(args.scenario)
    policies = Path(args.policies)
    if not policies.is_file():
        raise UsageError(f"no policy file at {policies} (give one with --policies)")
    try:
        load_policy_files([policies])
    except PolicyError as error:
        raise UsageError(str(error)) from None
    if args.workdir and Path(args.workdir).exists() and any(Path(args.workdir).iterdir()):
        raise UsageError(f"--workdir {args.workdir} is not empty (tunerd would adopt what it finds there)")
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="tunerd-demo-"))
    language = args.lang or default_language()

    def tell(line: str) -> None:
        print(line, flush=True)

    options = DemoOptions(
        scenario=chosen, policies=policies, workdir=workdir, language=language, box_seed=args.box_seed
    )
    result = run_demo(options, tell=None if args.json else tell)
    report = Path(args.report)
    write_report(result, report)
    kept = bool(args.workdir) or not result.ok  # a temporary folder goes when all went well
    if not kept:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.json:  # the work directory named only while it exists
        print(
            json.dumps(
                {**result.to_dict(), "report": str(report), "workdir": str(workdir) if kept else None},
                indent=2,
            )
        )
    else:
        print()
        for line in result.summary:
            print(line)
        print(f"\nreport: {report}")
    if not result.ok:
        print(f"tunerd demo: the story did not end as it should; logs in {workdir}", file=sys.stderr)
    return EXIT_OK if result.ok else EXIT_NO
