"""Recordings: a tape cut from the store replays to the very decisions the loop made, from any
window (the policies' pending ``for`` comes in the header); an edited policy shows its
difference; a bad file is named by its line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tunerd.outcomes import Mode, PolicyStatus
from tunerd.policy.engine import EngineContext, PolicyState, evaluate, new_states
from tunerd.policy.schema import Policy, PolicyError, load_policy_files
from tunerd.policy.testrun import load_test_file, run_test_file
from tunerd.recording import (
    Recording,
    RecordingError,
    Tape,
    compare,
    context_from_dict,
    context_to_dict,
    describe,
    iter_json_lines,
    parse_lines,
    replay,
    state_from_dict,
    state_to_dict,
)
from tunerd.store import Event, Store

SHIPPED = Path(__file__).resolve().parents[2] / "policies" / "default.yaml"
ENGINE = "main"
SETTINGS = {"gpu_memory_utilization": 0.92, "max_num_seqs": 64, "max_num_batched_tokens": 8192}
BOUNDS = {
    "gpu_memory_utilization": [0.70, 0.95],
    "max_num_seqs": [8, 256],
    "max_num_batched_tokens": [2048, 16384],
}
GIB = 1 << 30


def _run(policies: list[Policy], seconds: int = 1500, interval: float = 1.0) -> tuple[Store, Tape, list]:
    """A loop as the daemon runs it: readings into the store, the policies evaluated at each
    tick, the tape kept. The pool saturates from t=300 s with requests waiting, an OOM at
    1200 s; a plan in act mode takes effect (the settings change, a new generation)."""
    store, tape = Store(capacity=10_000), Tape()
    states: dict[str, PolicyState] = new_states(policies)
    settings, generation, plans = dict(SETTINGS), 0, []
    for step in range(int(seconds / interval)):
        now = 1_000_000.0 + step * interval
        saturated = step * interval >= 300
        values = {
            "kv_cache_usage": 0.97 if saturated else 0.4,
            "num_requests_waiting_capacity": 3.0 if saturated else 0.0,
            "num_requests_running": 64.0 if saturated else 20.0,
            "num_preemptions_total": float(step // 50),
            "gpu_memory_used_bytes": 22.5 * GIB + (step % 7) * 1e6,
            "gpu_memory_total_bytes": 24.0 * GIB,
            "engine_memory_bytes": 21.0 * GIB,
            "other_processes_memory_bytes": 1.2 * GIB,
            "engine_up": 1.0,
        }
        store.record_many(ENGINE, now, values, generation)
        if step * interval == 1200:
            store.add_event(Event(now, "engine_crash", ENGINE, generation, {"kind": "cuda_oom"}))
        context = EngineContext(
            ENGINE, dict(settings), bounds=BOUNDS, mode=Mode.ACT, observed_since=1_000_000.0
        )
        before = states
        states, plan = evaluate(policies, before, store, context, now)
        tape.tick(now, context, before, plan)
        if plan is not None:
            plans.append((now, plan))
            if plan.changes and not plan.hold:
                settings, generation = dict(plan.after), generation + 1
    return store, tape, plans


def _file(lines: list[dict]) -> Recording:
    """Through the file format, as `tunerd record` writes it and `tunerd replay` reads it."""
    return parse_lines("".join(iter_json_lines(lines)).splitlines(), "test.jsonl")


def test_a_whole_run_replays_to_the_decisions_the_loop_made() -> None:
    policies = load_policy_files([SHIPPED])
    store, tape, plans = _run(policies)
    assert len(plans) >= 2, "the story made the loop decide nothing: it tests nothing"
    recording = _file(tape.lines(store, ENGINE, 0, 2e6))
    assert recording.ticks == 1500
    assert [(t, d) for t, d in recording.decisions()] == [(t, describe(p)) for t, p in plans]
    decisions = compare(recording, replay(recording, policies))
    assert all(d.recorded and d.replayed for d in decisions), decisions
    assert len(decisions) == len(plans)


def test_a_window_from_the_middle_replays_the_same_thanks_to_the_states_in_its_header() -> None:
    """Cut while kv-pool-saturated's `for: 10m` is pending: a replay with fresh states would
    fire ten minutes late; with the header's states it fires when the loop did."""
    policies = load_policy_files([SHIPPED])
    store, tape, plans = _run(policies)
    start = 1_000_000.0 + 600  # the pool has been full for 5 minutes
    recording = _file(tape.lines(store, ENGINE, start, 2e6, lookback=300))
    expected = [(t, describe(p)) for t, p in plans if t >= start]
    assert expected
    replayed = replay(recording, policies)
    assert [(t, describe(p)) for t, p in replayed] == expected
    fresh = Recording(dict(recording.header, states={}), recording.lines)
    assert [(t, describe(p)) for t, p in replay(fresh, policies)] != expected  # the header matters


def test_an_edited_policy_shows_what_it_would_have_done_differently(tmp_path: Path) -> None:
    policies = load_policy_files([SHIPPED])
    store, tape, _ = _run(policies)
    recording = _file(tape.lines(store, ENGINE, 0, 2e6))
    edited = tmp_path / "edited.yaml"
    edited.write_text(SHIPPED.read_text().replace("for: 10m", "for: 3m"))
    decisions = compare(recording, replay(recording, load_policy_files([edited])))
    only_replayed = [d for d in decisions if d.replayed and not d.recorded]
    only_recorded = [d for d in decisions if d.recorded and not d.replayed]
    assert only_replayed, decisions
    assert only_recorded, decisions
    saturated = 1_000_000.0 + 300
    first = min(d.at for d in only_replayed if "kv-pool-saturated" in d.policy.split(","))
    assert first == pytest.approx(saturated + 180, abs=1.5)  # 3 minutes after it filled, not 10


