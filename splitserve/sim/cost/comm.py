"""The communication and pipelining terms of the parallel roofline (parallel.py), as pure
formulas — each one what its docstring says, so a test can check it by hand:

  pipeline      S stages, m micro-batches: a synchronous (flush) step takes Σ stage times + (m-1)
                × the slowest + (S-1) activation transfers — with equal stages of t / m each,
                t · (S + m - 1) / m, the bubble; asynchronous (micro-batches of successive steps
                overlap, as the seed's "several batches in flight"), the longer of one
                micro-batch's round trip and m passes of the slowest stage
  all-reduce    T ranks, g a node: within a node a ring, 2 (g-1)/g of the message over NVLink;
                across N nodes hierarchical (as NCCL's tree / NVLS): that within each node, then
                each rank's 1/g share all-reduced across the nodes over its own NIC, 2 (N-1)/N
                of it; plus one latency
  all-to-all    MoE dispatch and combine: tokens × top_k × hidden × dtype bytes a rank sends,
                (g-1)/R of them to its node's peers over NVLink and (R-g)/R to other nodes over
                its NIC (g of the R ranks in a node), the two at once; plus one latency
  transfer      point to point: latency + bytes / bandwidth
  experts hit   n tokens each picking top_k of E experts (uniformly): E (1 - (1 - k/E)^n) of them
                get at least one, and only their weights are read
"""

from __future__ import annotations

import math
from typing import Sequence

from splitserve.types import ConfigError

ACT_BYTES = 2  # bf16 activations, what all-reduces and pipeline transfers carry
SCHEDULES = ("flush", "async")


def bubble_factor(stages: int, micro_batches: int) -> float:
    """A synchronous pipeline's step over the time one stage takes for the whole batch."""
    return (stages + micro_batches - 1) / micro_batches


def pipeline_s(stage_s: Sequence[float], micro_batches: int, transfer_s: float = 0.0, schedule: str = "flush"
               ) -> float:
    """One step through the stages, given each stage's time for one micro-batch."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"unknown pipeline schedule {schedule!r}; known: {', '.join(SCHEDULES)}")
    hops = (len(stage_s) - 1) * transfer_s
    if schedule == "flush":
        return sum(stage_s) + (micro_batches - 1) * max(stage_s) + hops
    return max(sum(stage_s) + hops, micro_batches * max(stage_s))


def allreduce_s(nbytes: float, ranks: int, ranks_per_node: int, nvlink_bandwidth: float, network_bandwidth: float,
                latency_s: float) -> float:
    if ranks <= 1:
        return 0.0
    g = min(ranks, ranks_per_node)
    nodes = math.ceil(ranks / g)
    return (latency_s + 2 * (g - 1) / g * nbytes / nvlink_bandwidth
            + 2 * (nodes - 1) / nodes * nbytes / g / network_bandwidth)


def all_to_all_bytes(tokens: float, top_k: int, hidden: int, dtype_bytes: float) -> float:
    """Bytes a rank sends in one MoE dispatch (or combine) of its `tokens`."""
    return tokens * top_k * hidden * dtype_bytes


def all_to_all_s(nbytes: float, ranks: int, ranks_per_node: int, nvlink_bandwidth: float,
                 network_bandwidth: float, intra_latency_s: float, cross_latency_s: float) -> float:
    if ranks <= 1:
        return 0.0
    g = min(ranks, ranks_per_node)
    latency = cross_latency_s if ranks > g else intra_latency_s
    return latency + max(nbytes * (g - 1) / ranks / nvlink_bandwidth, nbytes * (ranks - g) / ranks / network_bandwidth)


def transfer_s(nbytes: float, bandwidth: float, latency_s: float) -> float:
    return latency_s + nbytes / bandwidth


def experts_hit(tokens: float, experts: int, top_k: int) -> float:
    """Expected experts that get at least one of `tokens` tokens (top_k of `experts` each)."""
    if experts == 0 or tokens <= 0:
        return 0.0
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)
