"""GPU types the roofline model knows, from their vendors' data sheets (dense bf16 and FP8
tensor FLOP/s without sparsity, HBM capacity and bandwidth, the NVLink bandwidth one GPU has to
its node's peers in one direction, and its share of the node's scale-out network). Pure data.

Sources: NVIDIA's H100 / H200 / A100 / L40S data sheets (the sparsity figures halved); H20-96G
and H800-80G as the LMSYS / Ant Group H20 report tabulates them ("Best Practices for Serving
DeepSeek-R1 on H20-96G", 2025-09-26: FP8 296 vs 1979 TFLOPS, BF16 148 vs 989, 96 vs 80 GB,
4.0 vs 3.35 TB/s, NVLink 900 vs 400 GB/s — both directions, halved here). The network: one
400 Gb/s NIC per GPU (8 × 400 Gb/s a node, InfiniBand NDR / RoCE), 200 Gb/s on A100 / L40S nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.types import ConfigError


@dataclass(frozen=True)
class GPUSpec:
    name: str
    bf16_flops: float  # dense, FLOP/s
    hbm_bytes: float
    hbm_bandwidth: float  # bytes/s
    nvlink_bandwidth: float  # bytes/s, one direction, to a peer in the node (PCIe where there is no NVLink)
    network_bandwidth: float  # bytes/s, this GPU's NIC (scale-out, across nodes)
    fp8_flops: float = 0.0  # dense FP8 tensor FLOP/s (0: no FP8 tensor cores — FP8 weights run at bf16 rate)

    @property
    def weight_flops(self) -> float:
        """FLOP/s of a GEMM on FP8 weights: FP8 tensor cores where there are any."""
        return self.fp8_flops or self.bf16_flops


_G = 1e9
GPUS: dict[str, GPUSpec] = {g.name: g for g in (
    GPUSpec("h100", 989e12, 80 * _G, 3.35e12, 450 * _G, 400 / 8 * _G, 1979e12),
    GPUSpec("h200", 989e12, 141 * _G, 4.8e12, 450 * _G, 400 / 8 * _G, 1979e12),
    GPUSpec("a100", 312e12, 80 * _G, 2.039e12, 300 * _G, 200 / 8 * _G),
    GPUSpec("h20", 148e12, 96 * _G, 4.0e12, 450 * _G, 400 / 8 * _G, 296e12),
    GPUSpec("h800", 989e12, 80 * _G, 3.35e12, 200 * _G, 400 / 8 * _G, 1979e12),
    GPUSpec("l40s", 362e12, 48 * _G, 864 * _G, 32 * _G, 200 / 8 * _G, 733e12),  # no NVLink: PCIe Gen4 x16
)}


def gpu(name: str) -> GPUSpec:
    spec = GPUS.get(name.lower())
    if spec is None:
        raise ConfigError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}")
    return spec
