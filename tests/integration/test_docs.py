"""Every command in README.md and docs/*.md is run here, so the docs stay true (issue 10).

Commands are the ``$ `` lines of ``console`` blocks and every line of ``sh`` blocks. tunerd's
own commands run for real, in document order, from the repository root, against a daemon this
module starts over a simulated engine (with a local webhook receiver as its chat sink) — the
paths of a real install (``/etc/tunerd/tunerd.yaml``, port 8000) are pointed at it. What cannot
run on a test machine (installing into /etc, systemctl, journalctl, kubectl) is checked for
what it names: the repository files it copies exist, the Make targets exist. ``make demo`` and
``make test`` are what CI and tests/integration/test_demo.py run.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from tests.integration.notify_receiver import Receiver, receiver
from tests.integration.sim_daemon import free_port, sim_command
from tunerd.policy.schema import load_policy_file
from tunerd.state import State

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: Tools of the host that a test machine cannot run for real; their repository paths are checked.
SYSTEM_TOOLS = {
    "systemctl", "journalctl", "systemd-sysusers", "systemd-tmpfiles", "sudoedit", "install", "cp",
    "python3", "pip", "kubectl", "promtool", "amtool", "curl", "nvidia-smi", "chmod", "chown",
    "mkdir", "ls", "tail", "cat", "grep", "ss", "systemd-run",
}  # fmt: skip
#: Documented commands that must fail, and how (everything else must exit 0).
EXPECTED_EXIT = {
    "tunerd run --config bad.yaml": 2,
    # the box has made no change to undo ("nothing to roll back"); tests/integration/
    # test_people_win.py runs rollbacks that take
    "tunerd rollback llama31-8b --reason the last tune made it worse": 2,
    # the box's incidents are not these, nor is its recording there ("no incident 3", "No such
    # file"); tests/integration/test_run_stories.py shows, records and replays a real incident
    "tunerd incident show 3": 1,
    "tunerd incident show 12": 1,
    "tunerd incident show 12 --html /tmp/incident-12.html": 1,
    "tunerd replay oom.jsonl --policies edited.yaml": 2,
}
#: Run elsewhere: the demo by tests/integration/test_demo.py, the test suite by CI, the gate
#: (a server, and its status against one) by tests/integration/test_gate.py.
RUN_ELSEWHERE = {"tunerd demo", "make demo", "make test", "tunerd gate"}


@dataclass(frozen=True)
class Command:
    doc: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.text}"


def _commands(path: Path) -> list[Command]:
    found = []
    lines = path.read_text(encoding="utf-8").splitlines()
    kind = None
    index = 0
    while index < len(lines):
        line = lines[index]
        fence = re.match(r"^```(\w*)", line)
        if fence:
            kind = None if kind is not None else (fence.group(1) or "text")
            index += 1
            continue
        start = index
        text = None
        if kind == "console" and line.startswith("$ "):
            text = line[2:]
        elif kind in ("sh", "bash", "shell") and line.strip() and not line.lstrip().startswith("#"):
            text = line
        while text is not None and text.rstrip().endswith("\\") and index + 1 < len(lines):
            index += 1
            text = text.rstrip()[:-1] + " " + lines[index].strip()
        if text is not None:
            text = re.sub(r"\s+#\s.*$", "", text).strip()  # a trailing comment
            found.append(Command(str(path.relative_to(ROOT)), start + 1, " ".join(text.split())))
        index += 1
    return found


def _normal(text: str) -> list[str]:
    """The argv as a user on a tunerd host types it: without sudo, tunerd by its plain name."""
    argv = shlex.split(text)
    while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", argv[0]):  # NO_COLOR=1 tunerd status
        argv = argv[1:]
    while argv and argv[0] == "sudo":
        argv = argv[3:] if argv[1:2] == ["-u"] else argv[1:]
    if argv and argv[0].endswith("/tunerd"):
        argv[0] = "tunerd"
    if argv and argv[0].endswith("/pip"):
        argv[0] = "pip"
    return argv


ALL = [command for doc in DOCS for command in _commands(doc)]


def test_the_docs_have_commands_and_each_is_known() -> None:
    assert len(ALL) > 30
    for command in ALL:
        argv = _normal(command.text)
        assert argv, command
        assert argv[0] in {"tunerd", "make", *SYSTEM_TOOLS}, f"{command}: not a command this test knows"


def test_system_commands_name_files_that_exist() -> None:
    for command in ALL:
        argv = _normal(command.text)
        if argv[0] == "make":
            targets = re.findall(r"^([a-z-]+):", (ROOT / "Makefile").read_text(), flags=re.M)
            asked = {arg for arg in argv[1:] if "=" not in arg}  # NAME=value sets a make variable
            assert asked <= set(targets), command
        elif argv[0] in SYSTEM_TOOLS:
            for arg in argv[1:]:
                top = arg.split("/", 1)[0]
                if "/" in arg and top in {"systemd", "policies", "contrib", "docs", "tests", "bench"}:
                    assert (ROOT / arg.rstrip("/")).exists(), f"{command}: no {arg} in the repository"


@dataclass
class Fixture:
    config: Path
    bad: Path
    engine_url: str
    doc_port: int
    hooks: Receiver
    state_dir: Path


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fixture]:
    """A running tunerd over a simulated engine, advise mode, a webhook sink; and a bad config."""
    tmp = tmp_path_factory.mktemp("docs")
    port = free_port()
    with receiver("webhook") as hooks:
        config = tmp / "tunerd.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "engines": [
                        {
                            "name": "llama31-8b",  # the docs' example engine
                            "command": sim_command(port),
                            "url": f"http://127.0.0.1:{port}",
                            "settings": {
                                "gpu_memory_utilization": 0.92,
                                "max_model_len": 32768,
                                "max_num_seqs": 8,
                                "max_num_batched_tokens": 2048,
                                "kv_cache_dtype": "fp8",
                            },
                            "bounds": {"gpu_memory_utilization": [0.80, 0.92], "max_num_seqs": [2, 8]},
                            "startup_timeout": "60s",
                            "probation": "1s",
                        }
                    ],
                    "gpu": {"source": "sim", "url": f"http://127.0.0.1:{port}"},
                    "mode": "advise",
                    "policies": [str(ROOT / "policies" / "default.yaml")],
                    "notify": [{"name": "ops", "kind": "webhook", "url": hooks.url}],
                    "state_dir": str(tmp / "state"),
                    "listen": {"status": str(tmp / "tunerd.sock"), "metrics": "127.0.0.1:0"},
                }
            )
        )
        bad = tmp / "bad.yaml"
        bad.write_text(
            "engines:\n  - name: main\n    command: [vllm, serve, /m]\n    settings: {max_num_seqs: many}\n"
        )
        daemon = subprocess.Popen(
            [sys.executable, "-m", "tunerd", "run", "--config", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 60
            while not (tmp / "tunerd.sock").exists() or not _healthy(f"http://127.0.0.1:{port}"):
                assert time.monotonic() < deadline, "the docs' daemon never came up"
                time.sleep(0.2)
            # one crash and the restart after it, as on a box someone was paged for: the
            # engine's log before the restart is kept as llama31-8b.log.1
            state = State.open(tmp / "state", readonly=True)
            record = state.engine("llama31-8b")
            assert record is not None
            assert record.pid is not None
            os.killpg(record.pid, signal.SIGKILL)
            while state.engine("llama31-8b").pid == record.pid or not _healthy(f"http://127.0.0.1:{port}"):  # type: ignore[union-attr]
                assert time.monotonic() < deadline + 60, "the docs' engine was never restarted"
                time.sleep(0.2)
            state.close()
            yield Fixture(config, bad, f"http://127.0.0.1:{port}", free_port(), hooks, tmp / "state")
        finally:
            daemon.terminate()
            daemon.wait(30)
            with contextlib.suppress(Exception):
                state = State.open(tmp / "state")
                record = state.engine("llama31-8b")
                state.close()
                if record is not None and record.pid:
                    os.killpg(record.pid, signal.SIGKILL)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


_TALKS_TO_A_DAEMON = {
    "status", "history", "resume", "pin", "rollback", "notify", "config", "run", "incident", "record",
}  # fmt: skip


def _rewrite(argv: list[str], box: Fixture) -> list[str]:
    """Point a documented command at this module's box."""
    out: list[str] = []
    for given in argv:
        arg = str(box.doc_port) if out[-1:] == ["--port"] and given == "8000" else given
        arg = arg.replace("/etc/tunerd/tunerd.yaml", str(box.config))
        arg = arg.replace("/var/lib/tunerd", str(box.state_dir))
        arg = str(box.bad) if arg == "bad.yaml" else arg
        arg = str(ROOT / "tests/data/model_configs/llama-3.1-8b.json") if arg == "./config.json" else arg
        out.append(arg.replace("127.0.0.1:8000", f"127.0.0.1:{box.doc_port}"))
    if out[1:3] == ["inspect", "gpu"] and "--source" not in out:
        out += ["--source", "sim", "--url", box.engine_url]  # no NVML here: the box's simulated GPU
    if len(out) > 1 and out[1] in _TALKS_TO_A_DAEMON and "--config" not in out and "--help" not in out:
        out += ["--config", str(box.config)]
    return [sys.executable, "-m", "tunerd", *out[1:]]


