"""vLLM's ``/metrics``: ``fetch()`` does the HTTP, ``parse(text)`` is pure (DESIGN §4.3).

A vLLM 0.33 page is ~55 KB of which tunerd needs a dozen lines, and prometheus_client's full
parse costs ~9 ms. :func:`parse` therefore skips every line that does not start with one of
the few wanted family names and parses only those, by hand, into a
:class:`MetricsSnapshot` normalized across versions:

- ``vllm:kv_cache_usage_perc`` (0.33), or ``vllm:gpu_cache_usage_perc`` (before 0.11);
- ``engine`` label absent in early V1 and V0 (one engine, called "0");
- several engines on one page (data parallel): request counts and counters are summed,
  ``kv_cache_usage`` is the maximum (a mean hides the hot engine), capacity is per engine;
- capacity from ``vllm:cache_config_info``'s ``kv_cache_size_tokens`` label, else
  ``num_gpu_blocks × block_size`` (``num_gpu_blocks`` is summed over DP engines, so it is
  divided by the engine count), else null;
- ``_created`` series, histograms and every other family are ignored; a label value of
  ``"None"`` is null; a line that cannot be parsed is reported, never raised. A value is the
  exposition format's number (``3.0``, ``1.7e+09``, ``NaN``, ``+Inf``), ASCII only: ``1_000``
  or ``٣``, which ``float()`` would take, is junk;
- a value no engine reports is dropped (the field is null, as if absent) and counted in
  ``dropped`` by ``"<family>: <reason>"``, so policies never see it: NaN and ±Inf (``not
  finite``; an infinite one is also reported as a problem), a KV usage outside [0, 1], a
  negative count, gauge or counter, one above 2**63 (no real counter gets there, and a sum of
  such could overflow to inf), and the same for ``cache_config_info``'s numeric labels
  (``"vllm:cache_config_info gpu_memory_utilization: outside (0, 1]"``).

:class:`CounterRates` turns the counters of successive snapshots into per-second rates
within one engine generation; a counter that goes down is a reset (no rate), not a negative
rate.
"""

from __future__ import annotations

import http.client
import itertools
import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tunerd.sources.http import KeptAlive

__all__ = [
    "COUNTERS",
    "WORKLOAD_HISTOGRAMS",
    "CounterRates",
    "EngineMetrics",
    "Histogram",
    "MetricsClient",
    "MetricsSnapshot",
    "ScrapeError",
    "histograms",
    "parse",
]

_RUNNING = "vllm:num_requests_running"
_WAITING = "vllm:num_requests_waiting"
_WAITING_BY_REASON = "vllm:num_requests_waiting_by_reason"
_KV_USAGE = "vllm:kv_cache_usage_perc"
_KV_USAGE_OLD = "vllm:gpu_cache_usage_perc"
_PREEMPTIONS = "vllm:num_preemptions_total"
_PROMPT_TOKENS = "vllm:prompt_tokens_total"
_GENERATION_TOKENS = "vllm:generation_tokens_total"
_CACHE_CONFIG = "vllm:cache_config_info"

WANTED = frozenset(
    {
        _RUNNING,
        _WAITING,
        _WAITING_BY_REASON,
        _KV_USAGE,
        _KV_USAGE_OLD,
        _PREEMPTIONS,
        _PROMPT_TOKENS,
        _GENERATION_TOKENS,
        _CACHE_CONFIG,
    }
)
# Prefixes to test a line against before splitting it (str.startswith takes a tuple).
_PREFIXES = tuple(sorted(WANTED))
#: Counter fields of a snapshot, turned into rates by :class:`CounterRates`.
COUNTERS = ("num_preemptions_total", "prompt_tokens_total", "generation_tokens_total")

_NAME_END = re.compile(r"[{\s]")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\\n]|\\.)*)"\s*(,|\})')
_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}
_FIRST_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_:#")
_MAX_PROBLEMS = 20
# A sample value as Prometheus writes one (Go's ParseFloat syntax, without hex and underscores).
_VALUE = re.compile(r"[+-]?(?:(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|(?i:inf(?:inity)?|nan))")
# Above any real count; also keeps sums over engines (and blocks × block size) finite.
_MAX_COUNT = 2**63
_USAGE = frozenset({_KV_USAGE, _KV_USAGE_OLD})


