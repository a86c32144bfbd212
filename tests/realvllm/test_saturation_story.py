"""A real vLLM (CPU build, tiny model) whose KV pool saturates: tunerd lowers ``--max-num-seqs``.

The story, with one tunerd and the engines it starts:

1. tunerd starts the engine with ``max_num_seqs 16`` and a 12,288-token pool
   (``--kv-cache-memory-bytes 12582912``);
2. sixteen clients keep sending distinct ~200-word prompts for ~1,000 tokens each, streamed,
   each pausing up to 2 s between requests (without the pause they fell into waves, sent and
   finished together, and a restart between two waves had nothing in flight): about ten fit, the pool stays near full (measured: 0.84–1.0 sampled each second), vLLM preempts and
   requests wait for capacity. (Requests large against the pool make it sawtooth instead: 6 ×
   1,500 tokens in 4,096 swung between 0.71 and 1.0 and never held over 0.85; and short ones
   leave it idle between bursts on two cores, both measured here). Even this load dips under
   0.85 now and then on two busy cores: with a 3 s hold, runs here fired after 30 s, after
   5 minutes, or not within 7 minutes, so the story acts on the first full reading;
3. the shipped ``kv-pool-saturated`` policy — its ``for: 10m`` cut to ``0s``, nothing else
   changed — steps ``max_num_seqs`` down to 12; the saga drains the old engine (SIGTERM
   to its API server only), starts the new one and verifies it;
4. the new engine's argv and its own ``non-default args`` log line say ``max_num_seqs: 12``, and
   its ``vllm:cache_config_info`` shows the pool tunerd recorded;
5. requests that were in flight when the drain began (their first token had come) still get
   every token they asked for. (Requests that *arrive* during the drain fail: vLLM keeps its
   port open and answers 500 "cannot schedule new futures after shutdown"; one taken in a
   moment before gets 200 and no tokens — ``finish_reason: abort``, or a stream that simply
   ends — all measured here — which is why a ``pre_stop`` hook should take the engine out of
   the load balancer first);
6. tunerd is stopped with SIGTERM: the engine keeps serving; a new tunerd adopts it (same PID,
   no restart).

``tunerd gate`` (issue 19) stands in front of the same engine all along, and two more clients
send short completions through it: tunerd holds the gate at the restart, so the requests they
send during the drain and the new engine's start-up wait and are served, none fails — the
same moments the direct clients of step 5 see refused. After the story, with the load gone,
the real engine behind the gate streams a chat answer chunk by chunk, the gate's prompt count
matches the engine's ``usage.prompt_tokens`` (its own tokenizer and chat template), and a client
that leaves mid-stream stops the engine's generation.
"""

from __future__ import annotations

import ast
import concurrent.futures
import json
import re
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.gate_world import Process, metric, start_gate
from tests.metrics_pages import families, series
from tests.realvllm.harness import (
    ENGINE,
    MODEL_NAME,
    REALVLLM,
    Load,
    Request,
    Tunerd,
    cmdline,
    engine_record,
    free_port,
    history,
    kill_engine,
    shipped_policy,
    wait_healthy,
    write_config,
)
from tunerd.engine.args import settings_from_argv, settings_from_cache_config
from tunerd.sources.vllm_metrics import parse

pytestmark = REALVLLM

SETTINGS = {
    "max_model_len": 2048,
    "max_num_seqs": 16,
    "max_num_batched_tokens": 512,
    "kv_cache_memory_bytes": 12582912,
}
DRAIN_REFUSALS = ("cannot schedule new futures after shutdown", "EngineCore encountered an issue")
NON_DEFAULT_ARGS = re.compile(r"non-default args: (\{.*\})")


@dataclass
class Story:
    tmp: Path
    url: str
    tunerd: Tunerd
    first_pid: int
    requests: list[Request]
    gate: Process
    gate_url: str
    gated: list[Request]  # what the clients behind the gate sent
    page_under_load: str = ""  # the real engine's /metrics while the clients run

    @property
    def state_dir(self) -> Path:
        return self.tmp / "state"


