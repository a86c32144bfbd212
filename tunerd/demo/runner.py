"""``tunerd demo``'s processes: the daemon (``tunerd run``, act mode, the shipped policies, the
simulator's clock), the simulated engine it starts and supervises, and the load — real
processes on loopback, as on a GPU box. The runner watches what an operator would (the GPU,
``/health``, ``/metrics``, tunerd's history and log), tells :class:`~tunerd.demo.story.Story`,
prints its narration, and stops everything it started when the story ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import httpx
import yaml

from tunerd.demo.report import (
    Check,
    Sample,
    bill_table,
    box_text,
    check_lines,
    checks,
    render_html,
    safe_kv_tokens,
)
from tunerd.demo.report import words as report_words
from tunerd.demo.scenarios import Scenario
from tunerd.demo.story import Story, Verdict, clock_text, settings_text
from tunerd.planner.gpus import gpu_profile
from tunerd.sources.vllm_metrics import parse as parse_metrics
from tunerd.state import State, StateError
from tunerd.yamlfile import load_yaml

__all__ = ["DemoOptions", "DemoResult", "run_demo", "without_fits", "write_report"]

#: Simulated neighbours' PIDs start here (``tunerd sim serve``); below it, the engine's.
_NEIGHBOUR_PIDS = 4_194_305
_POLL = 0.1  # wall seconds between looks


@dataclass(frozen=True)
class DemoOptions:
    scenario: Scenario
    policies: Path
    workdir: Path
    language: str = "en"
    wall_limit: float = 175.0  # seconds: the demo promises to finish within 3 minutes
    out: TextIO | None = None  # narration; None: quiet (--json)
    #: the simulated box's hidden truth drawn from this seed (None: the planner's assumptions)
    box_seed: int | None = None


@dataclass
class DemoResult:
    scenario: str
    ok: bool
    verdict: str
    narration: list[str]
    summary: list[str]
    checks: list[Check]
    start_settings: dict[str, Any]
    final_settings: dict[str, Any] | None
    kv_tokens: int | None
    safe_kv_tokens: int | None  # the planner's safe maximum for the final settings
    restarts: int
    crashes: int
    wall_seconds: float
    simulated_seconds: float
    samples: list[Sample] = field(default_factory=list)
    story: Story | None = None
    ooms_after_converging: int = 0
    box_seed: int | None = None
    #: the simulator's own safe maximum pool for the final settings' other knobs (/sim/truth)
    true_safe_kv_tokens: int | None = None
    truth: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        if self.box_seed is not None:
            extra = {
                "box_seed": self.box_seed,
                "true_safe_max_kv_cache_tokens": self.true_safe_kv_tokens,
                "truth": self.truth,
            }
        return {
            "scenario": self.scenario,
            "ok": self.ok,
            "verdict": self.verdict,
            "start_settings": self.start_settings,
            "final_settings": self.final_settings,
            "kv_cache_tokens": self.kv_tokens,
            "planner_safe_kv_tokens": self.safe_kv_tokens,
            "restarts": self.restarts,
            "crashes": self.crashes,
            "ooms_after_converging": self.ooms_after_converging,
            **extra,
            "checks": [check.__dict__ for check in self.checks],
            "wall_seconds": round(self.wall_seconds, 1),
            "simulated_seconds": round(self.simulated_seconds),
            "narration": self.narration,
            "summary": self.summary,
        }


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def without_fits(document: dict[str, Any]) -> bool:
    """Take every ``fit`` alternative out of a policy document's ``first_of`` actions (one whose
    alternatives are all fits keeps its first); whether anything was taken out."""
    taken = False
    for policy in document.get("policies") or []:
        for action in policy.get("then") or []:
            options = action.get("first_of") if isinstance(action, dict) else None
            if not options:
                continue
            kept = [option for option in options if "fit" not in (option.get("tune") or {}).values()]
            taken = taken or len(kept) < len(options)
            action["first_of"] = kept or options[:1]
    return taken


def _policies(options: DemoOptions) -> tuple[Path, list[str]]:
    """The shipped policies; with the scenario's mode overrides (or its notches only) written
    to a copy (said)."""
    scenario = options.scenario
    if not scenario.policy_modes and not scenario.notches_only:
        return options.policies, []
    document = load_yaml(options.policies).data  # the one loader: no aliases, located errors
    said = []
    if scenario.notches_only and without_fits(document):
        said.append("computed moves (fit) taken out")
    for policy in document["policies"]:
        mode = scenario.policy_modes.get(policy["name"])
        if mode is not None:
            policy["mode"] = mode
            said.append(f"{policy['name']}: mode {mode}")
    path = options.workdir / "policies.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False, allow_unicode=True), encoding="utf-8")
    return path, said


def _config(options: DemoOptions, port: int, policies: Path) -> Path:
    scenario = options.scenario
    url = f"http://127.0.0.1:{port}"
    command = [
        sys.executable, "-m", "tunerd", "sim", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--time-scale", f"{scenario.time_scale:g}", "--seed", "0",
        "--sim-model", scenario.model, "--sim-weights", scenario.weights, "--sim-gpu", scenario.gpu,
        *scenario.sim_args,
        *(["--box-seed", str(options.box_seed)] if options.box_seed is not None else []),
    ]  # fmt: skip
    config = {
        "engines": [
            {
                "name": "main",
                "command": command,
                "url": url,
                "settings": dict(scenario.settings),
                "bounds": {knob: list(values) for knob, values in scenario.bounds.items()},
                "drain": "60s",
                "startup_timeout": "60s",
                "probation": "2s",
                "gpu_wait": "20s",
            }
        ],
        "gpu": {"source": "sim", "url": url},
        "clock": {"source": "sim", "url": url},
        "metrics": {"interval": "500ms"},
        "mode": "act",
        "policies": [str(policies)],
        "state_dir": str(options.workdir / "state"),
        "listen": {
            "status": str(options.workdir / "tunerd.sock"),
            "metrics": f"127.0.0.1:{_free_port()}",
        },
    }
    path = options.workdir / "tunerd.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


def _follow(stream: TextIO, log: TextIO, events: queue.Queue[dict[str, Any]]) -> None:
    """Copy the daemon's JSON log to ``log``; hand its engine_crash events over."""
    for line in stream:
        log.write(line)
        log.flush()
        if line.startswith("{") and '"engine_crash"' in line:
            with contextlib.suppress(ValueError):
                events.put(json.loads(line))


