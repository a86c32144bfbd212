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
    assert result.stdout == f"{config}: ok (engines: llama; 10 policies; mode act)\n"


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


def test_what_run_would_trip_on_is_refused_by_config_check_and_by_run(tmp_path: Path) -> None:
    """Issue 16: `config check` said ok to each of these, then `run` failed or misbehaved."""
    config = tmp_path / "tunerd.yaml"
    config.write_text(
        "engines:\n"
        "  - name: a\n"
        "    command: [vllm, serve, m, --gpu_memory_utilization, '0.5', --disable_log_stats]\n"  # 3
        "    env: {'A=B': x}\n"  # 4
        "    bounds: {max_num_seqs: [16, 4]}\n"  # 5
        "    settings: {max_num_seqs: 1.0e+30}\n"  # 6
        "    probation: 1.0e+30\n"  # 7
        "listen: {metrics: '$(id):80', status: \"/run/t\\0.sock\"}\n"  # 8
        "notify: [{name: t, kind: webhook, url: 'file:///etc/passwd'}, {name: [], kind: teams, url: 5}]\n"  # 9
        "guards: {window: 0s, shared_gpu_max: true}\n"  # 10
        "policies: [nowhere/*.yaml]\n"  # 11
    )
    for command in (("config", "check"), ("run",)):
        done = _tunerd(*command, "--config", str(config))
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr
        problems = done.stderr.splitlines()
        for where in (
            "3: engines[0].command[3]: --gpu_memory_utilization (vLLM reads it as --gpu-memory-utilization)",
            "3: engines[0].command[5]: --disable_log_stats (vLLM reads it as --disable-log-stats)",
            "4: engines[0].env.A=B: expected a variable's name",
            "5: engines[0].bounds.max_num_seqs: max_num_seqs bounds are [low, high], got [16, 4]",
            "6: engines[0].settings.max_num_seqs: max_num_seqs must be at most 1,048,576",
            "7: engines[0].probation: duration 1e+30 is longer than 30 days",
            "8: listen.metrics: expected HOST:PORT",
            "8: listen.status: a NUL character (\\0) is not accepted",
            "9: notify[0].url: expected an http:// or https:// URL to a host, not a file: URL",
            "9: notify[1].name: Input should be a valid string, got []",
            "9: notify[1].url: Input should be a valid string, got 5",
            "10: guards.window: duration '0s' must be more than zero",
            "10: guards.shared_gpu_max: Input should be a valid number, got True",
        ):
            assert any(line.startswith(f"{config}:{where}") for line in problems), (where, problems)
        assert problems[-1].endswith("the config did not load")


def test_a_policy_glob_that_matches_nothing_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "tunerd.yaml"
    config.write_text("engine: {name: a, command: [vllm, serve, m]}\npolicies: [policies/*.yaml]\n")
    done = _tunerd("config", "check", "--config", str(config))
    assert done.returncode == 2
    assert (
        f"{config}:2: policies[0]: 'policies/*.yaml' matches no file (relative to {tmp_path.resolve()})"
        in done.stderr
    )


def test_an_alias_bomb_is_refused_at_once(tmp_path: Path) -> None:
    config = tmp_path / "tunerd.yaml"
    config.write_text(
        "engines: &a [x, x, x, x, x, x, x, x, x]\n"
        + "".join(
            f"{b}: &{b} [*{a}, *{a}, *{a}, *{a}, *{a}, *{a}, *{a}, *{a}, *{a}]\n"
            for a, b in zip("abcdefgh", "bcdefghi", strict=True)
        )
    )
    done = _tunerd("config", "check", "--config", str(config), timeout=15)  # it expanded for 20 s
    assert done.returncode == 2
    assert (
        f"{config}:1: YAML anchors and aliases (&x, *x) are not accepted: write the values out" in done.stderr
    )