@pytest.fixture(scope="module")
def story(vllm: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Story]:
    tmp = tmp_path_factory.mktemp("saturation")
    port, gate_port = free_port(), free_port()
    url, gate_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{gate_port}"
    config = write_config(
        tmp,
        python=vllm,
        model=tiny_model,
        port=port,
        settings=SETTINGS,
        bounds={"max_num_seqs": [2, 16]},
        policies=[shipped_policy("kv-pool-saturated", **{"for": "0s"})],
        gate={"listen": f"127.0.0.1:{gate_port}", "control": str(tmp / "gate.sock")},
    )
    story = Story(tmp, url, Tunerd(config), 0, [], start_gate(config), gate_url, [])
    try:
        story.gate.wait_event("gate_control_listening")
        story.tunerd.wait_event("restart_finished", timeout=300, where=lambda e: e["kind"] == "first_start")
        wait_healthy(url, timeout=30)
        story.gate.wait_event("gate_engine_up", timeout=30)
        story.first_pid = engine_record(story.state_dir).pid
        load = Load(url, workers=16, words=200, max_tokens=1000, pause=2.0).start()
        gated = Load(gate_url, workers=2, words=20, max_tokens=20, pause=1.0, seed=1).start()
        time.sleep(5)  # the clients' first requests in flight
        story.page_under_load = httpx.get(url + "/metrics", timeout=10).text
        try:
            story.tunerd.wait_event("engine_tuned", timeout=420)
            time.sleep(3)  # the clients behind the gate, served by the new engine
        except AssertionError as error:
            raise AssertionError(f"{error}\nthe pool meanwhile:\n{load.pool()}") from None
        finally:
            story.requests = load.stop()
            story.gated = gated.stop()
        yield story
    finally:
        story.tunerd.stop()  # the one running now: a test may have started another
        story.gate.stop()
        kill_engine(story.state_dir)


def test_tunerd_steps_max_num_seqs_down(story: Story) -> None:
    tuned = story.tunerd.events("engine_tuned")[0]
    assert tuned["outcome"] == "succeeded", story.tunerd.output()
    assert tuned["changes"] == {"max_num_seqs": [16, 12]}, story.tunerd.output()
    tunes = [h for h in history(story.state_dir) if h["kind"] == "tune"]
    assert len(tunes) == 1, tunes
    assert tunes[0]["policy"] == "kv-pool-saturated"
    assert tunes[0]["outcome"] == "succeeded"
    assert tunes[0]["from_settings"] == SETTINGS
    assert tunes[0]["to_settings"] == {**SETTINGS, "max_num_seqs": 12}
    evidence = tunes[0]["evidence"]["signals"]["kv-pool-saturated"]
    assert evidence["kv_cache_usage"] > 0.85, evidence
    assert evidence["num_requests_waiting_capacity"] > 0 or evidence["num_preemptions_total_rate"] > 0


def test_new_engine_argv_and_its_log_show_the_change(story: Story) -> None:
    record = engine_record(story.state_dir)
    assert record.pid != story.first_pid
    argv = cmdline(record.pid)
    assert argv == record.argv
    assert settings_from_argv(argv)["max_num_seqs"] == 12
    assert argv[argv.index("--max-num-seqs") + 1] == "12"
    logs = story.state_dir / "engines"
    new = _non_default_args(logs / f"{ENGINE}.log")
    old = _non_default_args(logs / f"{ENGINE}.log.1")  # rotated at the restart
    assert new["max_num_seqs"] == 12
    assert old["max_num_seqs"] == 16
    assert new["kv_cache_memory_bytes"] == old["kv_cache_memory_bytes"] == 12582912
    assert new["shutdown_timeout"] == 30  # the engine's drain, always passed


def test_cache_settings_show_in_cache_config_info(story: Story) -> None:
    snapshot = parse(httpx.get(story.url + "/metrics", timeout=10).text)
    assert snapshot.cache_config is not None
    read_back = settings_from_cache_config(snapshot.cache_config)
    assert read_back["kv_cache_memory_bytes"] == SETTINGS["kv_cache_memory_bytes"]


