"""The status view's pure pieces: engine states, the bills, one screen in 100 columns."""

from __future__ import annotations

import re

import pytest

from tunerd.outcomes import Mode
from tunerd.status import WIDTH, bills, engine_state, engine_status, render, status_document

GIB = 1 << 30
ESCAPE = re.compile(r"\033\[[0-9;]*m")


@pytest.mark.parametrize(
    ("facts", "state"),
    [
        ({"held": True, "pinned": True, "step": "stopping", "alive": True, "healthy": True}, "held"),
        ({"pinned": True, "step": "starting", "alive": True, "healthy": True}, "pinned"),
        ({"step": "stopping", "alive": True, "healthy": True}, "draining"),
        ({"step": "verifying", "alive": True, "healthy": False}, "restarting"),
        ({"alive": True, "healthy": True}, "running"),
        ({"alive": True, "healthy": False}, "starting"),
        ({"alive": False, "healthy": False, "crashed": True}, "crashed"),
        ({"alive": False, "healthy": False}, "stopped"),
    ],
)
def test_engine_state_names_what_a_person_must_know_first(facts: dict[str, object], state: str) -> None:
    full = {"held": False, "pinned": False, "step": None, "crashed": False, **facts}
    assert engine_state(**full) == state  # type: ignore[arg-type]


def test_engine_other_is_what_the_engine_holds_beyond_weights_and_pool() -> None:
    # the seed's 4090 numbers: 5.4 GiB AWQ weights, a 14 GiB pool, the engine at 21.6 GiB
    parts = bills(
        weights=int(5.4 * GIB), kv_pool=14 * GIB, engine_bytes=int(21.6 * GIB), other_processes=GIB, free=GIB
    )
    assert parts["engine_other"] == int(21.6 * GIB) - int(5.4 * GIB) - 14 * GIB
    unknown = bills(weights=None, kv_pool=14 * GIB, engine_bytes=20 * GIB, other_processes=None, free=None)
    assert unknown["engine_other"] is None  # never a guess


STATUS = {
    "mode": "act",
    "time": 1796000000.0,
    "gpus": [
        {"index": 0, "uuid": "GPU-1", "name": "NVIDIA GeForce RTX 4090", "used_bytes": 22 * GIB,
         "total_bytes": 24 * GIB, "free_bytes": 2 * GIB},
    ],
    "engines": [
        {
            "name": "llama31-8b-awq-with-a-long-name",
            "state": "running",
            "generation": 3,
            "settings": {"gpu_memory_utilization": 0.92, "max_model_len": 32768, "max_num_seqs": 6,
                         "max_num_batched_tokens": 2048, "kv_cache_dtype": "fp8", "enable_prefix_caching": True},
            "pid": 4242,
            "healthy": True,
            "last_known_good": None,
            "bills": {"weights": 5 * GIB, "kv_pool": 14 * GIB, "engine_other": 2 * GIB,
                      "other_processes": GIB, "free": 2 * GIB},
            "metrics": {"kv_cache_usage": 0.87, "num_requests_running": 6, "num_requests_waiting": 2,
                        "num_preemptions_total": 14.0},
            "policies": [{"name": f"policy-number-{n}", "state": "inactive", "since": None, "health": "ok",
                          "last_error": None} for n in range(9)]
            + [{"name": "kv-pool-saturated", "state": "firing", "since": 1795999000.0, "health": "error",
                "last_error": "no data for kv_cache_usage"}],
            "guards": {"restarts_in_window": 1, "budget_left": 2, "held": False},
            "last_actions": [{"id": 9, "time": "2026-11-29T15:40:00+00:00", "kind": "tune", "mode": "act",
                              "outcome": "succeeded", "policy": "kv-pool-saturated",
                              "reason": "pool over 85% with requests waiting for capacity " * 3}],
        }
    ],
}  # fmt: skip


