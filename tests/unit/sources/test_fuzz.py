"""Property tests: random and mutated pages, logs and nvidia-smi answers never crash a parser."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tunerd.diagnosis import diagnose
from tunerd.sources.smi import CommandResult, SmiError, SmiSource, parse_compute_apps, parse_query_gpu
from tunerd.sources.vllm_metrics import MetricsSnapshot, parse

DATA = Path(__file__).parents[2] / "data"
PAGES = [path.read_text() for path in sorted((DATA / "vllm-excerpts").glob("*.txt"))]
PAGES += [path.read_text() for path in sorted((DATA / "vllm").glob("metrics-*.txt"))]
LOGS = [path.read_text() for path in sorted((DATA / "vllm-failures").glob("*.log"))]
LOGS += [path.read_text() for path in sorted((DATA / "vllm").glob("*.log"))]
SMI = [path.read_text() for path in sorted((DATA / "nvidia-smi").glob("*.csv"))]

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def mutated(draw: st.DrawFn, corpus: Sequence[str]) -> str:
    """A recorded text with random lines dropped, duplicated, cut, or sprinkled with junk."""
    lines = draw(st.sampled_from(corpus)).splitlines()
    for _ in range(draw(st.integers(0, 8))):
        if not lines:
            break
        index = draw(st.integers(0, len(lines) - 1))
        action = draw(st.sampled_from(["drop", "dup", "cut", "junk", "swap"]))
        if action == "drop":
            del lines[index]
        elif action == "dup":
            lines.insert(index, lines[index])
        elif action == "cut":
            lines[index] = lines[index][: draw(st.integers(0, len(lines[index])))]
        elif action == "junk":
            position = draw(st.integers(0, len(lines[index])))
            lines[index] = lines[index][:position] + draw(st.text(max_size=12)) + lines[index][position:]
        else:
            other = draw(st.integers(0, len(lines) - 1))
            lines[index], lines[other] = lines[other], lines[index]
    return "\n".join(lines)


@FUZZ
@given(st.text())
def test_parse_random_text_never_raises(text: str) -> None:
    assert isinstance(parse(text), MetricsSnapshot)


@FUZZ
@given(mutated(PAGES))
def test_parse_mutated_pages_never_raise(text: str) -> None:
    snapshot = parse(text)
    if snapshot.kv_cache_usage is not None:
        assert snapshot.kv_cache_usage == snapshot.kv_cache_usage  # never NaN


@FUZZ
@given(st.sampled_from(list("<{[\x00!@%")), st.text())
def test_parse_junk_first_line_reported(first: str, rest: str) -> None:
    assert parse(first + rest).problems


@FUZZ
@given(st.lists(st.text(), max_size=30), st.one_of(st.none(), st.integers(-20, 300)))
def test_diagnose_random_lines_never_raise(lines: list[str], exit_code: int | None) -> None:
    result = diagnose(lines, exit_code=exit_code)
    if result.crash is not None:
        assert result.crash.phase in {"startup", "runtime"}


@FUZZ
@given(mutated(LOGS), st.one_of(st.none(), st.integers(-20, 300)))
def test_diagnose_mutated_logs_never_raise(text: str, exit_code: int | None) -> None:
    diagnose(text.splitlines(), exit_code=exit_code)


@FUZZ
@given(st.one_of(st.text(), mutated(SMI)))
def test_smi_parsers_raise_only_smi_error(text: str) -> None:
    for parser in (parse_query_gpu, parse_compute_apps):
        with contextlib.suppress(SmiError):
            parser(text, fields=None)


@FUZZ
@given(st.integers(0, 255), st.text(), st.text())
def test_smi_source_never_raises(code: int, stdout: str, stderr: str) -> None:
    def runner(argv: Sequence[str], timeout: float) -> CommandResult:
        return CommandResult(code, stdout, stderr)

    reading = SmiSource(runner=runner).sample()
    assert reading.status in {"ok", "no_gpu", "driver_gone", "library_missing", "error"}
