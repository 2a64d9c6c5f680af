"""One MoE layer's exchange under data-parallel attention: each replica routes its own tokens,
sends each (token, expert) row to the rank holding the expert (dispatch), that rank runs each of
its experts once over the rows every replica sent it, and the outputs go back to the tokens'
replicas, weighted and summed there (combine). Three all-to-alls per layer: the rows' counts per
destination slot, the rows, the outputs.

Which replica of an expert a row goes to is the single-process cut (model/moe.py): a replica's
rows of expert e, in Hugging Face's order (top-k slot, then token), cut into m even contiguous
runs over e's m replicas in slot order — so `Experts.count` counts what was sent. Rows travel
sorted by global slot (rank-major: grouped by destination, then by its local slot), so a
receiver knows from the counts alone which slot each row is for. The combine adds each token's
weighted outputs in ascending expert order, as the plain path does.

A replica with no tokens this step still calls every MoE layer with zero rows (`idle_pass`):
the others' all-to-alls need it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from splitserve.engine.model.moe import Experts, SparseMoE

if TYPE_CHECKING:
    from splitserve.engine.parallel.dp_group import DPGroup


class ExpertDispatch:
    """A layer's dispatch/combine over `group` (the replicas, which are its expert-parallel ranks)."""

    def __init__(self, group: "DPGroup") -> None:
        self.group = group
        self._table: tuple[object, torch.Tensor] | None = None  # (placement, [E, max replicas] global slots)

    @staticmethod
    def attach(model: torch.nn.Module, group: "DPGroup") -> list[SparseMoE]:
        layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
        for m in layers:
            m.dispatch = ExpertDispatch(group)
        return layers

    def __call__(self, experts: Experts, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
        n, k = top_idx.shape
        d, s = self.group.size, experts.gate_up_proj.shape[0]
        # the rows in Hugging Face's order: by expert, then top-k slot, then token
        e_flat = top_idx.T.reshape(-1)
        hf = torch.sort(e_flat, stable=True).indices
        expert, tok, j = e_flat[hf], hf % n if n else hf, hf // n if n else hf
        slot = self._slots(experts, expert)  # each row's global slot
        by_slot = torch.sort(slot, stable=True).indices  # grouped by destination rank, then its slot
        counts = torch.bincount(slot, minlength=d * s)
        got = self.group.all_to_all(counts, [s] * d, [s] * d)  # [source, my slot] rows
        send = counts.view(d, s).sum(1).tolist()
        recv = got.view(d, s).sum(1).tolist()
        rows = self.group.all_to_all(x[tok[by_slot]], send, recv)
        y = self.group.all_to_all(self._run(experts, rows, got, s), recv, send)
        back = torch.empty_like(y)
        back[by_slot] = y  # in Hugging Face's order again
        out = torch.zeros_like(x)
        out.index_add_(0, tok, (back * top_w[tok, j, None]).to(out.dtype))
        return out

    def _slots(self, experts: Experts, expert: torch.Tensor) -> torch.Tensor:
        """Each row's global slot: its expert's replica by the even cut of the expert's rows."""
        table = self._replica_table(experts, expert.device)
        m = (table >= 0).sum(1)[expert]
        if m.numel() == 0 or int(m.max()) == 1:
            return table[expert, 0]
        counts = torch.bincount(expert, minlength=table.shape[0])
        first = torch.cumsum(counts, 0) - counts  # the first row of each expert (rows are by expert)
        q = torch.arange(expert.numel(), device=expert.device) - first[expert]  # a row's index within its expert
        return table[expert, ((q + 1) * m - 1) // counts[expert]]

    def _replica_table(self, experts: Experts, device: torch.device) -> torch.Tensor:
        p = experts.placement
        if self._table is None or self._table[0] is not p:
            if p is None:  # replica r holds experts r·S .. (r+1)·S - 1 in its slots, one copy each
                e = experts.held.stop - experts.held.start
                table = torch.arange(e * self.group.size, device=device)[:, None]
            else:
                reps = p.replicas()
                table = torch.full((p.num_experts, max(map(len, reps))), -1, dtype=torch.int64, device=device)
                for i, gs in enumerate(reps):
                    table[i, :len(gs)] = torch.tensor(gs, dtype=torch.int64)
            self._table = (p, table)
        return self._table[1]

    @staticmethod
    def _run(experts: Experts, rows: torch.Tensor, got: torch.Tensor, s: int) -> torch.Tensor:
        """Each local slot's expert once over the rows every replica sent it; outputs in the
        rows' order (by source replica, then slot)."""
        slot = torch.arange(s, device=rows.device).repeat(got.numel() // s).repeat_interleave(got)
        out = torch.empty_like(rows)
        for i in torch.unique(slot).tolist():
            at = torch.where(slot == i)[0]
            out[at] = experts.compute(i, rows[at]).to(out.dtype)
        return out


def idle_pass(layers: list[SparseMoE], hidden: int, dtype: torch.dtype, device: torch.device) -> None:
    """This replica's part of a step it has no tokens in: every MoE layer's exchange, empty."""
    with torch.inference_mode():
        x = torch.empty(0, hidden, dtype=dtype, device=device)
        for m in layers:
            idx = torch.empty(0, m.moe.top_k, dtype=torch.int64, device=device)
            m.dispatch(m.experts, x, idx, torch.empty(0, m.moe.top_k, dtype=torch.float32, device=device))