def test_one_screen_in_a_hundred_columns_with_every_part() -> None:
    text = render(STATUS)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= WIDTH
    assert "\033[" not in text
    assert lines[0].startswith("tunerd — mode act — ")
    assert "GPU 0  NVIDIA GeForce RTX 4090  22.0 GiB of 24.0 GiB used, 2.0 GiB free" in text
    assert any(
        line.startswith("llama31-8b-awq-with-a-long-name  running  generation 3  pid 4242") for line in lines
    )
    bar = next(line for line in lines if line.startswith("  memory    ["))
    cells = bar.removeprefix("  memory    [").removesuffix("]")
    assert len(cells) == WIDTH - 14
    # proportional: weights 5 of 24 GiB, the pool 14 of 24, free 2 of 24
    assert cells.count("W") == round(5 / 24 * len(cells))
    assert cells.count("K") == round(14 / 24 * len(cells))
    assert cells.startswith("W")
    assert cells.endswith(".")
    assert "GiB: W weights 5.0 · K KV pool 14.0 · e engine 2.0 · o others 1.0 · . free 2.0" in text
    assert "KV usage 87% · running 6 · waiting 2 · preemptions 14.0" in text
    policy_lines = [line for line in lines if "policy-number" in line or "kv-pool-saturated firing" in line]
    assert len(policy_lines) >= 2  # wrapped, not cut
    assert "kv-pool-saturated firing since" in text
    assert "(error: no data for kv_cache_usage)" in text
    assert "1 restarts in the window · 2 left · not held" in text
    assert any(line.endswith("…") for line in lines if "tune succeeded (kv-pool-saturated)" in line)


def test_colour_only_when_asked_and_it_changes_no_width() -> None:
    plain = render(STATUS)
    painted = render(STATUS, color=True)
    assert "\033[" in painted
    stripped = [ESCAPE.sub("", line) for line in painted.splitlines()]
    assert max(len(line) for line in stripped) <= WIDTH
    assert len(stripped) == len(plain.splitlines())


def test_nothing_known_yet_still_renders() -> None:
    text = render(
        {"mode": "advise", "time": None, "gpus": [], "engines": [{"name": "a", "state": "starting"}]}
    )
    assert "GPU    none read" in text
    assert "[" + "?" * (WIDTH - 14) + "]" in text
    assert "actions   none yet" in text


def test_what_a_person_must_know_is_on_the_screen_not_only_in_json() -> None:
    """Paused and pinned (and why), the restart in flight with its step and deadline; never a
    bare ``None``; a long line ends at a word, not inside one."""
    engine = dict(STATUS["engines"][0])  # type: ignore[index]
    engine.update(
        state="restarting",
        pinned=True,
        paused="the config was changed by a person (max_num_seqs 8→4): adopted as the new base",
        restart={
            "kind": "restart",
            "step": "probation",
            "action_id": 12,
            "detail": "pid 5150 serving",
            "deadline": STATUS["time"] + 240,  # type: ignore[operator]
            "started": STATUS["time"],
        },
        settings={**engine["settings"], "kv_cache_dtype": None},
    )
    text = render({**STATUS, "engines": [engine]})
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("llama31-8b-awq-with-a-long-name"))
    assert "restarting  PINNED  PAUSED" in header
    restart = next(line for line in lines if line.startswith("  restart   "))
    assert "restart · probation · pid 5150 serving · gives up at " in restart
    assert restart.endswith("(in 240 s)")
    assert any(line.startswith("  paused    the config was changed by a person") for line in lines)
    assert any(line.startswith("  pinned    settings frozen by a person") for line in lines)
    assert "kv_cache_dtype default" in text
    assert "None" not in text
    action = next(line for line in lines if "tune succeeded (kv-pool-saturated)" in line)
    assert action.endswith("…")
    assert action.removesuffix("…").split()[-1] in (
        "pool",
        "over",
        "85%",
        "with",
        "requests",
        "waiting",
        "for",
        "capacity",
    )


