"""YAML that remembers where everything came from: file:line for every error. No I/O but reading.

:func:`load_yaml` parses a file into plain Python data *and* a map from each value's path
(``("policies", 0, "when", "all", 1, "for")``) to its line, refusing duplicate keys (PyYAML
would silently keep the last). Validation code reports problems as :class:`Problem` with a
path; :func:`located` turns them into ``file:line: message`` lines.

Anchors, aliases (``&x``, ``*x``) and merge keys (``<<``) are refused while the file is parsed,
before any node is composed: nested aliases expand exponentially when the data is built (a
400-byte file can cost gigabytes), and no file of tunerd's needs them. :func:`dump_yaml` writes
data without them, so what tunerd writes it can read back.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from yaml.events import AliasEvent, NodeEvent, ScalarEvent
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode
from yaml.reader import ReaderError

__all__ = [
    "Located",
    "NoAliasDumper",
    "Problem",
    "YamlError",
    "dump_yaml",
    "format_path",
    "load_yaml",
    "located",
]

PathKey = tuple[str | int, ...]
MAX_DEPTH = 100  # levels of nesting; a policy's conditions nest a few
MAX_BYTES = 16 * 1024 * 1024  # a config, policy or test file is kilobytes; this is no such file
ANCHORS_REFUSED = "YAML anchors and aliases (&x, *x) are not accepted: write the values out"
MERGE_REFUSED = "YAML merge keys (<<) are not accepted: write the values out"


class YamlError(ValueError):
    """The file could not be read or parsed; the message starts with ``file:line:``."""


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a file's content, at a path inside it."""

    path: PathKey
    message: str
    context: str = ""  # e.g. "policy 'kv-pool-saturated'"
    shown_from: int = 0  # the path is printed from this depth (relative to the context)


@dataclass(frozen=True)
class Located:
    """Parsed data and the line of every path in it."""

    file: str
    data: Any
    lines: dict[PathKey, int]

    def line_of(self, path: PathKey) -> int:
        """The line of ``path``, or of its nearest ancestor the file has."""
        for length in range(len(path), -1, -1):
            line = self.lines.get(path[:length])
            if line is not None:
                return line
        return 1


def format_path(path: Sequence[str | int]) -> str:
    """``("when", "all", 0, "for")`` → ``when.all[0].for``."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


class _Refused(Exception):
    def __init__(self, line: int, message: str) -> None:
        super().__init__(message)
        self.line, self.message = line, message


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing an anchor, an alias or a merge key at the event that
    brings it, before it is composed into a node (let alone expanded into data), and nesting
    deeper than :data:`MAX_DEPTH`."""

    depth = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        event = self.peek_event()  # type: ignore[no-untyped-call]
        line = event.start_mark.line + 1
        if isinstance(event, AliasEvent) or (isinstance(event, NodeEvent) and event.anchor is not None):
            raise _Refused(line, ANCHORS_REFUSED)
        if isinstance(event, ScalarEvent) and event.value == "<<" and event.implicit[0]:
            raise _Refused(line, MERGE_REFUSED)
        if self.depth >= MAX_DEPTH:
            raise _Refused(line, f"nested too deeply (more than {MAX_DEPTH} levels)")
        self.depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


