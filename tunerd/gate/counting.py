"""What a request asks of the KV pool, read from its body before the engine sees it. Pure.

For each OpenAI-style endpoint the gate serves (``/v1/completions``, ``/v1/chat/completions``,
``/v1/responses``) :func:`count_plan` finds the prompt and the output the request may
generate, and says how to count the prompt:

- exactly, at once: a prompt of token ids;
- exactly, by asking the engine: ``POST /tokenize`` with the prompt, or the chat messages
  (vLLM applies the model's own tokenizer and chat template: the count is the one
  ``usage.prompt_tokens`` will report);
- an upper bound, with no call: the prompt's UTF-8 bytes (a byte-level BPE or SentencePiece
  token covers at least one byte) plus an allowance for special tokens and the chat
  template. The gate admits on the bound when even the bound fits, and counts exactly when
  the decision depends on it.

The output is ``max_tokens`` (chat: ``max_completion_tokens`` first; responses:
``max_output_tokens``) times ``n``; without one it is unknown (None), and the admission
takes the rest of ``max_model_len``, as vLLM allows. Every field is hostile until read: a
body of the wrong shape gets a :class:`CountError` naming the field, which the gate answers
with a 400 of its own.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "CHAT_ALLOWANCE_TOKENS",
    "MESSAGE_ALLOWANCE_TOKENS",
    "CountError",
    "CountPlan",
    "Endpoint",
    "count_plan",
    "usage_prompt_tokens",
]

Endpoint = Literal["completions", "chat", "responses"]
ENDPOINTS: dict[str, Endpoint] = {
    "/v1/completions": "completions",
    "/v1/chat/completions": "chat",
    "/v1/responses": "responses",
}
CHAT_ALLOWANCE_TOKENS = 256  # a chat template's own text (a system preamble, a date line)
MESSAGE_ALLOWANCE_TOKENS = 16  # each message's role markers and separators
SPECIAL_ALLOWANCE_TOKENS = 8  # BOS/EOS and the like around a plain prompt
MAX_N = 128  # samples per request a body may ask for (vLLM's own limit is lower in practice)
MAX_OUTPUT = 2**31 - 1
_CHAT_KEYS = (
    "add_generation_prompt",
    "continue_final_message",
    "chat_template",
    "chat_template_kwargs",
    "tools",
)


class CountError(ValueError):
    """The body cannot be read as the endpoint's request (the message names the field)."""


@dataclass(frozen=True)
class CountPlan:
    """How to count one request: an ``exact`` count already known, else an upper ``bound``
    and the ``tokenize`` body that gets the exact count from the engine (None: no call can)."""

    endpoint: Endpoint
    bound: int
    exact: int | None
    tokenize: dict[str, Any] | None
    max_tokens: int | None  # the output it may generate, all samples together (None: not said)
    stream: bool