class ScrapeError(Exception):
    """``/metrics`` could not be fetched: ``kind`` is refused, timeout, http or error."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class EngineMetrics:
    """One engine (data-parallel rank) of a page."""

    engine: str
    kv_cache_usage: float | None = None
    num_requests_running: int | None = None
    num_requests_waiting: int | None = None
    num_requests_waiting_capacity: int | None = None
    num_preemptions_total: int | float | None = None
    prompt_tokens_total: int | float | None = None
    generation_tokens_total: int | float | None = None
    kv_cache_size_tokens: int | None = None
    num_gpu_blocks: int | None = None
    block_size: int | None = None
    gpu_memory_utilization: float | None = None
    cache_dtype: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class MetricsSnapshot:
    """A page normalized to DESIGN §4.3's fields; ``problems`` lists junk it skipped."""

    kv_cache_usage: float | None
    num_requests_running: int | None
    num_requests_waiting: int | None
    num_requests_waiting_capacity: int | None
    num_preemptions_total: int | float | None
    prompt_tokens_total: int | float | None
    generation_tokens_total: int | float | None
    kv_cache_size_tokens: int | None
    num_gpu_blocks: int | None
    block_size: int | None
    gpu_memory_utilization: float | None
    cache_dtype: str | None
    model_name: str | None
    engine_count: int
    engines: tuple[EngineMetrics, ...]
    problems: tuple[str, ...] = ()
    lines_read: int = 0
    cache_config: dict[str, str] | None = None  # the first engine's vllm:cache_config_info labels
    # Values dropped by the range and finiteness checks, by "<family>: <reason>".
    dropped: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """A usable page: vLLM metrics were found and nothing was junk."""
        return self.engine_count > 0 and not self.problems

    def to_dict(self) -> dict[str, Any]:
        data = {key: value for key, value in self.__dict__.items() if key not in {"engines", "lines_read"}}
        data["engines"] = [engine.to_dict() for engine in self.engines]
        data["problems"] = list(self.problems)
        data["dropped"] = dict(self.dropped)
        return data


def _unescape(value: str) -> str:
    if "\\" not in value:
        return value
    return re.sub(r"\\[\\\"n]", lambda match: _ESCAPES[match.group(0)], value)


def _parse_line(line: str) -> tuple[str, dict[str, str], float]:
    """``name{labels} value [timestamp]`` → (name, labels, value); ValueError on junk."""
    end = _NAME_END.search(line)
    if end is None:
        raise ValueError("no value")
    name = line[: end.start()]
    labels: dict[str, str] = {}
    position = end.start()
    if line[position] == "{":
        position += 1
        if line[position : position + 1] == "}":
            position += 1
        else:
            while True:
                match = _LABEL.match(line, position)
                if match is None:
                    raise ValueError("malformed labels")
                labels[match.group(1)] = _unescape(match.group(2))
                position = match.end()
                if match.group(3) == "}":
                    break
    parts = line[position:].split()
    if not parts or len(parts) > 2:
        raise ValueError("expected a value and an optional timestamp")
    if _VALUE.fullmatch(parts[0]) is None:
        raise ValueError("not a number")
    return name, labels, float(parts[0])


def _number(value: float) -> int | float | None:
    if math.isnan(value):
        return None
    if math.isinf(value):
        return value
    return int(value) if value.is_integer() else value


def _unusable(name: str, value: float) -> str | None:
    """Why a wanted family's value cannot be passed on, or None when it can."""
    if not math.isfinite(value):
        return "not finite"
    if name in _USAGE:
        return None if 0 <= value <= 1 else "outside [0, 1]"
    if value < 0:
        return "negative"
    return "above 2**63" if value > _MAX_COUNT else None


def _label_float(labels: Mapping[str, str], key: str, dropped: Counter[str]) -> float | None:
    """A label holding a number (``"0.92"``); ``"None"`` and junk are ``None``, a non-finite
    number is ``None`` and counted."""
    raw = labels.get(key)
    if raw is None or _VALUE.fullmatch(raw) is None:
        return None
    number = float(raw)
    if not math.isfinite(number):
        dropped[f"{_CACHE_CONFIG} {key}: not finite"] += 1
        return None
    return number


