"""The simulated box's hidden truth: what a real card, driver and process hold that no model
knows in advance. Pure.

A :class:`Box` is drawn from a seed (``tunerd sim serve --box-seed N``) within the ranges seen
on real cards (each range and where it comes from is in ``docs/simulator.md``, "Hidden box
truth"):

- ``cuda_context_bytes``: the engine process's CUDA context and library handles, outside
  vLLM's budget (PyTorch + cuBLAS, lazy module loading: 0.28–0.62 GiB);
- ``non_torch_bytes``: what grows during vLLM's profile run beside the activations (kernel
  modules, workspaces), inside the budget;
- ``activation_scale``: the step's real working set against the textbook count of four hidden
  tensors and the MLP's intermediate (kernels, attention metadata and temporaries differ);
- ``graph_scale``: the CUDA graph pool against the planner's estimate;
- ``frag_max``: how far the caching allocator's kept working set creeps above what a step
  needs once it has seen many step shapes;
- ``desktop_bytes``: a desktop's display server and its clients on a consumer card (0 on a
  data-centre card, or a headless one);
- ``driver_reserve_bytes``: NVML's total less what CUDA exposes (NVML v2 reports it as
  ``reserved``, as the real driver does).

The default box (no seed) is the planner's assumptions exactly — the simulator the rest of
the suite has always run against. With a seed, the planner is wrong by the box's draw, and
tunerd has to find out from what a real box shows (NVML, the log, ``/metrics``);
:mod:`tunerd.sim.truth` searches the simulator itself for the settings that really are safe.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, replace
from typing import Any

from tunerd.planner.bills import (
    CUDA_CONTEXT_BYTES,
    HOPPER_WORKSPACE_BYTES,
    NON_TORCH_BYTES,
    Runtime,
    activation_bytes,
    runtime_bytes,
)
from tunerd.planner.gpus import GpuProfile
from tunerd.planner.shapes import ModelShape
from tunerd.units import MIB

__all__ = ["RANGES", "Box", "default_box", "draw_box"]

#: The ranges a seeded box is drawn from (low, high), per parameter.
RANGES: dict[str, tuple[float, float]] = {
    "cuda_context_bytes": (280 * MIB, 620 * MIB),
    "non_torch_bytes": (40 * MIB, 260 * MIB),
    "activation_scale": (0.85, 1.35),
    "graph_scale": (0.7, 1.3),
    "frag_max": (0.05, 0.35),
    "desktop_bytes": (120 * MIB, 900 * MIB),  # when there is a desktop (consumer cards, one in two)
    "driver_reserve_bytes": (380 * MIB, 660 * MIB),
}
#: The share of consumer boxes with a desktop on the card (the rest run headless).
DESKTOP_SHARE = 0.5


@dataclass(frozen=True)
class Box:
    """One simulated box's hidden parameters (see the module's text)."""

    seed: int | None
    cuda_context_bytes: int
    non_torch_bytes: int
    activation_scale: float
    graph_scale: float
    frag_max: float
    desktop_bytes: int
    driver_reserve_bytes: int

    def runtime(self, shape: ModelShape, max_num_seqs: int, enforce_eager: bool) -> Runtime:
        """The runtime bill this box really holds: its context and non-torch memory, and the
        graph pool at ``graph_scale`` of the planner's estimate."""
        estimate = runtime_bytes(shape, max_num_seqs, enforce_eager)
        return replace(
            estimate,
            cuda_context_bytes=self.cuda_context_bytes,
            non_torch_bytes=self.non_torch_bytes,
            cuda_graph_bytes=round(estimate.cuda_graph_bytes * self.graph_scale),
        )

    def working_set(self, shape: ModelShape, tokens: int, requests: int) -> int:
        """The activation bytes a step of ``tokens`` tokens over ``requests`` requests really
        takes on this box (before the allocator's fragmentation)."""
        if tokens <= 0:
            return 0
        return round(activation_bytes(shape, tokens, max(1, requests)).bytes * self.activation_scale)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def default_box(profile: GpuProfile, *, frag_max: float = 0.3, desktop_bytes: int = 0) -> Box:
    """The planner's assumptions as a box: what the simulator is without ``--box-seed``."""
    return Box(
        seed=None,
        cuda_context_bytes=CUDA_CONTEXT_BYTES,
        non_torch_bytes=NON_TORCH_BYTES + (HOPPER_WORKSPACE_BYTES if profile.arch == "hopper" else 0),
        activation_scale=1.0,
        graph_scale=1.0,
        frag_max=frag_max,
        desktop_bytes=desktop_bytes,
        driver_reserve_bytes=max(0, profile.nvidia_smi_total_mib * MIB - profile.total_bytes),
    )


def draw_box(seed: int, profile: GpuProfile) -> Box:
    """A box drawn from ``seed``: the same seed and card give the same box."""
    rng = random.Random(f"tunerd-box-{seed}")

    def uniform(name: str) -> float:
        low, high = RANGES[name]
        return rng.uniform(low, high)

    desktop = 0
    has_desktop = rng.random() < DESKTOP_SHARE  # drawn on every card, so the rest do not shift
    desktop_size = uniform("desktop_bytes")
    if profile.consumer and has_desktop:
        desktop = round(desktop_size)
    return Box(
        seed=seed,
        cuda_context_bytes=round(uniform("cuda_context_bytes")),
        non_torch_bytes=round(uniform("non_torch_bytes")),
        activation_scale=round(uniform("activation_scale"), 4),
        graph_scale=round(uniform("graph_scale"), 4),
        frag_max=round(uniform("frag_max"), 4),
        desktop_bytes=desktop,
        driver_reserve_bytes=round(uniform("driver_reserve_bytes") / MIB) * MIB,
    )
