"""tunerd's own Prometheus metrics (``listen.metrics``, default ``127.0.0.1:9464``).

A collector over what the daemon published at its last tick (:class:`MetricsView`): it never
reads the daemon's state itself, so a scrape needs no lock and cannot slow the loop. Its own
registry (no process or platform collectors from the global one, single-process:
``PROMETHEUS_MULTIPROC_DIR`` is ignored). Names are the signals of docs/signals.md with ``tunerd_``
in front, plus:

- ``tunerd_memory_bytes{engine, bill}``: the bills of ``tunerd status`` (weights, kv_pool,
  engine_other, other_processes, free);
- ``tunerd_engine_state{engine, state}`` and ``tunerd_policy_state{engine, policy, state}``:
  1 for the current state;
- ``tunerd_actions_total{engine, policy, kind, outcome}`` from the history;
- ``tunerd_restarts_in_window``, ``tunerd_restart_budget_left``, ``tunerd_engine_held``;
- ``tunerd_kv_prediction_error_ratio{engine}`` (the last start's pool against the prediction)
  and ``tunerd_calibrated_headroom_bytes{engine}`` (the calibrated box's room at its worst);
- ``tunerd_sampling_lag_seconds`` (age of the newest GPU reading),
  ``tunerd_gpu_source_up{source}`` and ``tunerd_gpu_read_failures_total{source}``,
  ``tunerd_scrape_errors_total{engine}``;
- ``tunerd_jobs_skipped_total{job}`` (a run that fell due while the previous one still ran: a
  tick held by a restart) and ``tunerd_job_errors_total{job}``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

__all__ = ["Exporter", "MetricsView", "TunerdCollector"]

ENGINE_STATES = ("starting", "running", "draining", "restarting", "stopped", "crashed", "held", "pinned")
POLICY_STATES = ("inactive", "pending", "firing", "cooldown")
_COUNTERS = {"num_preemptions_total", "prompt_tokens_total", "generation_tokens_total", "gate_shed_total"}


@dataclass(frozen=True)
class MetricsView:
    """What a scrape reports: the daemon builds one per tick."""

    status: Mapping[str, Any]
    signals: Mapping[tuple[str, str], float] = field(default_factory=dict)  # (signal, engine) → latest
    actions: tuple[tuple[str, str, str, str, int], ...] = ()
    scrape_errors: Mapping[str, int] = field(default_factory=dict)
    sampling_lag_seconds: float | None = None
    jobs_skipped: Mapping[str, int] = field(default_factory=dict)  # job → runs skipped (still busy)
    job_errors: Mapping[str, int] = field(default_factory=dict)  # job → runs that raised


class TunerdCollector(Collector):
    def __init__(self, view: Callable[[], MetricsView | None]) -> None:
        self._view = view

    def collect(self) -> Iterator[Metric]:
        view = self._view()
        if view is None:
            return
        by_signal: dict[str, list[tuple[str, float]]] = {}
        for (signal, engine), value in sorted(view.signals.items()):
            by_signal.setdefault(signal, []).append((engine, value))
        for signal, values in by_signal.items():
            family_type = CounterMetricFamily if signal in _COUNTERS else GaugeMetricFamily
            name = f"tunerd_{signal.removesuffix('_total')}" if signal in _COUNTERS else f"tunerd_{signal}"
            family = family_type(
                name, f"signal {signal} (docs/signals.md), as tunerd last read it", labels=["engine"]
            )
            for engine, value in values:
                family.add_metric([engine], value)
            yield family
        memory = GaugeMetricFamily(
            "tunerd_memory_bytes", "GPU memory by bill on the engine's worst GPU", labels=["engine", "bill"]
        )
        state = GaugeMetricFamily(
            "tunerd_engine_state", "1 for the engine's state", labels=["engine", "state"]
        )
        policies = GaugeMetricFamily(
            "tunerd_policy_state", "1 for each policy's state", labels=["engine", "policy", "state"]
        )
        restarts = GaugeMetricFamily(
            "tunerd_restarts_in_window", "restarts in the guard window", labels=["engine"]
        )
        budget = GaugeMetricFamily(
            "tunerd_restart_budget_left", "restarts the guards still allow", labels=["engine"]
        )
        held = GaugeMetricFamily("tunerd_engine_held", "1 while the engine is held", labels=["engine"])
        error = GaugeMetricFamily(
            "tunerd_kv_prediction_error_ratio",
            "the last start's KV pool against tunerd's prediction: (observed - predicted) / observed",
            labels=["engine"],
        )
        headroom = GaugeMetricFamily(
            "tunerd_calibrated_headroom_bytes",
            "GPU memory left at the engine's and its neighbours' observed worst (calibration)",
            labels=["engine"],
        )
        for engine in view.status.get("engines", []):
            name = engine["name"]
            calibration = engine.get("calibration") or {}
            if calibration.get("prediction_error_ratio") is not None:
                error.add_metric([name], float(calibration["prediction_error_ratio"]))
            room = (calibration.get("bills") or {}).get("headroom_bytes")
            if room is not None:
                headroom.add_metric([name], float(room))
            for bill, value in (engine.get("bills") or {}).items():
                if value is not None:
                    memory.add_metric([name, bill], float(value))
            for candidate in ENGINE_STATES:
                state.add_metric([name, candidate], 1.0 if engine.get("state") == candidate else 0.0)
            for policy in engine.get("policies") or []:
                for candidate in POLICY_STATES:
                    policies.add_metric(
                        [name, policy["name"], candidate], 1.0 if policy["state"] == candidate else 0.0
                    )
            guards = engine.get("guards") or {}
            restarts.add_metric([name], float(guards.get("restarts_in_window") or 0))
            budget.add_metric([name], float(guards.get("budget_left") or 0))
            held.add_metric([name], 1.0 if guards.get("held") else 0.0)
        yield from (memory, state, policies, restarts, budget, held, error, headroom)
        actions = CounterMetricFamily(
            "tunerd_actions",
            "actions recorded, by policy, kind and outcome",
            labels=["engine", "policy", "kind", "outcome"],
        )
        for engine, policy, kind, outcome, count in view.actions:
            actions.add_metric([engine, policy, kind, outcome], float(count))
        yield actions
        errors = CounterMetricFamily(
            "tunerd_scrape_errors", "engine /metrics scrapes that failed", labels=["engine"]
        )
        for engine, count in sorted(view.scrape_errors.items()):
            errors.add_metric([engine], float(count))
        yield errors
        source = view.status.get("gpu_source")
        if source:
            up = GaugeMetricFamily(
                "tunerd_gpu_source_up",
                "1 while the GPU source's readings come through, 0 while they fail",
                labels=["source"],
            )
            up.add_metric([source["source"]], 1.0 if source["state"] == "ok" else 0.0)
            failures = CounterMetricFamily(
                "tunerd_gpu_read_failures", "GPU readings that failed since tunerd started", labels=["source"]
            )
            failures.add_metric([source["source"]], float(source.get("failures_total") or 0))
            yield from (up, failures)
        if view.sampling_lag_seconds is not None:
            lag = GaugeMetricFamily("tunerd_sampling_lag_seconds", "age of the newest GPU reading")
            lag.add_metric([], view.sampling_lag_seconds)
            yield lag
        for name, help_text, counts in (
            ("tunerd_jobs_skipped", "job runs skipped: the previous run was still going", view.jobs_skipped),
            ("tunerd_job_errors", "job runs that raised (the log has the traceback)", view.job_errors),
        ):
            family = CounterMetricFamily(name, help_text, labels=["job"])
            for job, count in sorted(counts.items()):
                family.add_metric([job], float(count))
            yield family


class Exporter:
    """Serves :class:`TunerdCollector` over HTTP on ``host:port`` (port 0: any free one)."""

    def __init__(self, address: str, view: Callable[[], MetricsView | None]) -> None:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"listen.metrics must be HOST:PORT, not {address!r}")
        self.host, self.port = host.strip("[]"), int(port)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(TunerdCollector(view))
        self._server: WSGIServer | None = None

    def start(self) -> Exporter:
        server, _ = start_http_server(self.port, addr=self.host, registry=self.registry)
        self._server = server
        self.port = server.server_port
        return self

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
