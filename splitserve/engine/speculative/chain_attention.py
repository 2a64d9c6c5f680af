"""The attention of a draft chain's speculative positions: a scratch, never the paged cache.

A draft head proposes its k tokens one at a time (draft.py). The chain's positions lie past the
sequence's computed context: their blocks may not be allocated yet (allocating them could
preempt someone), and their tokens are guesses. So they are never written into the cache: a
chain step's rows attend over the sequence's draft-layer KV in the cache (gathered once per
chain, as the torch backend gathers — FP8 rows decoded) followed by the chain's own K/V, held
here in small tensors and dropped with the chain. Once the target has verified a step, the
accepted positions' draft KV is written into the cache from the target's real hidden states
(draft.py's update); what the chain guessed is never read again.

Quacks as an AttentionBackend's `forward` for the draft layer (Attention and MLAttention call
it with the cache planes, which it does not need: the context is gathered already)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from splitserve.engine.attention.torch_backend import TorchBackend


class ChainAttention:
    name = "draft-chain"

    def __init__(self, reader: TorchBackend, kv: tuple[torch.Tensor, torch.Tensor], tables: list[list[int]],
                 ctx_lens: list[int], device: torch.device, dtype: torch.dtype) -> None:
        """`tables[i]`: sequence i's blocks covering its `ctx_lens[i]` context positions."""
        n, width = len(tables), max(len(t) for t in tables)
        blocks = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64, device=device)
        max_ctx = max(ctx_lens)
        self.k = reader.gather_context(kv[0], blocks.reshape(-1), n, max_ctx)  # [n, kv_heads, ctx, d]
        self.v = reader.gather_context(kv[1], blocks.reshape(-1), n, max_ctx)
        ctx = torch.tensor(ctx_lens, device=device)
        self.mask = torch.zeros(n, 1, 1, max_ctx, dtype=dtype, device=device)
        self.mask.masked_fill_((torch.arange(max_ctx, device=device)[None, :] >= ctx[:, None])[:, None, None],
                               float("-inf"))

    def forward(self, q, k, v, k_cache, v_cache, meta, scale: float) -> torch.Tensor:
        """One chain step: row i is sequence i's next position. Its K/V join the scratch first."""
        n, heads, d = q.shape
        self.k = torch.cat((self.k, k.to(self.k.dtype).unsqueeze(2)), dim=2)
        self.v = torch.cat((self.v, v.to(self.v.dtype).unsqueeze(2)), dim=2)
        self.mask = torch.cat((self.mask, self.mask.new_zeros(n, 1, 1, 1)), dim=-1)
        kvh = self.k.shape[1]
        qg = q.view(n, kvh, heads // kvh, d)
        o = F.scaled_dot_product_attention(qg, self.k, self.v, attn_mask=self.mask, scale=scale)
        return o.reshape(n, heads, self.v.shape[-1])