def test_a_saga_stuck_on_a_full_disk_says_so_on_the_screen_and_in_json() -> None:
    """Disk full mid-restart: the status looked fresh while the engine stayed down. Now the
    stuck step and why are on the screen, per engine and on top."""
    now = STATUS["time"]
    trouble = {
        "what": "step stopping: moving to step starting",
        "error": "/var/lib/tunerd/tunerd.db: database or disk is full",
        "unwritable": True,
        "since": now - 30,  # type: ignore[operator]
        "attempts": 4,
        "next_try": now + 8,  # type: ignore[operator]
    }
    engine = dict(STATUS["engines"][0])  # type: ignore[index]
    engine.update(
        state="restarting",
        stuck=trouble,
        restart={"kind": "restart", "step": "stopping", "action_id": 12, "detail": "", "deadline": None,
                 "started": now},
    )  # fmt: skip
    text = render({**STATUS, "engines": [engine], "state_trouble": [{**trouble, "engine": engine["name"]}]})
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= WIDTH
    assert lines[1].startswith(
        "STATE  llama31-8b-awq-with-a-long-name: step stopping: moving to step starting"
    )
    assert "cannot write the state: /var/lib/tunerd/tunerd.db: database or disk is full" in text
    stuck = [line for line in lines if line.startswith("  stuck     ")]
    assert stuck[0].startswith("  stuck     the saga is stuck on step stopping · step stopping: moving to")
    assert "4 tries · again in 8 s" in text
    assert "…" not in "".join(line for line in lines if line.startswith(("STATE", "  stuck")))


def test_the_json_keeps_its_fields_and_adds_the_state_trouble() -> None:
    engine = engine_status(
        name="a", state="running", generation=1, settings={}, pid=1, healthy=True, last_known_good=None,
        paused=None, pinned=False, held=False, weights=None, kv_pool=None, memory=None, free=None,
        metrics=None, policies=(), restarts_in_window=0, budget_left=3, last_actions=(), restart=None,
    )  # fmt: skip
    assert engine["stuck"] is None
    document = status_document(mode=Mode.ACT, now=1.0, gpus=(), engines=[engine])
    assert document["state_trouble"] == []
    assert set(document) == {"mode", "time", "wall_time", "gpus", "engines", "state_trouble", "gpu_source"}


