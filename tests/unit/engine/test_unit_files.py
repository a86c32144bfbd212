"""systemd mode's pure pieces: the environment file tunerd writes, ``systemctl show``'s output."""

from __future__ import annotations

import pytest

from tunerd.engine.args import engine_argv
from tunerd.engine.process import ProcessError
from tunerd.engine.unit import env_file_text, parse_show, parse_timespan, unit_problems


def test_env_file_holds_the_flags_on_one_quoted_line() -> None:
    flags = engine_argv((), {"max_num_seqs": 12, "kv_cache_dtype": "fp8", "enable_prefix_caching": False}, 30)
    text = env_file_text(flags)
    lines = [line for line in text.splitlines() if not line.startswith("#")]
    assert lines == [
        'TUNERD_ARGS="--max-num-seqs 12 --kv-cache-dtype fp8 --no-enable-prefix-caching --shutdown-timeout 30"'
    ]


@pytest.mark.parametrize("bad", ["two words", 'a"quote', "back\\slash", "$HOME", ""])
def test_a_flag_systemd_would_split_or_expand_is_refused(bad: str) -> None:
    # an unbraced $TUNERD_ARGS is split at whitespace by systemd: such a value would change meaning
    with pytest.raises(ProcessError, match="TUNERD_ARGS"):
        env_file_text(["--served-model-name", bad])


def test_show_output_is_read_as_key_values() -> None:
    # as systemd 252 prints `systemctl show UNIT -p MainPID -p ActiveState -p InvocationID`
    shown = parse_show("MainPID=4242\nActiveState=active\nInvocationID=9f1c0a2b3c4d4e5f8a9b0c1d2e3f4a5b\n")
    assert shown == {
        "MainPID": "4242",
        "ActiveState": "active",
        "InvocationID": "9f1c0a2b3c4d4e5f8a9b0c1d2e3f4a5b",
    }
    assert parse_show("ExecMainStatus=\n") == {"ExecMainStatus": ""}


@pytest.mark.parametrize(
    ("shown", "seconds"),
    [("1min 30s", 90.0), ("2min 30s", 150.0), ("45s", 45.0), ("500ms", 0.5), ("1h 5min", 3900.0)],
)
def test_time_spans_read_as_systemctl_prints_them(shown: str, seconds: float) -> None:
    # systemd's format_timespan(): the units of systemd.time(7), largest first, space-separated
    assert parse_timespan(shown) == seconds


def test_infinity_and_garbage() -> None:
    assert parse_timespan("infinity") == float("inf")
    assert parse_timespan("soon") is None


def test_the_shipped_unit_has_no_problems_and_systemd_defaults_have_three() -> None:
    shipped = {"LoadState": "loaded", "KillMode": "mixed", "Restart": "no", "TimeoutStopUSec": "2min 30s"}
    assert unit_problems("vllm-llama31.service", shipped, drain=120) == []
    defaults = {
        "LoadState": "loaded",
        "KillMode": "control-group",
        "Restart": "on-failure",
        "TimeoutStopUSec": "1min 30s",
    }
    problems = unit_problems("vllm-a.service", defaults, drain=120)
    assert [p.split(":", 2)[1].strip().split("=")[0] for p in problems] == [
        "KillMode",
        "Restart",
        "TimeoutStopSec",
    ]
    assert "TimeoutStopSec=90s is shorter than the drain (120s) + 30s" in problems[2]
    missing = unit_problems("vllm-b.service", {"LoadState": "not-found"}, drain=120)
    assert missing == [
        "vllm-b.service: LoadState=not-found: systemd has no such unit (systemctl cat vllm-b.service)"
    ]
