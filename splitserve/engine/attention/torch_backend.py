"""PyTorch attention over the paged KV cache: the CPU path and the reference for GPU kernels.

Decodes are batched: each sequence's context is gathered from its blocks into one padded
[batch, kv_heads, max_ctx, head_dim] view and attended with a length mask, query heads grouped
per KV head so GQA needs no K/V repetition. Prefill chunks run one sequence at a time; a chunk
with no earlier context attends to its own fresh K/V (no gather at all).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from splitserve.engine.attention.backend import AttentionBatch, SeqSlice


@dataclass
class _PrefillMeta:
    seq: SeqSlice
    slots: torch.Tensor | None  # context slots when the chunk follows cached context
    mask: torch.Tensor | None  # [q_len, ctx_len] bool, True = attend


@dataclass
class TorchMeta:
    slot_mapping: torch.Tensor
    num_decodes: int
    decode_slots: torch.Tensor | None  # [num_decodes, max_ctx] int64 (padding -> slot 0)
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_ctx] bool
    prefills: list[_PrefillMeta]


def context_slots(seq: SeqSlice, block_size: int) -> torch.Tensor:
    blocks = torch.tensor(seq.block_ids, dtype=torch.int64)
    offsets = torch.arange(block_size, dtype=torch.int64)
    return (blocks[:, None] * block_size + offsets[None, :]).reshape(-1)[: seq.ctx_len]


class TorchBackend:
    name = "torch"

    def prepare(self, batch: AttentionBatch) -> TorchMeta:
        dslots, dmask = self._prepare_decodes(batch)
        return TorchMeta(
            slot_mapping=batch.slot_mapping,
            num_decodes=len(batch.decodes),
            decode_slots=dslots,
            decode_mask=dmask,
            prefills=[self._prepare_prefill(s, batch.block_size) for s in batch.prefills],
        )

    @staticmethod
    def _prepare_decodes(batch: AttentionBatch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if not batch.decodes:
            return None, None
        bs = batch.block_size
        max_blocks = max(len(s.block_ids) for s in batch.decodes)
        table = torch.zeros(len(batch.decodes), max_blocks, dtype=torch.int64)
        for i, s in enumerate(batch.decodes):
            table[i, : len(s.block_ids)] = torch.tensor(s.block_ids, dtype=torch.int64)
        slots = (table[:, :, None] * bs + torch.arange(bs)[None, None, :]).reshape(len(batch.decodes), -1)
        ctx = torch.tensor([s.ctx_len for s in batch.decodes], dtype=torch.int64)
        max_ctx = int(ctx.max())
        slots = slots[:, :max_ctx].contiguous()
        mask = torch.arange(max_ctx)[None, :] < ctx[:, None]
        return slots, mask[:, None, None, :]

    @staticmethod
    def _prepare_prefill(seq: SeqSlice, block_size: int) -> _PrefillMeta:
        if seq.ctx_len == seq.q_len:
            return _PrefillMeta(seq, None, None)
        past = seq.ctx_len - seq.q_len
        qpos = torch.arange(seq.q_len)[:, None] + past
        mask = torch.arange(seq.ctx_len)[None, :] <= qpos
        return _PrefillMeta(seq, context_slots(seq, block_size), mask)

    def forward(self, q, k, v, k_cache, v_cache, meta: TorchMeta, scale: float) -> torch.Tensor:
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_flat = k_cache.view(-1, num_kv_heads, head_dim)
        v_flat = v_cache.view(-1, num_kv_heads, head_dim)
        k_flat.index_copy_(0, meta.slot_mapping, k)
        v_flat.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        if meta.num_decodes:
            nd = meta.num_decodes
            out[:nd] = self._decode(q[:nd], k_flat, v_flat, meta, scale)
        for p in meta.prefills:
            s = p.seq
            sl = slice(s.q_start, s.q_start + s.q_len)
            out[sl] = self._prefill(q[sl], k[sl], v[sl], k_flat, v_flat, p, scale)
        return out

    @staticmethod
    def _decode(q, k_flat, v_flat, meta: TorchMeta, scale: float) -> torch.Tensor:
        nd, num_heads, head_dim = q.shape
        num_kv_heads = k_flat.shape[1]
        group = num_heads // num_kv_heads
        kd = k_flat[meta.decode_slots].transpose(1, 2)  # [nd, kvh, ctx, d]
        vd = v_flat[meta.decode_slots].transpose(1, 2)
        qg = q.view(nd, num_kv_heads, group, head_dim)
        o = F.scaled_dot_product_attention(qg, kd, vd, attn_mask=meta.decode_mask, scale=scale)
        return o.reshape(nd, num_heads, head_dim)

    @staticmethod
    def _prefill(q, k, v, k_flat, v_flat, p: _PrefillMeta, scale: float) -> torch.Tensor:
        gqa = q.shape[1] != k_flat.shape[1]
        qt = q.transpose(0, 1)
        if p.slots is None:
            o = F.scaled_dot_product_attention(
                qt, k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scale, enable_gqa=gqa
            )
        else:
            kc = k_flat[p.slots].transpose(0, 1)
            vc = v_flat[p.slots].transpose(0, 1)
            o = F.scaled_dot_product_attention(qt, kc, vc, attn_mask=p.mask, scale=scale, enable_gqa=gqa)
        return o.transpose(0, 1)
