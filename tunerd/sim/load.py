"""``tunerd sim load``: a load generator for the simulator and for a real vLLM.

``concurrency`` workers each send one ``/v1/completions`` request after another (streaming, so
the time to the first token is measured) until ``duration`` has passed or ``requests`` have
been sent. Against the simulator (it answers ``/sim/clock``) prompts are sent as
``prompt_tokens: N`` and times are reported in simulated seconds; against a real vLLM the
prompt is text (``"the "`` repeated, about one token per word with common tokenizers).
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

import httpx

from tunerd.sources.sim_clock import time_scale

__all__ = ["LoadOptions", "LoadResult", "run_load"]


@dataclass(frozen=True)
class LoadOptions:
    url: str
    concurrency: int
    prompt_tokens: int
    max_tokens: int
    duration: float | None = None  # wall seconds
    requests: int | None = None
    ignore_eos: bool = True
    prompt_logprobs: int | None = None
    timeout: float = 600.0
    model: str | None = None
    retry_refused: bool = False  # keep sending through an engine restart, as real clients retry


@dataclass
class LoadResult:
    ok: int = 0
    failed: int = 0
    ttft: list[float] = field(default_factory=list)  # seconds (simulated when scale > 1)
    latency: list[float] = field(default_factory=list)
    output_tokens: int = 0
    elapsed: float = 0.0  # seconds, same clock as ttft
    errors: dict[str, int] = field(default_factory=dict)
    time_scale: float = 1.0

    @property
    def simulated(self) -> bool:
        return self.time_scale != 1.0

    def percentile(self, values: list[float], share: float) -> float | None:
        if not values:
            return None
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(share * len(ordered)))]

    def summary(self) -> str:
        clock = " (simulated time)" if self.simulated else ""
        lines = [f"requests: {self.ok} ok, {self.failed} failed"]
        p50, p95 = self.percentile(self.ttft, 0.5), self.percentile(self.ttft, 0.95)
        if p50 is not None and p95 is not None:
            lines.append(f"TTFT p50 {p50:.2f}s, p95 {p95:.2f}s{clock}")
        if self.latency:
            lines.append(f"latency p50 {statistics.median(self.latency):.2f}s{clock}")
        rate = self.output_tokens / self.elapsed if self.elapsed > 0 else 0.0
        lines.append(
            f"output: {self.output_tokens:,} tokens in {self.elapsed:.1f}s = {rate:,.1f} tokens/s{clock}"
        )
        for error, count in sorted(self.errors.items()):
            lines.append(f"failed: {count} × {error}")
        return "\n".join(lines)


def _model(client: httpx.Client, url: str) -> str | None:
    try:
        data = client.get(f"{url}/v1/models").json()
        return str(data["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return None


def run_load(
    options: LoadOptions, progress: IO[str] | None = None, monotonic: Callable[[], float] = time.monotonic
) -> LoadResult:
    url = options.url.rstrip("/")
    with httpx.Client(timeout=httpx.Timeout(options.timeout, connect=10.0)) as probe:
        scale = time_scale(probe, url)
        model = options.model or _model(probe, url)
    simulated = scale is not None
    result = LoadResult(time_scale=scale or 1.0)
    lock = threading.Lock()
    started = monotonic()
    sent = 0
    stop = threading.Event()

    def may_send() -> bool:
        nonlocal sent
        with lock:
            if stop.is_set():
                return False
            if options.requests is not None and sent >= options.requests:
                return False
            if options.duration is not None and monotonic() - started >= options.duration:
                return False
            sent += 1
            return True

    def body() -> dict[str, Any]:
        payload: dict[str, Any] = {
            "max_tokens": options.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": options.ignore_eos,
        }
        if model:
            payload["model"] = model
        if simulated:
            payload["prompt_tokens"] = options.prompt_tokens
        else:
            payload["prompt"] = "the " * options.prompt_tokens
        if options.prompt_logprobs is not None:
            payload["prompt_logprobs"] = options.prompt_logprobs
        return payload

    def worker() -> None:
        with httpx.Client(timeout=httpx.Timeout(options.timeout, connect=10.0)) as client:
            while may_send():
                refused = result.errors.get("ConnectError", 0)
                if refused and not options.retry_refused:
                    stop.set()  # the server is gone: stop rather than spin on refusals
                    break
                _one(
                    client,
                    url,
                    body=body(),
                    result=result,
                    lock=lock,
                    monotonic=monotonic,
                    scale=scale or 1.0,
                )
                if options.retry_refused and result.errors.get("ConnectError", 0) > refused:
                    time.sleep(0.2)  # the engine is restarting: knock again shortly

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(options.concurrency)]
    for thread in threads:
        thread.start()
    next_report = started + 2.0
    while any(thread.is_alive() for thread in threads):
        for thread in threads:
            thread.join(timeout=0.2)
        now = monotonic()
        if progress is not None and now >= next_report:
            with lock:
                in_flight = sum(thread.is_alive() for thread in threads)
                progress.write(
                    f"[{now - started:5.1f}s] {result.ok} ok, {result.failed} failed, "
                    f"{in_flight} workers busy, {result.output_tokens:,} tokens\n"
                )
            progress.flush()
            next_report = now + 2.0
    result.elapsed = (monotonic() - started) * result.time_scale
    return result


def _one(
    client: httpx.Client,
    url: str,
    *,
    body: dict[str, Any],
    result: LoadResult,
    lock: threading.Lock,
    monotonic: Callable[[], float],
    scale: float,
) -> None:
    start = monotonic()
    first: float | None = None
    tokens = 0
    error: str | None = None
    try:
        with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                response.read()
                error = f"HTTP {response.status_code}"
            else:
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line.removeprefix("data: ")
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if "error" in event:
                        error = "error mid-stream"
                        break
                    usage = event.get("usage")
                    if usage and usage.get("completion_tokens") is not None:
                        tokens = int(usage["completion_tokens"])  # the final, authoritative count
                    if not event.get("choices"):
                        continue
                    text = event["choices"][0].get("text", "")
                    if text and first is None:
                        first = monotonic()
                    if not usage:
                        tokens += max(1, len(text.split())) if text else 0
    except (httpx.HTTPError, ValueError, KeyError) as exception:
        error = type(exception).__name__
    end = monotonic()
    with lock:
        if error is None:
            result.ok += 1
            result.output_tokens += tokens
            result.latency.append((end - start) * scale)
            if first is not None:
                result.ttft.append((first - start) * scale)
        else:
            result.failed += 1
            result.errors[error] = result.errors.get(error, 0) + 1
