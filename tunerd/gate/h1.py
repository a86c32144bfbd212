"""HTTP/1.1 framing for the gate's data path: heads parsed, bodies framed, heads built. Pure.

The gate forwards bytes; it reads of them only what it must: a request's head and body (to
count its need), an answer's head (its status, its framing) and, for a stream, where it ends
and what its events say. This module is that reading, with no sockets: each function takes
bytes and returns values, or raises :class:`HttpError` with the status the client should get.

What it accepts is deliberately narrow (RFC 9112): origin-form targets, ``Content-Length`` or
``Transfer-Encoding: chunked`` (never both), no obsolete line folding, no whitespace before a
header's colon, heads up to :data:`MAX_HEAD` bytes. Everything ambiguous is refused rather
than guessed, so no request means one thing to the gate and another to the engine behind it
(request smuggling).
"""

from __future__ import annotations

import functools
import json
import re

__all__ = [
    "ERROR_HEADERS",
    "HOP_HEADERS",
    "MAX_HEAD",
    "ChunkedDecoder",
    "HttpError",
    "RequestHead",
    "ResponseHead",
    "answer_head",
    "error_body",
    "find_head_end",
    "forward_head",
    "parse_request_head",
    "parse_response_head",
    "request_bytes",
]

MAX_HEAD = 65536  # a request's or an answer's head, request line and headers together
MAX_CHUNK_LINE = 4096  # a chunk-size line, its extensions included
MAX_TRAILERS = 65536  # the trailer section after the last chunk
# Hop-by-hop headers (RFC 9110 §7.6.1) and those the gate recomputes: never forwarded.
HOP_HEADERS = frozenset(
    {
        "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
        "te", "trailer", "transfer-encoding", "upgrade", "host", "content-length", "expect",
    }
)  # fmt: skip
_REQUEST_LINE = re.compile(rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+) (/[^\x00-\x20\x7f]*) HTTP/1\.([01])")
_NAME = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# a header line: a token, a colon, a value of no CR, LF or NUL (its edges' blanks not its own)
_FIELD = re.compile(rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+):[ \t]*([^\r\n\x00]*?)[ \t]*\r\n")
_BLOCK = re.compile(rb"(?:[!#$%&'*+\-.^_`|~0-9A-Za-z]+:[^\r\n\x00]*\r\n)*")
# the header lines the framing is read from
_SPECIAL = re.compile(
    rb"(?im)^(content-length|transfer-encoding|connection|expect|content-type):[ \t]*([^\r\n]*?)[ \t]*\r\n"
)
_HOP_LINES = re.compile(rb"(?im)^(?:" + "|".join(sorted(HOP_HEADERS)).encode() + rb"):[^\r\n]*\r\n")
_NO_BODY = frozenset({"GET", "HEAD", "DELETE", "OPTIONS"})
_PLAIN_CONNECTION = frozenset({",", ",close,", ",keep-alive,"})  # Connection options that name no header


@functools.lru_cache(maxsize=16)
def _header_pattern(name: str) -> re.Pattern[bytes]:
    return re.compile(rb"(?im)^" + re.escape(name.encode("latin-1")) + rb":[ \t]*([^\r\n]*?)[ \t]*\r\n")


_REASONS = {
    100: "Continue", 200: "OK", 400: "Bad Request", 404: "Not Found", 408: "Request Timeout",
    413: "Content Too Large", 417: "Expectation Failed", 429: "Too Many Requests",
    431: "Request Header Fields Too Large", 500: "Internal Server Error", 501: "Not Implemented",
    502: "Bad Gateway", 503: "Service Unavailable", 505: "HTTP Version Not Supported",
}  # fmt: skip