class _Watch:
    """The engine as an operator sees it: its GPU, health, pool and tunerd's records of it."""

    def __init__(self, url: str, state_dir: Path) -> None:
        self.url = url
        self.state_dir = state_dir
        self.client = httpx.Client(timeout=1.0)
        self.state: State | None = None

    def open_state(self) -> State | None:
        """The daemon's state, read-only, once it holds its tables (the file exists a moment
        before the daemon has written them: the first reads raised 'no such table')."""
        if self.state is None and (self.state_dir / "tunerd.db").exists():
            with contextlib.suppress(StateError, OSError):
                state = State.open(self.state_dir, readonly=True)
                try:
                    state.history(limit=1)
                except StateError:
                    state.close()
                    return None
                self.state = state
        return self.state

    def gpu(self) -> tuple[int, int, int] | None:
        """(used, the engine's, total) bytes from ``/sim/gpu``."""
        try:
            gpu = self.client.get(self.url + "/sim/gpu").json()["gpus"][0]
        except (httpx.HTTPError, ValueError, KeyError, IndexError):
            return None
        mine = sum(p.get("used_bytes") or 0 for p in gpu.get("processes", []) if p["pid"] < _NEIGHBOUR_PIDS)
        return int(gpu["memory_used_bytes"]), int(mine), int(gpu["memory_total_bytes"])

    def healthy(self) -> bool:
        try:
            return self.client.get(self.url + "/health").status_code == 200
        except httpx.HTTPError:
            return False

    def truth(self, load: Any) -> dict[str, Any] | None:
        """The simulator's own safe maximum for the scenario's load (``/sim/truth``)."""
        query = {}
        if load is not None:
            query = {
                "concurrency": load.concurrency,
                "prompt_tokens": load.prompt_tokens,
                "max_tokens": load.max_tokens,
            }
        try:
            answer = self.client.get(self.url + "/sim/truth", params=query, timeout=60.0)
            return answer.json() if answer.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    def kv_tokens(self) -> int | None:
        try:
            return parse_metrics(self.client.get(self.url + "/metrics").text).kv_cache_size_tokens
        except httpx.HTTPError:
            return None

    def close(self) -> None:
        self.client.close()
        if self.state is not None:
            self.state.close()


