"""HTTP/1.1 framing of the gate's data path (tunerd.gate.h1): pure.

What is refused is what RFC 9112 says a server must not guess at (§6.1 both framings, §5.1
whitespace before a colon, §5.2 obsolete folding, §6.3 a bad length); what is read is what
clients and vLLM's uvicorn send. The real bytes are in ``tests/data/vllm-http/`` (PROVENANCE.md
there says how they were taken).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzzing import fuzz_settings
from tunerd.gate.h1 import (
    MAX_HEAD,
    ChunkedDecoder,
    HttpError,
    answer_head,
    find_head_end,
    forward_head,
    parse_request_head,
    parse_response_head,
    request_bytes,
)

HTTP = Path(__file__).parents[2] / "data" / "vllm-http"


def _request(text: str) -> bytes:
    return text.replace("\n", "\r\n").encode() + b"\r\n\r\n"


def test_a_post_with_a_length_and_its_headers() -> None:
    head = parse_request_head(
        _request(
            "POST /v1/chat/completions?x=1 HTTP/1.1\nHost: gate\nContent-Type: application/json\n"
            "Content-Length: 42\nX-Tunerd-Priority:  7 "
        )
    )
    assert (head.method, head.target, head.path, head.version) == (
        "POST",
        "/v1/chat/completions?x=1",
        "/v1/chat/completions",
        11,
    )
    assert (head.content_length, head.chunked, head.keep_alive, head.expect_continue) == (
        42,
        False,
        True,
        False,
    )
    assert head.header("x-tunerd-priority") == "7"  # names lower-case, values trimmed
    assert head.header("absent") is None


def test_keep_alive_follows_the_version_and_the_connection_header() -> None:
    assert not parse_request_head(_request("GET / HTTP/1.1\nConnection: close")).keep_alive
    assert not parse_request_head(_request("GET / HTTP/1.0")).keep_alive
    assert parse_request_head(_request("GET / HTTP/1.0\nConnection: Keep-Alive")).keep_alive
    assert parse_request_head(_request("GET / HTTP/1.1")).content_length == 0


def test_chunked_and_expect_continue() -> None:
    head = parse_request_head(
        _request("POST /v1/completions HTTP/1.1\nTransfer-Encoding: chunked\nExpect: 100-continue")
    )
    assert (head.chunked, head.content_length, head.expect_continue) == (True, None, True)


@pytest.mark.parametrize(
    ("text", "status", "words"),
    [
        ("POST / HTTP/1.1\nContent-Length: 5\nTransfer-Encoding: chunked", 400, "both"),
        ("POST / HTTP/1.1\nContent-Length: 5\nContent-Length: 6", 400, "twice"),
        ("POST / HTTP/1.1\nContent-Length: -5", 400, "not a number"),
        ("POST / HTTP/1.1\nContent-Length: 0x10", 400, "not a number"),
        ("POST / HTTP/1.1\nContent-Length: ５", 400, "not a number"),
        ("POST / HTTP/1.1\nTransfer-Encoding: gzip, chunked", 501, "only chunked"),
        ("POST / HTTP/1.1\nContent-Length : 5", 400, "not a token"),
        ("POST / HTTP/1.1\nX-A: 1\n folded: on", 400, "not a token"),
        ("POST / HTTP/1.1\nX-A: a\x00b", 400, "control character"),
        ("POST / HTTP/1.1\nno colon here", 400, "without a name"),
        ("POST / HTTP/2.0", 505, "HTTP/1.1"),
        ("POST /  HTTP/1.1", 400, "request line"),
        ("POST http://engine/v1/completions HTTP/1.1", 400, "origin-form"),
        ("PO(ST / HTTP/1.1", 400, "method"),
        ("POST / HTTP/1.1\nExpect: something-else", 417, "100-continue"),
        ("", 400, "empty"),
    ],
)
def test_ambiguous_or_malformed_heads_are_refused_with_the_status_the_client_gets(
    text: str, status: int, words: str
) -> None:
    with pytest.raises(HttpError) as raised:
        parse_request_head(_request(text) if text else b"\r\n\r\n")
    assert raised.value.status == status
    assert words in str(raised.value)


def test_a_head_ends_at_its_blank_line_and_is_capped() -> None:
    assert find_head_end(b"GET / HTTP/1.1\r\nHost: x\r\n") == -1
    data = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n{body"
    assert data[find_head_end(data) :] == b"{body"
    with pytest.raises(HttpError) as raised:
        find_head_end(b"GET / HTTP/1.1\r\nX: " + b"a" * MAX_HEAD)
    assert raised.value.status == 431


def test_answer_heads_say_how_their_body_ends() -> None:
    plain = parse_response_head(
        b"HTTP/1.1 200 OK\r\ncontent-length: 12\r\ncontent-type: application/json\r\n\r\n", "POST"
    )
    assert (plain.status, plain.length, plain.chunked, plain.until_close, plain.keep_alive) == (
        200,
        12,
        False,
        False,
        True,
    )
    assert plain.content_type == "application/json"
    stream = parse_response_head(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n", "POST")
    assert (stream.length, stream.chunked, stream.until_close) == (None, True, False)
    closing = parse_response_head(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n", "POST")
    assert (closing.until_close, closing.keep_alive) == (True, False)
    head = parse_response_head(b"HTTP/1.1 200 OK\r\ncontent-length: 99\r\n\r\n", "HEAD")
    assert (head.bodiless, head.length) == (True, 0)
    assert parse_response_head(b"HTTP/1.1 204 No Content\r\n\r\n", "DELETE").length == 0
    assert not parse_response_head(b"HTTP/1.0 200 OK\r\ncontent-length: 1\r\n\r\n", "GET").keep_alive
    with pytest.raises(HttpError):
        parse_response_head(b"ICY 200 OK\r\n\r\n", "GET")


def _chunked(pieces: list[bytes], trailers: bytes = b"") -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces if p) + b"0\r\n" + trailers + b"\r\n"


def test_a_chunked_body_read_whole_or_a_byte_at_a_time_gives_the_same_content() -> None:
    body = _chunked([b"data: one\n\n", b"data: two\n\n"], trailers=b"x-trailer: 1\r\n") + b"NEXT"
    whole = ChunkedDecoder()
    assert b"".join(whole.feed(body)) == b"data: one\n\ndata: two\n\n"
    assert (whole.done, whole.extra) == (True, b"NEXT")
    drip = ChunkedDecoder()
    content = b"".join(b"".join(drip.feed(body[i : i + 1])) for i in range(len(body)) if not drip.done)
    assert content == b"data: one\n\ndata: two\n\n"
    assert drip.done


def test_a_chunk_extension_is_ignored() -> None:
    decoder = ChunkedDecoder()
    assert decoder.feed(b"5;name=value\r\nhello\r\n0\r\n\r\n") == [b"hello"]
    assert decoder.done


@pytest.mark.parametrize(
    "body",
    [
        b"zz\r\nhello\r\n0\r\n\r\n",  # not hex
        b"5\r\nhelloEXTRA\r\n0\r\n\r\n",  # data longer than its size
        b"5\nhello\r\n0\r\n\r\n",  # a bare LF
        b"1" * 5000,  # a size line without an end
        b"11111111111111111\r\n",  # a size past 16 hex digits
    ],
)
def test_malformed_chunks_are_refused(body: bytes) -> None:
    with pytest.raises(HttpError):
        ChunkedDecoder().feed(body)


def test_the_engine_request_drops_hop_headers_and_carries_the_body_length() -> None:
    head = parse_request_head(
        _request(
            "POST /v1/completions HTTP/1.1\nHost: gate:8001\nConnection: keep-alive\nTransfer-Encoding: chunked\n"
            "Expect: 100-continue\nAuthorization: Bearer t\nX-Request-Id: 7"
        )
    )
    sent = request_bytes(head, "127.0.0.1:8000", b'{"prompt": "hi"}', prefix="/engine")
    text = sent.decode()
    assert text.startswith("POST /engine/v1/completions HTTP/1.1\r\nhost: 127.0.0.1:8000\r\n")
    assert "Authorization: Bearer t\r\nX-Request-Id: 7\r\n" in text  # as the client wrote them
    for dropped in ("gate:8001", "keep-alive", "chunked", "100-continue"):
        assert dropped not in text
    assert text.endswith('content-length: 16\r\n\r\n{"prompt": "hi"}')
    get = request_bytes(parse_request_head(_request("GET /metrics HTTP/1.1")), "e:1", b"")
    assert b"content-length" not in get


def test_the_engines_answer_head_keeps_its_headers_and_takes_the_gates_framing() -> None:
    answer = parse_response_head(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
        b"Connection: keep-alive\r\nKeep-Alive: timeout=5\r\ndate: d\r\n\r\n",
        "POST",
    )
    assert forward_head(answer, chunked=True) == (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ndate: d\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    assert forward_head(answer, connection="close").endswith(
        b"date: d\r\nconnection: close\r\n\r\n"
    )  # until close
    to_head = parse_response_head(b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\n", "HEAD")
    assert forward_head(to_head) == b"HTTP/1.1 200 OK\r\ncontent-length: 99\r\n\r\n"  # the length it says
    empty = parse_response_head(b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n", "DELETE")
    assert forward_head(empty) == b"HTTP/1.1 204 No Content\r\n\r\n"


def test_the_gates_own_answer_head() -> None:
    head = answer_head(
        503, [("content-type", "application/json"), ("retry-after", "7")], length=2, connection="close"
    )
    assert head == (
        b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 7\r\n"
        b"content-length: 2\r\nconnection: close\r\n\r\n"
    )


def test_headers_are_read_when_asked() -> None:
    head = parse_request_head(_request("GET / HTTP/1.1\nX-One:  a b \nx-two: 2"))
    assert head.headers == [("x-one", "a b"), ("x-two", "2")]
    assert head.header("X-Two") == "2"


def test_a_real_vllm_stream_decodes_to_its_events_however_it_is_cut() -> None:
    """The bytes a real vLLM (CPU build) sent for a streamed chat completion, split at every
    point: the content is the same, the end found, nothing after it."""
    raw = (HTTP / "chat-stream.http").read_bytes()
    end = find_head_end(raw)
    answer = parse_response_head(raw[:end], "POST")
    assert answer.chunked
    assert "text/event-stream" in answer.content_type
    body = raw[end:]
    whole = ChunkedDecoder()
    content = b"".join(whole.feed(body))
    assert (whole.done, whole.extra) == (True, b"")
    events = [line for line in content.split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]"
    assert len(events) > 10
    for cut in range(1, len(body), 37):
        decoder = ChunkedDecoder()
        assert b"".join(decoder.feed(body[:cut]) + decoder.feed(body[cut:])) == content
        assert decoder.done


def _refused_with(call: Callable[[], object]) -> int | None:
    """The status ``call`` refused with (an :class:`HttpError`), or None if it read."""
    try:
        call()
    except HttpError as error:
        return error.status
    return None


@pytest.mark.fuzz
@fuzz_settings()
@given(st.binary(max_size=400))
def test_fuzz_any_bytes_as_a_head_are_read_or_refused_never_raise_otherwise(data: bytes) -> None:
    end = find_head_end(data) if len(data) <= MAX_HEAD else -1
    for status in (
        _refused_with(lambda: parse_request_head(data[:end] if end > 0 else data)),
        _refused_with(lambda: parse_response_head(data, "GET")),
    ):
        assert status is None or 400 <= status < 600


@pytest.mark.fuzz
@fuzz_settings()
@given(st.lists(st.binary(max_size=50), max_size=8), st.lists(st.integers(1, 60), max_size=10))
def test_fuzz_any_chunked_body_cut_anywhere_decodes_to_its_content(
    pieces: list[bytes], cuts: list[int]
) -> None:
    body = _chunked(pieces) + b"rest"
    decoder = ChunkedDecoder()
    content: list[bytes] = []
    position = 0
    for size in [*cuts, len(body)]:
        if decoder.done:
            break
        content += decoder.feed(body[position : position + size])
        position += size
    assert decoder.done
    assert b"".join(content) == b"".join(pieces)


@pytest.mark.fuzz
@fuzz_settings()
@given(st.binary(max_size=300))
def test_fuzz_any_bytes_as_a_chunked_body_are_read_or_refused(data: bytes) -> None:
    assert _refused_with(lambda: ChunkedDecoder().feed(data)) in (None, 400)


def test_headers_the_connection_header_names_are_hop_by_hop_too() -> None:
    head = parse_request_head(
        _request(
            "POST / HTTP/1.1\nConnection: keep-alive, X-Hop\nX-Hop: secret\nX-Kept: 1\nContent-Length: 0"
        )
    )
    assert head.forwarded() == b"X-Kept: 1\r\n"