class HttpError(ValueError):
    """A head or body the gate will not read; ``status`` is the answer the peer gets."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Head:
    """The header section of a head: its lines as they came (validated, each ending in CRLF),
    read further only when asked; ``connection`` is its Connection header's options, as
    ``,token,token,``."""

    __slots__ = ("block", "connection")

    def __init__(self, block: bytes, connection: str = ",") -> None:
        self.block = block
        self.connection = connection

    @property
    def headers(self) -> list[tuple[str, str]]:
        """Every header, names lower-case, values trimmed."""
        return [
            (name.decode("ascii").lower(), value.decode("latin-1"))
            for name, value in _FIELD.findall(self.block)
        ]

    def header(self, name: str) -> str | None:
        """The first value of header ``name``, or None."""
        found = _header_pattern(name).search(self.block)
        return None if found is None else found.group(1).decode("latin-1")

    def forwarded(self) -> bytes:
        """The header lines without the hop-by-hop ones (RFC 9110 §7.6.1: those named by
        Connection too) and those the gate sets itself."""
        lines = _HOP_LINES.sub(b"", self.block)
        if self.connection in _PLAIN_CONNECTION:
            return lines
        named = {token for token in self.connection.split(",") if token} - {"close", "keep-alive"}
        if named:
            names = "|".join(re.escape(token) for token in sorted(named)).encode("latin-1")
            lines = re.sub(rb"(?im)^(?:" + names + rb"):[^\r\n]*\r\n", b"", lines)
        return lines


class RequestHead(_Head):
    """A request's head, as the client sent it."""

    __slots__ = ("chunked", "content_length", "expect_continue", "keep_alive", "method", "target", "version")

    def __init__(
        self,
        *,
        method: str,
        target: str,
        version: int,
        block: bytes,
        content_length: int | None,
        chunked: bool,
        keep_alive: bool,
        expect_continue: bool,
        connection: str = ",",
    ) -> None:
        super().__init__(block, connection)
        self.method = method
        self.target = target
        self.version = version  # 10 or 11
        self.content_length = content_length  # None: chunked
        self.chunked = chunked
        self.keep_alive = keep_alive
        self.expect_continue = expect_continue

    @property
    def path(self) -> str:
        return self.target.partition("?")[0]


class ResponseHead(_Head):
    """An answer's head. ``length`` is the body's size when known; ``chunked`` and
    ``until_close`` say how it ends otherwise; ``bodiless`` answers (to HEAD, 204, 304, 1xx)
    have none, whatever their headers say."""

    __slots__ = (
        "bodiless", "chunked", "content_type", "keep_alive", "length", "reason", "status", "until_close",
    )  # fmt: skip

    def __init__(
        self,
        *,
        status: int,
        reason: str,
        block: bytes,
        length: int | None,
        chunked: bool,
        until_close: bool,
        keep_alive: bool,
        bodiless: bool,
        content_type: str,
        connection: str = ",",
    ) -> None:
        super().__init__(block, connection)
        self.status = status
        self.reason = reason
        self.length = length
        self.chunked = chunked
        self.until_close = until_close
        self.keep_alive = keep_alive
        self.bodiless = bodiless
        self.content_type = content_type


def find_head_end(buffer: bytes | bytearray, start: int = 0) -> int:
    """Where the head that begins at ``start`` in ``buffer`` ends (the index after its blank
    line), or -1 if not yet; :class:`HttpError` 431 when none ends within :data:`MAX_HEAD`
    bytes."""
    end = buffer.find(b"\r\n\r\n", start)
    if end < 0:
        if len(buffer) - start > MAX_HEAD:
            raise HttpError(431, f"the head is larger than {MAX_HEAD:,} bytes")
        return -1
    if end + 4 - start > MAX_HEAD:
        raise HttpError(431, f"the head is larger than {MAX_HEAD:,} bytes")
    return end + 4


def _refuse_block(block: bytes) -> None:
    """Why a header section is not one: its first bad line named."""
    for line in block.split(b"\r\n"):
        if line and _BLOCK.fullmatch(line + b"\r\n") is None:
            name, colon, _ = line.partition(b":")
            if not colon or not name:
                raise HttpError(400, f"a header line without a name: {_shown(line)}")
            if _NAME.fullmatch(name) is None:
                # whitespace before the colon (RFC 9112 §5.1), a folded line, or junk
                raise HttpError(400, f"a header name that is not a token: {_shown(name)}")
            raise HttpError(400, f"a control character in header {_shown(name)}")
    raise HttpError(400, "a malformed header section")


def _framing(block: bytes) -> tuple[int | None, bool, str, str | None, str]:
    """What the header section says of the message's framing, each ambiguity refused: its
    length (or None), whether chunked, its Connection tokens, its Expect and its Content-Type.
    One pass of a compiled pattern over the lines that matter, after one that checks them all."""
    if _BLOCK.fullmatch(block) is None:
        _refuse_block(block)
    lengths: set[bytes] = set()
    codings: list[bytes] = []
    connection = ""
    expect = None
    content_type = ""
    for name, value in _SPECIAL.findall(block):
        key = name.lower()
        if key == b"content-length":
            lengths.add(value)
        elif key == b"transfer-encoding":
            codings.append(value)
        elif key == b"connection":
            connection += "," + value.decode("latin-1").lower().replace(" ", "")
        elif key == b"expect":
            expect = expect or value.decode("latin-1").lower()
        elif not content_type:
            content_type = value.decode("latin-1")
    if codings:
        if lengths:
            raise HttpError(400, "both Transfer-Encoding and Content-Length")
        coding = b",".join(codings).replace(b" ", b"").lower().decode("latin-1")
        if coding != "chunked":
            raise HttpError(501, f"Transfer-Encoding {coding[:40]!r} (only chunked is read)")
        return None, True, connection + ",", expect, content_type
    length = None
    if lengths:
        if len(lengths) > 1:
            raise HttpError(400, "Content-Length given twice, differently")
        (text,) = lengths
        if not text.isdigit() or len(text) > 18:
            raise HttpError(400, f"Content-Length is not a number: {_shown(text)}")
        length = int(text)
    return length, False, connection + ",", expect, content_type