def test_in_flight_requests_survive_the_drain(story: Story) -> None:
    stopping = story.tunerd.wait_event("restart_step", 0, lambda e: e["step"] == "stopping")["at"]
    around = _around(story.requests, stopping)
    # in flight: its first token had come when the SIGTERM was sent, so the engine had it. (A
    # request the API server had only just taken in is refused like a new one, or answered at
    # once with finish_reason "abort": both measured here.) Whether it drained: it got every
    # token it asked for.
    in_flight = [
        r for r in story.requests if r.first_token is not None and r.first_token < stopping < r.ended
    ]
    assert in_flight, "no request was in flight when the drain began:\n" + around
    assert all(r.whole(SETTINGS["max_model_len"]) and not r.detail for r in in_flight), around
    # before the drain the server answered nothing but whole answers (the client side saw an
    # occasional RemoteProtocolError with no answer — the server logged no error; two cores
    # under this load)
    before = [r for r in story.requests if r.ended < stopping and r.status is not None]
    assert all(r.whole(SETTINGS["max_model_len"]) for r in before), around
    # what had not reached the engine when the drain began is vLLM's to refuse (the docstring)
    late = [r for r in story.requests if r not in in_flight and r.ended > stopping and r.status is not None]
    for r in late:
        refused = r.status == 500 and any(text in r.detail for text in DRAIN_REFUSALS)
        # 200 with no token at all: finish_reason "abort", or a stream that just ends (both seen)
        aborted = (
            r.status == 200 and r.tokens == 0 and r.first_token is None and r.finish_reason in ("abort", None)
        )
        assert refused or aborted or r.whole(SETTINGS["max_model_len"]), around
    served_after = [r for r in story.requests if r.started > stopping and r.whole(SETTINGS["max_model_len"])]
    assert served_after, "the new engine served nothing:\n" + around


def test_the_gate_held_its_clients_through_the_restart(story: Story) -> None:
    """Issue 19: the same restart, seen by the clients behind the gate — nothing failed, and
    what they sent while the engine drained and started again waited and was served by the
    new one; the direct clients' requests of those moments failed."""
    stopping = story.tunerd.wait_event("restart_step", 0, lambda e: e["step"] == "stopping")["at"]
    serving = story.tunerd.wait_event("restart_step", 0, lambda e: e["step"] == "probation")["at"]
    hold = story.tunerd.wait_event("gate_hold", 0)
    assert hold["seconds"] > 30  # the drain and a start-up
    # the gate had said yes by the time tunerd logged it: before the SIGTERM, which the next
    # step of the restart sends. (Not a fixed second after the step: on a loaded 2-core CI box
    # the hold took longer than that to reach the gate, and the old engine served, whole, what
    # came in meanwhile — the clean-clone failure this replaced.)
    hold_on = datetime.fromisoformat(hold["timestamp"]).timestamp()
    story.tunerd.wait_event("gate_release", 0)
    around = f"(the hold was on at {hold_on - stopping:+.2f} s)\n" + _around(story.gated, stopping)
    assert story.gated, "no request went through the gate"
    failed = [r for r in story.gated if not r.whole(SETTINGS["max_model_len"]) or r.detail]
    assert not failed, around
    # sent once the hold was on, before the new engine served: each waited at the gate and got
    # its first token from the new engine
    held = [r for r in story.gated if hold_on < r.started < serving]
    assert held, around
    assert all(r.first_token is not None and r.first_token > serving - 1 for r in held), around
    direct = [r for r in story.requests if hold_on < r.started < serving]
    # (the new engine may serve a direct one in the moments before tunerd has seen it healthy)
    assert any(not r.whole(SETTINGS["max_model_len"]) for r in direct), _around(story.requests, stopping)


