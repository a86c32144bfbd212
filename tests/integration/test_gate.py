"""`tunerd gate` in front of `tunerd sim serve`, both real processes on loopback (issue 19).

What a client sees through the gate: the engine's own answers (plain and streamed, chunk by
chunk), the gate's own (400, 413, 429 and 503 with Retry-After), a client that goes away
aborting the engine's request, long prompts in their own lane, requests waiting through a
hold and through an engine that is down, and a gate that keeps serving through bad input.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.cli import run_tunerd
from tests.integration.gate_world import (
    SEED_ENGINE,
    GateWorld,
    gate_config,
    gate_world,
    metric,
    start_gate,
    start_sim,
    wait_healthy,
    words,
)
from tests.integration.sim_daemon import BEFORE, free_port, running, sim_daemon

pytestmark = pytest.mark.slow
#: the seed's engine with a pool of about 50K tokens: three 16K requests do not fit in it
SMALL_POOL = [arg if arg != "0.92" else "0.40" for arg in SEED_ENGINE]
AFTER = {**BEFORE, "max_num_seqs": 6}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GateWorld]:
    with gate_world(tmp_path_factory.mktemp("gate"), *SEED_ENGINE) as found:
        yield found


def _post(url: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(url, json=body, headers=headers, timeout=60)


def _watch(world: GateWorld, stop: threading.Event, seen: list[dict[str, Any]]) -> None:
    while not stop.is_set():
        seen.append(world.status())
        time.sleep(0.02)


def _together(calls: list[Callable[[], httpx.Response]]) -> list[httpx.Response]:
    results: list[httpx.Response | None] = [None] * len(calls)

    def run(index: int) -> None:
        results[index] = calls[index]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert all(result is not None for result in results)
    return [r for r in results if r is not None]


def test_answers_pass_through_plain_and_streamed_with_the_engines_usage(world: GateWorld) -> None:
    plain = _post(f"{world.url}/v1/completions", {"prompt": words(40), "max_tokens": 5})
    assert plain.status_code == 200
    assert plain.json()["usage"]["prompt_tokens"] == 40
    chat = {
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": words(30)}],
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{world.url}/v1/chat/completions", json=chat, timeout=30) as answer:
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("text/event-stream")
        events = [line for line in answer.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["usage"]["prompt_tokens"] == 2 + 2 + 30 + 2 + 1  # the template's count
    # the gate counted the same (by the engine's /tokenize): the error it measured is 0
    assert world.status()["last_count_error_ratio"] == 0.0
    assert world.gate_metric("tunerd_gate_count_error_ratio_count", engine="main") >= 1
    # everything else passes straight through, the engine's /metrics included
    models = httpx.get(f"{world.url}/v1/models", timeout=10).json()
    assert models["data"][0]["max_model_len"] == 32768
    assert "vllm:kv_cache_usage_perc" in httpx.get(f"{world.url}/metrics", timeout=10).text
    assert httpx.get(f"{world.url}/no/such/path", timeout=10).status_code == 404  # the engine's 404


def test_a_client_that_goes_away_aborts_the_engines_request(world: GateWorld) -> None:
    aborted = world.engine_metric("vllm:request_success_total", finished_reason="abort")
    long_answer = {"prompt": words(20), "max_tokens": 20000, "ignore_eos": True}
    with httpx.stream(
        "POST", f"{world.url}/v1/completions", json={**long_answer, "stream": True}, timeout=30
    ) as answer:
        for _ in answer.iter_lines():
            break  # the first chunk, then the client hangs up
    with pytest.raises(httpx.ReadTimeout):  # not streamed: the client gives up waiting
        httpx.post(f"{world.url}/v1/completions", json=long_answer, timeout=0.5)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if world.engine_metric("vllm:request_success_total", finished_reason="abort") >= aborted + 2:
            break
        time.sleep(0.1)
    assert world.engine_metric("vllm:request_success_total", finished_reason="abort") == aborted + 2
    assert world.engine_metric("vllm:num_requests_running") == 0
    status = world.status()
    assert (status["in_flight"], status["in_flight_tokens"]) == (0, 0)  # their need is free again


def test_the_gates_own_answers_for_bad_input(world: GateWorld) -> None:
    bad_json = httpx.post(f"{world.url}/v1/completions", content=b"{not json", timeout=10)
    assert bad_json.status_code == 400
    assert "malformed JSON" in bad_json.json()["error"]["message"]
    assert bad_json.headers["X-Tunerd-Gate"] == "1"
    not_object = httpx.post(f"{world.url}/v1/chat/completions", json=[1, 2], timeout=10)
    assert not_object.status_code == 400
    no_messages = _post(f"{world.url}/v1/chat/completions", {"messages": "hello"})
    assert "messages must be a non-empty list" in no_messages.json()["error"]["message"]
    bad_max = _post(f"{world.url}/v1/completions", {"prompt": "hi", "max_tokens": "lots"})
    assert "max_tokens must be a whole number" in bad_max.json()["error"]["message"]
    bad_priority = _post(f"{world.url}/v1/completions", {"prompt": "hi"}, **{"X-Tunerd-Priority": "high"})
    assert bad_priority.status_code == 400
    over_context = _post(f"{world.url}/v1/completions", {"prompt": words(30000), "max_tokens": 5000})
    assert over_context.status_code == 400
    assert "maximum context length is 32768" in over_context.json()["error"]["message"]
    # no max_tokens on a chat request: it may run to max_model_len, and it does run
    no_max = _post(f"{world.url}/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert no_max.status_code == 200
    huge = httpx.post(f"{world.url}/v1/completions", content=b"x" * (65 << 20), timeout=30)
    assert huge.status_code == 413
    passed = httpx.post(
        f"{world.url}/tokenize", content=b"x" * (65 << 20), timeout=30
    )  # not gated: capped too
    assert passed.status_code == 413
    assert "max_body" in passed.json()["error"]["message"]  # the gate's own answer, in vLLM's shape
    ok = _post(f"{world.url}/v1/completions", {"prompt": "still serving", "max_tokens": 2})
    assert ok.status_code == 200


def test_slow_clients_do_not_stop_the_others(world: GateWorld) -> None:
    host, port = world.url.removeprefix("http://").split(":")
    sockets = []
    for _ in range(50):  # slowloris: half a request line each, never finished
        sock = socket.create_connection((host, int(port)), timeout=5)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        sockets.append(sock)
    try:
        started = time.monotonic()
        ok = _post(f"{world.url}/v1/completions", {"prompt": "served", "max_tokens": 2})
        assert ok.status_code == 200
        assert time.monotonic() - started < 5
    finally:
        for sock in sockets:
            sock.close()


def test_long_prompts_run_in_their_lane_while_short_ones_flow(tmp_path: Path) -> None:
    with gate_world(tmp_path, *SEED_ENGINE, long_threshold=4000, long_lane=1) as world:
        seen: list[dict[str, Any]] = []
        stop = threading.Event()
        watcher = threading.Thread(target=_watch, args=(world, stop, seen))
        watcher.start()
        long_body = {"prompt": words(6000), "max_tokens": 300, "ignore_eos": True}
        short_body = {"prompt": words(50), "max_tokens": 20, "ignore_eos": True}
        calls = [lambda: _post(f"{world.url}/v1/completions", long_body) for _ in range(3)]
        calls += [lambda: _post(f"{world.url}/v1/completions", short_body) for _ in range(6)]
        answers = _together(calls)
        stop.set()
        watcher.join()
        assert [a.status_code for a in answers] == [200] * 9
        assert max(s["long_in_flight"] for s in seen) == 1  # run alone, one at a time
        assert max(s["queued"] for s in seen) >= 1  # the others waited for the lane
        decisions = world.status()["decisions"]
        assert decisions["admitted/long"] == 3
        assert decisions["admitted/short"] >= 6
        assert decisions.get("queued/long_lane", 0) >= 1


def test_the_seeds_four_full_contexts_preempt_straight_to_the_engine_and_never_through_the_gate(
    tmp_path: Path,
) -> None:
    """The seed's promise (four conversations at the full 32K context) on its box with a 16-bit
    KV cache, whose pool (129,872 tokens) is just short of four: two engines side by side,
    the same clients, one reached directly and one through the gate with its defaults. The
    direct engine preempts (vLLM recomputes the newest); the gated one never does, and every
    request through the gate is answered. (bench/bench_gate_seed.py runs the whole table.)"""
    pitfall = [arg if arg != "fp8" else "auto" for arg in SEED_ENGINE]
    port = free_port()
    direct = start_sim(port, *pitfall, scale="10")
    direct_url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(direct_url)
        with gate_world(tmp_path, *pitfall, scale="10") as world:
            stop = threading.Event()
            codes: dict[str, list[int]] = {"direct": [], "gate": []}

            def client(url: str, name: str, body: dict[str, Any]) -> None:
                with httpx.Client(timeout=300) as http:
                    while not stop.is_set():
                        codes[name].append(http.post(url, json=body).status_code)

            long_body = {"prompt": words(32000), "max_tokens": 512, "ignore_eos": True}
            chat = {
                "messages": [{"role": "user", "content": words(200)}],
                "max_tokens": 64,
                "ignore_eos": True,
            }
            threads = [
                threading.Thread(target=client, args=(f"{url}{path}", name, body))
                for name, url in (("direct", direct_url), ("gate", world.url))
                for path, body, count in (
                    ("/v1/completions", long_body, 4),
                    ("/v1/chat/completions", chat, 2),
                )
                for _ in range(count)
            ]
            for thread in threads:
                thread.start()
            time.sleep(12)  # two simulated minutes
            stop.set()
            for thread in threads:
                thread.join(120)
            assert world.engine_metric("vllm:num_preemptions_total") == 0
            assert set(codes["gate"]) == {200}
            assert len(codes["gate"]) >= 10
            assert metric(httpx.get(f"{direct_url}/metrics").text, "vllm:num_preemptions_total") > 0
    finally:
        direct.stop()


def test_the_kv_budget_holds_and_full_queues_answer_429_then_503(tmp_path: Path) -> None:
    with gate_world(
        tmp_path, *SMALL_POOL, long_threshold=1_000_000, queue={"max_requests": 2, "max_wait": "2s"}
    ) as world:
        pool = world.status()["pool_tokens"]
        # each request needs a third of the pool: two fit 0.9 of it, the third waits
        prompt = pool // 3 - 100
        assert prompt < 32768 - 100  # within max_model_len
        body = {"prompt": words(prompt), "max_tokens": 50, "ignore_eos": True}
        seen: list[dict[str, Any]] = []
        stop = threading.Event()
        watcher = threading.Thread(target=_watch, args=(world, stop, seen))
        watcher.start()
        answers = _together([lambda: _post(f"{world.url}/v1/completions", body) for _ in range(6)])
        stop.set()
        watcher.join()
        codes = sorted(a.status_code for a in answers)
        assert codes.count(200) >= 2
        assert max(s["in_flight_tokens"] for s in seen) <= world.status()["budget_tokens"]
        refused = [a for a in answers if a.status_code in (429, 503)]
        assert refused, codes  # two run, two wait, the rest find the queue full
        for answer in refused:
            assert int(answer.headers["Retry-After"]) >= 1
            assert answer.json()["error"]["code"] == answer.status_code
        assert any(a.status_code == 429 for a in refused)


def test_a_hold_keeps_requests_waiting_and_release_lets_them_through(world: GateWorld) -> None:
    held = world.control_post("hold", {"seconds": 30, "reason": "restart"}).json()
    assert held["held"] is True
    assert held["hold_reason"] == "restart"
    results: list[httpx.Response] = []
    thread = threading.Thread(
        target=lambda: results.append(
            _post(f"{world.url}/v1/completions", {"prompt": "wait", "max_tokens": 2})
        )
    )
    thread.start()
    time.sleep(1.0)
    assert not results  # still waiting at the gate
    assert world.status()["queued"] == 1
    assert world.gate_metric("tunerd_gate_held", engine="main") == 1
    released = world.control_post("release").json()
    assert released["held"] is False
    thread.join(10)
    assert [r.status_code for r in results] == [200]


def test_a_hold_past_its_max_is_503_with_retry_after_never_a_connection_error(tmp_path: Path) -> None:
    with gate_world(tmp_path, *SEED_ENGINE, hold={"max": "1s"}) as world:
        world.control_post("hold", {"reason": "restart"})
        answer = _post(f"{world.url}/v1/completions", {"prompt": "wait", "max_tokens": 2})
        assert answer.status_code == 503
        assert "engine's restart" in answer.json()["error"]["message"]
        assert int(answer.headers["Retry-After"]) >= 1
        assert _post(f"{world.url}/v1/completions", {"prompt": "after", "max_tokens": 2}).status_code == 200


def test_requests_wait_for_an_engine_that_is_down_and_run_when_it_is_back(tmp_path: Path) -> None:
    with gate_world(tmp_path, *SEED_ENGINE) as world:
        assert world.sim is not None
        world.sim.stop()
        results: list[httpx.Response] = []
        thread = threading.Thread(
            target=lambda: results.append(
                _post(f"{world.url}/v1/completions", {"prompt": "hi", "max_tokens": 2})
            )
        )
        thread.start()
        time.sleep(0.5)
        assert not results
        passed = httpx.get(f"{world.url}/v1/models", timeout=10)  # not gated: said at once
        assert passed.status_code == 502
        assert "is not answering" in passed.json()["error"]["message"]
        world.restart_sim(*SEED_ENGINE)
        wait_healthy(world.engine_url)
        thread.join(30)
        assert [r.status_code for r in results] == [200]  # no connection error: it waited
        assert world.gate.events("gate_engine_up")


def test_the_control_socket_retunes_live_and_refuses_bad_limits(world: GateWorld) -> None:
    changed = world.control_post("limits", {"long_threshold": 8192, "max_concurrency": 4}).json()
    assert changed["limits"]["long_threshold"] == 8192
    assert changed["limits"]["max_concurrency"] == 4
    assert world.gate_metric("tunerd_gate_limit", engine="main", limit="max_concurrency") == 4
    assert world.control_post("limits", {"target_fraction": 1.5}).status_code == 400
    assert world.control_post("limits", {"queue": 3}).status_code == 400
    assert world.control_post("limits", {"long_lane": "two"}).status_code == 400
    assert world.control_post("hold", {"seconds": -1}).status_code == 400
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(world.control)), timeout=5) as client:
        assert client.post("http://gate/engines/nope/hold", json={}).status_code == 404
    world.control_post("limits", {"long_threshold": 16384, "max_concurrency": 0})


def test_gate_status_and_the_command_lines_errors(world: GateWorld, tmp_path: Path) -> None:
    shown = run_tunerd("gate", "status", "--config", str(world.config))
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("main  open  listen 127.0.0.1:")
    as_json = json.loads(run_tunerd("gate", "status", "--json", "--config", str(world.config)).stdout)
    assert as_json["engines"]["main"]["pool_tokens"] > 0
    before = run_tunerd("gate", "--config", str(world.config), "status")  # the option before the action
    assert before.returncode == 0, before.stderr
    assert before.stdout.startswith("main  open  listen 127.0.0.1:")
    ungated = tmp_path / "ungated.yaml"
    ungated.write_text("engines:\n  - name: main\n    command: [vllm, serve, m]\n")
    refused = run_tunerd("gate", "--config", str(ungated))
    assert refused.returncode == 2
    assert "no engine has a gate: block" in refused.stderr
    nobody = tmp_path / "nobody.yaml"
    nobody.write_text(
        "state_dir: " + str(tmp_path) + "\nengines:\n  - name: main\n    command: [vllm, serve, m]\n"
        "    gate: {listen: '127.0.0.1:1', control: " + str(tmp_path / "none.sock") + "}\n"
    )
    missing = run_tunerd("gate", "status", "--config", str(nobody))
    assert missing.returncode == 3  # no gate answered
    assert "no gate answers at" in missing.stderr


def test_a_restart_by_tunerd_holds_new_requests_at_the_gate_and_none_fails(tmp_path: Path) -> None:
    """The whole story: tunerd (mode act) supervises the simulated engine, `tunerd gate` runs
    from the same config file, clients send steadily through the gate; a person's rollback
    makes tunerd restart the engine (drain, stop, start, verify). The gate holds what arrives
    meanwhile and lets it through once the new engine serves: no client sees an error."""
    gate_port = free_port()
    control = tmp_path / "gate.sock"
    said: list[dict[str, Any]] = []
    daemon = sim_daemon(
        tmp_path, said=said, gate={"listen": f"127.0.0.1:{gate_port}", "control": str(control)}
    )
    supervisor = daemon.engines[0].supervisor

    def tuned() -> None:  # a change that took: the rollback below has something to undo
        assert (
            supervisor.restart(AFTER, reason="kv-pool-saturated: max_num_seqs 8 → 6").outcome == "succeeded"
        )

    gate = start_gate(str(tmp_path / "tunerd.yaml"))
    url = f"http://127.0.0.1:{gate_port}"
    codes: list[int] = []
    stop = threading.Event()

    def client() -> None:
        with httpx.Client(timeout=60) as http:
            while not stop.is_set():
                try:
                    codes.append(
                        http.post(
                            f"{url}/v1/completions", json={"prompt": words(20), "max_tokens": 8}
                        ).status_code
                    )
                except httpx.HTTPError as error:  # a connection error: what the gate must prevent
                    codes.append(-1)
                    said.append({"event": "client_error", "error": repr(error)})

    try:
        with running(daemon, prepare=tuned):
            gate.wait_event("gate_engine_up")
            clients = [threading.Thread(target=client) for _ in range(4)]
            for thread in clients:
                thread.start()
            time.sleep(1.0)
            before = len(codes)
            asked = run_tunerd(
                "rollback", "main", "--state-dir", str(tmp_path / "state"), "--reason", "latency doubled"
            )
            assert asked.returncode == 0, asked.stderr
            deadline = time.monotonic() + 30
            while supervisor.running_settings() != BEFORE and time.monotonic() < deadline:
                time.sleep(0.1)
            assert supervisor.running_settings() == BEFORE
            time.sleep(1.0)  # clients keep going on the new engine
            stop.set()
            for thread in clients:
                thread.join(60)
            events = [event["event"] for event in said]
            assert "gate_hold" in events
            assert "gate_release" in events
            assert len(codes) > before + 10
            assert set(codes) == {200}, [e for e in said if e["event"] == "client_error"][:3]
            held = json.loads(
                run_tunerd("gate", "status", "--json", "--config", str(tmp_path / "tunerd.yaml")).stdout
            )
            decisions = held["engines"]["main"]["decisions"]
            assert (
                decisions.get("held/held", 0) + decisions.get("queued/engine_unknown", 0) >= 1
            )  # some waited
            status = daemon.status()["engines"][0]
            assert status["gate"]["engine"] == "main"  # tunerd status shows the gate
    finally:
        stop.set()
        gate.stop()


@contextlib.contextmanager
def _gated_daemon(tmp_path: Path, when: str, move: str = "step_down") -> Iterator[Any]:
    """tunerd (mode act, in this process) with one policy that moves the gate's
    ``target_fraction`` (``move``) once ``when`` holds, and ``tunerd gate`` in front of its
    engine."""
    policy = tmp_path / "tighten.yaml"
    policy.write_text(
        "version: 1\npolicies:\n"
        "  - name: tighten\n"
        f"    when: {when}\n"
        f"    then: [{{gate: {{target_fraction: {move}}}}}]\n"
        "    cooldown: 1h\n"
    )
    gate_port = free_port()
    daemon = sim_daemon(
        tmp_path,
        policies=(str(policy),),
        top={"metrics": {"interval": "250ms"}},
        gate={"listen": f"127.0.0.1:{gate_port}", "control": str(tmp_path / "gate.sock")},
    )
    gate = start_gate(str(tmp_path / "tunerd.yaml"))
    try:
        gate.wait_event("gate_control_listening")
        with running(daemon):
            yield daemon
    finally:
        gate.stop()


def _gate_records(daemon: Any, count: int, timeout: float = 20) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    found: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        found = [h for h in daemon.state.history(engine="main") if h["kind"] == "gate"]
        if len(found) >= count and all(h["outcome"] != "proposed" for h in found):
            return sorted(found, key=lambda h: h["id"])
        time.sleep(0.1)
    raise AssertionError(daemon.state.history(engine="main"))


def _gate_limits(tmp_path: Path) -> dict[str, Any]:
    shown = json.loads(
        run_tunerd("gate", "status", "--json", "--config", str(tmp_path / "tunerd.yaml")).stdout
    )
    return dict(shown["engines"]["main"]["limits"])


def test_a_policys_gate_action_retunes_the_running_gate_live_and_tunerd_rollback_sets_it_back(
    tmp_path: Path,
) -> None:
    """tunerd (mode act) with a policy whose `gate:` action fires at once: the gate takes the
    new limit within a tick, no restart happens, history says kind gate, succeeded. Then
    `tunerd rollback` undoes it the same way — live, recorded, tuning paused, no restart."""
    config = str(tmp_path / "tunerd.yaml")
    with _gated_daemon(tmp_path, "{metric: engine_up, above: 0.5}") as daemon:
        generation = daemon.state.engine("main").generation
        (record,) = _gate_records(daemon, 1)
        assert record["outcome"] == "succeeded"
        assert record["from_settings"] == {"target_fraction": 0.9}
        assert record["to_settings"] == {"target_fraction": 0.85}
        assert "tighten: gate target_fraction 0.9 → 0.85" in record["reason"]
        assert _gate_limits(tmp_path)["target_fraction"] == 0.85
        undone = run_tunerd(
            "rollback", "main", "--config", config, "--reason", "too tight for the batch jobs"
        )
        assert undone.returncode == 0, undone.stderr
        assert f"rollback of gate change #{record['id']} asked" in undone.stdout
        assert "target_fraction 0.85 → 0.9 live (no restart); tuning paused" in undone.stdout
        _, rollback = _gate_records(daemon, 2)
        assert rollback["outcome"] == "succeeded", rollback
        assert rollback["from_settings"] == {"target_fraction": 0.85}
        assert rollback["to_settings"] == {"target_fraction": 0.9}
        assert rollback["reason"] == f"too tight for the batch jobs (undoes #{record['id']})"
        assert _gate_limits(tmp_path)["target_fraction"] == 0.9
        engine = daemon.state.engine("main")
        assert engine.generation == generation  # neither change restarted the engine
        assert engine.paused == "rolled back by a person: too tight for the batch jobs"


def test_a_fit_gate_action_is_computed_from_the_gates_admitted_need_and_the_pools_usage(
    tmp_path: Path,
) -> None:
    """`gate: {target_fraction: fit}` with long requests through the gate: the running daemon
    computes the fraction from the gate's status (need admitted, pool) and the engine's usage
    at that tick, applies it live and records why."""
    with _gated_daemon(tmp_path, "{metric: kv_cache_usage, above: 0.05}", move="fit") as daemon:
        url = f"http://127.0.0.1:{daemon.config.engines[0].gate.listen.rsplit(':', 1)[1]}"
        body = {"prompt": words(20000), "max_tokens": 4000, "ignore_eos": True}
        stop = threading.Event()

        def client() -> None:
            with httpx.Client(timeout=120) as http:
                while not stop.is_set():
                    http.post(f"{url}/v1/completions", json=body)

        threads = [threading.Thread(target=client) for _ in range(3)]
        for thread in threads:
            thread.start()
        try:
            (record,) = _gate_records(daemon, 1, timeout=30)
        finally:
            stop.set()
            for thread in threads:
                thread.join(120)
        assert record["outcome"] == "succeeded", record
        fitted = record["to_settings"]["target_fraction"]
        assert 0.5 <= fitted <= 1.0
        assert fitted != 0.9
        assert f"gate target_fraction 0.9 → {fitted} (fit: the pool " in record["reason"]
        assert _gate_limits(tmp_path)["target_fraction"] == fitted


def test_a_pinned_engines_gate_is_not_retuned_by_policies(tmp_path: Path) -> None:
    """A person's pin holds for the gate's limits as for the settings: the policy fires, its
    action is recorded as skipped with why, and the gate keeps its limits."""
    with _gated_daemon(tmp_path, "{metric: engine_up, above: 0.5, for: 6s}") as daemon:
        pinned = run_tunerd("pin", "main", "--config", str(tmp_path / "tunerd.yaml"))
        assert pinned.returncode == 0, pinned.stderr
        (record,) = _gate_records(daemon, 1)
        assert record["outcome"] == "skipped", record
        assert "not applied: pinned" in record["reason"]
        assert _gate_limits(tmp_path)["target_fraction"] == 0.9


def test_the_config_in_docs_gate_md_runs_as_written(tmp_path: Path) -> None:
    """docs/gate.md's config block and commands, the user's way: only the ports and the
    socket's folder are this machine's."""
    doc = (Path(__file__).parents[2] / "docs" / "gate.md").read_text()
    block = re.findall(r"```yaml\n(.*?)```", doc, flags=re.S)[0]
    engine_port, gate_port = free_port(), free_port()
    control = tmp_path / "gate.sock"
    text = (
        block.replace("127.0.0.1:8000", f"127.0.0.1:{engine_port}")
        .replace("127.0.0.1:8001", f"127.0.0.1:{gate_port}")
        .replace("/run/tunerd/gate.sock", str(control))
    )
    config = tmp_path / "tunerd.yaml"
    config.write_text(f"state_dir: {tmp_path}\n{text}")
    commands = [
        line[2:] for line in re.findall(r"^\$ .*$", doc, flags=re.M) if line.startswith("$ tunerd gate")
    ]
    assert commands == ["tunerd gate status --config /etc/tunerd/tunerd.yaml"]
    sim = start_sim(engine_port, *SEED_ENGINE)
    gate = start_gate(str(config))
    try:
        gate.wait_event("gate_engine_up")
        argv = commands[0].replace("/etc/tunerd/tunerd.yaml", str(config)).split()[1:]
        shown = run_tunerd(*argv)
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout.startswith(f"llama31-8b  open  listen 127.0.0.1:{gate_port}")
        answer = httpx.post(
            f"http://127.0.0.1:{gate_port}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30
        )
        assert answer.status_code == 200
    finally:
        gate.stop()
        sim.stop()


class _DropsOneRequest:
    """A loopback TCP hop between the gate and the simulator that closes, without a byte of
    answer, the connection carrying the first ``POST /v1/completions`` — as a busy vLLM now and
    then drops a connection (seen behind the gate on the real CPU engine: a 502 for one
    request of a clean-clone run) — and passes everything else through."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.dropped = 0
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._pipe_pair, args=(client,), daemon=True).start()

    def _pipe_pair(self, client: socket.socket) -> None:
        upstream = socket.create_connection(("127.0.0.1", self.target))
        threading.Thread(target=self._copy, args=(upstream, client, False), daemon=True).start()
        self._copy(client, upstream, True)

    def _copy(self, source: socket.socket, sink: socket.socket, requests: bool) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                if requests and not self.dropped and data.startswith(b"POST /v1/completions"):
                    self.dropped += 1
                    self.on_drop(source)
                    break
                sink.sendall(data)
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)
            end.close()

    def on_drop(self, client: socket.socket) -> None:
        """What the dropped request's connection gets before it closes: nothing."""

    def close(self) -> None:
        self.server.close()


