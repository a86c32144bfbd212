"""Tuning: DESIGN §4.5's notches, bounds never crossed, ladders never stuck."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tunerd.tune import apply_tune

BOUNDS = {
    "max_num_seqs": [4, 16],
    "max_num_batched_tokens": [512, 8192],
    "gpu_memory_utilization": [0.80, 0.95],
    "max_model_len": [4096, 32768],
    "kv_cache_memory_bytes": [2**30, 2**34],
}


@pytest.mark.parametrize(
    ("knob", "operation", "current", "after"),
    [
        ("max_num_seqs", "step_down", 8, 6),
        ("max_num_seqs", "step_down", 6, 4),
        ("max_num_seqs", "step_up", 8, 10),
        ("max_num_batched_tokens", "step_down", 2048, 1024),
        ("max_num_batched_tokens", "halve", 2048, 1024),
        ("max_num_batched_tokens", "double", 2048, 4096),
        ("gpu_memory_utilization", "step_down", 0.92, 0.89),
        ("gpu_memory_utilization", -0.03, 0.92, 0.89),
        ("gpu_memory_utilization", "+0.02", 0.92, 0.94),
        ("gpu_memory_utilization", 0.85, 0.92, 0.85),
        ("max_model_len", "halve", 32768, 16384),
    ],
)
def test_notches(knob: str, operation: str | float, current: float, after: float) -> None:
    assert apply_tune(knob, operation, current, BOUNDS[knob]).after == after


def test_default_seq_ladder_from_design() -> None:
    values = [8]
    for _ in range(3):
        values.append(apply_tune("max_num_seqs", "step_down", values[-1], [1, 100]).after)
    assert values == [8, 6, 4, 3]


def test_two_decimal_arithmetic() -> None:
    result = apply_tune("gpu_memory_utilization", "step_down", 0.92, [0.5, 0.95])
    assert repr(result.after) == "0.89"


def test_no_bounds_never_tuned() -> None:
    result = apply_tune("max_num_seqs", "step_down", 8, None)
    assert not result.changed
    assert "never tuned" in result.reason


def test_at_bound_does_nothing_and_says_so() -> None:
    result = apply_tune("max_num_seqs", "step_down", 4, [4, 16])
    assert not result.changed
    assert "already at its bound" in result.reason


def test_explicit_ladder() -> None:
    ladder = [4, 6, 8, 12, 16]
    assert apply_tune("max_num_seqs", "step_up", 8, [4, 16], ladder=ladder).after == 12
    assert apply_tune("max_num_seqs", "step_down", 7, [4, 16], ladder=ladder).after == 6


def test_failed_value_never_stepped_up_to() -> None:
    result = apply_tune("max_num_seqs", "step_up", 8, [4, 16], failed=[10])
    assert not result.changed
    assert "failed recently" in result.reason


def test_kv_dtype_steps() -> None:
    assert apply_tune("kv_cache_dtype", "step_down", "auto", ["auto", "fp8"]).after == "fp8"
    assert not apply_tune("kv_cache_dtype", "fp8", "auto", ["auto"]).changed


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(sorted(BOUNDS)),
    st.lists(
        st.sampled_from(["step_down", "step_up", "halve", "double", "-0.03", "+0.03", "-1", "+1"]),
        min_size=1,
        max_size=40,
    ),
    st.data(),
)
def test_bounds_never_crossed_and_ladders_never_stick(
    knob: str, operations: list[str], data: st.DataObject
) -> None:
    low, high = BOUNDS[knob]
    if knob == "gpu_memory_utilization":
        value: float = data.draw(
            st.sampled_from([round(low + i / 100, 2) for i in range(int((high - low) * 100) + 1)])
        )
    else:
        value = data.draw(st.integers(int(low), int(high)))
    for operation in operations:
        result = apply_tune(knob, operation, value, BOUNDS[knob])
        assert low <= result.after <= high
        if result.changed:
            assert (result.after < value) == (
                operation in {"step_down", "halve"} or operation.startswith("-")
            )
        elif operation in {"step_down", "halve"}:
            assert value == low or "bound" in result.reason or "end" in result.reason  # stuck only at the end
        value = result.after
    # From anywhere inside the bounds, enough steps down reach the lower bound (no sticking).
    for _ in range(100):
        value = apply_tune(knob, "step_down", value, BOUNDS[knob]).after
    assert value == low
