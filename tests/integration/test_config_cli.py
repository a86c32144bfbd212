"""`tunerd config check` and `tunerd run` on bad configs: DESIGN §4.1's exit codes."""

from __future__ import annotations

from pathlib import Path

from tests.integration.cli import run_tunerd as _tunerd

ROOT = Path(__file__).parents[2]


def test_a_good_config_checks_ok(tmp_path: Path) -> None:
    config = tmp_path / "tunerd.yaml"
    config.write_text(
        "engine:\n  name: llama\n  command: [vllm, serve, /srv/m]\n  settings: {max_num_seqs: 8}\n"
        f"policies: [{ROOT / 'policies' / 'default.yaml'}]\nmode: act\n"
    )
    result = _tunerd("config", "check", "--config", str(config))
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{config}: ok (engines: llama; 7 policies; mode act)\n"


def test_bad_configs_exit_2_with_located_problems(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("engines:\n  - name: a\n    command: [vllm, serve, m, --max-num-seqs, '8']\n")
    for command in (("config", "check"), ("run",)):
        result = _tunerd(*command, "--config", str(config))
        assert result.returncode == 2
        assert f"{config}:3: engines[0].command[3]: --max-num-seqs is tuned by tunerd" in result.stderr
        assert "the config did not load" in result.stderr


def test_policies_the_config_names_are_checked_too(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text(
        "version: 1\npolicies:\n  - name: x\n    when: {metric: kv_cache_usage, above: 0.9, for: banana}\n    then: [{notify: {severity: info}}]\n"
    )
    config = tmp_path / "tunerd.yaml"
    config.write_text("engine: {name: a, command: [vllm, serve, m]}\npolicies: [p.yaml]\n")
    result = _tunerd("config", "check", "--config", str(config))
    assert result.returncode == 2
    assert "p.yaml:4: policy 'x'" in result.stderr
    assert "invalid duration 'banana'" in result.stderr


def test_config_check_explains_a_systemd_engine_with_a_command(tmp_path: Path) -> None:
    config = tmp_path / "tunerd.yaml"
    config.write_text(
        "engine: {name: llama31, control: systemd, unit: vllm-llama31.service, command: [vllm, serve, m]}\n"
        f"policies: []\nstate_dir: {tmp_path / 'state'}\n"
    )
    done = _tunerd("config", "check", "--config", str(config))
    assert done.returncode == 2, done.stderr
    assert (
        "tunerd.yaml:1: engines[0].command: systemd control: the command is the unit's ExecStart"
        in done.stderr
    )
    assert "Traceback" not in done.stderr
