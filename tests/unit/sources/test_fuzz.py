"""Fuzz tier (issue 16) of what reads an engine's and a driver's text: /metrics pages, engine
logs (following and passing through), their diagnosis and nvidia-smi's CSV.

Inputs are random text and structural mutations of the recorded real inputs in tests/data
(:func:`tests.fuzzing.mutated`), plus generated lines in each format with hostile numbers.
Each property asserts that only the module's documented error escapes (none, for most) and
that every number that comes out is finite and in range — what the policies and the status
JSON rely on. ``make test`` runs 100 cases each; ``make fuzz`` 10,000.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzzing import NASTY, fuzz_settings, mutated
from tunerd.diagnosis import CRASH_KINDS, LogDiagnosis, diagnose
from tunerd.gpu import GpuReading, GpuSample
from tunerd.sources.engine_log import PASSTHROUGH, FileFollower, LogTail, PipeReader, passed_through
from tunerd.sources.smi import (
    APP_FIELDS,
    GPU_FIELDS,
    CommandResult,
    SmiError,
    SmiSource,
    parse_compute_apps,
    parse_processes_xml,
    parse_query_gpu,
)
from tunerd.sources.vllm_metrics import WANTED, EngineMetrics, MetricsSnapshot, parse

pytestmark = pytest.mark.fuzz

DATA = Path(__file__).parents[2] / "data"
PAGES = [path.read_text() for path in sorted((DATA / "vllm-excerpts").glob("*.txt"))]
PAGES += [path.read_text() for path in sorted((DATA / "vllm").glob("metrics-*.txt"))]
LOGS = [path.read_text() for path in sorted((DATA / "vllm-failures").glob("*.log"))]
LOGS += [path.read_text() for path in sorted((DATA / "vllm").glob("*.log"))]
SMI_CSV = [path.read_text() for path in sorted((DATA / "nvidia-smi").glob("*.csv"))]
SMI_XML = [path.read_text() for path in sorted((DATA / "nvidia-smi").glob("*.xml"))]
SMI_ALL = SMI_CSV + SMI_XML + [path.read_text() for path in sorted((DATA / "nvidia-smi").glob("*.txt"))]
# The recorded lines that carry numbers diagnosis reads, one corpus entry each, so that the
# mutations (a number swapped for 1.2.3, 1e400, ², …) land on them rather than on the
# hundreds of other lines of a whole log.
FIGURE_LINES = sorted(
    {
        line
        for log in LOGS
        for line in log.splitlines()
        if any(
            marker in line
            for marker in (
                "took",
                "KV cache",
                "Tried to allocate",
                "memory in use",
                "estimated maximum",
                "GPU blocks",
                "concurrency",
            )
        )
    }
)
assert PAGES
assert LOGS
assert SMI_CSV
assert FIGURE_LINES

LEVELS = {"debug", "info", "warning", "error", "critical"}
SMI_STATUSES = {"ok", "no_gpu", "driver_gone", "library_missing", "error"}

# A number in any spelling a hostile or broken writer could produce.
numbers = st.one_of(
    st.sampled_from(NASTY),
    st.integers(-(10**30), 10**30).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(alphabet="0123456789.,-+eE_", max_size=12),
)


@st.composite
def one_number_made_hostile(draw: st.DrawFn, lines: Sequence[str]) -> str:
    """A recorded line with one of its numbers (``14.99``, ``567,978``) swapped for a hostile
    one: the parser's number syntax is hit on every case, not one in many."""
    line = draw(st.sampled_from(list(lines)))
    spans = [match.span() for match in re.finditer(r"[0-9][0-9.,]*", line)]
    if not spans:
        return line
    start, end = draw(st.sampled_from(spans))
    return line[:start] + draw(numbers) + line[end:]


def _json(data: dict[str, Any]) -> None:
    """What the status socket and ``--json`` print: strict JSON, so no NaN or Infinity."""
    json.dumps(data, allow_nan=False)


# /metrics -------------------------------------------------------------------------------


