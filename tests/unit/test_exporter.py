"""tunerd's own /metrics from a published view (the real collector, registry and text format),
and the shipped Grafana dashboard asks only for metrics the exporter serves."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tunerd.config import GateConfig
from tunerd.exporter import ENGINE_STATES, Exporter, MetricsView
from tunerd.gate.admission import Pool
from tunerd.gate.proxy import EngineGate
from tunerd.signals import SIGNALS

ROOT = Path(__file__).parents[2]
GIB = 1 << 30
VIEW = MetricsView(
    status={
        "engines": [
            {
                "name": "main",
                "state": "running",
                "bills": {
                    "weights": 5 * GIB,
                    "kv_pool": 14 * GIB,
                    "engine_other": GIB,
                    "other_processes": None,
                    "free": GIB,
                },
                "policies": [{"name": "kv-pool-saturated", "state": "firing"}],
                "guards": {"restarts_in_window": 2, "budget_left": 1, "held": False},
            }
        ]
    },
    signals={(signal, "main"): 1.0 for signal in SIGNALS},
    actions=(("main", "kv-pool-saturated", "tune", "succeeded", 3),),
    scrape_errors={"main": 4},
    sampling_lag_seconds=0.12,
    jobs_skipped={"tick": 7, "gpu-sample": 30},
    job_errors={"tick": 1},
)


def _samples() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    exporter = Exporter("127.0.0.1:0", lambda: VIEW)
    page = generate_latest(exporter.registry).decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(page)
        for sample in family.samples
    }


def test_the_view_as_prometheus_reads_it() -> None:
    samples = _samples()
    assert samples[("tunerd_memory_bytes", (("bill", "kv_pool"), ("engine", "main")))] == 14 * GIB
    assert (
        "tunerd_memory_bytes",
        (("bill", "other_processes"), ("engine", "main")),
    ) not in samples  # unknown: absent
    running = [s for (name, labels), s in samples.items() if name == "tunerd_engine_state" and s == 1.0]
    assert len(running) == 1
    assert len([name for name, _ in samples if name == "tunerd_engine_state"]) == len(ENGINE_STATES)
    assert (
        samples[
            (
                "tunerd_policy_state",
                (("engine", "main"), ("policy", "kv-pool-saturated"), ("state", "firing")),
            )
        ]
        == 1
    )
    assert (
        samples[
            (
                "tunerd_actions_total",
                (
                    ("engine", "main"),
                    ("kind", "tune"),
                    ("outcome", "succeeded"),
                    ("policy", "kv-pool-saturated"),
                ),
            )
        ]
        == 3
    )
    assert samples[("tunerd_scrape_errors_total", (("engine", "main"),))] == 4
    assert samples[("tunerd_num_preemptions_total", (("engine", "main"),))] == 1.0  # a counter keeps _total
    assert samples[("tunerd_kv_cache_usage", (("engine", "main"),))] == 1.0
    assert samples[("tunerd_sampling_lag_seconds", ())] == 0.12
    assert samples[("tunerd_jobs_skipped_total", (("job", "tick"),))] == 7
    assert samples[("tunerd_jobs_skipped_total", (("job", "gpu-sample"),))] == 30
    assert samples[("tunerd_job_errors_total", (("job", "tick"),))] == 1


def test_nothing_published_yet_serves_an_empty_page() -> None:
    assert generate_latest(Exporter("127.0.0.1:0", lambda: None).registry) == b""


def test_the_dashboard_asks_only_for_served_metrics() -> None:
    dashboard = json.loads((ROOT / "docs" / "grafana" / "tunerd-dashboard.json").read_text())
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    queries += [item["expr"] for item in dashboard["annotations"]["list"]]
    queries.append(dashboard["templating"]["list"][0]["query"])
    asked = {name for query in queries for name in re.findall(r"\btunerd_[a-z_]+\b", query)}
    served = {name for name, _ in _samples()} | _gate_samples()  # the gate serves its own
    assert asked
    assert asked <= served, asked - served
    assert all(panel["datasource"]["uid"] == "${DS_PROMETHEUS}" for panel in dashboard["panels"])
    # a fleet's dashboard (issue 21): pick instances and engines, several at once
    variables = {item["name"]: item for item in dashboard["templating"]["list"]}
    assert set(variables) == {"instance", "engine"}
    assert all(item["multi"] and item["includeAll"] for item in variables.values())
    for query in queries[:-1]:  # every panel and annotation (not the variable's own)
        assert 'instance=~"$instance"' in query, query
        assert 'engine="$engine"' not in query, query  # multi-select needs =~
    actions = next(item for item in dashboard["annotations"]["list"] if item["name"] == "tunerd actions")
    assert actions["expr"].startswith("increase(tunerd_actions_total{")


def _gate_samples() -> set[str]:
    """The sample names ``tunerd gate`` serves at ``/gate/metrics`` (a gate with some history:
    each histogram and counter has samples)."""
    gate = EngineGate("main", "http://127.0.0.1:1", GateConfig(listen="127.0.0.1:8001"))
    gate.admission.pool = Pool(num_blocks=4096, block_size=16, max_model_len=32768)
    gate.admission.counts[("admitted", "short")] += 1
    for histogram in (gate.wait_seconds, gate.added_seconds, gate.count_error):
        histogram.labels("main").observe(0.001)
    page = _gate_page(gate)
    return {sample.name for family in text_string_to_metric_families(page) for sample in family.samples}


def _gate_page(gate: EngineGate | None = None) -> str:
    if gate is None:
        gate = EngineGate("main", "http://127.0.0.1:1", GateConfig(listen="127.0.0.1:8001"))
        gate.admission.pool = Pool(num_blocks=4096, block_size=16, max_model_len=32768)
    return generate_latest(gate.registry()).decode()


def _promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        if os.environ.get("TUNERD_REQUIRE_PROMTOOL"):
            pytest.fail(
                "no promtool on PATH, and TUNERD_REQUIRE_PROMTOOL is set (apt-get install prometheus)"
            )
        pytest.skip("no promtool on PATH (apt-get install prometheus)")
    return found


def test_the_shipped_alerting_rules_are_the_documented_ones_and_promtool_passes_them() -> None:
    """Issue 21: the rules of docs/fleet.md as a file, checked by Prometheus's own tool."""
    shipped = ROOT / "contrib" / "prometheus" / "tunerd-rules.yml"
    documented = (ROOT / "docs" / "fleet.md").read_text()
    assert shipped.read_text() in documented  # the file is the doc's block, whole
    done = subprocess.run(
        [_promtool(), "check", "rules", str(shipped)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 6 rules found" in done.stdout + done.stderr


def test_promtool_finds_nothing_wrong_with_tunerds_own_page() -> None:
    pages = [
        generate_latest(Exporter("127.0.0.1:0", lambda: VIEW).registry).decode(),
        _gate_page(),
    ]
    for page in pages:
        done = subprocess.run(
            [_promtool(), "check", "metrics"],
            input=page,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert not (done.stdout + done.stderr).strip(), done.stdout + done.stderr  # no lint either
