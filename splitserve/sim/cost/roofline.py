"""Roofline cost of a step: a GPU's data sheet × a model shape, with stated efficiencies.

  FLOPs = 2 · matmul params · tokens + 2 · LM head params · sampled rows
          + 4 · layers · heads · head_dim · attention pairs (prefill: causal, chunk × its
            context; decode: each sequence's context)
  bytes = weights (read once a step) + KV read (decode contexts, prefill chunks' contexts)
          + KV written (the step's tokens)
  step  = max(FLOPs / (peak · compute_efficiency), bytes / (HBM bandwidth · memory_efficiency))
          + step_overhead_s (scheduling, launches, sampling: the part no roofline has)

The KV pool is what is left of `memory_utilization` of HBM after the weights and an
activation reserve. KV moves over NVLink within a node and over the GPU's NIC across nodes,
each at `link_efficiency` of its rated bandwidth.

Tensor parallelism (`tensor_parallel` T, one worker = T GPUs of a node): each GPU holds 1/T of
the weights, the KV heads and the FLOPs, so both roofline terms divide by T; every layer adds two
all-reduces of the step's activations (tokens × hidden, ring: 2 (T-1)/T of them over NVLink, plus
`allreduce_latency_s` each). The KV pool is the T GPUs' together; a hand-over moves each rank's
heads over its own NIC (T links in parallel). A model whose weights do not fit T GPUs is refused.
Pipeline stages, data-parallel attention, experts and latent attention: parallel.py, which
reduces to this model for one stage of a dense one.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

from splitserve.engine.step_shape import StepShape
from splitserve.sim.cost import Link
from splitserve.sim.cost.hardware import GPUSpec
from splitserve.sim.cost.shapes import ModelShape
from splitserve.types import ConfigError


@dataclass(frozen=True)
class RooflineCost:
    gpu: GPUSpec
    model: ModelShape
    compute_efficiency: float = 0.6  # of peak bf16 FLOP/s that large GEMMs reach (prefill MFU 50-65% is typical)
    memory_efficiency: float = 0.8  # of HBM bandwidth a decode step's reads reach
    step_overhead_s: float = 0.002  # per step: scheduler, kernel launches, sampling, detokenizing
    memory_utilization: float = 0.9  # share of HBM the engine may use
    activation_reserve_bytes: float = 4e9
    link_efficiency: float = 0.8
    tensor_parallel: int = 1  # GPUs per worker
    allreduce_latency_s: float = 10e-6  # per all-reduce (NCCL within a node, small messages)
    name: str = "roofline"

    def __post_init__(self) -> None:
        for n in ("compute_efficiency", "memory_efficiency", "memory_utilization", "link_efficiency"):
            if not 0 < getattr(self, n) <= 1:
                raise ConfigError(f"roofline {n} must be in (0, 1], got {getattr(self, n)}")
        if self.step_overhead_s < 0 or self.allreduce_latency_s < 0:
            raise ConfigError("roofline step_overhead_s and allreduce_latency_s must be >= 0")
        if not isinstance(self.model, ModelShape):
            raise ConfigError(f"{self.model.name} is not a dense GQA shape: the parallel roofline (parallel.py) "
                              "models it")
        t = self.tensor_parallel
        if not isinstance(t, int) or isinstance(t, bool) or t < 1:
            raise ConfigError(f"roofline tensor_parallel must be an integer >= 1, got {t!r}")
        if self.model.num_kv_heads % t or self.model.num_heads % t:
            raise ConfigError(f"tensor_parallel {t} does not divide {self.model.name}'s heads "
                              f"({self.model.num_heads} query, {self.model.num_kv_heads} KV)")
        if self._kv_bytes() <= 0:
            raise ConfigError(f"{self.model.name} ({self.model.weight_bytes / 1e9:.0f} GB of weights) leaves no KV "
                              f"memory on {t} × {self.gpu.name}: it needs (more) tensor parallelism")

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token

    @property
    def link(self) -> Link:
        e, t = self.link_efficiency, self.tensor_parallel
        return Link(self.gpu.nvlink_bandwidth * e * t, self.gpu.network_bandwidth * e * t)

    @property
    def gpus_per_worker(self) -> int:
        return self.tensor_parallel

    def _kv_bytes(self) -> float:
        """The KV pool of one worker: what each of its GPUs has left after its weight shard."""
        t = self.tensor_parallel
        per_gpu = self.gpu.hbm_bytes * self.memory_utilization - self.model.weight_bytes / t \
            - self.activation_reserve_bytes
        return per_gpu * t

    def kv_blocks(self, block_size: int) -> int:
        return int(self._kv_bytes() // (self.kv_bytes_per_token * block_size))

    @functools.cached_property
    def _per(self) -> tuple[float, ...]:
        """Seconds per unit of each term (computed once: the simulator asks every step)."""
        m, t = self.model, self.tensor_parallel
        flop_s = self.gpu.bf16_flops * self.compute_efficiency * t
        byte_s = self.gpu.hbm_bandwidth * self.memory_efficiency * t
        return (2 * m.matmul_params / flop_s, 2 * m.vocab * m.hidden / flop_s,
                4 * m.num_layers * m.num_heads * m.head_dim / flop_s, m.weight_bytes / byte_s,
                m.kv_bytes_per_token / byte_s) + self._allreduce()

    def _allreduce(self) -> tuple[float, float]:
        """(seconds per step, seconds per token) of the two all-reduces per layer; none at T = 1."""
        m, t = self.model, self.tensor_parallel
        if t == 1:
            return (0.0, 0.0)
        per_token = 2 * (t - 1) / t * m.hidden * m.dtype_bytes / (self.gpu.nvlink_bandwidth * self.link_efficiency)
        return (2 * m.num_layers * self.allreduce_latency_s, 2 * m.num_layers * per_token)

    def step_s(self, s: StepShape) -> float:
        token, head, pair, weights, kv, ar_step, ar_token = self._per
        compute = token * (s.prefill_tokens + s.decode_seqs) + head * s.sampled + pair * (s.prefill_attended + s.decode_context)
        memory = weights + kv * (s.decode_context + s.prefill_context + s.decode_seqs)
        comm = ar_step + ar_token * (s.prefill_tokens + s.decode_seqs) if ar_step else 0.0
        return (compute if compute > memory else memory) + comm + self.step_overhead_s

    def coeffs(self) -> tuple[float, float, float, float, float]:
        """The roofline made linear the way the engine's fit sees a real GPU: a weight-bound
        step floor, compute per prefill token, the decode reads per sequence and per context
        token, and the compute per prefill attention pair."""
        m, g, t = self.model, self.gpu, self.tensor_parallel
        flop_s, byte_s = g.bf16_flops * self.compute_efficiency * t, g.hbm_bandwidth * self.memory_efficiency * t
        ar_step, ar_token = self._allreduce()
        c0 = m.weight_bytes / byte_s + self.step_overhead_s + ar_step
        c1 = 2 * m.matmul_params / flop_s + ar_token
        c2 = (2 * m.vocab * m.hidden) / flop_s + m.kv_bytes_per_token / byte_s + ar_token
        pair = 4 * m.num_layers * m.num_heads * m.head_dim / flop_s
        c3 = max(m.kv_bytes_per_token / byte_s, pair)
        return (c0, c1, c2, c3, pair)

    def describe(self) -> dict:
        d = asdict(self)
        d["kv_blocks_per_16"] = self.kv_blocks(16)
        d["weight_bytes"] = self.model.weight_bytes
        return d