def _check_metrics(snapshot: MetricsSnapshot) -> None:
    """Every figure a policy or the store may read is finite, in range and fits a float."""
    _json(snapshot.to_dict())
    rows: list[MetricsSnapshot | EngineMetrics] = [snapshot, *snapshot.engines]
    for row in rows:
        usage = row.kv_cache_usage
        assert usage is None or 0 <= usage <= 1
        utilization = row.gpu_memory_utilization
        assert utilization is None or 0 < utilization <= 1
        for name in ("num_requests_running", "num_requests_waiting", "num_requests_waiting_capacity"):
            count = getattr(row, name)
            assert count is None or (isinstance(count, int) and count >= 0), (name, count)
        for name in ("kv_cache_size_tokens", "num_gpu_blocks", "block_size"):
            count = getattr(row, name)
            assert count is None or (isinstance(count, int) and count >= 0), (name, count)
        for name in (
            "num_requests_running",
            "num_requests_waiting",
            "num_requests_waiting_capacity",
            "num_preemptions_total",
            "prompt_tokens_total",
            "generation_tokens_total",
            "kv_cache_size_tokens",
        ):
            value = getattr(row, name)
            assert value is None or (math.isfinite(float(value)) and value >= 0), (name, value)
    assert all(isinstance(count, int) and count > 0 for count in snapshot.dropped.values())


@fuzz_settings()
@given(st.text())
def test_parse_random_text_never_raises(text: str) -> None:
    _check_metrics(parse(text))


@fuzz_settings()
@given(mutated(PAGES))
def test_parse_mutated_pages_finite_and_in_range(text: str) -> None:
    _check_metrics(parse(text))


@st.composite
def metric_lines(draw: st.DrawFn) -> str:
    """Lines of the families tunerd reads, with hostile values and ``cache_config_info``
    labels, for up to three data-parallel engines."""
    lines = []
    for _ in range(draw(st.integers(1, 12))):
        name = draw(st.sampled_from(sorted(WANTED)))
        labels = {"engine": draw(st.sampled_from(["0", "1", "2"]))}
        if name == "vllm:cache_config_info":
            for key in ("gpu_memory_utilization", "num_gpu_blocks", "block_size", "kv_cache_size_tokens"):
                labels[key] = draw(st.one_of(st.just("None"), numbers))
        elif name == "vllm:num_requests_waiting_by_reason":
            labels["reason"] = draw(st.sampled_from(["capacity", "deferred"]))
        rendered = ",".join(f'{key}="{value}"' for key, value in labels.items())
        lines.append(f"{name}{{{rendered}}} {draw(numbers)}")
    return "\n".join(lines)


@fuzz_settings()
@given(metric_lines())
def test_parse_hostile_values_finite_and_in_range(text: str) -> None:
    _check_metrics(parse(text))


@fuzz_settings()
@given(st.sampled_from(list("<{[\x00!@%")), st.text())
def test_parse_junk_first_line_reported(first: str, rest: str) -> None:
    assert parse(first + rest).problems


# Engine logs: what passes into tunerd's log, the tail, the followers -------------------------


@fuzz_settings()
@given(mutated(LOGS))
def test_passed_through_and_tail_on_mutated_logs(text: str) -> None:
    lines = text.splitlines()
    for line in lines:
        for mode in PASSTHROUGH:
            level = passed_through(line, mode)
            assert level is None or level in LEVELS
            if mode == "none" or not line.strip():
                assert level is None
            elif mode == "all":
                assert level is not None
    tail = LogTail(size=50)
    tail.extend(lines)
    kept = tail.lines()
    assert len(kept) == min(50, len(lines))
    assert not any(line.endswith(("\r", "\n")) for line in kept)


def _expected_lines(data: bytes) -> list[str]:
    """The complete lines of ``data`` as a follower hands them on (``\\n`` ends a line)."""
    return [line.decode("utf-8", "replace") for line in data.split(b"\n")[:-1]]


log_bytes = st.one_of(mutated(LOGS).map(lambda text: text.encode()), st.binary(max_size=200))


