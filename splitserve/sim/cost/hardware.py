"""GPU types the roofline model knows, from their vendors' data sheets (dense bf16 tensor
FLOP/s without sparsity, HBM capacity and bandwidth, the NVLink bandwidth one GPU has to its
node's peers in one direction, and its share of the node's scale-out network). Pure data."""

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


_G = 1e9
GPUS: dict[str, GPUSpec] = {g.name: g for g in (
    GPUSpec("h100", 989e12, 80 * _G, 3.35e12, 450 * _G, 400 / 8 * _G),
    GPUSpec("h200", 989e12, 141 * _G, 4.8e12, 450 * _G, 400 / 8 * _G),
    GPUSpec("a100", 312e12, 80 * _G, 2.039e12, 300 * _G, 200 / 8 * _G),
    GPUSpec("h20", 148e12, 96 * _G, 4.0e12, 450 * _G, 400 / 8 * _G),
    GPUSpec("l40s", 362e12, 48 * _G, 864 * _G, 32 * _G, 200 / 8 * _G),  # no NVLink: PCIe Gen4 x16
)}


def gpu(name: str) -> GPUSpec:
    spec = GPUS.get(name.lower())
    if spec is None:
        raise ConfigError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}")
    return spec