def _stop_engine(state_dir: Path) -> None:
    """SIGTERM to the engine tunerd left serving (it drains), then its process group."""
    with contextlib.suppress(StateError, OSError):
        state = State.open(state_dir, readonly=True)
        record = state.engine("main")
        state.close()
        if record is None or record.pid is None:
            return
        try:  # only the simulator the daemon started: a dead engine's PID may be reused
            argv = Path(f"/proc/{record.pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return
        if b"sim" not in argv or b"serve" not in argv:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(record.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                os.kill(record.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(record.pid, signal.SIGKILL)


def _load(options: DemoOptions, url: str) -> subprocess.Popen[bytes] | None:
    load = options.scenario.load
    if load is None:
        return None
    log = (options.workdir / "load.log").open("wb")
    argv = [sys.executable, "-m", "tunerd", "sim", "load", "--url", url, "--retry-refused"]
    argv += ["--concurrency", str(load.concurrency), "--prompt-tokens", str(load.prompt_tokens)]
    argv += ["--max-tokens", str(load.max_tokens), "--timeout", "600"]
    argv += ["--requests", str(load.requests)] if load.requests else ["--duration", "1h"]
    return subprocess.Popen(
        argv,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


QUIET_S = 10.0  # of wall time without a line: the demo says what is going on


def run_demo(options: DemoOptions, tell: Callable[[str], None] | None = None) -> DemoResult:
    """Play the scenario; return how it ended. Every process it started is stopped."""
    scenario = options.scenario
    story = Story(scenario, options.language, tune_required=options.box_seed is None)
    narration: list[str] = []
    started = time.monotonic()

    def now() -> float:
        return (time.monotonic() - started) * scenario.time_scale

    last_said = [time.monotonic()]

    def say(line: str, stamp: bool = True) -> None:
        text = f"[{clock_text(now())}] {line}" if stamp else line
        narration.append(text)
        last_said[0] = time.monotonic()
        if tell is not None:
            tell(text)

    options.workdir.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    policies, overrides = _policies(options)
    config = _config(options, port, policies)
    names = ", ".join(p["name"] for p in load_yaml(policies).data["policies"])
    say(story.say("title", scenario=scenario.name, what=scenario.title[options.language]), stamp=False)
    say(
        story.say(
            "world",
            gpu=scenario.gpu,
            model=scenario.model,
            weights=scenario.weights,
            scale=scenario.time_scale,
            policies=names + (f" ({'; '.join(overrides)})" if overrides else ""),
        ),
        stamp=False,
    )
    log = (options.workdir / "tunerd.log").open("w", encoding="utf-8")
    daemon = subprocess.Popen(
        [sys.executable, "-m", "tunerd", "run", "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "NO_COLOR": "1"},
    )
    assert daemon.stdout is not None
    events: queue.Queue[dict[str, Any]] = queue.Queue()
    follower = threading.Thread(target=_follow, args=(daemon.stdout, log, events), daemon=True)
    follower.start()
    watch = _Watch(url, options.workdir / "state")
    budget_total = gpu_profile(scenario.gpu).total_bytes
    samples: list[Sample] = []
    load: subprocess.Popen[bytes] | None = None
    serving_pid: int | None = None
    truth: dict[str, Any] | None = None
    running_settings: dict[str, Any] = dict(scenario.settings)
    verdict: Verdict | None = None
    try:
        while verdict is None:
            time.sleep(_POLL)
            t = now()
            state = watch.open_state()
            record = state.engine("main") if state is not None else None
            if record is not None and record.running is not None and state is not None:
                running_settings = state.version(record.running).settings
            reading = watch.gpu()
            if reading is not None:
                used, mine, total = reading
                budget = int(float(running_settings["gpu_memory_utilization"]) * budget_total)
                samples.append(Sample(t, used, mine, total, budget if mine else None))
            while not events.empty():
                event = events.get()
                for line in story.on_crash(event.get("kind"), t):
                    say(line)
            if state is not None:
                for row in reversed(state.history(limit=30)):
                    for line in story.on_row(row, t):
                        say(line)
            new = record is not None and record.pid is not None and record.pid != serving_pid
            if new and record is not None and watch.healthy():
                serving_pid = record.pid
                for line in story.on_serving(running_settings, watch.kv_tokens(), t):
                    say(line)
                if scenario.load is None and len(story.settings) == 1:
                    say(story.say("no_load"))
            wanted = scenario.load
            if load is None and wanted is not None and story.settings and t >= wanted.start_after:
                load = _load(options, url)
                say(
                    story.say(
                        "load", clients=wanted.concurrency, prompt=wanted.prompt_tokens, out=wanted.max_tokens
                    )
                )
            verdict = story.verdict(t)
            if verdict is None and time.monotonic() - last_said[0] >= QUIET_S:
                say(story.quiet(t, reading[0] if reading else None, reading[2] if reading else None))
            if verdict is not None and options.box_seed is not None:
                truth = watch.truth(scenario.load)  # while the final engine still serves
            if verdict is None and daemon.poll() is not None:
                say(story.say("daemon_died", code=daemon.returncode, log=options.workdir / "tunerd.log"))
                verdict = Verdict(False, "tunerd exited")
            elif verdict is None and time.monotonic() - started > options.wall_limit:
                verdict = Verdict(False, f"not over after {options.wall_limit:.0f} s of wall time")
        say(verdict.why)
    finally:
        if load is not None:
            load.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                load.wait(10)
            if load.poll() is None:
                load.kill()
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(30)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        follower.join(5)
        log.close()
        _stop_engine(options.workdir / "state")
        watch.close()
    final = story.settings[-1][1] if story.settings else None
    kv = story.kv_tokens[-1][1] if story.kv_tokens else None
    safe_max = (truth or {}).get("safe_max") or {}
    true_safe = safe_max.get("kv_cache_tokens") if isinstance(safe_max, dict) else None
    summary: list[str] = []
    measured: list[Check] = []
    if final is not None:
        said = report_words(options.language)
        summary.append(f"{said['start']}: {settings_text(scenario.settings)}")
        summary.append(f"{said['final']}: {settings_text(final)}")
        if options.box_seed is None:
            summary.extend(bill_table(scenario, scenario.settings, final, options.language))
        else:
            summary.append(f"box {options.box_seed}: {box_text((truth or {}).get('box'))}")
        if scenario.expect == "converged":
            measured = checks(story, final, kv, true_safe if options.box_seed is not None else None)
            summary.extend(check_lines(measured, options.language))
    ok = verdict.ok and all(check.met for check in measured)
    return DemoResult(
        scenario=scenario.name,
        ok=ok,
        verdict=verdict.why,
        narration=narration,
        summary=summary,
        checks=measured,
        start_settings=dict(scenario.settings),
        final_settings=final,
        kv_tokens=kv,
        safe_kv_tokens=safe_kv_tokens(scenario, final) if final is not None else None,
        restarts=story.restarts_used(),
        crashes=len(story.crashes),
        wall_seconds=time.monotonic() - started,
        simulated_seconds=now(),
        samples=samples,
        story=story,
        ooms_after_converging=story.ooms_after(story.settled_at()),
        box_seed=options.box_seed,
        true_safe_kv_tokens=true_safe if isinstance(true_safe, int) else None,
        truth=truth,
    )


def write_report(result: DemoResult, path: Path) -> None:
    """The HTML page: the memory curve with the story's marks, the narration, the summary."""
    assert result.story is not None
    page = render_html(result.story, result.samples, result.narration, result.summary, result.verdict)
    path.write_text(page, encoding="utf-8")