def _shown(data: bytes) -> str:
    text = data[:60].decode("latin-1")
    return repr(text + ("…" if len(data) > 60 else ""))


def _refuse_request_line(first: bytes) -> None:
    """Why a request line is not one."""
    parts = first.split(b" ")
    if len(parts) != 3:
        raise HttpError(400, f"a malformed request line: {_shown(first)}")
    method, target, version = parts
    if not method or _NAME.fullmatch(method) is None:
        raise HttpError(400, f"a malformed method: {_shown(method)}")
    if version.startswith(b"HTTP/") and version not in (b"HTTP/1.1", b"HTTP/1.0"):
        raise HttpError(505, f"{_shown(version)} (the gate speaks HTTP/1.1 and 1.0)")
    if version not in (b"HTTP/1.1", b"HTTP/1.0"):
        raise HttpError(400, f"a malformed request line: {_shown(first)}")
    raise HttpError(400, f"a request target the gate does not take: {_shown(target)} (origin-form only)")


def parse_request_head(head: bytes) -> RequestHead:
    """A request's head (through its blank line), read strictly."""
    first, _, block = head.partition(b"\r\n")
    block = block[:-2] if block.endswith(b"\r\n") else block  # the blank line's CRLF
    if not first:
        raise HttpError(400, "an empty request")
    line = _REQUEST_LINE.fullmatch(first)
    if line is None:
        _refuse_request_line(first)
    method, target, minor = line.groups()  # type: ignore[union-attr]
    number = 11 if minor == b"1" else 10
    length, chunked, tokens, expect, _ = _framing(block)
    keep_alive = ",close," not in tokens if number == 11 else ",keep-alive," in tokens
    if expect is not None and expect != "100-continue":
        raise HttpError(417, f"Expect: {expect[:30]!r} (only 100-continue is met)")
    return RequestHead(
        method=method.decode("ascii"),
        target=target.decode("latin-1"),
        version=number,
        block=block,
        content_length=length if length is not None else (None if chunked else 0),
        chunked=chunked,
        keep_alive=keep_alive,
        expect_continue=expect == "100-continue",
        connection=tokens,
    )


def parse_response_head(head: bytes, method: str) -> ResponseHead:
    """An answer's head (through its blank line) to a request of ``method``."""
    first, _, block = head.partition(b"\r\n")
    block = block[:-2] if block.endswith(b"\r\n") else block
    if not first:
        raise HttpError(502, "an empty answer")
    version, _, rest = first.partition(b" ")
    code, _, reason = rest.partition(b" ")
    if version not in (b"HTTP/1.1", b"HTTP/1.0") or len(code) != 3 or not code.isdigit():
        raise HttpError(502, f"a malformed status line: {_shown(first)}")
    status = int(code)
    length, chunked, tokens, _, content_type = _framing(block)
    keep_alive = ",close," not in tokens if version == b"HTTP/1.1" else ",keep-alive," in tokens
    bodiless = method == "HEAD" or status in (204, 304) or 100 <= status < 200
    until_close = not bodiless and length is None and not chunked
    return ResponseHead(
        status=status,
        reason=reason.decode("latin-1"),
        block=block,
        length=0 if bodiless else length,
        chunked=chunked and not bodiless,
        until_close=until_close,
        keep_alive=keep_alive and not until_close,
        bodiless=bodiless,
        content_type=content_type,
        connection=tokens,
    )