def test_the_measured_box_is_on_the_screen() -> None:
    """Issue 18: the calibration block in one line — the peak over budget, the headroom at the
    worst, the last prediction's error, the utilization a fit would pick — and nothing before
    an engine has been seen serving."""
    engine = dict(STATUS["engines"][0])  # type: ignore[index]
    engine["calibration"] = {
        "bills": {"over_budget_bytes": GIB // 2, "headroom_bytes": GIB},
        "prediction_error_ratio": -0.0012,
        "fits": {"gpu_memory_utilization": {"value": 0.948, "reason": "…", "prediction": None}},
    }
    lines = render({**STATUS, "engines": [engine]}).splitlines()
    start = next(n for n, line in enumerate(lines) if line.startswith("  measured  "))
    shown = " · ".join(line.strip() for line in lines[start : start + 2]).removeprefix("measured  ")
    assert shown.startswith("peak 0.5 GiB over budget · headroom at the worst 1.0 GiB · last pool")
    assert "last pool prediction -0.1% · fit utilization 0.948" in shown
    assert max(len(line) for line in lines) <= WIDTH
    assert "measured" not in render(STATUS)


def test_the_legend_keys_each_colour_and_an_unknown_bill_is_not_stretched_over() -> None:
    """Issue 21: solid coloured blocks had no key; with the engine's other memory and the
    neighbours unknown, weights and pool filled the whole bar."""
    painted = render(STATUS, color=True)
    legend = next(line for line in painted.splitlines() if "GiB: " in line)
    assert "\033[34m█\033[0m weights 5.0" in legend  # the bar's colour, then its name
    assert "\033[32m█\033[0m KV pool 14.0" in legend
    engine = dict(STATUS["engines"][0])  # type: ignore[index]
    engine["bills"] = {"weights": 5 * GIB, "kv_pool": 14 * GIB, "engine_other": None, "other_processes": None,
                       "free": 2 * GIB, "total": 24 * GIB}  # fmt: skip
    lines = render({**STATUS, "engines": [engine]}).splitlines()
    cells = next(line for line in lines if line.startswith("  memory    [")).removeprefix("  memory    [")[
        :-1
    ]
    assert cells.count("W") == round(5 / 24 * len(cells))  # of the card, not of what is known
    assert cells.count("?") == len(cells) - cells.count("W") - cells.count("K") - cells.count(".")
    assert cells.count("?") >= round(3 / 24 * len(cells)) - 2  # the 3 GiB nobody accounted for
    assert "? not known" in next(line for line in lines if "GiB: " in line)


def test_simulated_time_is_said_beside_the_wall_clock() -> None:
    first = render({**STATUS, "wall_time": 1795900000.0}).splitlines()[0]
    assert re.match(
        r"tunerd — mode act — simulated \d{4}-\d\d-\d\d \d\d:\d\d:\d\d \(wall \d\d:\d\d:\d\d\)$", first
    )
    assert "simulated" not in render(STATUS).splitlines()[0]


def test_the_prefill_plateau_is_on_the_screen_under_its_names() -> None:
    """Issue 21: the seed's word and vLLM's side by side — the latest rise that stayed (what the
    memory_ratchet policies act on) and the tallest that fell back, with what was in flight;
    "none" over ten quiet minutes; no line while the engine's memory is not read."""
    engine = dict(STATUS["engines"][0])  # type: ignore[index]
    common = {"before_bytes": 20 * GIB, "running": 3, "gate_longest_prompt": None}
    engine["plateaus"] = [
        {**common, "kind": "transient", "at": 1795999400.0, "end": 1795999404.5, "height_bytes": 300 * 1024**2,
         "duration_s": 4.5, "prompt_tokens": 28672, "gate_prompt_tokens_in_flight": 30000},
        {**common, "kind": "transient", "at": 1795999500.0, "end": 1795999501.0, "height_bytes": 100 * 1024**2,
         "duration_s": 1.0, "prompt_tokens": 2000, "gate_prompt_tokens_in_flight": None},
        {**common, "kind": "step", "at": 1795999900.0, "end": None, "height_bytes": int(1.5 * GIB),
         "duration_s": 100.0, "prompt_tokens": 57344, "gate_prompt_tokens_in_flight": None, "running": 4,
         "in_flight_until": 1795999930.0},
    ]  # fmt: skip
    lines = render({**STATUS, "engines": [engine]}).splitlines()
    start = next(n for n, line in enumerate(lines) if line.startswith("  plateaus  "))
    block = [lines[start], *(line for line in lines[start + 1 : start + 4] if line.startswith(" " * 12))]
    shown = " · ".join(line.strip() for line in block).removeprefix("plateaus  ")
    assert shown.startswith("prefill plateau (memory_ratchet) +1.5 GiB at ")
    assert (
        ", kept (the allocator holds it) · 57,344 prompt tokens prefilled in its first 30 s, 4 running"
        in shown
    )
    assert "transient (of 2) +300 MiB for 4.5 s at " in shown  # the tallest of the two
    assert ", fell back · 28,672 prompt tokens prefilled, 30,000 in flight at the gate, 3 running" in shown
    assert max(len(line) for line in lines) <= WIDTH
    quiet = render({**STATUS, "engines": [{**engine, "plateaus": []}]})
    assert "  plateaus  prefill plateau (memory_ratchet): none in the last 10 min" in quiet
    assert "plateau" not in render(STATUS)  # memory not read: nothing to say
    # an answer of another shape (read as any page is): no crash, what is readable shown
    odd = [{"kind": "transient", "height_bytes": "lots", "duration_s": "x", "at": None}, 7, "step"]
    assert "transient +? at -, fell back" in render({**STATUS, "engines": [{**engine, "plateaus": odd}]})
    assert "plateau" not in render({**STATUS, "engines": [{**engine, "plateaus": "lots"}]})