class NoAliasDumper(yaml.SafeDumper):
    """PyYAML's safe dumper, writing a value shared by two places out twice (PyYAML would write
    an anchor and an alias, which :func:`load_yaml` refuses)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def dump_yaml(data: Any, **options: Any) -> str:
    """``data`` as YAML that :func:`load_yaml` reads back: no anchors or aliases."""
    return yaml.dump(data, Dumper=NoAliasDumper, **options)  # type: ignore[no-any-return]


def _walk(node: Node, path: PathKey, lines: dict[PathKey, int], problems: list[tuple[int, str]]) -> None:
    """Record the line of every value; report duplicate keys (PyYAML keeps the last silently)."""
    lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, MappingNode):
        seen: set[str] = set()
        for key_node, value_node in node.value:
            if not isinstance(key_node, ScalarNode):
                continue  # complex keys: the data itself is refused elsewhere
            key = key_node.value
            if key in seen:
                problems.append(
                    (key_node.start_mark.line + 1, f"{format_path((*path, key))}: duplicate key '{key}'")
                )
            seen.add(key)
            number = key.isascii() and key.isdigit()  # "²".isdigit() too, and int() refuses it
            child: PathKey = (*path, int(key) if number else key)
            _walk(value_node, child, lines, problems)
            if number:
                _walk(value_node, (*path, key), lines, problems)
    elif isinstance(node, SequenceNode):
        for index, item in enumerate(node.value):
            _walk(item, (*path, index), lines, problems)


def load_yaml(path: str | Path, text: str | None = None) -> Located:
    """Parse ``path`` (or ``text`` named by it). Raises :class:`YamlError` on syntax errors,
    values YAML cannot build, anchors, aliases and merge keys, and duplicate keys, each
    ``file:line: message``."""
    name = str(path)
    if text is None:
        text = _read(path)
    loader: _Loader | None = None
    try:
        loader = _Loader(text)  # the reader refuses unprintable characters here
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except _Refused as refused:
        raise YamlError(f"{name}:{refused.line}: {refused.message}") from None
    except ReaderError as error:  # a character YAML refuses (NUL, a control character)
        line = text.count("\n", 0, error.position) + 1
        code = error.character if isinstance(error.character, int) else ord(str(error.character)[:1] or "?")
        raise YamlError(f"{name}:{line}: YAML does not accept the character #x{code:04x}") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        line = mark.line + 1 if mark is not None else 1
        problem = getattr(error, "problem", None) or str(error)
        raise YamlError(f"{name}:{line}: YAML syntax error: {problem}") from None
    except (TypeError, ValueError, RecursionError) as error:  # e.g. a list as a mapping key
        raise YamlError(f"{name}: YAML that cannot be read as data: {error}") from None
    finally:
        if loader is not None:
            loader.dispose()
    lines: dict[PathKey, int] = {}
    problems: list[tuple[int, str]] = []
    if node is not None:
        try:
            _walk(node, (), lines, problems)
        except RecursionError:
            raise YamlError(f"{name}: nested too deeply") from None
    if problems:
        raise YamlError("\n".join(f"{name}:{line}: {message}" for line, message in problems))
    return Located(name, data, lines)


def _read(path: str | Path) -> str:
    """The text of a regular file of at most :data:`MAX_BYTES`. Opened without blocking and
    checked before it is read: a FIFO or ``/dev/zero`` would hang the reader."""
    name = str(path)
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise YamlError(f"{name}: no such file") from None
    except (OSError, ValueError) as error:  # ValueError: a NUL in the name
        raise YamlError(f"{name}: cannot read: {error}") from None
    try:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            raise YamlError(f"{name}: not a regular file")
        with os.fdopen(descriptor, "rb", closefd=False) as file:
            raw = file.read(MAX_BYTES + 1)
    except OSError as error:
        raise YamlError(f"{name}: cannot read: {error}") from None
    finally:
        os.close(descriptor)
    if len(raw) > MAX_BYTES:
        raise YamlError(f"{name}: larger than {MAX_BYTES // (1024 * 1024)} MiB: not a file tunerd reads")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise YamlError(f"{name}: cannot read: {error}") from None


def located(source: Located, problems: Sequence[Problem]) -> list[str]:
    """``file:line: context: path: message`` for each problem, in file order."""
    rendered = []
    for problem in problems:
        line = source.line_of(problem.path)
        where = format_path(problem.path[problem.shown_from :])
        parts = [f"{source.file}:{line}"]
        if problem.context:
            parts.append(problem.context)
        parts.append(f"{where}: {problem.message}" if where else problem.message)
        rendered.append((line, ": ".join(parts)))
    return [text for _, text in sorted(rendered, key=lambda item: item[0])]
