"""GPU profiles: the memory CUDA really exposes on each card, not the number on the box.

``total_bytes`` is what ``cudaMemGetInfo`` (and so PyTorch and vLLM) reports as the device
total: the driver keeps a few hundred MiB for itself, so an RTX 4090 sold as 24 GiB exposes
about 23.5 GiB. vLLM's budget is ``ceil(total_bytes × gpu_memory_utilization)``, so planning
against the box's number overstates every pool. The figures and their sources are listed in
``docs/planner.md`` (GPU profiles); newer drivers report slightly less than older ones, and
each profile takes the newest report found.
"""

from __future__ import annotations

from dataclasses import dataclass

from tunerd.units import GIB, MIB

__all__ = ["GPU_PROFILES", "GpuProfile", "custom_gpu", "gpu_profile"]


@dataclass(frozen=True)
class GpuProfile:
    name: str
    description: str
    total_bytes: int  # CUDA-visible total
    nvidia_smi_total_mib: int  # what `nvidia-smi --query-gpu=memory.total` prints
    consumer: bool  # a desktop card (display neighbours, PCIe, 24 GiB class)
    arch: str  # ampere | ada | hopper
    reported: str  # how the total was seen, for --explain
    # Datasheet speeds, for the simulator's roofline (the planner's arithmetic does not use them).
    bandwidth_bytes_per_s: float = 1.0e12  # memory bandwidth
    bf16_flops: float = 150e12  # dense bf16 tensor throughput (fp32 accumulate)

    @property
    def fp8_kv_native(self) -> bool:
        """fp8 has hardware support (Ada, Hopper); Ampere cards depend on the attention backend."""
        return self.arch in {"ada", "hopper"}

    @property
    def vllm_default_max_num_seqs(self) -> int:
        """vLLM 0.33's API-server default for ``--max-num-seqs`` on this card."""
        return 1024 if self._large else 256

    @property
    def vllm_default_max_num_batched_tokens(self) -> int:
        """vLLM 0.33's API-server default for ``--max-num-batched-tokens`` on this card."""
        if self.total_bytes >= 160 * GIB:
            return 16384
        return 8192 if self._large else 2048

    @property
    def _large(self) -> bool:
        # arg_utils: 70 GiB or more, except that every A100 keeps the small defaults.
        return self.total_bytes >= 70 * GIB and not self.name.startswith("a100")


def _mib(value: float) -> int:
    return int(value * MIB)