class _AbortsOneInTheDrain(_DropsOneRequest):
    """The restart's race, made to happen every time: the first completion reaches the engine
    just as tunerd holds the gate for a restart, and the draining engine answers it 200 with a
    stream that ends with no token (what vLLM does with a request it had only just taken in;
    seen on the real CPU engine in a clean-clone run)."""

    def __init__(self, target: int, control: Path) -> None:
        self.control = control
        super().__init__(target)

    def on_drop(self, client: socket.socket) -> None:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(self.control)), timeout=5) as gate:
            assert gate.post("http://gate/engines/main/hold", json={"seconds": 30}).status_code == 200
        client.sendall(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
            b'data: {"id": "cmpl-1", "choices": [{"index": 0, "text": "", "finish_reason": "abort"}]}\n\n'
            b"data: [DONE]\n\n"
        )


class _BreaksOffOneAnswer(_DropsOneRequest):
    """The first completion's answer: its head and a tenth of its body, then the connection
    closes."""

    def on_drop(self, client: socket.socket) -> None:
        client.sendall(
            b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{"id": 1'
        )


@contextlib.contextmanager
def _gate_behind(tmp_path: Path, hop_type: type[_DropsOneRequest]) -> Iterator[tuple[str, _DropsOneRequest]]:
    """The seed's simulated engine, ``hop_type`` between it and a gate: the gate's URL, the hop."""
    engine_port = free_port()
    sim = start_sim(engine_port, *SEED_ENGINE)
    hop = hop_type(engine_port)
    try:
        wait_healthy(f"http://127.0.0.1:{engine_port}")
        config, _, port = gate_config(tmp_path, hop.port)
        gate = start_gate(config)
        try:
            gate.wait_event("gate_engine_up")
            yield f"http://127.0.0.1:{port}", hop
        finally:
            gate.stop()
    finally:
        hop.close()
        sim.stop()


def test_an_answer_the_engine_breaks_off_before_the_gate_wrote_any_is_a_502_not_a_reset(
    tmp_path: Path,
) -> None:
    with _gate_behind(tmp_path, _BreaksOffOneAnswer) as (url, _):
        broken = _post(f"{url}/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert broken.status_code == 502, broken.text
        assert "broke off" in broken.json()["error"]["message"]
        assert broken.headers["X-Tunerd-Gate"] == "1"
        assert (
            _post(f"{url}/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200
        )  # serves on


def test_a_request_the_engine_drops_before_answering_is_asked_again_not_failed(tmp_path: Path) -> None:
    with _gate_behind(tmp_path, _DropsOneRequest) as (url, hop):
        answer = _post(f"{url}/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert answer.status_code == 200, answer.text
        assert hop.dropped == 1
        page = httpx.get(f"{url}/gate/metrics", timeout=5).text
        assert metric(page, "tunerd_gate_decisions_total", outcome="retried") == 1


def test_a_stream_the_draining_engine_ends_without_a_token_waits_for_the_new_engine(tmp_path: Path) -> None:
    engine_port = free_port()
    sim = start_sim(engine_port, *SEED_ENGINE)
    hop = _AbortsOneInTheDrain(engine_port, tmp_path / "gate.sock")  # gate_config's control socket
    config, control, port = gate_config(tmp_path, hop.port)
    try:
        wait_healthy(f"http://127.0.0.1:{engine_port}")
        gate = start_gate(config)
        try:
            gate.wait_event("gate_engine_up")
            answers: list[httpx.Response] = []
            body = {"prompt": "hi", "max_tokens": 4, "stream": True}
            sent = threading.Thread(
                target=lambda: answers.append(_post(f"http://127.0.0.1:{port}/v1/completions", body))
            )
            sent.start()
            deadline = time.monotonic() + 10
            while not hop.dropped:
                assert time.monotonic() < deadline, "the request never reached the engine"
                time.sleep(0.05)
            time.sleep(0.5)
            assert not answers  # it waits at the gate: the hold is on
            with httpx.Client(transport=httpx.HTTPTransport(uds=str(control)), timeout=5) as client:
                assert client.post("http://gate/engines/main/release").status_code == 200
            sent.join(30)
            (answer,) = answers
            assert answer.status_code == 200
            texts = [
                json.loads(line[6:])["choices"][0]["text"]
                for line in answer.text.splitlines()
                if line.startswith("data: {") and json.loads(line[6:])["choices"]
            ]
            assert "".join(texts), answer.text  # the new engine's tokens, not the drain's empty stream
            assert '"abort"' not in answer.text
        finally:
            gate.stop()
    finally:
        hop.close()
        sim.stop()


def test_a_spell_of_shedding_is_an_incident_with_what_was_in_flight(tmp_path: Path) -> None:
    """Issue 20: the gate sheds (429, its queue full): tunerd, reading the gate at each tick,
    opens a `shed` incident whose recording has the prompts in flight, whose post-mortem says
    so, and whose chart marks where the shedding began."""
    gate_port = free_port()
    daemon = sim_daemon(
        tmp_path,
        top={"metrics": {"interval": "250ms"}},
        gate={
            "listen": f"127.0.0.1:{gate_port}",
            "control": str(tmp_path / "gate.sock"),
            "long_threshold": 1_000_000,
            "queue": {"max_requests": 2, "max_wait": "5s"},
        },
    )
    gate = start_gate(str(tmp_path / "tunerd.yaml"))
    try:
        gate.wait_event("gate_control_listening")
        with running(daemon):
            url = f"http://127.0.0.1:{gate_port}"
            deadline = time.monotonic() + 30
            while (daemon.engines[0].gate or {}).get("pool_tokens") is None:
                assert time.monotonic() < deadline, daemon.engines[0].gate
                time.sleep(0.1)
            pool = int(daemon.engines[0].gate["pool_tokens"])  # type: ignore[index]
            prompt = min(pool // 4, 30_000)  # a few run, two wait, the rest find the queue full
            body = {"prompt": words(prompt), "max_tokens": 50, "ignore_eos": True}
            answers = _together([lambda: _post(f"{url}/v1/completions", body) for _ in range(10)])
            assert any(a.status_code == 429 for a in answers), [a.status_code for a in answers]
            deadline = time.monotonic() + 30
            while not (found := [i for i in daemon.state.incidents("main") if i["kind"] == "shed"]):
                assert time.monotonic() < deadline, daemon.state.incidents("main")
                time.sleep(0.2)
            time.sleep(1)  # another tick or two: still one spell, one incident
            assert len([i for i in daemon.state.incidents("main") if i["kind"] == "shed"]) == 1
    finally:
        gate.stop()
    (shed,) = found
    config = str(tmp_path / "tunerd.yaml")
    shown = run_tunerd(
        "incident", "show", str(shed["id"]), "--config", config, "--html", str(tmp_path / "s.html")
    )
    assert shown.returncode == 0, shown.stderr
    assert "the gate shed" in shown.stdout
    assert "Suspected cause: the gate shed load" in shown.stdout
    assert re.search(r"at the gate: \d+ in flight \([\d,]+ prompt tokens, the longest [\d,]+\)", shown.stdout)
    page = (tmp_path / "s.html").read_text()
    assert '<g class="mark" data-kind="shed"' in page
    recorded = run_tunerd(
        "record", "--incident", str(shed["id"]), str(tmp_path / "s.jsonl"), "--config", config
    )
    assert recorded.returncode == 0, recorded.stderr
    prompts = [
        json.loads(line)["samples"].get("gate_in_flight_prompt_tokens")
        for line in (tmp_path / "s.jsonl").read_text().splitlines()[1:]
        if '"samples"' in line
    ]
    assert max(p for p in prompts if p is not None) >= prompt  # a prompt in flight, counted
