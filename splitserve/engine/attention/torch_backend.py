"""PyTorch attention over the paged KV cache: the CPU path and the reference for GPU kernels.

Decodes are batched: each sequence's blocks are gathered whole (one `index_select` of
block-sized rows, far faster on CPU than gathering token slots) into a padded
[batch, kv_heads, max_ctx, head_dim] tensor and attended with an additive length mask, query
heads grouped per KV head so GQA needs no K/V repetition. Prefill chunks run one sequence at a
time through SDPA's fused CPU kernel (K/V expanded for GQA: `enable_gqa` falls back to a slow
unfused path on CPU); a chunk with no earlier context attends to its own fresh K/V (no gather).

Short chunks that follow context (at most `multi_query_max` tokens: a speculative verify row, its
last token and k proposals) are batched like decodes instead: one gather and one SDPA call over
all of them, each sequence's queries padded to the longest, query j of a chunk seeing the context
up to its own position (a per-row length mask). A verify step of B sequences is then one batched
attention call per layer, not B small prefills.

With an FP8 cache (kv_cache/fp8.py) K/V are encoded as they are stored and decoded as they are
gathered; the fresh K/V a chunk attends to are the decoded ones too, so a token sees the same
keys whether its context was computed in this step, an earlier chunk, or another worker.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from splitserve.engine.attention.backend import AttentionBatch, SeqSlice
from splitserve.engine.kernels import paged_decode_cpu
from splitserve.engine.kv_cache import fp8 as kv_fp8


@dataclass
class _PrefillMeta:
    seq: SeqSlice
    blocks: torch.Tensor | None  # the context's blocks when the chunk follows cached context
    mask: torch.Tensor | None  # [q_len, ctx_len] bool, True = attend


@dataclass
class _MultiQueryMeta:
    """Short chunks attended together: [n, q_max] query rows (padding repeats a chunk's last row,
    and its output is dropped)."""

    rows: torch.Tensor  # [n * q_max] int64: flat rows to read queries from
    dst: torch.Tensor  # [real rows] int64: flat rows the outputs go to
    keep: torch.Tensor  # [real rows] int64: their index in the padded [n * q_max]
    blocks: torch.Tensor  # [n * max_blocks] int64
    q_max: int
    max_ctx: int
    mask: torch.Tensor  # [n, 1, q_max, max_ctx] additive: 0 or -inf


@dataclass
class TorchMeta:
    slot_mapping: torch.Tensor
    num_decodes: int
    decode_blocks: torch.Tensor | None  # [num_decodes * max_blocks] int64 (padding -> block 0)
    decode_max_ctx: int
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_ctx] additive: 0 or -inf
    decode_ctx: torch.Tensor | None  # [num_decodes] int64
    prefills: list[_PrefillMeta]
    multi: _MultiQueryMeta | None = None


class TorchBackend:
    name = "torch"
    multi_query_max = 16  # chunks this short that follow context attend batched (0: never)

    def __init__(self, dtype: torch.dtype = torch.float32, fp8: bool = False) -> None:
        self.dtype = dtype
        self.fp8 = fp8  # the cache holds FP8 rows

    def prepare(self, batch: AttentionBatch) -> TorchMeta:
        blocks, max_ctx, mask, ctx = self._prepare_decodes(batch)
        return TorchMeta(
            slot_mapping=batch.slot_mapping,
            num_decodes=len(batch.decodes),
            decode_blocks=blocks,
            decode_max_ctx=max_ctx,
            decode_mask=mask,
            decode_ctx=ctx,
            prefills=[self._prepare_prefill(s, batch.slot_mapping.device) for s in batch.prefills
                      if not self._is_multi(s)],
            multi=self._prepare_multi([s for s in batch.prefills if self._is_multi(s)], batch.slot_mapping.device),
        )

    def _is_multi(self, s: SeqSlice) -> bool:
        return s.q_len <= self.multi_query_max and s.ctx_len > s.q_len

    def _prepare_multi(self, seqs: list[SeqSlice], device: torch.device) -> _MultiQueryMeta | None:
        if not seqs:
            return None
        q_max = max(s.q_len for s in seqs)
        max_blocks = max(len(s.block_ids) for s in seqs)
        max_ctx = max(s.ctx_len for s in seqs)
        table = [list(s.block_ids) + [0] * (max_blocks - len(s.block_ids)) for s in seqs]
        j = torch.arange(q_max)
        q_len = torch.tensor([s.q_len for s in seqs])
        jj = torch.minimum(j[None, :], q_len[:, None] - 1)  # padding: the chunk's last row again
        rows = torch.tensor([s.q_start for s in seqs])[:, None] + jj
        real = (j[None, :] < q_len[:, None]).reshape(-1)
        past = torch.tensor([s.ctx_len - s.q_len for s in seqs])
        sees = torch.arange(max_ctx)[None, None, :] <= (past[:, None] + jj)[:, :, None]  # [n, q_max, max_ctx]
        mask = torch.zeros(sees.shape, dtype=self.dtype).masked_fill_(~sees, float("-inf"))
        return _MultiQueryMeta(
            rows=rows.reshape(-1).to(device), dst=rows.reshape(-1)[real].to(device),
            keep=torch.nonzero(real).reshape(-1).to(device),
            blocks=torch.tensor(table, dtype=torch.int64, device=device).reshape(-1),
            q_max=q_max, max_ctx=max_ctx, mask=mask[:, None].to(device))

    def _prepare_decodes(self, batch: AttentionBatch):
        if not batch.decodes:
            return None, 0, None, None
        device = batch.slot_mapping.device
        max_blocks = max(len(s.block_ids) for s in batch.decodes)
        table = [list(s.block_ids) + [0] * (max_blocks - len(s.block_ids)) for s in batch.decodes]
        blocks = torch.tensor(table, dtype=torch.int64, device=device).reshape(-1)
        ctx = torch.tensor([s.ctx_len for s in batch.decodes], dtype=torch.int64, device=device)
        max_ctx = int(ctx.max())
        if not self.gathers_decodes():
            return blocks, max_ctx, None, ctx
        mask = torch.zeros(len(batch.decodes), 1, 1, max_ctx, dtype=self.dtype, device=device)
        mask.masked_fill_((torch.arange(max_ctx, device=device)[None, :] >= ctx[:, None])[:, None, None, :],
                          float("-inf"))
        return blocks, max_ctx, mask, ctx

    def gathers_decodes(self) -> bool:
        """Whether `_decode` gathers the context and attends with a length mask (built once per
        step in `prepare`, for every layer)."""
        return True

    @staticmethod
    def _prepare_prefill(seq: SeqSlice, device: torch.device) -> _PrefillMeta:
        if seq.ctx_len == seq.q_len:
            return _PrefillMeta(seq, None, None)
        past = seq.ctx_len - seq.q_len
        qpos = torch.arange(seq.q_len, device=device)[:, None] + past
        mask = torch.arange(seq.ctx_len, device=device)[None, :] <= qpos
        return _PrefillMeta(seq, torch.tensor(seq.block_ids, dtype=torch.int64, device=device), mask)

    def forward(self, q, k, v, k_cache, v_cache, meta: TorchMeta, scale: float) -> torch.Tensor:
        k, v = self._store(k_cache, k, meta.slot_mapping), self._store(v_cache, v, meta.slot_mapping)
        out = torch.empty_like(q)
        if meta.num_decodes:
            nd = meta.num_decodes
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta, scale)
        for p in meta.prefills:
            s = p.seq
            sl = slice(s.q_start, s.q_start + s.q_len)
            out[sl] = self._prefill(q[sl], k[sl], v[sl], k_cache, v_cache, p, scale)
        if meta.multi is not None:
            out.index_copy_(0, meta.multi.dst, self._multi(q, k_cache, v_cache, meta.multi, scale))
        return out

    def _store(self, cache: torch.Tensor, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Write the new tokens' K (or V) at their slots; returns them as attention reads them."""
        flat = cache.view(-1, *cache.shape[2:])
        if not self.fp8:
            flat.index_copy_(0, slots, x)
            return x
        rows = kv_fp8.encode(x)
        flat.index_copy_(0, slots, rows)
        return kv_fp8.decode(rows, x.dtype)

    def _gather(self, cache: torch.Tensor, blocks: torch.Tensor, rows: int, ctx: int) -> torch.Tensor:
        """[rows, kv_heads, ctx, head_dim] from whole blocks, contiguous for the fused kernel."""
        g = cache.index_select(0, blocks).view(rows, -1, cache.shape[2], cache.shape[3])[:, :ctx]
        if self.fp8:
            g = kv_fp8.decode(g, self.dtype)
        return g.transpose(1, 2).contiguous()

    def gather_context(self, cache: torch.Tensor, blocks: torch.Tensor, rows: int, ctx: int) -> torch.Tensor:
        """`rows` sequences' context from their whole `blocks` (padded tables, flat), as attention
        reads it: [rows, kv_heads, ctx, head_dim], FP8 rows decoded (a draft chain's scratch
        attention reads the cache so: speculative/chain_attention.py)."""
        return self._gather(cache, blocks, rows, ctx)

    def _decode(self, q, k_cache, v_cache, meta: TorchMeta, scale: float) -> torch.Tensor:
        nd, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        kd = self._gather(k_cache, meta.decode_blocks, nd, meta.decode_max_ctx)
        vd = self._gather(v_cache, meta.decode_blocks, nd, meta.decode_max_ctx)
        qg = q.view(nd, num_kv_heads, num_heads // num_kv_heads, head_dim)
        o = F.scaled_dot_product_attention(qg, kd, vd, attn_mask=meta.decode_mask, scale=scale)
        return o.reshape(nd, num_heads, head_dim)

    def _multi(self, q, k_cache, v_cache, m: _MultiQueryMeta, scale: float) -> torch.Tensor:
        """The short chunks' real rows, in `m.dst` order. GQA as `_decode`: each KV head's query
        heads × the chunk's rows form one block of queries (group-major, like the mask's repeat)."""
        _, num_heads, head_dim = q.shape
        kvh = k_cache.shape[2]
        group, n = num_heads // kvh, m.rows.numel() // m.q_max
        kd = self._gather(k_cache, m.blocks, n, m.max_ctx)
        vd = self._gather(v_cache, m.blocks, n, m.max_ctx)
        qg = q.index_select(0, m.rows).view(n, m.q_max, kvh, group, head_dim)
        qg = qg.permute(0, 2, 3, 1, 4).reshape(n, kvh, group * m.q_max, head_dim)
        mask = m.mask.repeat(1, 1, group, 1) if group > 1 else m.mask
        o = F.scaled_dot_product_attention(qg, kd, vd, attn_mask=mask, scale=scale)
        o = o.view(n, kvh, group, m.q_max, head_dim).permute(0, 3, 1, 2, 4).reshape(n * m.q_max, num_heads, head_dim)
        return o.index_select(0, m.keep)

    def _prefill(self, q, k, v, k_cache, v_cache, p: _PrefillMeta, scale: float) -> torch.Tensor:
        group = q.shape[1] // k_cache.shape[2]
        qt = q.transpose(0, 1)
        if p.blocks is None:
            kt, vt = k.transpose(0, 1), v.transpose(0, 1)
        else:
            kt = self._gather(k_cache, p.blocks, 1, p.seq.ctx_len)[0]
            vt = self._gather(v_cache, p.blocks, 1, p.seq.ctx_len)[0]
        if group > 1:  # query head h reads KV head h // group, as in HF's repeat_kv
            kt, vt = kt.repeat_interleave(group, dim=0), vt.repeat_interleave(group, dim=0)
        # 4-D inputs: SDPA's fused CPU kernel does not take 3-D ones (they fall back to the math path).
        if p.mask is None:
            o = F.scaled_dot_product_attention(qt[None], kt[None], vt[None], is_causal=True, scale=scale)
        else:
            o = F.scaled_dot_product_attention(qt[None], kt[None], vt[None], attn_mask=p.mask, scale=scale)
        return o[0].transpose(0, 1)


class CpuBackend(TorchBackend):
    """The PyTorch backend with decode attention in a native kernel that reads K/V in place
    (no gather copy): on CPU, decode attention is otherwise dominated by copying the cache."""

    name = "cpu"

    def gathers_decodes(self) -> bool:
        return self.fp8 or self.dtype not in paged_decode_cpu.DTYPES

    def _decode(self, q, k_cache, v_cache, meta: TorchMeta, scale: float) -> torch.Tensor:
        if self.gathers_decodes():
            return super()._decode(q, k_cache, v_cache, meta, scale)
        table = meta.decode_blocks.view(meta.num_decodes, -1)
        return paged_decode_cpu.paged_decode(q.contiguous(), k_cache, v_cache, table, meta.decode_ctx, scale)
