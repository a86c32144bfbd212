"""Comparing two vLLM /metrics pages by their shape: which ``vllm:`` families they have, with
which types, and which label sets their samples carry — the simulator's page against a real
engine's (tests/integration/test_sim.py against a recorded page, the real-engine tier against
a live one)."""

from __future__ import annotations

__all__ = ["families", "series"]

#: Labels whose values are part of a page's shape (a bucket, a reason); the others (the
#: model's name, the engine's index) are not compared.
_SHAPED = ("le", "reason", "finished_reason", "source", "sleep_state")


def families(page: str) -> dict[str, str]:
    """``vllm:`` family → type, from the page's TYPE lines (``_created`` series aside: tunerd
    ignores them, and prometheus_client's custom collectors do not emit them)."""
    found = {}
    for line in page.splitlines():
        if line.startswith("# TYPE vllm:"):
            _, _, name, kind = line.split()
            if not name.endswith("_created"):
                found[name] = kind
    return found


def series(page: str) -> set[tuple[str, frozenset[tuple[str, str]]]]:
    """Every ``vllm:`` sample's name and label set (values only for the labels of the shape)."""
    found = set()
    for line in page.splitlines():
        if not line.startswith("vllm:") or "_created" in line.split("{")[0]:
            continue
        name, _, rest = line.partition("{")
        labels = rest.rpartition("}")[0]
        pairs = [pair.split("=", 1) for pair in labels.split('",') if "=" in pair]
        shaped = frozenset(
            (key, value.strip('"') if key in _SHAPED else "") for key, value in pairs if key != "model_name"
        )
        found.add((name.split(" ")[0], shaped))
    return found