class ChunkedDecoder:
    """A chunked body's framing, read as it comes: :meth:`feed` takes the bytes that arrived
    and returns the payload they carry; :attr:`done` once the last chunk and its trailers
    have passed, and :attr:`extra` holds what came after (the next message's bytes)."""

    __slots__ = ("_left", "_line", "_state", "done", "extra")

    def __init__(self) -> None:
        self._state = 0  # 0: a size line, 1: data, 2: the CRLF after data, 3: trailers
        self._left = 0
        self._line = b""
        self.done = False
        self.extra = b""

    def feed(self, data: bytes) -> list[bytes]:
        payload: list[bytes] = []
        position = 0
        size = len(data)
        while position < size and not self.done:
            if self._state == 1:  # data: take what there is
                take = min(self._left, size - position)
                payload.append(data[position : position + take])
                position += take
                self._left -= take
                if not self._left:
                    self._state = 2
                continue
            end = data.find(b"\n", position)
            if end < 0:
                self._line += data[position:]
                limit = MAX_TRAILERS if self._state == 3 else MAX_CHUNK_LINE
                if len(self._line) > limit:
                    raise HttpError(400, "a chunk-size line (or trailer) without an end")
                break
            line = self._line + data[position:end]
            self._line = b""
            position = end + 1
            if line.endswith(b"\r"):
                line = line[:-1]
            else:
                raise HttpError(400, "a chunk line not ended by CRLF")
            if self._state == 2:
                if line:
                    raise HttpError(400, "chunk data longer than its size")
                self._state = 0
            elif self._state == 0:
                text = line.split(b";", 1)[0].strip(b" \t")
                if not text or len(text) > 16 or any(c not in b"0123456789abcdefABCDEF" for c in text):
                    raise HttpError(400, f"a malformed chunk size: {_shown(line)}")
                self._left = int(text, 16)
                self._state = 1 if self._left else 3
            elif not line:  # state 3: the blank line after the trailers ends the body
                self.done = True
        if self.done:
            self.extra = data[position:]
        return payload


def _head_lines(headers: list[tuple[str, str]]) -> list[bytes]:
    return [f"{key}: {value}\r\n".encode("latin-1") for key, value in headers]


def request_bytes(head: RequestHead, host: str, body: bytes, *, prefix: str = "") -> bytes:
    """The request as the gate sends it to the engine: hop-by-hop headers dropped, ``Host``
    the engine's, the target under the engine URL's path ``prefix``, the body whole with its
    length (a chunked one arrives decoded)."""
    length = b"content-length: %d\r\n" % len(body) if body or head.method not in _NO_BODY else b""
    start = f"{head.method} {prefix}{head.target} HTTP/1.1\r\nhost: {host}\r\n".encode("latin-1")
    return b"".join((start, head.forwarded(), length, b"\r\n", body))


def forward_head(
    answer: ResponseHead, *, length: int | None = None, chunked: bool = False, connection: str | None = None
) -> bytes:
    """The engine's answer head as the client gets it: its own headers but the hop-by-hop
    ones, then the framing the gate sends the body with (``length``, ``chunked``, or neither:
    until close), and the gate's ``Connection`` header to the client (``close``,
    ``keep-alive``, or none). A bodiless answer keeps the length it says (a HEAD's)."""
    if answer.bodiless:
        said = answer.header("content-length")
        framing = (
            b"" if said is None or answer.status in (204, 304) else f"content-length: {said}\r\n".encode()
        )
    elif length is not None:
        framing = b"content-length: %d\r\n" % length
    else:
        framing = b"transfer-encoding: chunked\r\n" if chunked else b""
    start = f"HTTP/1.1 {answer.status} {answer.reason or _REASONS.get(answer.status, 'Unknown')}\r\n"
    return b"".join(
        (
            start.encode("latin-1"),
            answer.forwarded(),
            framing,
            f"connection: {connection}\r\n".encode("latin-1") if connection else b"",
            b"\r\n",
        )
    )


ERROR_HEADERS = [("content-type", "application/json"), ("x-tunerd-gate", "1")]  # the gate's own answers


def error_body(status: int, message: str, kind: str) -> bytes:
    """The body of an answer of the gate's own, shaped as vLLM's errors are (OpenAI's ``error``
    object)."""
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}}).encode()


def answer_head(
    status: int,
    headers: list[tuple[str, str]],
    *,
    length: int | None = None,
    connection: str | None = None,
) -> bytes:
    """The head of an answer of the gate's own: ``headers`` (lower-case names, no framing of
    their own), its ``length``, and its ``Connection`` header (``close``, ``keep-alive``, or
    none)."""
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\n".encode("latin-1")]
    lines += _head_lines(headers)
    if length is not None:
        lines.append(b"content-length: %d\r\n" % length)
    if connection:
        lines.append(f"connection: {connection}\r\n".encode("latin-1"))
    lines.append(b"\r\n")
    return b"".join(lines)
