"""The sparse feed-forward of mixture-of-experts decoders (Mixtral, Qwen2-MoE, Qwen3-MoE,
DeepSeek-V3): route each token to its top-k experts (softmax, or DeepSeek's grouped sigmoid
routing), run each expert once over the tokens sent to it (dispatch), and sum the weighted
results back per token (combine), plus a shared expert (gated, for Qwen2-MoE) where the
architecture has one.

The arithmetic follows Hugging Face's order — router softmax in fp32, experts visited in
ascending order, each expert's rows ordered by (top-k slot, token), results added in with
`index_add_` — so that greedy tokens match transformers exactly. Each layer counts the tokens
its experts took (`expert_tokens`): the load imbalance an operator watches.

With an `ExpertPlacement` (model/expert_placement.py; engine/expert_balance.py sets it) the
experts sit in physical slots, hot ones possibly in several (redundant replicas, on several
expert-parallel ranks): each expert's rows are cut evenly over its replicas and a rank computes
the contiguous run of its own replicas in one GEMM, still visiting experts in ascending order, so
that each token's outputs are added in the plain path's order. In one process (or wherever a
token's rows stay on one rank) the result is the plain path's, bit for bit; rows cut over ranks
differ from it only as far as a GEMM's rounding depends on its row count, and the ranks' partial
sums meet in the all-reduce as they already do under expert parallelism. Tokens per slot are
counted too (`slot_tokens`): the per-rank load the balancer plans from.

Under data-parallel attention each rank routes only its own tokens, and `dispatch`
(parallel/expert_dispatch.py) sends each row to the rank of the replica the same cut chooses and
brings the outputs back, combined in the plain path's order.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.expert_placement import ExpertPlacement
from splitserve.engine.model.layers import MLP
from splitserve.engine.parallel.shard import Shard


class Experts(nn.Module):
    """The SwiGLU experts this rank holds, `held` (global indices: all of them, or a contiguous
    share under expert parallelism), as two stacked weights (the layout transformers 5 loads):
    gate_up [E, 2·I, H] and down [E, H, I] (I: this rank's columns of each). Once `place`d, the
    first dimension is this rank's physical slots instead, holding what `placement` says."""

    def __init__(self, held: range, hidden: int, inter: int) -> None:
        super().__init__()
        self.held, self.inter = held, inter
        self.gate_up_proj = nn.Parameter(torch.empty(len(held), 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(len(held), hidden, inter))
        self.placement: ExpertPlacement | None = None  # None: slot i holds held[i], one copy each
        self.rank = 0  # this rank's row of the placement (its expert-parallel rank)
        self._runs: list[tuple[int, int, int, int] | None] = []
        self.slot_tokens: torch.Tensor | None = None  # [ranks · slots] rows each global slot took

    def place(self, placement: ExpertPlacement, rank: int) -> None:
        """Take the slot layout `placement` from the loaded one (`held`, one copy each), every
        slot filled from an expert this rank holds: the start (ExpertPlacement.contiguous)."""
        src = [self.held.index(e) for e in placement.slots[rank]]
        with torch.no_grad():
            self.gate_up_proj = nn.Parameter(self.gate_up_proj.data[src].clone(), requires_grad=False)
            self.down_proj = nn.Parameter(self.down_proj.data[src].clone(), requires_grad=False)
        self.set_placement(placement, rank)

    def set_placement(self, placement: ExpertPlacement, rank: int) -> None:
        """The slots hold `placement`'s experts now (their weights are in place): route by it."""
        self.placement, self.rank = placement, rank
        reps, mine = placement.replicas(), range(rank * placement.slots_per_rank, (rank + 1) * placement.slots_per_rank)
        self._runs = []
        for slots in reps:  # ascending: this rank's replicas of an expert are one contiguous run
            js = [j for j, g in enumerate(slots) if g in mine]
            self._runs.append((js[0], js[-1] + 1, len(slots), slots[js[0]] - mine.start) if js else None)
        dev = self.gate_up_proj.device
        flat = placement.flat()
        self._slot_expert = torch.tensor(flat, dtype=torch.int64, device=dev)
        self._rep_index = torch.tensor([reps[e].index(g) for g, e in enumerate(flat)], dtype=torch.int64, device=dev)
        self._rep_count = torch.tensor([len(reps[e]) for e in flat], dtype=torch.int64, device=dev)
        self.slot_tokens = torch.zeros(len(flat), dtype=torch.int64, device=dev)

    def count(self, per_expert: torch.Tensor) -> None:
        """Add a step's rows per expert to the slots that took them (the cut `forward` makes)."""
        if self.placement is not None:
            n, j, m = per_expert[self._slot_expert], self._rep_index, self._rep_count
            self.slot_tokens += n * (j + 1) // m - n * j // m

    def forward(self, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
        """Dispatch each token to its experts held here and combine their weighted outputs; the
        ranks' outputs sum to the layer's (the DecoderLayer's all-reduce)."""
        out = torch.zeros_like(x)
        for e in torch.unique(top_idx).tolist():  # ascending
            if self.placement is None:
                if e not in self.held:
                    continue
                i, run = e - self.held.start, None
            else:
                run = self._runs[e]
                if run is None:
                    continue
                i = run[3]
            slot, tok = torch.where((top_idx == e).T)  # rows by (slot, token), as HF orders them
            if run is not None and run[2] > 1:  # this rank's replicas' run of the rows
                j0, j1, m, _ = run
                n = tok.shape[0]
                lo, hi = n * j0 // m, n * j1 // m
                if lo == hi:
                    continue
                slot, tok = slot[lo:hi], tok[lo:hi]
            y = self.compute(i, x[tok]) * top_w[tok, slot, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out

    def compute(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """The expert in this rank's slot `i` (or of held index `i`) on rows `x`, unweighted."""
        gate, up = F.linear(x, self.gate_up_proj[i]).split([self.inter, self.inter], dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj[i])


class ExpertGate(nn.Module):
    """The router's weights, on every rank: `weight` [E, H], and DeepSeek-V3's per-expert
    `e_score_correction_bias` (added to the scores for the choice only)."""

    def __init__(self, hidden: int, experts: int, score_bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden))
        self.e_score_correction_bias = nn.Parameter(torch.empty(experts)) if score_bias else None


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard | None = None) -> None:
        super().__init__()
        m = cfg.moe
        assert m is not None
        self.moe = m
        self.gate = ExpertGate(cfg.hidden_size, m.num_experts, m.score_bias)
        held = range(m.num_experts) if shard is None else shard.experts
        self.experts = Experts(held, cfg.hidden_size, m.expert_intermediate_size)
        self.shared_expert = None
        self.shared_expert_gate = None
        if m.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg.hidden_size, m.shared_expert_intermediate_size)
            if m.shared_expert_gated:
                self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        self.register_buffer("expert_tokens", torch.zeros(m.num_experts, dtype=torch.int64), persistent=False)
        # data-parallel attention: the exchange that sends this rank's tokens to the ranks holding
        # their experts and combines what comes back (parallel/expert_dispatch.py); None: the
        # rank has every token (one process, or TP), its experts' partial sum is its share
        self.dispatch: Callable[[Experts, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices [n, k], weights [n, k]) of each token's experts."""
        if self.moe.scoring == "sigmoid":
            return self._route_grouped(x)
        logits = F.linear(x, self.gate.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top_w, top_idx = torch.topk(probs, self.moe.top_k, dim=-1)
        if self.moe.renormalize:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return top_idx, (top_w if self.moe.weights_in_fp32 else top_w.to(logits.dtype))

    def _route_grouped(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek-V3's: sigmoid scores in fp32; each group of experts rated by its best two
        (bias included), the tokens' experts chosen within the `topk_group` best groups; the
        weights are the unbiased scores, renormalised, times `routed_scaling_factor`."""
        m, g = self.moe, self.gate
        scores = F.linear(x.float(), g.weight.float()).sigmoid()
        choice = scores + g.e_score_correction_bias.float()
        n = x.shape[0]
        groups = choice.view(n, m.n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
        best = torch.topk(groups, k=m.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(groups).scatter_(1, best, 1).bool()
        choice = choice.masked_fill(~keep.repeat_interleave(m.num_experts // m.n_group, dim=1), float("-inf"))
        top_idx = torch.topk(choice, k=m.top_k, dim=-1, sorted=False)[1]
        top_w = scores.gather(1, top_idx)
        if m.renormalize:
            top_w = top_w / (top_w.sum(dim=-1, keepdim=True) + 1e-20)
        return top_idx, top_w * m.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top_idx, top_w = self.route(x)
        per_expert = torch.bincount(top_idx.flatten(), minlength=self.moe.num_experts)
        self.expert_tokens += per_expert
        self.experts.count(per_expert)
        out = self.experts(x, top_idx, top_w) if self.dispatch is None else self.dispatch(self.experts, x, top_idx, top_w)
        if self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return out
