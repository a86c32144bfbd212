"""The shipped systemd-mode files (contrib/systemd/): the engine unit passes `systemd-analyze
verify` and keeps the four lines tunerd relies on; the polkit rule, run in Node.js against a
stand-in `polkit` object, grants the tunerd user start/stop/restart of that one unit only.
Each part skips with a reason where its tool is missing."""

from __future__ import annotations

import configparser
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CONTRIB = Path(__file__).parents[2] / "contrib" / "systemd"
SERVICE = Path(__file__).parents[2] / "systemd"
UNIT = CONTRIB / "vllm-llama31.service"
RULE = CONTRIB / "50-tunerd-vllm-llama31.rules"


def _service(path: Path = UNIT) -> configparser.SectionProxy:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(path.read_text())
    return parser["Service"]


def test_the_engine_unit_keeps_what_tunerd_relies_on() -> None:
    service = _service()
    assert service["EnvironmentFile"] == "-/var/lib/tunerd/engines/llama31.env"
    assert service["ExecStart"].endswith(" $TUNERD_ARGS")
    assert service["Restart"] == "no"
    assert service["KillMode"] == "mixed"
    assert int(service["TimeoutStopSec"]) >= 120 + 30  # the default drain + 30 s


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_analyze_verify_accepts_the_engine_unit(tmp_path: Path) -> None:
    # verify checks that ExecStart's program exists: point it at one that does here
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace("/opt/vllm/bin/vllm serve", f"{sys.executable} -m vllm"))
    done = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == ""  # parse warnings ("Unknown key ...") only go to stderr


RUN_RULE = """
const rules = [];
globalThis.polkit = { Result: { YES: "yes", NO: "no" }, addRule: (rule) => rules.push(rule) };
require(process.argv[1]);
const ask = ([unit, verb, user]) => {
  const action = { id: "org.freedesktop.systemd1.manage-units", lookup: (k) => ({ unit, verb })[k] };
  return rules.map((rule) => rule(action, { user })).find((r) => r !== undefined) ?? null;
};
console.log(JSON.stringify(JSON.parse(process.argv[2]).map(ask)));
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js not installed")
def test_the_polkit_rule_grants_one_unit_to_tunerd_only(tmp_path: Path) -> None:
    rule = tmp_path / "rule.js"
    rule.write_text(RULE.read_text())
    asks = [
        ["vllm-llama31.service", "restart", "tunerd"],
        ["vllm-llama31.service", "start", "tunerd"],
        ["vllm-llama31.service", "stop", "tunerd"],
        ["vllm-llama31.service", "restart", "alice"],
        ["sshd.service", "restart", "tunerd"],
        ["vllm-llama31.service", "set-property", "tunerd"],
    ]
    done = subprocess.run(
        ["node", "-e", RUN_RULE, str(rule), json.dumps(asks)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == ["yes", "yes", "yes", None, None, None]


def test_tunerds_own_unit_keeps_what_the_daemon_relies_on() -> None:
    service = _service(SERVICE / "tunerd.service")
    assert service["Type"] == "notify"
    assert int(service["WatchdogSec"]) > 0
    assert service["KillMode"] == "process"  # supervised engines outlive a tunerd restart
    assert service["RestartPreventExitStatus"] == "2"  # a bad config is not retried
    assert service["PrivateDevices"] == "no"  # it would hide /dev/nvidia*
    assert service["StateDirectory"] == service["RuntimeDirectory"] == "tunerd"
    text = (SERVICE / "tunerd.service").read_text()
    for device in ("nvidiactl", "nvidia-frontend", "nvidia-uvm"):
        assert f"DeviceAllow=char-{device} rw" in text


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
@pytest.mark.parametrize("name", ["tunerd.service", "tunerd-gate.service"])
def test_systemd_analyze_verify_accepts_tunerds_units(tmp_path: Path, name: str) -> None:
    unit = tmp_path / name
    unit.write_text(
        (SERVICE / name).read_text().replace("/opt/tunerd/bin/tunerd", f"{sys.executable} -m tunerd")
    )
    done = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == ""


@pytest.mark.skipif(shutil.which("systemd-sysusers") is None, reason="systemd-sysusers not installed")
def test_sysusers_and_tmpfiles_make_the_user_and_folders(tmp_path: Path) -> None:
    # both tools take --root: they run against an empty tree here, not this machine
    (tmp_path / "etc").mkdir()
    for name in ("passwd", "group"):
        (tmp_path / "etc" / name).touch()
    sysusers = subprocess.run(
        ["systemd-sysusers", f"--root={tmp_path}", str(SERVICE / "tunerd.sysusers")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert sysusers.returncode == 0, sysusers.stderr
    passwd = (tmp_path / "etc" / "passwd").read_text()
    assert passwd.startswith("tunerd:x:")
    assert ":/var/lib/tunerd:" in passwd
    groups = (tmp_path / "etc" / "group").read_text().splitlines()
    for group in ("video", "systemd-journal"):  # /dev/nvidia*; the engine unit's journal
        assert any(line.startswith(f"{group}:") and line.endswith(":tunerd") for line in groups), groups
    tmpfiles = subprocess.run(
        ["systemd-tmpfiles", f"--root={tmp_path}", "--create", str(SERVICE / "tunerd.tmpfiles")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert tmpfiles.returncode == 0, tmpfiles.stderr
    uid = int(passwd.split(":")[2])
    for folder, mode in (("etc/tunerd", 0o750), ("var/lib/tunerd/engines", 0o750)):
        info = (tmp_path / folder).stat()
        assert info.st_mode & 0o777 == mode
    assert (tmp_path / "var/lib/tunerd/engines").stat().st_uid == uid


def test_the_gates_unit_is_its_own_and_shares_the_runtime_folder_safely() -> None:
    service = _service(SERVICE / "tunerd-gate.service")
    assert service["ExecStart"] == "/opt/tunerd/bin/tunerd gate --config /etc/tunerd/tunerd.yaml"
    assert service["Type"] == "notify"
    assert service["Restart"] == "always"  # the data path comes back whatever ended it
    assert service["RestartPreventExitStatus"] == "2"
    assert int(service["TimeoutStopSec"]) > 30  # the gate's 30 s drain fits
    # both units name /run/tunerd; without Preserve, stopping either removes the other's socket
    tunerd = _service(SERVICE / "tunerd.service")
    assert service["RuntimeDirectory"] == tunerd["RuntimeDirectory"] == "tunerd"
    assert service["RuntimeDirectoryPreserve"] == tunerd["RuntimeDirectoryPreserve"] == "yes"
