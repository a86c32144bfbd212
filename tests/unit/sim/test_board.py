"""The shared simulated card's board: what each engine posts, what the others read."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tunerd.planner.gpus import gpu_profile
from tunerd.sim.board import GpuBoard
from tunerd.sim.engine import Neighbour, SimGpu


def test_engines_see_each_other_and_a_dead_ones_memory_is_freed(tmp_path: Path) -> None:
    path = tmp_path / "card.json"
    gone = subprocess.Popen(["true"])
    gone.wait()  # a PID that no longer runs: an engine that was killed
    mine, theirs, dead = GpuBoard(path, os.getpid()), GpuBoard(path, os.getppid()), GpuBoard(path, gone.pid)
    assert mine.exchange(30 << 30) == {}
    dead.exchange(5 << 30)
    assert theirs.exchange(20 << 30) == {os.getpid(): 30 << 30}  # the dead one is dropped
    assert mine.exchange(31 << 30) == {os.getppid(): 20 << 30}
    mine.leave()
    assert theirs.exchange(20 << 30) == {}
    assert GpuBoard(path, 1).exchange(0) == {os.getppid(): 20 << 30}  # posting nothing adds nothing


def test_peers_hold_their_memory_before_neighbours_grow_into_it() -> None:
    gpu = SimGpu(gpu_profile("h100-80g"), [Neighbour(7, "notebook", 60 << 30)])
    gpu.peers = [Neighbour(42, "python3", 30 << 30)]
    held = {n.pid: size for n, size in gpu.neighbour_bytes(0.0, engine_bytes=20 << 30)}
    assert held[42] == 30 << 30
    assert held[7] == gpu.cuda_total_bytes - (50 << 30)  # the notebook gets only what is left
