"""Tuning: DESIGN §4.5's notches, bounds never crossed, ladders never stuck."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tunerd.tune import MAX_VALUES, apply_tune, bounds_problem, changes, shown, validate_value

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


@pytest.mark.parametrize(
    ("knob", "value", "problem"),
    [
        ("max_num_seqs", 1e30, "max_num_seqs must be at most 1,048,576, got 1e+30"),
        ("max_num_seqs", 10**30, f"max_num_seqs must be at most 1,048,576, got {10**30}"),
        ("max_model_len", 2**31, "max_model_len must be at most 2,147,483,647, got 2147483648"),
        ("max_num_batched_tokens", 2**31, "max_num_batched_tokens must be at most 2,147,483,647"),
        ("kv_cache_memory_bytes", 2**40 + 1, "kv_cache_memory_bytes must be at most 1,099,511,627,776"),
        ("max_num_seqs", 0, "max_num_seqs takes a positive whole number, got 0"),
        ("max_num_seqs", 8.5, "max_num_seqs takes a positive whole number, got 8.5"),
        ("max_num_seqs", float("nan"), "max_num_seqs takes a positive whole number, got nan"),
        ("max_num_seqs", True, "max_num_seqs takes a number, got True"),
        ("gpu_memory_utilization", 0, "gpu_memory_utilization must be in (0, 1], got 0"),
        (
            "kv_cache_dtype",
            ["fp8"],
            "kv_cache_dtype takes auto, float16, bfloat16, fp8, fp8_e4m3, fp8_e5m2, got ['fp8']",
        ),
    ],
)
def test_values_out_of_a_knobs_range_are_refused(knob: str, value: object, problem: str) -> None:
    """Issue 16: `max_num_seqs: 1e30` passed `config check` and reached vLLM's argv."""
    why = validate_value(knob, value)
    assert why is not None
    assert why.startswith(problem)


def test_the_ends_of_each_range_are_valid() -> None:
    for knob, high in MAX_VALUES.items():
        assert validate_value(knob, high) is None
        assert validate_value(knob, 1 if knob != "gpu_memory_utilization" else 0.01) is None


@pytest.mark.parametrize(
    ("knob", "bounds", "problem"),
    [
        ("max_num_seqs", [16, 4], "max_num_seqs bounds are [low, high], got [16, 4]: the low one first"),
        ("max_num_seqs", [4], "max_num_seqs bounds are [low, high], got [4]"),
        ("max_num_seqs", [4, 8, 16], "max_num_seqs bounds are [low, high], got [4, 8, 16]"),
        ("max_num_seqs", [], "max_num_seqs bounds are [low, high], got []"),
        ("max_num_seqs", {"low": 4}, "max_num_seqs bounds are [low, high], got {'low': 4}"),
        ("max_num_seqs", [4, 1e30], "max_num_seqs must be at most 1,048,576"),
        ("kv_cache_dtype", [], "kv_cache_dtype bounds are a list of the values it may take, got []"),
        ("enforce_eager", [1], "enforce_eager takes true or false, got 1"),
        ("swap_space", [1, 2], "'swap_space' is not a tunable"),
    ],
)
def test_bounds_are_low_then_high_and_in_range(knob: str, bounds: object, problem: str) -> None:
    why = bounds_problem(knob, bounds)
    assert why is not None
    assert why.startswith(problem)
    assert bounds_problem("max_num_seqs", [4, 4]) is None
    assert bounds_problem("kv_cache_dtype", ["auto", "fp8"]) is None


class TestFit:
    BOUNDS = (0.80, 0.95)

    def test_fit_moves_down_to_the_target_in_thousandths(self) -> None:
        result = apply_tune(
            "gpu_memory_utilization", "fit", 0.92, self.BOUNDS, fit=(0.8734, "peak", {"p": 1})
        )
        assert (result.after, result.prediction) == (0.873, {"p": 1})
        assert "fit: peak" in result.reason

    def test_fit_is_clamped_to_the_bounds_and_then_has_no_prediction(self) -> None:
        result = apply_tune("gpu_memory_utilization", "fit", 0.92, self.BOUNDS, fit=(0.7, "peak", {"p": 1}))
        assert result.after == 0.8
        assert result.prediction is None  # the prediction was for 0.7

    def test_no_target_changes_nothing_and_says_why(self) -> None:
        result = apply_tune(
            "gpu_memory_utilization", "fit", 0.92, self.BOUNDS, fit=(None, "nothing seen", None)
        )
        assert not result.changed
        assert not result.settled
        assert "nothing seen" in result.reason
        assert not apply_tune("gpu_memory_utilization", "fit", 0.92, self.BOUNDS).changed

    def test_small_moves_are_within_the_fit(self) -> None:
        down = apply_tune("gpu_memory_utilization", "fit", 0.92, self.BOUNDS, fit=(0.917, "peak", None))
        up = apply_tune("gpu_memory_utilization", "fit", 0.92, self.BOUNDS, fit=(0.935, "peak", None))
        assert (down.changed, down.settled, up.changed, up.settled) == (False, True, False, True)

    def test_a_memory_policy_never_raises(self) -> None:
        result = apply_tune(
            "gpu_memory_utilization", "fit", 0.85, self.BOUNDS, fit=(0.93, "room", None), fit_up=False
        )
        assert (result.changed, result.settled) == (False, True)

    def test_fit_of_steps_and_knobs_without_one(self) -> None:
        assert (
            apply_tune("max_num_batched_tokens", "fit", 8192, [512, 8192], fit=(2048, "room", None)).after
            == 2048
        )
        assert not apply_tune("max_model_len", "fit", 8192, [512, 8192]).changed

    def test_a_fit_already_reached_is_settled_whichever_way_it_may_move(self) -> None:
        for up in (True, False):
            result = apply_tune(
                "max_num_batched_tokens", "fit", 4096, [512, 8192], fit=(4096, "room", None), fit_up=up
            )
            assert (result.changed, result.settled) == (False, True)


def test_an_unset_knob_reads_default_never_none() -> None:
    """Issue 21: `None→0.92` is no way to tell a person that the knob was vLLM's default."""
    assert changes({}, {"gpu_memory_utilization": 0.92}) == ["gpu_memory_utilization default→0.92"]
    assert changes({"max_num_seqs": 8}, {}) == ["max_num_seqs 8→default"]
    assert shown(None) == "default"
    assert shown(0) == "0"
