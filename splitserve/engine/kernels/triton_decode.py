"""Paged decode attention in Triton (flash-decoding): one query token per sequence attends to
its whole cached context, read block by block through its block table.

Grid (sequence, kv head, split): each program takes the GQA group of query heads that share one
KV head and a contiguous range of the context (split-K), keeps an online softmax (running max,
running sum, weighted V), and writes its partial result; a second kernel merges the splits with
their log-sum-exp weights. One split means no merge pass. Scores are accumulated in fp32 for
every input dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_partial(q, k_cache, v_cache, block_tables, context_lens, part_o, part_m, part_l, scale,
                    stride_bt, max_blocks_per_split,
                    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, HKV: tl.constexpr,
                    SPLITS: tl.constexpr):
    s, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ctx = tl.load(context_lens + s)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    gmask = g < G
    qv = tl.load(q + (s * HKV * G + kvh * G + g)[:, None] * D + d[None, :], mask=gmask[:, None], other=0.0)
    qv = qv.to(tl.float32) * scale
    m = tl.full((GP,), float("-inf"), tl.float32)
    l = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, D), tl.float32)
    first = split * max_blocks_per_split
    last = tl.minimum(first + max_blocks_per_split, tl.cdiv(ctx, BS))
    offs = tl.arange(0, BS)
    for b in range(first, last):
        block = tl.load(block_tables + s * stride_bt + b).to(tl.int64)
        pos = b * BS + offs
        valid = pos < ctx
        base = (block * BS + offs)[:, None] * (HKV * D) + kvh * D + d[None, :]
        k = tl.load(k_cache + base, mask=valid[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_cache + base, mask=valid[:, None], other=0.0).to(tl.float32)
        scores = tl.sum(qv[:, None, :] * k[None, :, :], axis=2)  # [GP, BS]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    row = (s * HKV + kvh) * SPLITS + split
    tl.store(part_o + (row * GP + g)[:, None] * D + d[None, :], acc)
    tl.store(part_m + row * GP + g, m)
    tl.store(part_l + row * GP + g, l)


@triton.jit
def _decode_merge(part_o, part_m, part_l, out, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                  HKV: tl.constexpr, SPLITS: tl.constexpr):
    s, kvh = tl.program_id(0), tl.program_id(1)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    m_all = tl.full((GP,), float("-inf"), tl.float32)
    for i in range(SPLITS):
        m_all = tl.maximum(m_all, tl.load(part_m + ((s * HKV + kvh) * SPLITS + i) * GP + g))
    l_all = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, D), tl.float32)
    for i in range(SPLITS):
        row = (s * HKV + kvh) * SPLITS + i
        m_i = tl.load(part_m + row * GP + g)
        w = tl.where(m_i == float("-inf"), 0.0, tl.exp(m_i - m_all))  # an empty split weighs nothing
        l_all += w * tl.load(part_l + row * GP + g)
        acc += w[:, None] * tl.load(part_o + (row * GP + g)[:, None] * D + d[None, :])
    o = acc / l_all[:, None]
    tl.store(out + (s * HKV * G + kvh * G + g)[:, None] * D + d[None, :], o.to(out.dtype.element_ty),
             mask=(g < G)[:, None])


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           num_splits: int | None = None) -> torch.Tensor:
    """`q` `[num_seqs, num_heads, head_dim]` → `out` of the same shape. `block_tables`
    `[num_seqs, max_blocks]` int32, `context_lens` `[num_seqs]` int32 (every sequence ≥ 1 token).
    `num_splits`: context splits per sequence (None: 1 for short contexts, more for long)."""
    nb, bs, hkv, d = _check(q, k_cache, v_cache, block_tables, context_lens)
    n, h = q.shape[0], q.shape[1]
    max_blocks = block_tables.shape[1]
    if num_splits is None:
        num_splits = max(1, min(16, max_blocks // 16))
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    per_split = triton.cdiv(max_blocks, num_splits)
    g = h // hkv
    gp = triton.next_power_of_2(g)
    out = torch.empty_like(q)
    if n == 0:
        return out
    rows = n * hkv * num_splits
    part_o = torch.empty((rows, gp, d), dtype=torch.float32, device=q.device)
    part_m = torch.empty((rows, gp), dtype=torch.float32, device=q.device)
    part_l = torch.empty((rows, gp), dtype=torch.float32, device=q.device)
    qc = q.contiguous()
    _decode_partial[(n, hkv, num_splits)](qc, k_cache, v_cache, block_tables, context_lens, part_o, part_m, part_l,
                                          float(scale), block_tables.stride(0), per_split,
                                          G=g, GP=gp, D=d, BS=bs, HKV=hkv, SPLITS=num_splits)
    _decode_merge[(n, hkv)](part_o, part_m, part_l, out, G=g, GP=gp, D=d, HKV=hkv, SPLITS=num_splits)
    return out


def paged_attention_decode_reference(q, k_cache, v_cache, block_tables, context_lens, scale) -> torch.Tensor:
    """Gather each sequence's context and run plain softmax attention in fp32."""
    n, h, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    for s in range(n):
        ctx = int(context_lens[s])
        blocks = block_tables[s, : -(-ctx // bs)].long()
        k = k_cache[blocks].reshape(-1, hkv, d)[:ctx].float().repeat_interleave(h // hkv, dim=1)
        v = v_cache[blocks].reshape(-1, hkv, d)[:ctx].float().repeat_interleave(h // hkv, dim=1)
        w = torch.softmax(torch.einsum("hd,thd->ht", q[s].float() * scale, k), dim=-1)
        out[s] = torch.einsum("ht,thd->hd", w, v).to(q.dtype)
    return out


def _check(q, k_cache, v_cache, block_tables, context_lens) -> tuple[int, int, int, int]:
    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ValueError(msg)

    need(k_cache.dim() == 4 and v_cache.shape == k_cache.shape,
         f"k_cache / v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
         f"got {tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    nb, bs, hkv, d = k_cache.shape
    need(k_cache.is_contiguous() and v_cache.is_contiguous(), "k_cache and v_cache must be contiguous")
    need(q.dim() == 3 and q.shape[2] == d, f"q must be [num_seqs, num_heads, {d}], got {tuple(q.shape)}")
    need(q.shape[1] % hkv == 0, f"num_heads ({q.shape[1]}) must be a multiple of num_kv_heads ({hkv})")
    need(d % 16 == 0 and d <= 256, f"head_dim must be a multiple of 16 up to 256, got {d}")
    need(bs & (bs - 1) == 0, f"block_size must be a power of two, got {bs}")
    need(q.dtype == k_cache.dtype == v_cache.dtype, f"dtypes differ: q {q.dtype}, cache {k_cache.dtype}")
    need(q.dtype in (torch.float16, torch.bfloat16, torch.float32), f"unsupported dtype {q.dtype}")
    need(block_tables.dim() == 2 and block_tables.shape[0] == q.shape[0] and block_tables.dtype == torch.int32,
         f"block_tables must be int32 [{q.shape[0]}, max_blocks], got {block_tables.dtype} {tuple(block_tables.shape)}")
    need(context_lens.shape == (q.shape[0],) and context_lens.dtype == torch.int32,
         f"context_lens must be int32 [{q.shape[0]}], got {context_lens.dtype} {tuple(context_lens.shape)}")
    need(block_tables.stride(1) == 1 and context_lens.is_contiguous(), "block_tables rows and context_lens must be contiguous")
    if q.shape[0]:
        need(int(context_lens.min()) >= 1, "every sequence needs a context of at least 1 token")
        need(int(context_lens.max()) <= block_tables.shape[1] * bs,
             f"a context of {int(context_lens.max())} tokens does not fit {block_tables.shape[1]} blocks of {bs}")
    devices = {t.device for t in (q, k_cache, v_cache, block_tables, context_lens)}
    need(len(devices) == 1, f"tensors on different devices: {devices}")
    return nb, bs, hkv, d
