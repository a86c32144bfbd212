"""A GPU source that keeps failing under a running daemon (issue 17): the daemon goes on —
ticking, supervising its engine, feeding the watchdog — shows the source as degraded in
``tunerd status`` and its own /metrics, alerts once, and resolves the alert when readings come
back. Before, an exception out of the NVML backend (NVMLLibraryMismatchError on a driver
without ``_v3``) escaped the daemon's first sample and systemd restarted tunerd for ever."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.registry import CollectorRegistry

from tests.fakes.gpu_sources import MismatchedGpu
from tests.integration.sim_daemon import close_daemon, sim_daemon, started
from tunerd.clock import SystemClock
from tunerd.exporter import TunerdCollector
from tunerd.status import render

pytestmark = pytest.mark.slow


def test_a_failing_gpu_source_degrades_alerts_once_and_recovers(tmp_path: Path) -> None:
    ahead = [0.0]  # the test moves tunerd's clocks on by this much
    clock = SystemClock(wall=lambda: time.time() + ahead[0], monotonic=lambda: time.monotonic() + ahead[0])
    gpu = MismatchedGpu(details={"unsupported": "nvmlDeviceGetUtilizationRates"})
    said: list[dict[str, Any]] = []
    daemon = sim_daemon(tmp_path, gpu=gpu, clock=clock, said=said)
    try:
        started(daemon)  # the first reading raised out of start() before
        for _ in range(10):
            daemon.sampler.sample_once()
        daemon._tick_job()
        assert daemon.published is not None
        assert daemon.published["gpu_source"]["state"] == "failing"
        assert daemon.engines[0].healthy  # the engine is supervised all along
        ahead[0] += 31
        daemon.sampler.sample_once()
        ticks = daemon.ticks
        for _ in range(3):
            daemon._tick_job()
        assert daemon.ticks == ticks + 3
        source = daemon.published["gpu_source"]
        assert (source["state"], source["source"]) == ("degraded", "nvml")
        assert "NVMLLibraryMismatchError" in source["error"]
        screen = render(daemon.published)
        failures = source["failures_in_a_row"]
        assert failures >= 11
        assert f"GPU    source nvml degraded: {failures} readings in a row failed" in screen
        scraped = _scrape(daemon)
        assert 'tunerd_gpu_source_up{source="nvml"} 0.0' in scraped
        assert f'tunerd_gpu_read_failures_total{{source="nvml"}} {float(failures)}' in scraped

        gpu.fixed = True
        daemon.sampler.sample_once()
        daemon._tick_job()
        assert daemon.published["gpu_source"]["state"] == "ok"
        assert "not available from this driver or GPU: nvmlDeviceGetUtilizationRates" in render(
            daemon.published
        )
        assert 'tunerd_gpu_source_up{source="nvml"} 1.0' in _scrape(daemon)
    finally:
        close_daemon(daemon, kill=True)
    alerts = [(e["policy"], e["severity"], e["status"]) for e in said if e["event"] == "alert"]
    assert alerts == [
        ("gpu-source-degraded", "warning", "firing"),
        ("gpu-source-degraded", "warning", "resolved"),
    ]


def _scrape(daemon: Any) -> str:
    """tunerd's own /metrics as Prometheus would read it, from what the last tick published."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(TunerdCollector(lambda: daemon.metrics_view))
    return generate_latest(registry).decode()
