"""`tunerd incident`, `record` and `replay` as a person meets them with nothing to show yet or
a bad file: each says what is wrong, with the exit status the help promises."""

from __future__ import annotations

from pathlib import Path

from tests.integration.cli import run_tunerd
from tunerd.state import State

SHIPPED = Path(__file__).parents[2] / "policies" / "default.yaml"


def test_no_state_no_incident_and_no_daemon_to_record_from(tmp_path: Path) -> None:
    missing = run_tunerd("incident", "list", "--state-dir", str(tmp_path / "none"))
    assert missing.returncode == 2
    assert "no state" in missing.stderr
    State.open(tmp_path / "state").close()  # a state with no incident in it
    listed = run_tunerd("incident", "list", "--state-dir", str(tmp_path / "state"))
    assert listed.returncode == 0
    assert listed.stdout == "no incidents recorded\n"
    assert run_tunerd(
        "incident", "list", "--json", "--state-dir", str(tmp_path / "state")
    ).stdout.strip() == ('{\n  "incidents": []\n}')
    shown = run_tunerd("incident", "show", "5", "--state-dir", str(tmp_path / "state"))
    assert shown.returncode == 1
    assert "no incident 5 (tunerd incident list shows them)" in shown.stderr
    later = run_tunerd(
        "record", "main", "--for", "1h", str(tmp_path / "x.jsonl"), "--socket", str(tmp_path / "s")
    )
    assert later.returncode == 3
    assert f"no status socket at {tmp_path / 's'}: is tunerd running?" in later.stderr
    neither = run_tunerd("record", str(tmp_path / "x.jsonl"))
    assert neither.returncode == 2
    assert "say --incident ID FILE, or ENGINE --for D FILE, or ENGINE --last D FILE" in neither.stderr


def test_replay_names_the_bad_line_and_the_bad_policy(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"format": "tunerd-recording", "version": 1, "engine": "main"}\n{"t": 1, "samples": {"kv": 1}}\n'
    )
    replayed = run_tunerd("replay", str(bad), "--policies", str(SHIPPED))
    assert replayed.returncode == 2
    assert f"{bad}:2: unknown signal 'kv'" in replayed.stderr
    good = tmp_path / "good.jsonl"
    good.write_text(
        '{"format": "tunerd-recording", "version": 1, "engine": "main"}\n{"t": 1, "tick": true}\n'
    )
    policy = tmp_path / "p.yaml"
    policy.write_text(
        "version: 1\npolicies:\n  - name: x\n    when: {metric: nope, above: 1}\n    then: []\n"
    )
    refused = run_tunerd("replay", str(good), "--policies", str(policy))
    assert refused.returncode == 2
    assert "p.yaml" in refused.stderr
    fine = run_tunerd("replay", str(good), "--policies", str(SHIPPED), "--json")
    assert fine.returncode == 0, fine.stderr
    assert fine.stdout.strip() == '{\n  "decisions": []\n}'
