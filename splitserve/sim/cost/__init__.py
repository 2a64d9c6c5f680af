"""Cost models: how long a simulated engine step takes, how many KV blocks a worker holds, and
how fast KV moves between workers. Chosen by name (`make_cost`):

    linear     the engine's own step-time form, c0 + c1·prefill tokens + c2·decode seqs +
               c3·decode context tokens + c4·prefill attention pairs, with coefficients
               measured on a machine (`splitserve simulate --calibrate`, linear.py), taken from
               served workers' online fits (their /metrics), or fitted to a GPU bench JSON
               (profiled.py)
    roofline   a GPU type's data sheet × a model shape, with stated efficiency factors
               (roofline.py)
    parallel   the same for a worker cut into pipeline stages, tensor-parallel groups (within or
               across nodes), data-parallel attention replicas and expert-parallel ranks, for
               dense and latent-attention MoE shapes (parallel.py: the terms; comm.py: the
               collectives' and the pipeline's formulas; mla_moe.py: DeepSeek-V3/R1's shape)

Every model also gives the linear coefficients the workers report in `WorkerStats`, which
admission and the autoscaler read: what a real worker's online fit would converge to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from splitserve.engine.step_shape import StepShape
from splitserve.types import ConfigError, Role


@dataclass(frozen=True)
class Link:
    """KV transfer between two workers: latency + bytes / bandwidth, by locality."""

    same_node_bandwidth: float  # bytes/s
    cross_node_bandwidth: float
    same_node_latency_s: float = 20e-6
    cross_node_latency_s: float = 50e-6

    def __post_init__(self) -> None:
        if not (self.same_node_bandwidth > 0 and self.cross_node_bandwidth > 0):
            raise ConfigError("link bandwidths must be > 0")
        if self.same_node_latency_s < 0 or self.cross_node_latency_s < 0:
            raise ConfigError("link latencies must be >= 0")

    def transfer_s(self, num_bytes: int, same_node: bool) -> float:
        if same_node:
            return self.same_node_latency_s + num_bytes / self.same_node_bandwidth
        return self.cross_node_latency_s + num_bytes / self.cross_node_bandwidth


class CostModel(Protocol):
    name: str
    kv_bytes_per_token: int
    link: Link
    gpus_per_worker: int  # GPUs one worker holds (tensor parallelism)

    def step_s(self, shape: StepShape) -> float:
        """Seconds one engine step of this shape takes."""
        ...

    def kv_blocks(self, block_size: int) -> int:
        """KV blocks of `block_size` tokens one worker holds."""
        ...

    def coeffs(self) -> tuple[float, float, float, float, float]:
        """(c0, c1, c2, c3, c4) of the engine's linear step-time form (engine/step_model.py),
        as a worker reports them."""
        ...

    def describe(self) -> dict:
        """Everything the model assumes, for the result JSON."""
        ...


@dataclass(frozen=True)
class ByRole:
    """A cost model per pool, where the two sides were measured apart (a served deployment's
    prefill and decode workers each fit their own steps). KV size and links: the decode side's."""

    prefill: CostModel
    decode: CostModel

    @staticmethod
    def of(cost: "CostModel | ByRole") -> "ByRole":
        return cost if isinstance(cost, ByRole) else ByRole(cost, cost)

    def of_role(self, role: Role) -> CostModel:
        return self.prefill if role is Role.PREFILL else self.decode
