"""YAML that remembers where everything came from: file:line for every error. No I/O but reading.

:func:`load_yaml` parses a file into plain Python data *and* a map from each value's path
(``("policies", 0, "when", "all", 1, "for")``) to its line, refusing duplicate keys (PyYAML
would silently keep the last). Validation code reports problems as :class:`Problem` with a
path; :func:`located` turns them into ``file:line: message`` lines.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

__all__ = ["Located", "Problem", "YamlError", "format_path", "load_yaml", "located"]

PathKey = tuple[str | int, ...]


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


def _walk(node: Node, path: PathKey, lines: dict[PathKey, int], problems: list[tuple[int, str]]) -> None:
    """Record the line of every value; report duplicate keys (PyYAML keeps the last silently)."""
    lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, MappingNode):
        seen: set[str] = set()
        for key_node, value_node in node.value:
            if not isinstance(key_node, ScalarNode):
                continue  # complex keys: the data itself is refused elsewhere
            key = key_node.value
            if key == "<<":
                continue  # a merge key: its values keep the anchor's lines
            if key in seen:
                problems.append(
                    (key_node.start_mark.line + 1, f"{format_path((*path, key))}: duplicate key '{key}'")
                )
            seen.add(key)
            child: PathKey = (*path, int(key) if key.isdigit() else key)
            _walk(value_node, child, lines, problems)
            if key.isdigit():
                _walk(value_node, (*path, key), lines, problems)
    elif isinstance(node, SequenceNode):
        for index, item in enumerate(node.value):
            _walk(item, (*path, index), lines, problems)


def load_yaml(path: str | Path, text: str | None = None) -> Located:
    """Parse ``path`` (or ``text`` named by it). Raises :class:`YamlError` on syntax errors,
    values YAML cannot build, and duplicate keys, each ``file:line: message``."""
    name = str(path)
    if text is None:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise YamlError(f"{name}: no such file") from None
        except (OSError, UnicodeDecodeError) as error:
            raise YamlError(f"{name}: cannot read: {error}") from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.load(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        line = mark.line + 1 if mark is not None else 1
        problem = getattr(error, "problem", None) or str(error)
        raise YamlError(f"{name}:{line}: YAML syntax error: {problem}") from None
    except (TypeError, ValueError, RecursionError) as error:  # e.g. a list as a mapping key
        raise YamlError(f"{name}: YAML that cannot be read as data: {error}") from None
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
