"""The post-mortem read from an incident's recording: the peak, who grew, the cause; the short
text the alerts quote, in both languages, and how an alert carries it."""

from __future__ import annotations

from tests.unit.notify.test_sinks import alert
from tunerd.incident import NEIGHBOUR, PLATEAU, chart_of, html_page, pack, postmortem, render, short, unpack
from tunerd.notify.alert import render as render_alert
from tunerd.recording import FORMAT, VERSION

GIB = 1 << 30


def _recording(neighbour_grows: bool) -> list[dict]:
    """Two minutes at 1 Hz on a 24 GiB card: the engine (or a neighbour) grows 1.5 GiB, then
    the crash at t=120."""
    lines: list[dict] = [
        {"format": FORMAT, "version": VERSION, "engine": "main", "settings": {}, "states": {}}
    ]
    for t in range(121):
        grown = 1.5 * GIB * min(1.0, max(0.0, (t - 60) / 30))
        engine = 21.0 * GIB + (0 if neighbour_grows else grown)
        others = 0.5 * GIB + (grown if neighbour_grows else 0)
        samples = {
            "gpu_memory_used_bytes": engine + others,
            "gpu_memory_total_bytes": 24.0 * GIB,
            "engine_memory_bytes": engine,
            "other_processes_memory_bytes": others,
            "engine_over_budget_bytes": -0.2 * GIB + (0 if neighbour_grows else grown),
            "kv_cache_usage": 0.6,
        }
        lines.append({"t": 1000.0 + t, "g": 0, "samples": samples})
        lines.append({"t": 1000.0 + t, "tick": True})
    return lines


def _incident(detail: dict) -> dict:
    return {
        "id": 7,
        "engine": "main",
        "kind": "crash",
        "at": "…",
        "time": 1120.0,
        "detail": detail,
        "complete": True,
    }