@fuzz_settings(scale=0.5)
@given(st.lists(log_bytes, min_size=1, max_size=4), st.integers(0, 3))
def test_file_follower_hands_on_every_complete_line_once(chunks: list[bytes], rotate_at: int) -> None:
    """Appended in pieces (cut anywhere, even inside a UTF-8 character) and rotated once:
    every complete line comes out once, in order; the rotated file's unfinished last line too."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "engine.log"
        path.write_bytes(b"")
        follower = FileFollower(path)
        lines: list[str] = []
        expected: list[str] = []
        written = b""
        for position, chunk in enumerate(chunks):
            if position == rotate_at and position > 0:
                os.rename(path, path.with_suffix(".1"))
                path.write_bytes(b"")
                expected += _expected_lines(written)
                rest = written.rsplit(b"\n", 1)[-1]
                expected += [rest.decode("utf-8", "replace")] if rest else []
                written = b""
            with path.open("ab") as handle:
                handle.write(chunk)
            written += chunk
            lines += follower.read_lines()
        follower.close()
    assert lines == expected + _expected_lines(written)


@fuzz_settings(scale=0.3)
@given(log_bytes)
def test_pipe_reader_hands_on_every_line(data: bytes) -> None:
    read, write = os.pipe()
    reader = PipeReader(os.fdopen(read, "rb"))
    with os.fdopen(write, "wb") as stream:
        stream.write(data)
    assert reader.closed.wait(timeout=10)
    pieces = data.split(b"\n")  # as readline() cuts: after each newline, and the unfinished rest
    raw = [piece + b"\n" for piece in pieces[:-1]] + ([pieces[-1]] if pieces[-1] else [])
    expected = [line.decode("utf-8", "replace").rstrip("\r\n") for line in raw]
    assert reader.read_lines() == expected
    reader.close()


# Diagnosis ---------------------------------------------------------------------------------


def _check_diagnosis(result: LogDiagnosis) -> None:
    """Figures are finite and non-negative, the crash is a known kind: what ``inspect log``
    prints and what the tuner computes with."""
    _json(result.to_dict())
    for value in (result.model_loading_gib, result.available_kv_cache_gib, result.max_concurrency):
        assert value is None or (math.isfinite(value) and value >= 0)
    for count in (result.kv_cache_size_tokens, result.max_model_len):
        assert count is None or (isinstance(count, int) and count >= 0 and math.isfinite(float(count)))
    crash = result.crash
    if crash is not None:
        assert crash.kind in CRASH_KINDS
        assert crash.phase in {"startup", "runtime"}
        for size in (crash.tried_to_allocate_bytes, crash.own_bytes, crash.estimated_max_model_len):
            assert size is None or (size >= 0 and math.isfinite(float(size)))
        assert all(pid >= 0 and size >= 0 for pid, size in crash.other_processes)


@fuzz_settings()
@given(st.lists(st.text(), max_size=30), st.one_of(st.none(), st.integers(-20, 300)))
def test_diagnose_random_lines(lines: list[str], exit_code: int | None) -> None:
    _check_diagnosis(diagnose(lines, exit_code=exit_code))


@fuzz_settings()
@given(mutated(LOGS), st.one_of(st.none(), st.integers(-20, 300)), st.booleans())
def test_diagnose_mutated_logs(text: str, exit_code: int | None, serving: bool) -> None:
    lines = text.splitlines()
    result = diagnose(lines, exit_code=exit_code, serving=serving)
    _check_diagnosis(result)
    coloured = ["\x1b[1;36m" + line + "\x1b[0m" for line in lines]  # as vLLM writes to a TTY
    assert diagnose(coloured, exit_code=exit_code, serving=serving) == result


@fuzz_settings()
@given(
    st.lists(st.one_of(mutated(FIGURE_LINES), one_number_made_hostile(FIGURE_LINES)), min_size=1, max_size=6)
)
def test_diagnose_mutated_figure_lines(lines: list[str]) -> None:
    """The recorded lines whose numbers diagnosis reads, with those numbers made hostile."""
    _check_diagnosis(diagnose(lines, exit_code=1))


@st.composite
def figure_lines(draw: st.DrawFn) -> list[str]:
    templates = [
        "Model loading took {} GiB memory and {} seconds",
        "Loading model weights took {} GB",
        "Available KV cache memory: {} GiB",
        "reserved {} GiB memory for KV Cache as specified by kv_cache_memory_bytes",
        "Explicitly set ({}/{}) GiB for KV cache",
        "GPU KV cache size: {} tokens, Maximum concurrency for {} tokens per request: {}x",
        "# GPU blocks: {}, # CPU blocks: {}",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {} {}. Process {} has {} GiB "
        "memory in use. Of the allocated memory this process has {} MiB memory in use.",
        "ValueError: To serve at least one request with the models's max seq len ({}), ({} GiB KV "
        "cache is needed, the estimated maximum model length is {}.",
    ]
    lines = []
    for template in draw(st.lists(st.sampled_from(templates), min_size=1, max_size=5)):
        lines.append(template.format(*(draw(numbers) for _ in range(template.count("{}")))))
    return lines


@fuzz_settings()
@given(figure_lines())
def test_diagnose_generated_figure_lines(lines: list[str]) -> None:
    _check_diagnosis(diagnose(lines, exit_code=1))


# nvidia-smi --------------------------------------------------------------------------------


def _check_samples(samples: Sequence[GpuSample]) -> None:
    for sample in samples:
        _json(sample.to_dict())
        assert sample.index >= 0
        for size in (
            sample.memory_total_bytes,
            sample.memory_used_bytes,
            sample.memory_free_bytes,
            sample.memory_reserved_bytes,
        ):
            assert size is None or (size >= 0 and math.isfinite(float(size)))
        assert sample.utilization_ratio is None or 0 <= sample.utilization_ratio <= 1
        for process in sample.processes or ():
            assert process.pid >= 0
            assert process.used_bytes is None or process.used_bytes >= 0


@st.composite
def smi_rows(draw: st.DrawFn, width: int) -> str:
    """CSV rows of ``width`` cells, each a number (hostile or not), a placeholder or text."""
    cell = st.one_of(
        numbers, st.sampled_from(["[N/A]", "N/A", "[Not Supported]", "GPU-a", "24564 MiB", "5 %"])
    )
    rows = draw(st.lists(st.lists(cell, min_size=width, max_size=width), min_size=1, max_size=3))
    return "\n".join(", ".join(row) for row in rows)


# The columns tunerd reads as numbers, by header name.
NUMERIC_COLUMNS = {
    "index",
    "memory.total",
    "memory.used",
    "memory.free",
    "memory.reserved",
    "utilization.gpu",
    "pid",
    "used_memory",
    "used_gpu_memory",
}


@st.composite
def smi_one_cell_made_hostile(draw: st.DrawFn) -> str:
    """A recorded answer with a header whose cell in one numeric column is made hostile."""
    text = draw(st.sampled_from([text for text in SMI_CSV if any(name in text for name in NUMERIC_COLUMNS)]))
    header, *rows = text.splitlines()
    names = [cell.split(" [", 1)[0].strip() for cell in header.split(",")]
    columns = [position for position, name in enumerate(names) if name in NUMERIC_COLUMNS]
    if not rows or not columns:
        return text
    row = draw(st.integers(0, len(rows) - 1))
    cells = rows[row].split(",")
    column = draw(st.sampled_from(columns))
    if column < len(cells):
        cells[column] = " " + draw(numbers)
    rows[row] = ",".join(cells)
    return "\n".join([header, *rows])


smi_text = st.one_of(
    st.text(),
    mutated(SMI_CSV),
    smi_one_cell_made_hostile(),
    smi_rows(len(GPU_FIELDS)),
    smi_rows(len(APP_FIELDS)),
)


@fuzz_settings()
@given(smi_text)
def test_smi_parsers_raise_only_smi_error(text: str) -> None:
    for fields in (None, GPU_FIELDS):
        with contextlib.suppress(SmiError):
            _check_samples(parse_query_gpu(text, fields))
    for app_fields in (None, APP_FIELDS):
        try:
            processes = parse_compute_apps(text, app_fields)
        except SmiError:
            continue
        for listed in processes.values():
            assert all(process.pid >= 0 and (process.used_bytes or 0) >= 0 for process in listed)


@fuzz_settings()
@given(st.one_of(mutated(SMI_XML), st.text(), smi_text))
def test_smi_report_parser_raises_only_smi_error(text: str) -> None:
    """``nvidia-smi -q -x`` mutated (lines dropped, cut, swapped, a number made hostile) or
    not XML at all: processes with a PID, a kind and a usage that are what they say, or an
    SmiError — never ParseError, ValueError or an escaping entity."""
    try:
        listed = parse_processes_xml(text)
    except SmiError:
        return
    for processes in listed.values():
        for process in processes:
            assert process.pid >= 0
            assert process.used_bytes is None or process.used_bytes >= 0
            assert process.kind in (None, "compute", "graphics", "compute+graphics")


answers = st.builds(
    CommandResult,
    st.one_of(st.sampled_from([0, 0, 0, 2, 6, 9, 15, 18, 124, 127, 255]), st.integers(-300, 300)),
    st.one_of(
        smi_text,
        st.sampled_from(SMI_ALL),
        st.builds('Field "{}" is not a valid field to query.'.format, st.text()),
    ),
    st.one_of(st.just(""), st.text()),
)


@fuzz_settings()
@given(answers, answers)
def test_smi_source_sample_never_raises(gpus: CommandResult, apps: CommandResult) -> None:
    """Whatever nvidia-smi answers: a reading with a known status, never an exception."""

    def runner(argv: Sequence[str], timeout: float) -> CommandResult:
        return gpus if argv[1].startswith("--query-gpu") else apps

    reading = SmiSource(runner=runner).sample()
    assert isinstance(reading, GpuReading)
    assert reading.status in SMI_STATUSES
    _check_samples(reading.gpus)
    _json(reading.to_dict())
