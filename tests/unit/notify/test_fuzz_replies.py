"""Fuzzing each sink's reply parser (``classify(status, headers, body)``) as a hostile service
would answer: any status, ``Retry-After`` of every shape (huge, negative, NaN, a date, junk),
and bodies of random bytes, JSON of the wrong shape (a code that is a list, a string, a
boolean, a number of a thousand digits, NaN; ``retry_after: 1e300``), nesting past the
parser's depth, up to the 64 KiB the sender reads. Only the documented outcome comes back —
an :class:`Outcome` whose kind is ok, retry or permanent, a short detail, a wait within
``[0, MAX_RETRY_AFTER_S]`` — never an exception (one in a sender's thread lost the alert in
flight and stalled every later one).

``make test`` runs 100 cases a property; ``make fuzz`` 10,000 (tests/fuzzing.py)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzzing import NASTY, fuzz_settings
from tunerd.notify.sink import MAX_RETRY_AFTER_S, Outcome, retry_after_seconds, wait_seconds
from tunerd.notify.sinks import KINDS, module

pytestmark = pytest.mark.fuzz

# the keys the services' replies carry, and a few they do not
_KEYS = ["code", "StatusCode", "msg", "errcode", "errmsg", "retry_after", "message", "global", "ok", "data"]

_numbers = st.one_of(
    st.integers(-(10**40), 10**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, 11232, 130101, 45009, 310000, 19021, -1, 2**63, 1e300, -1e300, 0.0, -0.0]),
)
_json = st.recursive(
    st.one_of(st.none(), st.booleans(), _numbers, st.text(max_size=20), st.sampled_from(NASTY)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.sampled_from(_KEYS) | st.text(max_size=6), inner, max_size=4),
    ),
    max_leaves=12,
)


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    shape = draw(st.sampled_from(["object", "json", "bytes", "huge", "deep", "digits", "cut"]))
    if shape == "object":  # the right keys, values of any type
        reply = draw(st.dictionaries(st.sampled_from(_KEYS), _json, max_size=5))
        return json.dumps(reply, allow_nan=True).encode()
    if shape == "json":
        return json.dumps(draw(_json), allow_nan=True).encode()
    if shape == "bytes":
        return draw(st.binary(max_size=300))
    if shape == "huge":  # up to the 64 KiB the sender reads
        return draw(st.binary(min_size=1, max_size=16)) * draw(st.integers(1, 4096))
    if shape == "deep":  # nesting past the JSON parser's recursion limit
        key = draw(st.sampled_from(['{"errcode":', '{"code":', '{"retry_after":', "[", '{"a":']))
        return (key * draw(st.integers(1, 20_000))).encode()
    if shape == "digits":  # a number past the int parser's 4300 digits, or past a float's range
        key = draw(st.sampled_from(_KEYS))
        digits = "9" * draw(st.integers(300, 6000)) + draw(st.sampled_from(["", ".5", "e999", "e-999"]))
        return f'{{"{key}": {draw(st.sampled_from(["", "-"]))}{digits}}}'.encode()
    whole = json.dumps(draw(st.dictionaries(st.sampled_from(_KEYS), _json, max_size=5))).encode()
    return whole[: draw(st.integers(0, len(whole)))]


_retry_after = st.one_of(
    st.sampled_from(NASTY),
    st.sampled_from(
        ["99999999999", "1e300", "-5", "NaN", "inf", "Wed, 21 Oct 2015 07:28:00 GMT", " 7 ", "1_0"]
    ),
    st.integers(-(10**30), 10**30).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(max_size=30),
)
headers = st.dictionaries(
    st.sampled_from(["Retry-After", "retry-after", "RETRY-AFTER", "Content-Type", "X-Rate-Limit"]),
    _retry_after,
    max_size=3,
)
statuses = st.one_of(
    st.sampled_from([200, 201, 202, 204, 400, 403, 404, 408, 429, 500, 502, 503]),
    st.integers(-1000, 10**6),
)


def _documented(outcome: object) -> None:
    assert isinstance(outcome, Outcome), outcome
    assert outcome.kind in ("ok", "retry", "permanent")
    assert isinstance(outcome.detail, str)
    assert len(outcome.detail) <= 1000
    if outcome.retry_after is not None:
        assert isinstance(outcome.retry_after, float)
        assert 0.0 <= outcome.retry_after <= MAX_RETRY_AFTER_S


@pytest.mark.parametrize("kind", KINDS)
def test_a_reply_of_any_shape_is_an_outcome(kind: str) -> None:
    classify = module(kind).classify

    @fuzz_settings()
    @given(status=statuses, headers=headers, body=bodies())
    def check(status: int, headers: dict[str, str], body: bytes) -> None:
        _documented(classify(status, headers, body))

    check()


@pytest.mark.parametrize("kind", KINDS)
def test_a_rate_limit_reply_asks_for_a_wait_within_an_hour(kind: str) -> None:
    """The statuses and codes that mean "again later", with every shape of wait."""
    classify = module(kind).classify

    @fuzz_settings()
    @given(
        status=st.sampled_from([200, 429, 503]),
        wait=_retry_after,
        body=st.builds(
            lambda key, code, wait: json.dumps({key: code, "retry_after": wait}, allow_nan=True).encode(),
            st.sampled_from(["errcode", "code"]),
            st.sampled_from([130101, 45009, 11232, [1], "130101", True, 1e300]),
            _json,
        ),
    )
    def check(status: int, wait: str, body: bytes) -> None:
        _documented(classify(status, {"Retry-After": wait}, body))

    check()


@fuzz_settings()
@given(value=st.one_of(_json, _retry_after, st.integers(-(10**400), 10**400)))
def test_a_wait_of_any_kind_is_clamped_or_none(value: Any) -> None:
    wait = wait_seconds(value)
    assert wait is None or (isinstance(wait, float) and 0.0 <= wait <= MAX_RETRY_AFTER_S)
    is_nan = isinstance(value, float) and math.isnan(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not is_nan:
        expected = float(value) if abs(value) < 1e308 else (math.inf if value > 0 else -math.inf)
        assert wait == min(max(expected, 0.0), MAX_RETRY_AFTER_S)
    header = retry_after_seconds({"Retry-After": value if isinstance(value, str) else json.dumps(value)})
    assert header is None or 0.0 <= header <= MAX_RETRY_AFTER_S