def test_the_gate_streams_a_chat_answer_and_counts_its_prompt_as_the_engine_does(story: Story) -> None:
    """Through the gate, the real engine: a chat answer comes chunk by chunk as it is generated,
    and the gate's prompt count (the engine's ``/tokenize`` with the chat template) is the
    engine's ``usage.prompt_tokens`` — chat streamed, completions plain."""

    # a budget (0.02 of the 12,288-token pool) smaller than each request's bound: the gate
    # counts each exactly before admitting it (with the default budget it would count one a
    # second, the rest on their bounds)
    def compared() -> float:  # requests whose count the gate compared with the engine's usage
        page = httpx.get(story.gate_url + "/gate/metrics", timeout=5).text
        return metric(page, "tunerd_gate_count_error_ratio_count")

    assert _limits(story, {"target_fraction": 0.02}).status_code == 200
    try:
        before = compared()
        messages = [
            {"role": "system", "content": "you answer in words of the corpus"},
            {"role": "user", "content": "tell me about the engine and the gate in front of it"},
        ]
        body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 300, "ignore_eos": True}
        body |= {"stream": True, "stream_options": {"include_usage": True}}

        def stream(base: str) -> tuple[list[float], dict[str, Any]]:
            content: list[float] = []  # when each content chunk came
            usage: dict[str, Any] = {}
            with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=120) as answer:
                assert answer.status_code == 200, answer.read()
                for line in answer.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: ") :])
                    if any(choice["delta"].get("content") for choice in chunk.get("choices", [])):
                        content.append(time.monotonic())
                    usage = chunk.get("usage") or usage
            return content, usage

        # they came as generated, not at the end in one piece. Whether the engine sent them so
        # is told only by its own stream of the same request at the same moment: one straight
        # from the engine and one through the gate, side by side (one batch of the engine's).
        # Taken one after the other they were not comparable: the CI's engine was still
        # finishing the story's load, the direct stream spread 1.05 → 0.57 s over three tries
        # while the gated one, a moment later, came in ~1 ms. What the engine spreads, the gate
        # must not squash; a try where the engine itself bursts is tried again.
        spreads: list[tuple[float, float]] = []  # (straight from the engine, through the gate)
        timings: list[str] = []  # when each stream's first and last content came, from one start
        while len(spreads) < 3 and (not spreads or not spreads[-1][0] > 0.3):
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                began = time.monotonic()
                direct_run, gated_run = pool.submit(stream, story.url), pool.submit(stream, story.gate_url)
                (direct, _), (content, usage) = direct_run.result(), gated_run.result()
            assert usage["completion_tokens"] == 300
            assert len(content) >= 250  # a chunk a token (a few tokens decode to no text)
            spreads.append((direct[-1] - direct[0], content[-1] - content[0]))
            timings.append(
                f"engine {direct[0] - began:.3f}–{direct[-1] - began:.3f} s, "
                f"gate {content[0] - began:.3f}–{content[-1] - began:.3f} s"
            )
        engine_spread, gate_spread = spreads[-1]
        assert compared() == before + len(spreads)  # each was counted exactly and compared
        assert abs(_gate_status(story)["last_count_error_ratio"]) <= 0.02, usage
        # a prompt whose byte bound (≥ 390) is over the budget (≈ 245 tokens) too: counted first
        plain = {
            "model": MODEL_NAME,
            "prompt": "the gate counts what the engine counts " * 10,
            "max_tokens": 4,
        }
        answer = httpx.post(story.gate_url + "/v1/completions", json=plain, timeout=60)
        assert answer.status_code == 200, answer.text
        assert compared() == before + len(spreads) + 1
        assert abs(_gate_status(story)["last_count_error_ratio"]) <= 0.02, answer.json()["usage"]
        if engine_spread <= 0.3:  # said in the summary
            warnings.warn(
                f"the engine itself sent each stream in one burst ({spreads} s): not judged", stacklevel=1
            )
        elif not gate_spread > 0.5 * engine_spread:
            # Watched (docs/gate.md, "Not yet"): side by side with the engine's own stream of the
            # same request, the 2-core CI's gated stream once came in one burst (0.75 s against
            # 1.3 ms), on aiohttp's data path since replaced; never reproduced here.
            # the times say which: a gated stream whose first content came after the engine's
            # last had waited (admission, the count) and then came whole; one inside the
            # engine's span was held back while the engine sent it
            pytest.xfail(
                f"known, open: the gate bunched the engine's stream: (engine, gate) spreads {spreads} s; "
                f"content came: {'; '.join(timings)}; gate status {_gate_status(story)}"
            )
    finally:
        assert _limits(story, {"target_fraction": 0.9}).status_code == 200


def test_a_client_that_leaves_mid_stream_stops_the_engines_generation(story: Story) -> None:
    """The client goes at the first token of a 2,000-token answer: the gate drops its upstream
    connection, vLLM aborts the request, its running count falls to 0 and it generates no more.
    (A first version left after five chunks of 1,500: on one loaded clean-clone run all 1,500
    were generated; the margin is wider now, and the failure says how far the engine had got.)"""

    def generated() -> float:
        return metric(httpx.get(story.url + "/metrics", timeout=10).text, "vllm:generation_tokens_total")

    asked = SETTINGS["max_model_len"] - 48  # the most the prompt leaves room for
    body = {"model": MODEL_NAME, "prompt": "a long answer please", "max_tokens": asked, "ignore_eos": True}

    def leave_at_the_first_token() -> tuple[float, float]:
        """(generated when the client left, generated in all) for one request it leaves."""
        before = generated()
        with httpx.stream(
            "POST", story.gate_url + "/v1/completions", json={**body, "stream": True}, timeout=120
        ) as answer:
            assert answer.status_code == 200
            for line in answer.iter_lines():
                if line.startswith("data: "):
                    break  # and leave: the stream is closed here
        left = generated()
        deadline = time.monotonic() + 15
        while metric(httpx.get(story.url + "/metrics", timeout=10).text, "vllm:num_requests_running") > 0:
            assert time.monotonic() < deadline, "the engine still runs the request its client left"
            time.sleep(0.1)
        settled = generated()
        time.sleep(1.0)
        assert generated() == settled
        return left - before, settled - before

    # A box too loaded to run the engine's API server while it generates delivers the whole
    # stream in one burst at the end (seen: all 2,000 generated when the first chunk came, as the
    # streaming test saw all 300 chunks within 2 ms): then there is nothing left to cancel, so
    # such a try is made again. A gate that did not cancel would generate all of it every time.
    tries: list[tuple[float, float]] = []
    while len(tries) < 3 and (not tries or tries[-1][1] >= asked):
        tries.append(leave_at_the_first_token())
    assert tries[-1][1] < asked, "; ".join(
        f"{left:.0f} generated when the client left, {total:.0f} in all" for left, total in tries
    )


