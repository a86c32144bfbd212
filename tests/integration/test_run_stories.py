"""`tunerd run` end to end on the simulator (real processes, loopback, time scale 50)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.integration.sim_daemon import close_daemon, sim_daemon, started, ticked
from tunerd.state import State

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


#: the OOM-prone config of the OOM stories: 0.97 utilization, 16-bit KV, 8192 batched tokens
GREEDY = {
    "gpu_memory_utilization": 0.97,
    "max_model_len": 32768,
    "max_num_seqs": 16,
    "max_num_batched_tokens": 8192,
    "kv_cache_dtype": "auto",
}
GREEDY_BOUNDS: dict[str, list[object]] = {
    "gpu_memory_utilization": [0.80, 0.97],
    "max_num_batched_tokens": [1024, 8192],
}


def _policies(tmp_path: Path, *names: str) -> Path:
    """The shipped default policies, only those named: one story at a time."""
    shipped = yaml.safe_load((ROOT / "policies" / "default.yaml").read_text())
    chosen = [policy for policy in shipped["policies"] if policy["name"] in names]
    assert [p["name"] for p in chosen] == list(names)
    path = tmp_path / "policies.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "policies": chosen}))
    return path


def _config(
    tmp_path: Path,
    port: int,
    settings: dict[str, object],
    bounds: dict[str, list[object]],
    *extra: str,
    policies: Path,
) -> Path:
    url = f"http://127.0.0.1:{port}"
    command = [
        sys.executable, "-m", "tunerd", "sim", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--time-scale", "50", "--sim-startup-seconds", "10",
        "--sim-model", "llama-3.1-8b", "--sim-weights", "awq", "--sim-gpu", "rtx4090", *extra,
    ]  # fmt: skip
    config = {
        "engine": {
            "name": "main",
            "command": command,
            "url": url,
            "settings": settings,
            "bounds": bounds,
            "drain": "30s",
            "startup_timeout": "30s",
            "probation": "1s",
        },
        "gpu": {"source": "sim", "url": url},
        "metrics": {"interval": "200ms"},
        "mode": "act",
        "policies": [str(policies)],
        "guards": {"max_restarts": 5, "window": "1h", "settle": "0s"},
        "state_dir": str(tmp_path / "state"),
    }
    path = tmp_path / "tunerd.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _load(url: str, seconds: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tunerd",
            "sim",
            "load",
            "--url",
            url,
            "--concurrency",
            "4",
            "--prompt-tokens",
            "28000",
            "--max-tokens",
            "512",
            "--duration",
            f"{seconds}s",
            "--timeout",
            "60",
            "--retry-refused",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _start_tunerd(config: Path, url: str) -> subprocess.Popen[str]:
    """`tunerd run` as a user starts it; returns once the engine it started answers."""
    tunerd = subprocess.Popen(
        [sys.executable, "-m", "tunerd", "run", "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return tunerd
        time.sleep(0.1)
    tunerd.kill()
    raise AssertionError("the engine tunerd started never answered:\n" + (tunerd.communicate()[0] or ""))


def _kill_engine(state_dir: Path) -> None:
    with contextlib.suppress(Exception):
        state = State.open(state_dir)
        record = state.engine("main")
        if record is not None and record.pid is not None:
            os.killpg(record.pid, signal.SIGKILL)
        state.close()


def test_oom_prone_config_is_tuned_down_until_stable(tmp_path: Path) -> None:
    """0.97 utilization, 16-bit KV, 8192 batched tokens under the seed's long prompts: the engine
    dies of a CUDA OOM; the `oom` policy lowers utilization and restarts it; it ends stable."""
    port = _free_port()
    config = _config(
        tmp_path,
        port,
        GREEDY,
        GREEDY_BOUNDS,
        policies=_policies(tmp_path, "oom"),
    )
    url = f"http://127.0.0.1:{port}"
    tunerd = _start_tunerd(config, url)
    try:
        load = _load(url, 40)
        summary = load.communicate(timeout=120)[0]
        # after the load: no restart in flight, and the engine serves
        deadline = time.monotonic() + 60
        healthy = False
        while time.monotonic() < deadline and not healthy:
            state = State.open(tmp_path / "state", readonly=True)
            settled = state.intents() == []
            state.close()
            with contextlib.suppress(httpx.HTTPError):
                healthy = settled and httpx.get(url + "/health", timeout=1).status_code == 200
            time.sleep(0.2)
        assert healthy
    finally:
        tunerd.send_signal(signal.SIGTERM)
        output = tunerd.communicate(timeout=60)[0]
        _kill_engine(tmp_path / "state")
    events = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    assert any(e["event"] == "engine_crash" and e["kind"] == "cuda_oom" for e in events), output
    state = State.open(tmp_path / "state")
    history = state.history()
    tunes = [h for h in history if h["kind"] == "tune" and h["outcome"] == "succeeded"]
    assert tunes, history
    assert all(h["policy"] == "oom" for h in tunes)
    assert all(
        h["to_settings"]["gpu_memory_utilization"] < h["from_settings"]["gpu_memory_utilization"]
        for h in tunes
    )
    assert "cuda_oom" in tunes[-1]["reason"]
    record = state.engine("main")
    assert record is not None
    assert not record.held
    final = state.version(record.running).settings
    # computed from what the first start showed (fit): below the greedy 0.97, no lower than the
    # box needs (the fit lands near 0.948) — also when the engine died before any tick saw it
    # serving, as a clean-clone run on a loaded machine did: it is observed at its death (the
    # test below makes that happen every time)
    assert 0.90 <= final["gpu_memory_utilization"] < 0.97
    reason = tunes[-1]["reason"]
    assert "(fit: " in reason, reason
    # stable: one crash, one change, and the load kept being served afterwards (~30 simulated min)
    assert len(tunes) == 1
    assert len(state.crashes("main", since=0)) == 1
    served = int(summary.split("requests: ")[1].split(" ok")[0])
    assert served >= 100, summary
    assert record.running == record.last_known_good
    _the_crash_is_an_incident(tmp_path, state, tunes[-1]["id"])


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "tunerd", *args]
    return subprocess.run(command, check=False, capture_output=True, text=True, timeout=60)


def _the_crash_is_an_incident(tmp_path: Path, state: State, tune_id: int) -> None:
    """Issue 20: the OOM is an incident, written before the restart that answered it (which
    joined it), with the time after it; its post-mortem names the crash and the GPU's
    peak; its recording replays to the decision the daemon made."""
    incidents = state.incidents()
    crashes = [i for i in incidents if i["kind"] == "crash"]
    assert len(crashes) == 1, incidents
    crash = crashes[0]
    assert crash["action_ids"] == [tune_id], crash
    tuned_at = state._read("SELECT time FROM actions WHERE id = ?", (tune_id,)).fetchone()[0]
    assert crash["time"] <= tuned_at  # written in the tick that saw the crash, before the restart
    state_dir = str(tmp_path / "state")
    listed = _run_cli("incident", "list", "--json", "--state-dir", state_dir)
    assert listed.returncode == 0, listed.stderr
    assert [i["id"] for i in json.loads(listed.stdout)["incidents"]] == [crash["id"]]
    shown = _run_cli("incident", "show", str(crash["id"]), "--state-dir", state_dir)
    assert shown.returncode == 0, shown.stderr
    for words in ("What filled the GPU", "cuda_oom", "Suspected cause", f"#{tune_id} tune → succeeded"):
        assert words in shown.stdout, shown.stdout
    report = json.loads(
        _run_cli("incident", "show", str(crash["id"]), "--json", "--state-dir", state_dir).stdout
    )
    assert report["crash"]["kind"] == "cuda_oom", report
    assert report["peak"]["used_bytes"] > 20 * 2**30, report
    recording = tmp_path / "oom.jsonl"
    written = _run_cli("record", "--incident", str(crash["id"]), str(recording), "--state-dir", state_dir)
    assert written.returncode == 0, written.stderr
    replayed = _run_cli("replay", str(recording), "--policies", str(tmp_path / "policies.yaml"), "--json")
    assert replayed.returncode == 0, replayed.stderr
    lines = [json.loads(line) for line in recording.read_text().splitlines()]
    ticks = [line["t"] for line in lines[1:] if line.get("tick")]
    # the two minutes after had not passed when tunerd stopped (wall time; the simulator runs
    # 50× faster): its stop wrote the time after the crash that there was
    assert ticks[0] < crash["time"] < ticks[-1], (ticks[0], crash["time"], ticks[-1])
    decisions = json.loads(replayed.stdout)["decisions"]
    oom = [d for d in decisions if d["policy"] == "oom"]
    assert oom, decisions
    assert all(d["recorded"] and d["replayed"] for d in decisions), decisions
    # an edited policy (one that blames neighbours for any growth at all) would not have tuned:
    # the difference is printed
    edited = tmp_path / "edited.yaml"
    edited.write_text((tmp_path / "policies.yaml").read_text().replace("512MiB", "0MiB"))
    differs = _run_cli("replay", str(recording), "--policies", str(edited))
    assert differs.returncode == 0, differs.stderr
    assert "0 decisions as recorded, 1 different" in differs.stdout, differs.stdout
    assert re.search(r"^  - .*oom: tune gpu_memory_utilization", differs.stdout, re.MULTILINE), differs.stdout
    # the incident as a regression test: the policies it ran pass, the edited one fails, named
    for policies, code in (("policies.yaml", 0), ("edited.yaml", 1)):
        test = tmp_path / f"{policies}.test.yaml"
        test.write_text(
            f"policies: [{policies}]\ntests:\n  - name: the seed's OOM\n    recording: oom.jsonl\n"
            "    expect_as_recorded: true\n"
        )
        tested = _run_cli("policy", "test", str(test))
        assert tested.returncode == code, tested.stdout + tested.stderr
    assert "only recorded" in tested.stdout + tested.stderr


def test_a_growing_neighbour_is_alerted_not_tuned_and_the_crash_loop_held(tmp_path: Path) -> None:
    """The seed's config at 0.90 while a notebook on the same GPU grows by 1 GiB a minute: the
    engine dies of a CUDA OOM that is not its own fault; tunerd alerts and tunes nothing. (The
    simulated notebook starts over with each engine start, so the next crash comes soon and,
    with unchanged settings, is a loop: tunerd holds rather than tune around a neighbour.)"""
    port = _free_port()
    seed = {
        "gpu_memory_utilization": 0.90,
        "max_model_len": 32768,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 2048,
        "kv_cache_dtype": "fp8",
    }
    config = _config(
        tmp_path,
        port,
        seed,
        {"gpu_memory_utilization": [0.80, 0.90]},
        "--sim-neighbor",
        "256MiB@0s+1GiB/1m:notebook",
        policies=_policies(tmp_path, "oom-neighbour", "oom"),
    )
    url = f"http://127.0.0.1:{port}"
    tunerd = _start_tunerd(config, url)
    try:
        load = _load(url, 15)
        load.communicate(timeout=120)
    finally:
        tunerd.send_signal(signal.SIGTERM)
        output = tunerd.communicate(timeout=60)[0]
        _kill_engine(tmp_path / "state")
    events = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    assert any(e["event"] == "engine_crash" and e["kind"] == "cuda_oom" for e in events), output
    state = State.open(tmp_path / "state")
    history = state.history(limit=500)
    alerts = [h for h in history if h["kind"] == "notify"]
    assert alerts, history
    first = alerts[-1]  # history is newest first
    assert first["policy"] == "oom-neighbour"
    assert first["reason"].startswith("critical")
    assert "restarting after cuda_oom with the same settings" in first["reason"]  # not at fault
    assert [h for h in history if h["kind"] == "tune"] == []  # nothing tuned, ever
    # the crash loop (DESIGN §4.9): a second OOM with the same settings holds the engine and
    # pages a person; last-known-good restarts with backoff (30 s, doubling), not in a storm.
    # (Whether the simulated notebook brings the second OOM within the 15 s of load varies on a
    # busy machine, so this part is checked when it did.)
    crashes = state.crashes("main", since=0)
    holds = [h for h in history if h["kind"] == "hold"]
    if len(crashes) >= 2:
        assert len(holds) == 1, history
        assert holds[0]["reason"].startswith("crash loop after cuda_oom")
        assert any("held (crash loop" in h["reason"] for h in alerts)
    restarts = [h for h in history if h["kind"] == "restart" and h["outcome"] != "skipped"]
    assert len(restarts) <= 3, restarts  # the first start, one crash restart, at most one held retry
    record = state.engine("main")
    assert record is not None
    assert state.version(record.running).settings == seed


def test_an_engine_that_dies_of_an_oom_before_any_tick_measured_it_is_calibrated_from_its_log(
    tmp_path: Path,
) -> None:
    """The greedy config of the story above, driven tick by tick: the engine starts, and dies
    of a CUDA OOM before tunerd's first tick has seen it serving (one request whose prompt
    logprobs over 8,192-token chunks the profile never saw). Its log has the start-up figures
    and torch's text the CUDA total: the `oom` policy's `fit` is computed from them, not left
    to the notch (it was, before: 0.97 → 0.94). (tests/unit/test_diagnosis.py has torch's
    "total capacity" read from recorded texts.)"""
    said: list[dict[str, object]] = []
    daemon = sim_daemon(
        tmp_path,
        settings=GREEDY,
        policies=(str(_policies(tmp_path, "oom")),),
        said=said,
        bounds=GREEDY_BOUNDS,
    )
    try:
        started(daemon)
        assert daemon.ticks == 0
        url = daemon.config.engines[0].url
        killer = {"prompt_tokens": 30000, "max_tokens": 1, "prompt_logprobs": 1}
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(f"{url}/v1/completions", json=killer, timeout=30)
        process = daemon.engines[0].supervisor.process
        assert process is not None
        deadline = time.monotonic() + 30
        while process.alive():  # dead before the first tick: no tick saw it serve
            assert time.monotonic() < deadline, "the engine did not die of the OOM"
            time.sleep(0.05)
        tunes: list[dict[str, object]] = []
        while not tunes:
            assert time.monotonic() < deadline, daemon.state.history()
            ticked(daemon)
            tunes = [h for h in daemon.state.history() if h["kind"] == "tune"]
            time.sleep(0.1)
        (tune,) = tunes
        assert tune["policy"] == "oom"
        assert "cuda_oom" in str(tune["reason"])
        assert "(fit: " in str(tune["reason"]), tune["reason"]
        assert any(e["event"] == "engine_observed_at_death" for e in said)
        # room for what the OOM asked on top (4.90 GiB of fp32 prompt logits): more than the
        # notch's 0.03, down to the bound
        assert 0.80 <= tune["to_settings"]["gpu_memory_utilization"] < 0.94  # type: ignore[index]
    finally:
        close_daemon(daemon, kill=True)


def test_a_crash_incident_survives_kill_9_of_tunerd_right_after_it(tmp_path: Path) -> None:
    """Issue 20: the numbers are there right after a crash. The engine dies of a CUDA OOM;
    the moment tunerd says it wrote the incident, tunerd is killed with SIGKILL (no shutdown,
    nothing flushed): the incident is in the state, its recording readable, its post-mortem
    shown by `tunerd incident show` — and it was written before the restart that answers the
    crash began (no restart record after it)."""
    port = _free_port()
    config = _config(tmp_path, port, GREEDY, GREEDY_BOUNDS, policies=_policies(tmp_path, "oom"))
    url = f"http://127.0.0.1:{port}"
    tunerd = _start_tunerd(config, url)
    said: list[str] = []
    try:
        time.sleep(1.0)  # a few ticks of the engine serving: the recording has them
        killer = {"prompt_tokens": 30000, "max_tokens": 1, "prompt_logprobs": 1}
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(f"{url}/v1/completions", json=killer, timeout=30)
        assert tunerd.stdout is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = tunerd.stdout.readline()
            said.append(line)
            if '"event": "incident"' in line and '"kind": "crash"' in line:
                break
        else:
            raise AssertionError("no crash incident said:\n" + "".join(said[-40:]))
        tunerd.kill()  # SIGKILL: the incident must already be on disk
        tunerd.wait(timeout=10)
    finally:
        if tunerd.poll() is None:
            tunerd.kill()
        _kill_engine(tmp_path / "state")
    state = State.open(tmp_path / "state", readonly=True)
    try:
        (incident,) = state.incidents()
        assert incident["kind"] == "crash"
        assert "cuda_oom" in incident["summary"]
        # written in the tick that saw the crash: the tune that answers it (if it got that far
        # before the SIGKILL) was recorded at that tick or later
        answers = state._read("SELECT time FROM actions WHERE kind = 'tune'").fetchall()
        assert all(row[0] >= incident["time"] for row in answers), (answers, incident)
        detail = state.incident(incident["id"])
        assert detail is not None
        assert detail["detail"]["crash"]["kind"] == "cuda_oom"
    finally:
        state.close()
    shown = _run_cli("incident", "show", str(incident["id"]), "--state-dir", str(tmp_path / "state"))
    assert shown.returncode == 0, shown.stderr
    assert "cuda_oom" in shown.stdout
    assert "at the peak" in shown.stdout, shown.stdout  # the recording's samples are there