def test_contexts_and_states_survive_json() -> None:
    context = EngineContext(
        ENGINE,
        SETTINGS,
        bounds=BOUNDS,
        ladders={"max_num_seqs": [32, 64]},
        failed={"max_num_seqs": [128]},
        mode=Mode.ADVISE,
        observed_since=5.0,
        fits={"gpu_memory_utilization": (0.88, "fits the peak", {"kv_tokens": 10})},
        gate={"target_fraction": 0.9},
        gate_fits={"target_fraction": (0.8, "pool usage")},
    )
    again = context_from_dict(ENGINE, json.loads(json.dumps(context_to_dict(context))))
    assert again == context
    state = PolicyState("p", PolicyStatus.PENDING, since=3.0, holds={(0, 1): 3.0}, clear=False)
    assert state_from_dict("p", json.loads(json.dumps(state_to_dict(state)))) == state


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "empty"),
        ('{"format": "something else", "version": 1}', "not a tunerd recording"),
        ('{"format": "tunerd-recording", "version": 9, "engine": "e"}', "version 9"),
        ('{"format": "tunerd-recording", "version": 1}', "names no engine"),
        (
            '{"format": "tunerd-recording", "version": 1, "engine": "e"}\n{"t": 1, "samples": {"nope": 1}}',
            ":2: unknown signal 'nope'",
        ),
        ('{"format": "tunerd-recording", "version": 1, "engine": "e"}\nnot json', ":2: not JSON"),
        (
            '{"format": "tunerd-recording", "version": 1, "engine": "e"}\n{"t": 2, "tick": true}\n{"t": 1, "tick": true}',
            ":3: time 1 goes back",
        ),
        (
            '{"format": "tunerd-recording", "version": 1, "engine": "e"}\n{"t": "x", "tick": true}',
            ":2: each line has a finite time",
        ),
        (
            '{"format": "tunerd-recording", "version": 1, "engine": "e"}\n{"t": 1, "samples": {"kv_cache_usage": "high"}}',
            "not a number",
        ),
        (
            '{"format": "tunerd-recording", "version": 1, "engine": "e"}\n{"t": 1, "tick": true, "context": {"mode": "wild"}}',
            ":2: a tick's context cannot be read",
        ),
        (
            '{"format": "tunerd-recording", "version": 1, "engine": "e"}\n{"t": 1}',
            "expected samples, an event or a tick",
        ),
        (
            '{"format": "tunerd-recording", "version": 1, "engine": "e", "states": {"p": {"state": "odd"}}}',
            "policy state",
        ),
    ],
)
def test_a_bad_recording_is_named_by_its_line(text: str, says: str) -> None:
    with pytest.raises(RecordingError, match=r"bad\.jsonl") as error:
        parse_lines(text.splitlines(), "bad.jsonl")
    assert says in str(error.value)


def test_the_tape_is_bounded() -> None:
    tape = Tape(capacity=100)
    context = EngineContext(ENGINE, SETTINGS)
    for step in range(1000):
        changed = EngineContext(ENGINE, {"max_num_seqs": step})  # a context that changes each tick
        tape.tick(float(step), changed if step % 2 else context, {}, None)
    assert len(tape.ticks) == 100
    assert len(tape.contexts) <= 101
    assert tape.ticks[0] == 900.0


def test_a_recording_is_a_policy_test_that_passes_and_fails_as_it_should(tmp_path: Path) -> None:
    """A real incident as a regression test: the shipped policies decide as recorded (pass);
    an edited policy does not (fail, each difference named); `expect` times count from the
    recording's first tick."""
    policies = load_policy_files([SHIPPED])
    store, tape, plans = _run(policies)
    (tmp_path / "incident.jsonl").write_text("".join(iter_json_lines(tape.lines(store, ENGINE, 0, 2e6))))
    (tmp_path / "default.yaml").write_text(SHIPPED.read_text())
    (tmp_path / "edited.yaml").write_text(SHIPPED.read_text().replace("for: 10m", "for: 3m"))
    first = plans[0][0] - 1_000_000.0
    for policy_file in ("default.yaml", "edited.yaml"):
        (tmp_path / f"{policy_file}_test.yaml").write_text(
            f"policies: [{policy_file}]\n"
            "tests:\n"
            "  - name: the saturation as it happened\n"
            "    recording: incident.jsonl\n"
            "    expect_as_recorded: true\n"
            f"    expect:\n      - at: {first:g}s\n        restart: true\n"
        )
    [passed] = run_test_file(tmp_path / "default.yaml_test.yaml")
    assert passed.passed, passed.failures
    [failed] = run_test_file(tmp_path / "edited.yaml_test.yaml")
    assert not failed.passed
    assert any("only replayed" in f for f in failed.failures), failed.failures
    assert any("only recorded" in f for f in failed.failures), failed.failures


def test_a_policy_test_names_a_recording_it_cannot_read(tmp_path: Path) -> None:
    (tmp_path / "default.yaml").write_text(SHIPPED.read_text())
    (tmp_path / "bad.jsonl").write_text(
        '{"format": "tunerd-recording", "version": 1, "engine": "e"}\n{oops\n'
    )
    test = tmp_path / "t_test.yaml"
    test.write_text("policies: [default.yaml]\ntests:\n  - name: t\n    recording: bad.jsonl\n")
    with pytest.raises(PolicyError) as error:
        load_test_file(test)
    assert "bad.jsonl:2: not JSON" in str(error.value.problems)
    test.write_text("policies: [default.yaml]\ntests:\n  - name: t\n    recording: gone.jsonl\n")
    with pytest.raises(PolicyError, match=r"gone\.jsonl"):
        load_test_file(test)