def _limits(story: Story, limits: dict[str, Any]) -> httpx.Response:
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(story.tmp / "gate.sock")), timeout=5) as client:
        return client.post(f"http://gate/engines/{ENGINE}/limits", json=limits)


def _gate_status(story: Story) -> dict[str, Any]:
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(story.tmp / "gate.sock")), timeout=5) as client:
        engines: dict[str, Any] = client.get("http://gate/status").json()["engines"]
        return dict(engines[ENGINE])


def test_sigterm_leaves_the_engine_serving_and_a_new_tunerd_adopts_it(story: Story) -> None:
    assert story.tunerd.stop() == 0
    record = engine_record(story.state_dir)
    wait_healthy(story.url, timeout=5)
    answer = httpx.post(
        story.url + "/v1/completions",
        json={"model": MODEL_NAME, "prompt": "the engine is still serving", "max_tokens": 8},
        timeout=120,
    )
    assert answer.status_code == 200
    again = Tunerd(story.tunerd.config)
    story.tunerd = again  # the fixture stops whichever is current
    reconciled = again.wait_event("engine_reconciled", timeout=60)
    assert reconciled["outcome"] == f"adopted pid {record.pid}"
    assert engine_record(story.state_dir).pid == record.pid
    restarts = [h for h in history(story.state_dir) if h["kind"] in ("restart", "tune")]
    assert len(restarts) == 2  # the first start and the one tune: adopting restarted nothing


def _around(requests: list[Request], at: float) -> str:
    """The requests that started in the minute before ``at``, relative to it (a failure message)."""
    near = [r for r in requests if at - 60 < r.started < at + 60]
    return "\n".join(
        f"{r.started - at:+7.2f} {(r.first_token or at) - at:+7.2f} {r.ended - at:+7.2f} {r.status} {r.finish_reason} {r.tokens}/{r.asked}+{r.prompt_tokens} {r.detail[-60:]!r}"
        for r in near
    )


def _non_default_args(log: Path) -> dict[str, Any]:
    for line in log.read_text(errors="replace").splitlines():
        found = NON_DEFAULT_ARGS.search(line)
        if found:
            return dict(ast.literal_eval(found.group(1)))
    raise AssertionError(f"no non-default args line in {log}")


def test_the_simulator_serves_the_families_and_labels_the_real_engine_does(
    story: Story, tmp_path: Path
) -> None:
    """Issue 17: the simulator's page under load against this real engine's under load — the
    same ``vllm:`` families with the same types and label sets, buckets included (both at a
    2,048-token max length)."""
    port = free_port()
    engine = subprocess.Popen(
        [sys.executable, "-m", "tunerd", "sim", "serve", "--host", "127.0.0.1", "--port", str(port),
         "--time-scale", "50", "--sim-startup-seconds", "2", "--max-model-len", "2048"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, timeout=30)
        for _ in range(3):
            httpx.post(url + "/v1/completions", json={"prompt_tokens": 300, "max_tokens": 20}, timeout=30)
        simulated = httpx.get(url + "/metrics", timeout=10).text
    finally:
        engine.terminate()
        engine.wait(timeout=30)
    assert story.page_under_load
    assert families(simulated) == families(story.page_under_load)
    ours = {item for item in series(simulated) if item[0] != "vllm:cache_config_info"}
    theirs = {item for item in series(story.page_under_load) if item[0] != "vllm:cache_config_info"}
    assert ours == theirs, (sorted(ours - theirs)[:10], sorted(theirs - ours)[:10])