def _int_field(body: Mapping[str, Any], key: str, low: int, high: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise CountError(f"{key} must be a whole number, got {_shown(value)}")
    if not low <= value <= high:
        raise CountError(f"{key} must be from {low} to {high:,}, got {value:,}")
    return value


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _bytes(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def _content_bytes(content: Any, where: str) -> int:
    """UTF-8 bytes of a message's content: a string, or parts (text parts counted, other
    parts — images, audio — by their JSON, a generous stand-in the exact count replaces)."""
    if content is None:
        return 0
    if isinstance(content, str):
        return _bytes(content)
    if isinstance(content, list):
        total = 0
        for index, part in enumerate(content):
            if not isinstance(part, dict):
                raise CountError(f"{where}.content[{index}] must be an object")
            text = part.get("text")
            total += _bytes(text) if isinstance(text, str) else _bytes(json.dumps(part, default=str))
        return total
    raise CountError(f"{where}.content must be a string or a list of parts")


def _messages_bound(messages: Any, where: str) -> int:
    if not isinstance(messages, list) or not messages:
        raise CountError(f"{where} must be a non-empty list of messages")
    total = CHAT_ALLOWANCE_TOKENS
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise CountError(f"{where}[{index}] must be an object with a role")
        total += MESSAGE_ALLOWANCE_TOKENS + _content_bytes(message.get("content"), f"{where}[{index}]")
        for key in ("tool_calls", "name"):
            if key in message:
                total += _bytes(json.dumps(message[key], default=str))
    return total


def _output(body: Mapping[str, Any], keys: tuple[str, ...], default: int | None) -> int | None:
    out: int | None = None
    for key in keys:
        out = _int_field(body, key, 0, MAX_OUTPUT)
        if out is not None:
            break
    if out is None:
        out = default
    n = _int_field(body, "n", 1, MAX_N) or 1
    best_of = _int_field(body, "best_of", 1, MAX_N) or 1
    return None if out is None else out * max(n, best_of)


def count_plan(endpoint: Endpoint, body: Mapping[str, Any]) -> CountPlan:
    """How to count ``body`` sent to ``endpoint`` (raises :class:`CountError` when the body is
    not such a request)."""
    stream = body.get("stream") is True
    if endpoint == "completions":
        prompt = body.get("prompt")
        max_tokens = _output(body, ("max_tokens",), 16)  # the completions API's default
        if isinstance(prompt, str):
            bound = _bytes(prompt) + SPECIAL_ALLOWANCE_TOKENS
            return CountPlan(endpoint, bound, None, {"prompt": prompt}, max_tokens, stream)
        if isinstance(prompt, list) and prompt and all(_is_token(t) for t in prompt):
            return CountPlan(endpoint, len(prompt), len(prompt), None, max_tokens, stream)
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            bound = sum(_bytes(p) + SPECIAL_ALLOWANCE_TOKENS for p in prompt)  # a batch: bound only
            each = max_tokens
            return CountPlan(
                endpoint, bound, None, None, None if each is None else each * len(prompt), stream
            )
        if (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(p, list) and all(map(_is_token, p)) for p in prompt)
        ):
            exact = sum(len(p) for p in prompt)
            each = max_tokens
            return CountPlan(
                endpoint, exact, exact, None, None if each is None else each * len(prompt), stream
            )
        raise CountError("prompt must be a string, a list of strings or a list of token ids")
    if endpoint == "chat":
        messages = body.get("messages")
        bound = _messages_bound(messages, "messages")
        if body.get("tools") is not None:
            bound += _bytes(json.dumps(body["tools"], default=str))
        tokenize: dict[str, Any] = {"messages": messages}
        tokenize.update({key: body[key] for key in _CHAT_KEYS if key in body})
        max_tokens = _output(body, ("max_completion_tokens", "max_tokens"), None)
        return CountPlan(endpoint, bound, None, tokenize, max_tokens, stream)
    # responses: instructions (a system message) and input (text, or a list of messages)
    messages_list: list[Any] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise CountError("instructions must be a string")
        messages_list.append({"role": "system", "content": instructions})
    given = body.get("input")
    if isinstance(given, str):
        messages_list.append({"role": "user", "content": given})
    elif isinstance(given, list) and given:
        for index, item in enumerate(given):
            if not isinstance(item, dict):
                raise CountError(f"input[{index}] must be an object")
            if "role" in item:
                messages_list.append({"role": item["role"], "content": item.get("content")})
            else:  # a function call's output and the like: its JSON stands in
                messages_list.append({"role": "user", "content": json.dumps(item, default=str)})
    else:
        raise CountError("input must be a string or a non-empty list of items")
    bound = _messages_bound(messages_list, "input")
    max_tokens = _output(body, ("max_output_tokens",), None)
    return CountPlan(endpoint, bound, None, {"messages": messages_list}, max_tokens, stream)


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31


def tokenize_count(data: Any) -> int | None:
    """The ``count`` of a ``/tokenize`` answer (None: not such an answer)."""
    if isinstance(data, dict):
        count = data.get("count")
        if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
            return count
    return None


def usage_prompt_tokens(data: Any) -> int | None:
    """``usage.prompt_tokens`` of a response (responses API: ``usage.input_tokens``)."""
    if not isinstance(data, dict):
        return None
    usage = data.get("usage")
    if not isinstance(usage, dict):
        response = data.get("response")  # a responses stream's last event carries the response
        usage = response.get("usage") if isinstance(response, dict) else None
    if not isinstance(usage, dict):
        return None
    for key in ("prompt_tokens", "input_tokens"):
        value = usage.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None


def stream_usage(tail: bytes) -> int | None:
    """The prompt tokens of a server-sent-events stream's usage event, from the stream's last
    bytes (the usage chunk comes last, before ``[DONE]``)."""
    for event in reversed(tail.replace(b"\r\n", b"\n").split(b"\n\n")):
        for line in event.split(b"\n"):
            if line.startswith(b"data: {") and b"usage" in line:
                try:
                    found = usage_prompt_tokens(json.loads(line[6:]))
                except ValueError:
                    continue
                if found is not None:
                    return found
    return None
