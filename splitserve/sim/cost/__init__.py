"""Cost models: how long a simulated engine step takes, how many KV blocks a worker holds, and
how fast KV moves between workers. Chosen by name (`make_cost`):

    linear     the engine's own step-time form, c0 + c1·prefill tokens + c2·decode seqs +
               c3·decode context tokens, with coefficients measured on a machine
               (`splitserve simulate --calibrate`, linear.py) or fitted to a GPU bench JSON
               (profiled.py)
    roofline   a GPU type's data sheet × a model shape, with stated efficiency factors
               (roofline.py)

Every model also gives the linear coefficients the workers report in `WorkerStats`, which
admission and the autoscaler read: what a real worker's online fit would converge to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

from splitserve.types import ConfigError


class StepShape(NamedTuple):  # a tuple: one per simulated step
    """What one scheduled step computes (from a SchedulerOutput)."""

    prefill_tokens: int = 0  # tokens of prefill chunks
    prefill_attended: float = 0.0  # Σ chunk tokens × (context before it + half the chunk): causal attention pairs
    prefill_context: int = 0  # Σ (context + chunk) over chunks: the KV those chunks read
    decode_seqs: int = 0
    decode_context: int = 0  # Σ context of the decoding sequences (the KV decode reads)
    sampled: int = 0  # rows that go through the LM head


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

    def step_s(self, shape: StepShape) -> float:
        """Seconds one engine step of this shape takes."""
        ...

    def kv_blocks(self, block_size: int) -> int:
        """KV blocks of `block_size` tokens one worker holds."""
        ...

    def coeffs(self) -> tuple[float, float, float, float]:
        """(c0, c1, c2, c3) of the engine's linear step-time form, as a worker reports them."""
        ...

    def describe(self) -> dict:
        """Everything the model assumes, for the result JSON."""
        ...