def _label_fraction(labels: Mapping[str, str], key: str, dropped: Counter[str]) -> float | None:
    """A label holding a fraction in (0, 1] (``gpu_memory_utilization``)."""
    number = _label_float(labels, key, dropped)
    if number is not None and not 0 < number <= 1:
        dropped[f"{_CACHE_CONFIG} {key}: outside (0, 1]"] += 1
        return None
    return number


def _label_int(labels: Mapping[str, str], key: str, dropped: Counter[str]) -> int | None:
    """A label holding a count (``"9271"``); a fraction is junk (``None``), a count out of
    range is ``None`` and counted."""
    number = _label_float(labels, key, dropped)
    if number is None or not number.is_integer():
        return None
    if (reason := _unusable(key, number)) is not None:
        dropped[f"{_CACHE_CONFIG} {key}: {reason}"] += 1
        return None
    return int(number)


@dataclass
class _Engine:
    values: dict[str, float] = field(default_factory=dict)
    waiting_capacity: float | None = None
    info: dict[str, str] | None = None


def parse(text: str) -> MetricsSnapshot:
    """Normalize one ``/metrics`` page (classic text or OpenMetrics). Never raises."""
    engines: dict[str, _Engine] = {}
    model_name: str | None = None
    problems: list[str] = []
    dropped: Counter[str] = Counter()
    lines_read = 0
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.startswith(_PREFIXES):
            if line and line[0] not in _FIRST_CHARS and not line.isspace() and len(problems) < _MAX_PROBLEMS:
                problems.append(f"line {number}: not a metric: {line[:80]!r}")
            continue
        try:
            name, labels, value = _parse_line(line)
        except (ValueError, IndexError) as error:
            if len(problems) < _MAX_PROBLEMS:
                problems.append(f"line {number}: {error}: {line[:80]!r}")
            continue
        if name not in WANTED:
            continue  # a longer name sharing a prefix (…_created, …_bucket)
        if math.isinf(value):
            dropped[f"{name}: not finite"] += 1
            if len(problems) < _MAX_PROBLEMS:
                problems.append(f"line {number}: value out of range: {line[:80]!r}")
            continue
        lines_read += 1
        engine = engines.setdefault(labels.get("engine", "0"), _Engine())
        if model_name is None and "model_name" in labels:
            model_name = labels["model_name"]
        if name == _CACHE_CONFIG:
            engine.info = labels  # (its value is always 1: the labels are the information)
        elif (reason := _unusable(name, value)) is not None:
            dropped[f"{name}: {reason}"] += 1
        elif name == _WAITING_BY_REASON:
            if labels.get("reason") == "capacity":
                engine.waiting_capacity = value
        elif name == _KV_USAGE_OLD:
            engine.values.setdefault(_KV_USAGE, value)  # the new name wins when both exist
        elif name == _KV_USAGE:
            engine.values[_KV_USAGE] = value
        else:
            engine.values[name] = value
    return _normalize(engines, model_name, problems, lines_read, dropped)


def _engine_metrics(key: str, engine: _Engine, engine_count: int, dropped: Counter[str]) -> EngineMetrics:
    values = engine.values

    def get(name: str) -> int | float | None:
        return _number(values[name]) if name in values else None

    def count(name: str) -> int | None:
        number = get(name)
        return None if number is None or math.isinf(number) else round(number)

    info = engine.info or {}
    blocks = _label_int(info, "num_gpu_blocks", dropped)
    block_size = _label_int(info, "block_size", dropped)
    capacity = _label_int(info, "kv_cache_size_tokens", dropped)
    if capacity is None and blocks is not None and block_size is not None:
        capacity = blocks * block_size // max(engine_count, 1)  # blocks are summed over DP engines
    usage = get(_KV_USAGE)
    waiting_capacity = engine.waiting_capacity
    return EngineMetrics(
        engine=key,
        kv_cache_usage=float(usage) if usage is not None else None,
        num_requests_running=count(_RUNNING),
        num_requests_waiting=count(_WAITING),
        num_requests_waiting_capacity=(
            round(waiting_capacity)
            if waiting_capacity is not None and math.isfinite(waiting_capacity)
            else None
        ),
        num_preemptions_total=get(_PREEMPTIONS),
        prompt_tokens_total=get(_PROMPT_TOKENS),
        generation_tokens_total=get(_GENERATION_TOKENS),
        kv_cache_size_tokens=capacity,
        num_gpu_blocks=blocks,
        block_size=block_size,
        gpu_memory_utilization=_label_fraction(info, "gpu_memory_utilization", dropped),
        cache_dtype=info.get("cache_dtype") if info.get("cache_dtype") not in {None, "None"} else None,
    )