def test_the_engine_growing_past_its_budget_is_the_plateau() -> None:
    detail = {
        "crash": {
            "kind": "cuda_oom",
            "message": "CUDA out of memory",
            "excerpt": ["torch.OutOfMemoryError: CUDA"],
        },
        "figures": {"weights_bytes": 5 * GIB, "kv_available_bytes": 15 * GIB, "cuda_graph_bytes": GIB // 4},
    }
    report = postmortem(_incident(detail), unpack(pack(_recording(neighbour_grows=False))))
    assert report["cause"] == PLATEAU
    assert report["peak"]["used_bytes"] == 23.0 * GIB
    assert report["grew"][0]["who"] in ("engine", "gpu")
    assert (
        round(report["bills"]["activations_and_runtime_bytes"] / GIB, 2) == 2.25
    )  # 22.5 GiB held − 20.25 GiB of known bills
    text = render(report)
    for words in (
        "What filled the GPU",
        "bills: weights 5.00 GiB",
        "engine: +1.50 GiB",
        "torch.OutOfMemoryError",
    ):
        assert words in text, text


def test_a_neighbour_that_grew_is_named_in_both_languages() -> None:
    report = postmortem(
        _incident({"crash": {"kind": "cuda_oom"}}), unpack(pack(_recording(neighbour_grows=True)))
    )
    assert report["cause"] == NEIGHBOUR
    english, chinese = short(report, "en"), short(report, "zh")
    assert "a neighbour grew" in english
    assert "其他进程" in chinese
    assert all("tunerd incident show 7" in text for text in (english, chinese))


def test_an_alert_carries_the_post_mortem_in_its_language_while_firing() -> None:
    texts = {"en": "Suspected cause: a neighbour grew", "zh": "疑似原因：其他进程增长"}
    firing = alert(postmortem=texts)
    assert render_alert(firing, "en").summary.endswith(texts["en"])
    assert render_alert(firing, "zh").summary.endswith(texts["zh"])
    assert firing.to_dict()["postmortem"] == texts
    resolved = firing.resolved(firing.time + 60, "over")
    assert texts["en"] not in render_alert(resolved, "en").summary


def _with_processes(lines: list[dict]) -> list[dict]:
    """The neighbour-growth recording with what the GPU listed: the engine, Xorg, and a notebook
    that comes at t=60 and grows to 1.5 GiB; the engine down (a restart) from t=100 to t=110."""
    out = [lines[0]]
    for given in lines[1:]:
        t = given["t"] - 1000.0
        line = given
        if "samples" in given and 100 <= t < 110:
            line = {**given, "samples": {**given["samples"], "engine_memory_bytes": None}}
        out.append(line)
        if "samples" in line and t % 10 == 0:
            listed = [
                {"gpu": 0, "pid": 11, "name": "python3", "used_bytes": 21 * GIB, "engine": True},
                {"gpu": 0, "pid": 5, "name": "Xorg", "used_bytes": GIB // 2, "engine": False},
            ]
            if t >= 60:
                grown = int(1.5 * GIB * min(1.0, (t - 60) / 30))
                listed.append({"gpu": 0, "pid": 7, "name": "notebook", "used_bytes": grown, "engine": False})
            out.append({"t": line["t"], "event": "gpu_processes", "data": {"processes": listed}})
    return out


def test_who_grew_names_the_neighbour_by_its_pid() -> None:
    recording = unpack(pack(_with_processes(_recording(neighbour_grows=True))))
    report = postmortem(_incident({"crash": {"kind": "cuda_oom"}}), recording)
    grew = {item["who"]: item for item in report["grew"]}
    assert grew["pid 7 (notebook)"]["from_bytes"] == 0  # it came during the window
    assert grew["pid 7 (notebook)"]["by_bytes"] == 1.5 * GIB
    assert "pid 5 (Xorg)" not in grew  # it did not move
    assert "pid 7 (notebook): +1.50 GiB (0 B → 1.50 GiB)" in render(report)


def test_the_incidents_chart_stacks_bills_and_neighbours_and_leaves_the_restart_a_gap() -> None:
    recording = unpack(pack(_with_processes(_recording(neighbour_grows=True))))
    detail = {
        "crash": {"kind": "cuda_oom"},
        "figures": {"weights_bytes": 5 * GIB, "kv_available_bytes": 15 * GIB, "cuda_graph_bytes": GIB // 4},
        "actions": [
            {"id": 3, "kind": "tune", "outcome": "succeeded", "reason": "oom", "time": "1970-01-01T00:18:41Z"}
        ],
    }
    panels, marks = chart_of(_incident(detail), recording)
    memory = {layer.name: layer.values for layer in panels[0].layers}
    assert list(memory)[:4] == [
        "engine: weights",
        "engine: KV cache pool",
        "engine: CUDA graphs",
        "engine: activations, context and the rest",
    ]
    assert "pid 7 (notebook)" in memory
    assert "pid 5 (Xorg)" in memory
    times = list(panels[0].times)
    during = [i for i, t in enumerate(times) if 1100 <= t < 1110]
    assert during
    assert all(memory["engine: weights"][i] is None for i in during)  # the restart: a gap
    assert all(memory["pid 7 (notebook)"][i] for i in during)  # the neighbour was still there
    assert sorted(mark.kind for mark in marks) == ["tune"]  # its time read from ISO 8601
    assert marks[0].time == 1121.0
    page = html_page(postmortem(_incident(detail), recording), _incident(detail), recording)
    assert 'data-name="pid 7 (notebook)"' in page


def test_prefill_plateaus_that_fell_back_are_in_the_post_mortem() -> None:
    """The daemon's ``transient_plateau`` events in the recording: listed under ``plateaus`` and
    named in the evidence (how many, the tallest's height, how long, the prompt tokens)."""
    lines = _recording(neighbour_grows=False)
    said = {"kind": "transient", "at": 1010.0, "end": 1014.5, "height_bytes": 300 << 20, "duration_s": 4.5,
            "prompt_tokens": 28672, "running": 2, "gate_prompt_tokens_in_flight": None}  # fmt: skip
    lines[1:] = sorted(
        [
            *lines[1:],
            {"t": 1015.0, "event": "transient_plateau", "data": said},
            {
                "t": 1030.0,
                "event": "transient_plateau",
                "data": {**said, "at": 1025.0, "height_bytes": 100 << 20},
            },
        ],
        key=lambda line: line["t"],
    )  # in time order, as recordings are
    report = postmortem(_incident({}), unpack(pack(lines)))
    assert [p["at"] for p in report["plateaus"]] == [1010.0, 1025.0]
    (named,) = [line for line in report["evidence"] if "prefill plateau" in line]
    assert named == (
        "2 prefill plateaus fell back in the window (tallest +300.00 MiB for 4.5 s, 28,672 prompt tokens prefilled)"
    )
    assert postmortem(_incident({}), unpack(pack(_recording(neighbour_grows=False))))["plateaus"] == []
