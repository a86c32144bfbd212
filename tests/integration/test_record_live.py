"""`tunerd record ENGINE --for D FILE` and `--last D` against a running `tunerd run` (a real
daemon process over the simulator, its status socket on disk), as docs/incidents.md shows;
the file is a recording `tunerd replay` and `tunerd policy test` take."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.integration.cli import TunerdRun, run_tunerd
from tests.integration.sim_daemon import sim_config
from tunerd import __version__

SHIPPED = Path(__file__).parents[2] / "policies" / "default.yaml"
pytestmark = pytest.mark.slow


def _ticks(path: Path) -> list[dict[str, object]]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0]["format"] == "tunerd-recording"
    assert lines[0]["source"] == "daemon"
    return [line for line in lines[1:] if line.get("tick")]


def test_the_next_and_the_last_minutes_from_the_running_daemon(tmp_path: Path) -> None:
    config, _ = sim_config(tmp_path, policies=[str(SHIPPED)], metrics={"interval": "500ms"})
    tunerd = TunerdRun(config)
    try:
        tunerd.event("restart_finished", timeout=60)
        ahead = tmp_path / "next.jsonl"
        recorded = run_tunerd(
            "record", "main", "--for", "4s", str(ahead), "--config", str(config), timeout=60
        )
        assert recorded.returncode == 0, recorded.stderr
        assert "recording main: " in recorded.stderr  # progress, as it goes
        assert f"wrote {ahead}: main," in recorded.stderr
        ticks = _ticks(ahead)
        assert len(ticks) >= 4  # 4 s at 2 Hz, a tick or two lost to a loaded box at most
        span = float(ticks[-1]["t"]) - float(ticks[0]["t"])  # type: ignore[arg-type]
        assert 2.5 <= span <= 4.5
        past = tmp_path / "last.jsonl"
        recorded = run_tunerd("record", "main", "--last", "3s", str(past), "--config", str(config))
        assert recorded.returncode == 0, recorded.stderr
        assert 3 <= len(_ticks(past)) <= 8
        replayed = run_tunerd("replay", str(ahead), "--policies", str(SHIPPED), "--json")
        assert replayed.returncode == 0, replayed.stderr
        decisions = json.loads(replayed.stdout)["decisions"]
        assert all(d["recorded"] == d["replayed"] for d in decisions)  # the daemon's, replayed
        # what cannot be: an engine it does not run, longer than it keeps, nonsense
        nobody = run_tunerd("record", "other", "--for", "1s", str(tmp_path / "x"), "--config", str(config))
        assert nobody.returncode == 2
        assert "no engine 'other' (tunerd runs: main)" in nobody.stderr
        long = run_tunerd("record", "main", "--for", "30d", str(tmp_path / "x"), "--config", str(config))
        assert long.returncode == 2
        assert "tunerd keeps the last 2h of main's ticks: record at most that" in long.stderr
        bad = run_tunerd("record", "main", "--for", "soon", str(tmp_path / "x"), "--config", str(config))
        assert bad.returncode == 2
        assert "--for 'soon'" in bad.stderr
        assert not (tmp_path / "x").exists()
        # the socket's GET /recording, asked what no client of ours asks
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(tmp_path / "state" / "tunerd.sock"))) as raw:
            for query, code in [
                ("engine=main&since=abc", 400),
                ("engine=main&since=nan", 400),
                ("engine=main&until=inf", 400),
                ("engine=", 404),
                ("engine=main&since=1e300", 200),  # a window after now: nothing in it
                ("engine=main&" + "x=1&" * 2000, 200),  # a long query is cut, not choked on
            ]:
                answer = raw.get(f"http://tunerd/recording?{query}", timeout=30)
                assert answer.status_code == code, (query, answer.text)
            assert raw.get("http://tunerd/recording?engine=main&since=1e300").json()["lines"] == []
    finally:
        assert tunerd.stop() == 0
    # the journal's first and last lines say which tunerd ran with which config (issue 21)
    started, stopped = tunerd.event("tunerd_starting"), tunerd.event("tunerd_stopped", timeout=10)
    for said in (started, stopped):
        assert said["version"] == __version__
        assert said["config"] == str(config.resolve())
    assert started["engines"] == ["main"]
    assert (stopped["reason"], stopped["exit_code"]) == ("asked to stop", 0)


def test_with_no_daemon_it_says_so(tmp_path: Path) -> None:
    config, _ = sim_config(tmp_path)
    done = run_tunerd("record", "main", "--for", "1h", str(tmp_path / "x.jsonl"), "--config", str(config))
    assert done.returncode == 3  # no daemon answered
    assert "no status socket at" in done.stderr
    assert "is tunerd running?" in done.stderr
    both = run_tunerd("record", "--incident", "3", "main", "--last", "1m", "x", "--config", str(config))
    assert both.returncode == 2
    assert "not both" in both.stderr