# fmt: off
GPU_PROFILES: dict[str, GpuProfile] = {
    profile.name: profile
    for profile in (
        GpuProfile("rtx4090", "NVIDIA GeForce RTX 4090 24 GB", _mib(24084), 24564, True, "ada",
                   "23.52 GiB total in torch's OOM text and vLLM's start-up check (driver R580)",
                   bandwidth_bytes_per_s=1008e9, bf16_flops=165.2e12),
        GpuProfile("rtx3090", "NVIDIA GeForce RTX 3090 24 GB", _mib(24125), 24576, True, "ampere",
                   "23.56 GiB in vLLM's 'Free memory on device (22.93/23.56 GiB)'",
                   bandwidth_bytes_per_s=936e9, bf16_flops=71e12),
        GpuProfile("rtx4080", "NVIDIA GeForce RTX 4080 16 GB", _mib(16049), 16376, True, "ada",
                   "torch total_memory=16049MB (15.67 GiB); 15.99 GiB on an older driver",
                   bandwidth_bytes_per_s=716.8e9, bf16_flops=97.5e12),
        GpuProfile("rtx4070ti", "NVIDIA GeForce RTX 4070 Ti 12 GB", _mib(12011), 12282, True, "ada",
                   "11.73 GiB total capacity in torch's OOM text",
                   bandwidth_bytes_per_s=504e9, bf16_flops=80.2e12),
        GpuProfile("a10g", "NVIDIA A10G 24 GB (AWS g5)", _mib(22508), 23028, False, "ampere",
                   "21.98 GiB total capacity in torch's OOM text on a g5.12xlarge (22.06 GiB elsewhere)",
                   bandwidth_bytes_per_s=600e9, bf16_flops=70e12),
        GpuProfile("l4", "NVIDIA L4 24 GB", _mib(22559), 23034, False, "ada",
                   "22.03 GiB total capacity in torch's OOM text",
                   bandwidth_bytes_per_s=300e9, bf16_flops=121e12),
        GpuProfile("l40s", "NVIDIA L40S 48 GB", _mib(45599), 46068, False, "ada",
                   "44.53 GiB total capacity in torch's OOM text",
                   bandwidth_bytes_per_s=864e9, bf16_flops=362e12),
        GpuProfile("a100-40g", "NVIDIA A100-SXM4-40GB", 42298834944, 40960, False, "ampere",
                   "42,298,834,944 bytes from deviceQuery (39.39 GiB)",
                   bandwidth_bytes_per_s=1555e9, bf16_flops=312e12),
        GpuProfile("a100-80g", "NVIDIA A100-SXM4-80GB", _mib(81050), 81920, False, "ampere",
                   "total_gpu_memory=79.15GiB in vLLM's start-up log",
                   bandwidth_bytes_per_s=2039e9, bf16_flops=312e12),
        GpuProfile("h100-80g", "NVIDIA H100 80GB HBM3", _mib(81009), 81559, False, "hopper",
                   "79.11 GiB total capacity in torch's OOM text",
                   bandwidth_bytes_per_s=3350e9, bf16_flops=989e12),
        GpuProfile("h100-pcie", "NVIDIA H100 PCIe 80 GB", _mib(81008), 81559, False, "hopper",
                   "torch total_memory=81008MB (79.11 GiB)",
                   bandwidth_bytes_per_s=2000e9, bf16_flops=756e12),
        GpuProfile("h200", "NVIDIA H200 141 GB", _mib(143166), 143771, False, "hopper",
                   "139.81 GiB in vLLM's 'Free memory on device (139.21/139.81 GiB)'",
                   bandwidth_bytes_per_s=4800e9, bf16_flops=989e12),
    )
}
# fmt: on

_ALIASES = {
    "4090": "rtx4090",
    "rtx-4090": "rtx4090",
    "3090": "rtx3090",
    "rtx-3090": "rtx3090",
    "a100": "a100-80g",
    "a100-40gb": "a100-40g",
    "a100-80gb": "a100-80g",
    "h100": "h100-80g",
    "h100-80gb": "h100-80g",
    "h100-sxm": "h100-80g",
    "h100-sxm5": "h100-80g",
    "h100-pcie-80g": "h100-pcie",
    "4080": "rtx4080",
    "rtx-4080": "rtx4080",
    "4070ti": "rtx4070ti",
    "4070-ti": "rtx4070ti",
    "rtx-4070-ti": "rtx4070ti",
    "h200-141g": "h200",
}


#: A card of this size or less is planned with consumer-card rules (the 24 GiB class).
CONSUMER_MAX_BYTES = 32 * GIB


def custom_gpu(total_bytes: int) -> GpuProfile:
    """A card known only by its CUDA-visible total (``--gpu-mem``)."""
    return GpuProfile(
        name="custom",
        description=f"a GPU of {total_bytes / GIB:.2f} GiB",
        total_bytes=total_bytes,
        nvidia_smi_total_mib=0,
        consumer=total_bytes <= CONSUMER_MAX_BYTES,
        arch="unknown",
        reported="--gpu-mem",
    )


def gpu_profile(name: str) -> GpuProfile:
    """The profile called ``name`` (aliases such as ``4090`` accepted); unknown names raise
    ``ValueError`` listing the known ones."""
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    profile = GPU_PROFILES.get(key)
    if profile is None:
        known = ", ".join(GPU_PROFILES)
        raise ValueError(f"unknown GPU '{name}' (known: {known}; or pass --gpu-mem SIZE)")
    return profile