def _sum(values: Iterable[int | float | None]) -> int | float | None:
    present = [value for value in values if value is not None]
    return sum(present) if present else None


def _normalize(
    engines: dict[str, _Engine],
    model_name: str | None,
    problems: list[str],
    lines_read: int,
    dropped: Counter[str],
) -> MetricsSnapshot:
    per_engine = tuple(
        _engine_metrics(key, engine, len(engines), dropped)
        for key, engine in sorted(engines.items(), key=lambda item: (len(item[0]), item[0]))
    )
    if not per_engine and not problems:
        problems = ["no vLLM metrics on the page (is this vLLM's /metrics, with log stats on?)"]
    usages = [engine.kv_cache_usage for engine in per_engine if engine.kv_cache_usage is not None]
    capacities = [engine.kv_cache_size_tokens for engine in per_engine]
    first = per_engine[0] if per_engine else None

    def total(name: str) -> Any:
        return _sum(getattr(engine, name) for engine in per_engine)

    return MetricsSnapshot(
        kv_cache_usage=max(usages) if usages else None,
        num_requests_running=total("num_requests_running"),
        num_requests_waiting=total("num_requests_waiting"),
        num_requests_waiting_capacity=total("num_requests_waiting_capacity"),
        num_preemptions_total=total("num_preemptions_total"),
        prompt_tokens_total=total("prompt_tokens_total"),
        generation_tokens_total=total("generation_tokens_total"),
        kv_cache_size_tokens=(
            sum(c for c in capacities if c is not None) if capacities and None not in capacities else None
        ),
        num_gpu_blocks=first.num_gpu_blocks if first else None,
        block_size=first.block_size if first else None,
        gpu_memory_utilization=first.gpu_memory_utilization if first else None,
        cache_dtype=first.cache_dtype if first else None,
        model_name=model_name,
        engine_count=len(per_engine),
        engines=per_engine,
        problems=tuple(problems),
        lines_read=lines_read,
        cache_config=_first_info(engines),
        dropped=dict(dropped),
    )


def _first_info(engines: dict[str, _Engine]) -> dict[str, str] | None:
    ordered = sorted(engines.items(), key=lambda item: (len(item[0]), item[0]))
    return next((dict(engine.info) for _, engine in ordered if engine.info is not None), None)


class CounterRates:
    """Per-second rates of the snapshot counters between scrapes of one engine generation.

    Pure apart from the state it keeps: the caller passes the time and the generation. No rate
    spans two generations, and a counter that went down (a restart the caller did not see) is
    a reset: its rate is ``None`` for that interval.
    """

    def __init__(self) -> None:
        self._previous: tuple[float, int, dict[str, float | None]] | None = None

    def update(self, snapshot: MetricsSnapshot, now: float, generation: int) -> dict[str, float | None]:
        current: dict[str, float | None] = {}
        for name in COUNTERS:
            value = getattr(snapshot, name)
            current[name] = float(value) if value is not None else None
        rates: dict[str, float | None] = dict.fromkeys(COUNTERS)
        previous = self._previous
        self._previous = (now, generation, current)
        if previous is None:
            return rates
        then, previous_generation, before = previous
        elapsed = now - then
        if previous_generation != generation or elapsed <= 0:
            return rates
        for name in COUNTERS:
            old, new = before[name], current[name]
            if old is None or new is None or new < old:
                continue
            rates[name] = (new - old) / elapsed
        return rates