def _tunerd_commands() -> list[Command]:
    return [
        c
        for c in ALL
        if _normal(c.text)[0] == "tunerd" and " ".join(_normal(c.text)[:2]) not in RUN_ELSEWHERE
    ]


def test_every_tunerd_command_in_the_docs_runs(box: Fixture) -> None:
    served: subprocess.Popen[bytes] | None = None
    failures = []
    try:
        for command in _tunerd_commands():
            argv = _rewrite(_normal(command.text), box)
            if argv[3:5] == ["sim", "serve"]:  # a server: start it, wait until it answers
                if "--port" not in argv:
                    argv += ["--port", str(box.doc_port)]
                served = subprocess.Popen(
                    [*argv, "--time-scale", "50"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
                deadline = time.monotonic() + 30
                while not _healthy(f"http://127.0.0.1:{box.doc_port}") and time.monotonic() < deadline:
                    time.sleep(0.1)
                if not _healthy(f"http://127.0.0.1:{box.doc_port}"):
                    failures.append(f"{command}: never answered")
                continue
            if argv[3:4] == ["run"] and str(box.bad) not in argv:
                continue  # the daemon itself: this module's box is one
            argv = [
                found
                for arg in argv
                for found in (sorted(glob.glob(arg, root_dir=ROOT)) if "*" in arg else [arg])
            ]
            done = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)
            expected = EXPECTED_EXIT.get(" ".join(_normal(command.text)), 0)
            argv = [
                match
                for arg in argv
                for match in (sorted(glob.glob(arg, root_dir=ROOT)) if "*" in arg else [arg])
            ]
            if done.returncode != expected:
                failures.append(
                    f"{command}: exit {done.returncode}, expected {expected}\n{done.stdout[-800:]}{done.stderr[-800:]}"
                )
    finally:
        if served is not None:
            served.terminate()
            served.wait(30)
    assert not failures, "\n\n".join(failures)


def test_every_policy_file_in_the_docs_is_valid() -> None:
    """The cookbook's recipes (and any whole policy file a doc shows) pass `tunerd policy check`."""
    checked = 0
    for doc in DOCS:
        for block in re.findall(r"```yaml\n(.*?)```", doc.read_text(encoding="utf-8"), flags=re.S):
            if block.startswith("version: 1") and "\npolicies:" in block:
                load_policy_file(f"{doc.name} block {checked}", block)  # raises, located, when bad
                checked += 1
    assert checked >= 5


def test_the_kubernetes_example_config_passes_config_check(tmp_path: Path) -> None:
    """docs/fleet.md: the DaemonSet's tunerd.yaml, with the shipped policies beside it."""
    documents = list(yaml.safe_load_all((ROOT / "contrib/kubernetes/tunerd-daemonset.yaml").read_text()))
    assert [document["kind"] for document in documents] == ["ConfigMap", "DaemonSet"]
    (tmp_path / "tunerd.yaml").write_text(documents[0]["data"]["tunerd.yaml"])
    (tmp_path / "policies").mkdir()
    (tmp_path / "policies" / "default.yaml").write_text((ROOT / "policies" / "default.yaml").read_text())
    done = subprocess.run(
        [sys.executable, "-m", "tunerd", "config", "check", "--config", str(tmp_path / "tunerd.yaml")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "10 policies; mode advise" in done.stdout


def test_the_annotated_config_in_docs_passes_config_check(tmp_path: Path) -> None:
    """docs/config.md's example, with the chat sink's variables set as the unit would set them."""
    block = re.findall(r"```yaml\n(.*?)```", (ROOT / "docs" / "config.md").read_text(), flags=re.S)[0]
    (tmp_path / "tunerd.yaml").write_text(block)
    done = subprocess.run(
        [sys.executable, "-m", "tunerd", "config", "check", "--config", str(tmp_path / "tunerd.yaml")],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "TUNERD_FEISHU_URL": "https://open.feishu.cn/x", "TUNERD_FEISHU_SECRET": "s"},
    )
    assert done.returncode == 0, done.stderr
