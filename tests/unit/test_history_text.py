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
