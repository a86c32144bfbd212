"""`tunerd policy check` and `tunerd policy test` as a user runs them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


def tunerd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tunerd", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=ROOT,
    )


def test_policy_check_shipped_policies_pass() -> None:
    files = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "policies").rglob("*.yaml"))
    result = tunerd("policy", "check", *files)
    assert result.returncode == 0, result.stderr
    assert "policies/default.yaml: ok (10 policies)" in result.stdout


def test_policy_test_shipped_tests_pass() -> None:
    files = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "tests" / "policies").glob("*_test.yaml"))
    result = tunerd("policy", "test", *files)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "FAIL" not in result.stdout
    assert result.stdout.count("PASS") >= 14


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        (
            "version: 1\npolicies:\n  - name: p\n    when: {metric: kv_cache_usage, above: [0.9\n",
            "YAML syntax error",
        ),
        (
            "version: 1\npolicies:\n  - name: p\n    when: {metric: kv_cache_usage, above: 0.9}\n"
            "    then: [{tune: {swap_space: 4}}]\n",
            "p.yaml:5: policy 'p': then[0].tune.swap_space:",
        ),
    ],
)
def test_policy_check_broken_exit_2(tmp_path: Path, text: str, fragment: str) -> None:
    (tmp_path / "p.yaml").write_text(text)
    result = subprocess.run(
        [sys.executable, "-m", "tunerd", "policy", "check", "p.yaml"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert fragment in result.stderr


def test_policy_test_wrong_expectation_exit_1_shows_what_happened(tmp_path: Path) -> None:
    test = (ROOT / "tests" / "policies" / "default_test.yaml").read_text()
    test = test.replace(
        "policies: [../../policies/default.yaml]", f"policies: [{ROOT / 'policies' / 'default.yaml'}]"
    )
    test = test.replace(
        "tune: {max_num_seqs: 6}\n        restart: true\n    expect_no_other_actions: true",
        "tune: {max_num_seqs: 5}\n        restart: true\n    expect_no_other_actions: true",
    )
    (tmp_path / "t.yaml").write_text(test)
    result = tunerd("policy", "test", str(tmp_path / "t.yaml"))
    assert result.returncode == 1
    assert "FAIL" in result.stdout
    assert "expected at 11m: max_num_seqs → 5, restart" in result.stdout
    assert "at 660s (kv-pool-saturated): max_num_seqs 8→6, restart, notify warning" in result.stdout


def test_policy_test_bad_file_exit_2(tmp_path: Path) -> None:
    (tmp_path / "t.yaml").write_text(
        "policies: [x.yaml]\ninterval: 5s\ntests:\n  - name: a\n    series: {kv_usage: '1x3'}\n"
    )
    result = tunerd("policy", "test", str(tmp_path / "t.yaml"))
    assert result.returncode == 2
    assert "t.yaml:5: test 'a': series.kv_usage: unknown signal 'kv_usage'" in result.stderr


def test_policy_check_refuses_an_alias_bomb_at_once(tmp_path: Path) -> None:
    """Issue 16: these 400 bytes cost `policy check` 20 s and 1.1 GB."""
    bomb = "version: 1\npolicies: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{b}: &{b} [*{a}, *{a}, *{a}, *{a}, *{a}, *{a}, *{a}, *{a}, *{a}]\n"
        for a, b in zip("abcdefgh", "bcdefghi", strict=True)
    )
    (tmp_path / "bomb.yaml").write_text(bomb)
    result = subprocess.run(
        [sys.executable, "-m", "tunerd", "policy", "check", "bomb.yaml"],
        capture_output=True,
        text=True,
        timeout=15,
        check=False,
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert (
        result.stderr
        == "bomb.yaml:2: YAML anchors and aliases (&x, *x) are not accepted: write the values out\n"
    )


SHIPPED = sorted([*(ROOT / "policies").glob("*.yaml"), *(ROOT / "policies" / "examples").glob("*.yaml")])


@pytest.mark.parametrize("policies", SHIPPED, ids=[path.stem for path in SHIPPED])
def test_every_shipped_policy_file_has_passing_tests_and_a_healthy_engine_fires_none(policies: Path) -> None:
    """Issue 17: each shipped file has its policy tests (tests/policies/STEM_test.yaml), they
    pass the user's way (`tunerd policy test FILE`), and one of them is a healthy engine that
    fires nothing — the desktop example's over_budget used to warn on a healthy engine for ever."""
    test = ROOT / "tests" / "policies" / f"{policies.stem}_test.yaml"
    assert test.exists(), f"{policies} has no tests: write {test.relative_to(ROOT)}"
    assert f"../../{policies.relative_to(ROOT)}" in test.read_text()
    result = tunerd("policy", "test", str(test.relative_to(ROOT)))
    assert result.returncode == 0, result.stdout + result.stderr
    healthy = [line for line in result.stdout.splitlines() if line.startswith("PASS") and "a healthy" in line]
    assert healthy, result.stdout
