"""`tunerd history`'s text: who acted, and a policy's name said once."""

from __future__ import annotations

from tunerd.commands.history import _text


def _action(**fields: object) -> dict[str, object]:
    return {
        "id": 2,
        "time": "2026-11-29T12:52:35+00:00",
        "engine": "tiny",
        "policy": None,
        "kind": "tune",
        "mode": "act",
        "from_settings": {"max_model_len": 1024},
        "to_settings": {"max_model_len": 2048},
        "outcome": "rolled_back",
        "reason": "",
        "evidence": {"signals": {}, "log_lines": []},
        **fields,
    }


def test_a_policys_reason_names_it_once() -> None:
    # the reason as the policy engine writes it (seen doubled in a real-vLLM story's history)
    text = _text([_action(policy="grow-context", reason="grow-context: max_model_len 1024 → 2048")])
    assert "\n    grow-context: max_model_len 1024 → 2048\n" in text
    assert "grow-context: grow-context" not in text


def test_what_a_person_asked_for_says_by_hand() -> None:
    asked = _action(kind="rollback", reason="latency doubled", evidence={"asked_by": "ops"})
    assert "    by hand: latency doubled" in _text([asked])
    assert "    tunerd: first start" in _text([_action(kind="restart", reason="first start")])


def test_none_is_never_printed() -> None:
    """A first start has nothing before it: what it started with, not `None→0.92`; a knob left
    to vLLM on one side is its default."""
    first = _action(
        kind="restart",
        from_settings=None,
        to_settings={"gpu_memory_utilization": 0.92, "max_num_seqs": 8},
        outcome="succeeded",
        reason="first start under tunerd",
    )
    text = _text([first])
    assert "restart (act) succeeded — with gpu_memory_utilization 0.92, max_num_seqs 8\n" in text
    unset = _action(from_settings={"kv_cache_dtype": None}, to_settings={"kv_cache_dtype": "fp8"})
    assert "kv_cache_dtype default→fp8" in _text([unset])
    assert "None" not in text + _text([unset])
