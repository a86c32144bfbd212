"""The repository stands alone (issue 21): every link in the README and docs/ reaches a file of
the repository, and every `#anchor` a heading of it (GitHub's slugs); nothing points at design
notes the repository does not hold."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "CHANGELOG.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```")


def _prose(path: Path) -> list[str]:
    """The lines outside code blocks."""
    lines, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped but for ``-`` and ``_``,
    each space a ``-``."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link's words
    text = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    found: set[str] = set()
    for line in _prose(path):
        if line.startswith("#"):
            base = slug(line.lstrip("#"))
            name, n = base, 1
            while name in found:  # a repeated heading: -1, -2 …
                name, n = f"{base}-{n}", n + 1
            found.add(name)
    return found


def test_the_slug_is_githubs() -> None:
    assert slug("`tunerd status --json`") == "tunerd-status---json"
    assert slug("Output (`--json`)") == "output---json"
    assert slug("A real incident as a policy test") == "a-real-incident-as-a-policy-test"


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_link_reaches_the_repository(doc: Path) -> None:
    broken = []
    for line in _prose(doc):
        if "DESIGN §" in line or "../shared" in line:
            broken.append(f"{doc.name}: cites what the repository does not hold: {line.strip()[:80]}")
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            where = (doc.parent / file).resolve() if file else doc
            if not where.exists():
                broken.append(f"{doc.name}: {target}: no such file")
            elif anchor and where.suffix == ".md" and anchor not in _anchors(where):
                broken.append(f"{doc.name}: {target}: no heading #{anchor} in {where.name}")
    assert not broken, "\n".join(broken)