class MetricsClient:
    """Fetches ``/metrics`` (and ``/health``) over one kept-alive connection, with timeouts
    (:class:`~tunerd.sources.http.KeptAlive`: read every tick, so the cheap client)."""

    def __init__(self, url: str, timeout: float = 2.0) -> None:
        self.base_url = url.rstrip("/")
        self._http = KeptAlive(url, timeout)

    def fetch(self) -> str:
        """The page's text; :class:`ScrapeError` when it cannot be had."""
        url = f"{self.base_url}/metrics"
        try:
            status, body = self._http.get("/metrics")
        except ValueError as error:
            raise ScrapeError("invalid_url", f"{url}: not a usable URL ({error})") from None
        except ConnectionRefusedError as error:
            raise ScrapeError("refused", f"{url}: connection refused ({error})") from None
        except TimeoutError:
            raise ScrapeError("timeout", f"{url}: no answer within the timeout") from None
        except (OSError, http.client.HTTPException) as error:
            raise ScrapeError("error", f"{url}: {type(error).__name__}: {error}") from None
        if status != 200:
            raise ScrapeError("http", f"{url}: HTTP {status}")
        return body.decode("utf-8", "replace")

    def health(self) -> int | None:
        """``/health``'s status code (200 up, 503 engine dead), ``None`` when unreachable."""
        try:
            return self._http.get("/health")[0]
        except (OSError, http.client.HTTPException, ValueError):
            return None

    def close(self) -> None:
        self._http.close()


#: The request histograms right-sizing reads (vLLM 0.32 ``v1/metrics/loggers.py``).
WORKLOAD_HISTOGRAMS = (
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:request_params_max_tokens",
    "vllm:request_queue_time_seconds",
    "vllm:request_num_preemptions",
)


@dataclass(frozen=True)
class Histogram:
    """One histogram family of a page, summed over its engines: cumulative counts by upper
    bound (``+Inf`` last), the count and the sum."""

    name: str
    buckets: tuple[tuple[float, float], ...]
    count: float
    total: float

    def quantile(self, q: float) -> float | None:
        """The upper bound of the bucket holding the ``q`` quantile (None: no observations;
        ``inf``: it lies past the last finite bound). An upper bound, never an interpolation:
        sizing to it never sizes too small."""
        if self.count <= 0:
            return None
        wanted = q * self.count
        for bound, cumulative in self.buckets:
            if cumulative >= wanted:
                return bound
        return math.inf

    def to_dict(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "sum": self.total,
            "p50": self.quantile(0.5),
            "p95": self.quantile(0.95),
            "p99": self.quantile(0.99),
        }


def histograms(text: str, names: Iterable[str] = WORKLOAD_HISTOGRAMS) -> dict[str, Histogram]:
    """The named histogram families of a ``/metrics`` page, summed over engines and other
    labels. Never raises: a malformed line, a bound that is not a number, a count that is
    negative or not finite is skipped; a family whose buckets do not rise is dropped."""
    wanted = set(names)
    prefixes = tuple(sorted(wanted))
    buckets: dict[str, dict[float, float]] = {}
    counts: dict[str, float] = {}
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(prefixes):
            continue
        try:
            name, labels, value = _parse_line(line)
        except (ValueError, IndexError):
            continue
        if not math.isfinite(value) or value < 0 or value > _MAX_COUNT:
            continue
        for family in wanted:
            if name == family + "_bucket":
                try:
                    bound = float(labels.get("le", ""))
                except ValueError:
                    break
                if math.isnan(bound):
                    break
                family_buckets = buckets.setdefault(family, {})
                family_buckets[bound] = family_buckets.get(bound, 0.0) + value
            elif name == family + "_count":
                counts[family] = counts.get(family, 0.0) + value
            elif name == family + "_sum":
                sums[family] = sums.get(family, 0.0) + value
    found = {}
    for family, by_bound in buckets.items():
        ordered = tuple(sorted(by_bound.items()))
        if any(later < earlier for (_, earlier), (_, later) in itertools.pairwise(ordered)):
            continue  # not cumulative: not a histogram to trust
        count = counts.get(family, ordered[-1][1] if ordered else 0.0)
        found[family] = Histogram(family, ordered, count, sums.get(family, 0.0))
    return found
