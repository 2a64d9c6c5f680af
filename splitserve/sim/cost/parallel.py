"""The parallel roofline: a worker of `tp × dp_attention × pp` GPUs, for dense (GQA) models and
latent-attention MoE ones (DeepSeek-V3 / R1). A Layout says how the worker is cut:

  tp             an attention replica's heads (and a dense MLP, a shared expert, and — without
                 expert parallelism — every routed expert) split over tp GPUs; two all-reduces a
                 layer (attention out, MLP / MoE out) over NVLink, hierarchically over the NICs
                 too where the group spans nodes (cross-node TP: 2 × 61 = 122 a pass for DeepSeek,
                 each paying the cross-node latency)
  dp_attention   D attention replicas per stage, each with its own requests and KV (an MLA latent
                 held once per replica, not on every rank): the step's tokens, sequences and
                 contexts spread evenly over them (the router balances them; one engine stands
                 for the D schedulers, its batch their sum)
  expert_parallel routed experts spread whole over the stage's tp × D ranks (ceil(E / R) a rank);
                 every MoE layer a dispatch + combine all-to-all; the busiest rank's expert
                 tokens (and all-to-all bytes) × `expert_imbalance`
  pp             S stages of contiguous layers (the first stages one more where they do not
                 divide), each holding its layers' weights and KV — a stage's KV per token 1/S
                 of the model's; the embedding on the first, the LM head on the last; between
                 stages the activations (tokens × hidden × 2 bytes) go rank to rank, across
                 nodes where the stages are; `micro_batches` m split each step's batch
                 (comm.pipeline_s: the bubble)

Per stage and micro-batch, for one rank: FLOPs = 2 × its share of the linear weights × tokens
(FP8 GEMMs at the GPU's FP8 rate where the weights are FP8) + attention pairs × their FLOPs +
the LM head (bf16), over `compute_efficiency` of peak; bytes = its weights (only the routed
experts some token picked: comm.experts_hit) + the KV its sequences read and write, over
`memory_efficiency` of HBM; the stage takes the larger, plus its all-reduces and all-to-alls
(not overlapped with compute). A step = comm.pipeline_s over the stages + `step_overhead_s`.
With one stage, one replica and a dense model this is RooflineCost exactly (a test holds it).

The KV pool: on each rank, `memory_utilization` of HBM less its weights and an activation
reserve, over its stage's per-token KV; the worker's tokens = D × the tightest stage's.
Left out: compute/communication overlap (two-batch overlap, DeepEP's hooks), node-limited
routing's dedup of cross-node dispatch, MTP speculation, kernel efficiencies by shape, CUDA
graphs vs eager, prefill's up-projection of a cached context's latent.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass
from typing import NamedTuple

from splitserve.engine.least_squares import nonneg_least_squares
from splitserve.engine.step_shape import StepShape
from splitserve.sim.cost import Link
from splitserve.sim.cost.comm import (ACT_BYTES, SCHEDULES, all_to_all_bytes, all_to_all_s, allreduce_s, experts_hit,
                                      pipeline_s, transfer_s)
from splitserve.sim.cost.hardware import GPUSpec
from splitserve.sim.cost.layers import LayerShape
from splitserve.sim.cost.mla_moe import MLAMoEShape
from splitserve.sim.cost.shapes import ModelShape
from splitserve.types import ConfigError


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp_attention: int = 1
    expert_parallel: bool = False
    micro_batches: int = 1
    schedule: str = "flush"  # comm.SCHEDULES
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        for n in ("tp", "pp", "dp_attention", "micro_batches", "gpus_per_node"):
            v = getattr(self, n)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"layout {n} must be an integer >= 1, got {v!r}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"unknown pipeline schedule {self.schedule!r}; known: {', '.join(SCHEDULES)}")

    @property
    def stage_ranks(self) -> int:
        return self.tp * self.dp_attention

    @property
    def gpus(self) -> int:
        return self.stage_ranks * self.pp

    @property
    def name(self) -> str:
        parts = [f"dp{self.dp_attention}" if self.dp_attention > 1 else "", f"tp{self.tp}" if self.tp > 1 else "",
                 f"ep{self.stage_ranks}" if self.expert_parallel else "",
                 f"pp{self.pp}" if self.pp > 1 else "",
                 f"m{self.micro_batches}{'' if self.schedule == 'flush' else '-' + self.schedule}"
                 if self.pp > 1 or self.micro_batches > 1 else ""]
        return "-".join(p for p in parts if p) or "tp1"

    def stage_layers(self, num_layers: int) -> list[range]:
        """Contiguous layer ranges, the first `num_layers % pp` stages one layer longer."""
        if self.pp > num_layers:
            raise ConfigError(f"{self.pp} pipeline stages for {num_layers} layers")
        base, extra = divmod(num_layers, self.pp)
        out, start = [], 0
        for s in range(self.pp):
            n = base + (s < extra)
            out.append(range(start, start + n))
            start += n
        return out

    def boundary_crosses_nodes(self, s: int) -> bool:
        """Whether some rank of stage s sends to its peer of stage s + 1 on another node."""
        r, g = self.stage_ranks, self.gpus_per_node
        return any((s * r + i) // g != ((s + 1) * r + i) // g for i in range(r))


@dataclass(frozen=True)
class Stage:
    """One pipeline stage's sums, per token and per rank (computed once)."""

    layers: int
    moe_layers: int
    dense_flops: float  # per token through the replica's (attention, MLP, shared expert) weights, one rank
    routed_flops: float  # per token routed (top_k experts), one rank's share at a balanced load
    prefill_pair_flops: float  # Σ over its layers, one rank
    decode_pair_flops: float
    head_flops: float  # per sampled row, one rank (last stage)
    fixed_weight_bytes: float  # read every micro-batch: attention, MLP, shared expert, embedding / head
    expert_bytes: float  # the routed experts a rank holds (read as far as tokens hit them)
    kv_bytes_per_token: float  # one rank's share of a token's KV in this stage's layers

    @property
    def held_bytes(self) -> float:
        return self.fixed_weight_bytes + self.expert_bytes


class StageTerms(NamedTuple):
    """One stage's seconds for one micro-batch, by term (for one rank: they all take as long)."""

    compute_s: float
    memory_s: float
    allreduce_s: float
    all_to_all_s: float

    @property
    def total(self) -> float:
        return max(self.compute_s, self.memory_s) + self.allreduce_s + self.all_to_all_s


@dataclass(frozen=True)
class ParallelCost:
    gpu: GPUSpec
    model: ModelShape | MLAMoEShape
    layout: Layout = Layout()
    compute_efficiency: float = 0.6
    memory_efficiency: float = 0.8
    step_overhead_s: float = 0.002
    memory_utilization: float = 0.9
    activation_reserve_bytes: float = 4e9
    link_efficiency: float = 0.8
    expert_imbalance: float = 1.0  # the busiest rank's routed tokens over the mean (EP)
    intra_node_latency_s: float = 10e-6  # a collective or send within a node (NCCL, small messages)
    # across nodes: nccl-tests' small all-reduces over two InfiniBand nodes, DeepEP's internode
    # kernels' fixed cost — of this order (an assumption, not a measurement)
    cross_node_latency_s: float = 30e-6
    dispatch_dtype_bytes: float = 1.0  # DeepEP dispatches FP8
    combine_dtype_bytes: float = 2.0  # and combines bf16
    name: str = "parallel"

    def __post_init__(self) -> None:
        for n in ("compute_efficiency", "memory_efficiency", "memory_utilization", "link_efficiency"):
            if not 0 < getattr(self, n) <= 1:
                raise ConfigError(f"parallel roofline {n} must be in (0, 1], got {getattr(self, n)}")
        if self.expert_imbalance < 1:
            raise ConfigError(f"expert_imbalance is the busiest rank over the mean: >= 1, got {self.expert_imbalance}")
        if min(self.step_overhead_s, self.intra_node_latency_s, self.cross_node_latency_s) < 0:
            raise ConfigError("step overhead and latencies must be >= 0")
        lay, moe = self.layout, any(x.experts for x in self.model.layers())
        err = self.model.tp_error(lay.tp)
        if err:
            raise ConfigError(f"tensor_parallel {err}")
        if lay.dp_attention > 1 and moe and not lay.expert_parallel:
            raise ConfigError("data-parallel attention over a MoE model needs expert_parallel (each replica would "
                              "hold every expert)")
        if lay.expert_parallel and not moe:
            raise ConfigError(f"expert_parallel: {self.model.name} has no routed experts")
        lay.stage_layers(len(self.model.layers()))
        if self._tokens_per_replica() <= 0:
            raise ConfigError(f"{self.model.name} ({self.model.weight_bytes / 1e9:.0f} GB of weights) leaves no KV "
                              f"memory on {lay.name} × {self.gpu.name} ({lay.gpus} GPUs)")

    # -- the CostModel protocol --------------------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token

    @property
    def gpus_per_worker(self) -> int:
        return self.layout.gpus

    @property
    def link(self) -> Link:
        """A hand-over moves each stage's layers from its ranks at once (tp of them a replica)."""
        e, n = self.link_efficiency, self.layout.pp * self.layout.tp
        return Link(self.gpu.nvlink_bandwidth * e * n, self.gpu.network_bandwidth * e * n)

    def kv_blocks(self, block_size: int) -> int:
        return int(self.kv_tokens // block_size)

    @property
    def kv_tokens(self) -> float:
        return self.layout.dp_attention * self._tokens_per_replica()

    def step_s(self, s: StepShape) -> float:
        return self.stage_times(s)[1]

    @functools.cached_property
    def _coeffs(self) -> tuple[float, float, float, float, float]:
        """The linear form fitted to this model's steps over decode batches × contexts and prefill
        chunks × contexts, scaled to the replicas — what a worker's online fit would find."""
        d, rows, ys = self.layout.dp_attention, [], []
        for b in (1, 4, 16, 64, 256):
            for ctx in (512, 2048, 8192):
                rows.append((1.0, 0.0, b * d, b * d * ctx, 0.0))
                ys.append(self.step_s(StepShape(0, 0.0, 0, b * d, b * d * ctx, b * d)))
        for t in (256, 1024, 4096):
            for ctx in (0, 4096):
                n = t * d
                att = n * (ctx + (t + 1) / 2)
                rows.append((1.0, n, 0.0, 0.0, att))
                ys.append(self.step_s(StepShape(n, att, n + ctx * d, 0, 0, d)))
        c = nonneg_least_squares(rows, ys)
        return (c[0], c[1], c[2], c[3], c[4])

    def coeffs(self) -> tuple[float, float, float, float, float]:
        return self._coeffs

    def describe(self) -> dict:
        d = asdict(self)
        d.update(layout_name=self.layout.name, gpus=self.layout.gpus, kv_tokens=self.kv_tokens,
                 kv_blocks_per_16=self.kv_blocks(16), weight_bytes=self.model.weight_bytes,
                 weight_bytes_per_gpu=max(st.held_bytes for st in self.stages),
                 allreduces_per_pass=self.allreduces_per_pass, all_to_alls_per_pass=self.all_to_alls_per_pass)
        return d

    # -- the model ----------------------------------------------------------------------------------
    @property
    def allreduces_per_pass(self) -> int:
        """All-reduces one micro-batch's pass through every stage takes: two a layer under TP."""
        return 2 * len(self.model.layers()) if self.layout.tp > 1 else 0

    @property
    def all_to_alls_per_pass(self) -> int:
        """Dispatch + combine, each MoE layer, under expert parallelism."""
        return 2 * sum(st.moe_layers for st in self.stages) if self.layout.expert_parallel else 0

    @functools.cached_property
    def stages(self) -> tuple[Stage, ...]:
        return tuple(self._stage(s, r) for s, r in enumerate(self.layout.stage_layers(len(self.model.layers()))))

    def _stage(self, s: int, layer_range: range) -> Stage:
        m, lay = self.model, self.layout
        tp, ranks = lay.tp, lay.stage_ranks
        ls: list[LayerShape] = [m.layers()[i] for i in layer_range]
        wb, eb = m.weight_dtype_bytes, m.embedding_dtype_bytes

        def experts_per_rank(x: LayerShape) -> float:  # whole experts under EP, slices of all under TP
            return math.ceil(x.experts / ranks) if lay.expert_parallel else x.experts / tp

        first, last = s == 0, s == lay.pp - 1
        table = m.vocab * m.hidden * eb / tp
        # the embedding on the first stage, the LM head on the last (a tied one there too, unless that is the first)
        embed = (table if first else 0.0) + (table if last and not (m.tied_embeddings and first) else 0.0)
        return Stage(
            layers=len(ls), moe_layers=sum(1 for x in ls if x.experts),
            dense_flops=2 * sum(x.attn_params + x.mlp_params for x in ls) / tp,
            routed_flops=2 * sum(x.top_k * x.expert_params for x in ls) / (ranks if lay.expert_parallel else tp),
            prefill_pair_flops=sum(x.prefill_pair_flops for x in ls) / tp,
            decode_pair_flops=sum(x.decode_pair_flops for x in ls) / tp,
            head_flops=2 * m.vocab * m.hidden / tp if last else 0.0,
            fixed_weight_bytes=sum(x.attn_params + x.mlp_params for x in ls) * wb / tp + embed,
            expert_bytes=sum(experts_per_rank(x) * x.expert_params for x in ls) * wb,
            kv_bytes_per_token=sum(x.kv_bytes / (tp if x.kv_by_heads else 1) for x in ls))

    def _tokens_per_replica(self) -> float:
        usable = self.gpu.hbm_bytes * self.memory_utilization - self.activation_reserve_bytes
        return min((usable - st.held_bytes) / st.kv_bytes_per_token for st in self.stages)

    @functools.cached_property
    def _rates(self) -> dict[str, float]:
        g, lay, e = self.gpu, self.layout, self.link_efficiency
        fp8 = self.model.weight_dtype_bytes == 1
        moe = next((x for x in self.model.layers() if x.experts), None)
        return {"weight_flops": (g.weight_flops if fp8 else g.bf16_flops) * self.compute_efficiency,
                "bf16_flops": g.bf16_flops * self.compute_efficiency,
                "hbm": g.hbm_bandwidth * self.memory_efficiency,
                "nvlink": g.nvlink_bandwidth * e, "network": g.network_bandwidth * e,
                "tp_lat": self.cross_node_latency_s if lay.tp > lay.gpus_per_node else self.intra_node_latency_s,
                "experts": moe.experts if moe else 0, "top_k": moe.top_k if moe else 0}

    def stage_times(self, s: StepShape) -> tuple[tuple[float, ...], float]:
        """(each stage's seconds for one micro-batch, the step's seconds)."""
        terms, hop, m = self.terms(s)
        times = tuple(t.total for t in terms)
        return times, pipeline_s(times, m, hop, self.layout.schedule) + self.step_overhead_s

    def terms(self, s: StepShape) -> tuple[tuple["StageTerms", ...], float, int]:
        """(each stage's terms for one micro-batch, one stage-to-stage transfer's seconds, the
        micro-batches the step is cut into: at most one a token)."""
        lay = self.layout
        tokens = s.prefill_tokens + s.decode_seqs
        m = max(1, min(lay.micro_batches, tokens))
        n = tokens / m  # a micro-batch's tokens, all replicas
        hop = 0.0
        if lay.pp > 1:
            g, e = self.gpu, self.link_efficiency
            nbytes = n / lay.stage_ranks * self.model.hidden * ACT_BYTES
            cross = any(lay.boundary_crosses_nodes(i) for i in range(lay.pp - 1))
            hop = transfer_s(nbytes, (g.network_bandwidth if cross else g.nvlink_bandwidth) * e,
                             self.cross_node_latency_s if cross else self.intra_node_latency_s)
        return tuple(self._terms(st, s, m, n) for st in self.stages), hop, m

    def _terms(self, st: Stage, s: StepShape, m: int, n: float) -> "StageTerms":
        lay, r = self.layout, self._rates
        d = lay.dp_attention
        imb = self.expert_imbalance if lay.expert_parallel else 1.0
        weight_flops = n / d * st.dense_flops + n * st.routed_flops * imb
        other_flops = (s.prefill_attended * st.prefill_pair_flops + s.decode_context * st.decode_pair_flops
                       + s.sampled * st.head_flops) / (m * d)
        compute = weight_flops / r["weight_flops"] + other_flops / r["bf16_flops"]
        hit = experts_hit(n, r["experts"], r["top_k"]) / r["experts"] if r["experts"] else 0.0
        kv = (s.decode_context + s.prefill_context + s.decode_seqs) / (m * d) * st.kv_bytes_per_token
        memory = (st.fixed_weight_bytes + hit * st.expert_bytes + kv) / r["hbm"]
        allreduce = 2 * st.layers * allreduce_s(n / d * self.model.hidden * ACT_BYTES, lay.tp, lay.gpus_per_node,
                                                r["nvlink"], r["network"], r["tp_lat"])
        a2a = st.moe_layers * self._all_to_all_s(n / lay.stage_ranks * imb) if lay.expert_parallel else 0.0
        return StageTerms(compute, memory, allreduce, a2a)

    def _all_to_all_s(self, tokens_per_rank: float) -> float:
        """One MoE layer's dispatch + combine for a rank sending `tokens_per_rank` tokens."""
        g, lay, e, r = self.gpu, self.layout, self.link_efficiency, self._rates
        args = (lay.stage_ranks, lay.gpus_per_node, g.nvlink_bandwidth * e, g.network_bandwidth * e,
                self.intra_node_latency_s, self.cross_node_latency_s)
        return sum(all_to_all_s(all_to_all_bytes(tokens_per_rank, r["top_k"], self.model.hidden, b), *args)
                   for b in (self.dispatch_dtype_bytes, self.combine_dtype_bytes))
