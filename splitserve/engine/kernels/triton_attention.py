"""Paged attention in Triton over the KV cache layout of DESIGN.md §4 (per layer, K and V each
`[num_blocks, block_size, num_kv_heads, head_dim]`). The new tokens' K/V are already in the
cache (`triton_kv.store_kv` ran first).

  paged_attention_decode   one query token per sequence attends to its whole context;
                           split-K over the context (flash-decoding), splits merged by their
                           log-sum-exp weights
  paged_attention_prefill  a chunk of new tokens per sequence attends causally to its cached
                           prefix and to the new tokens up to itself (chunked prefill, prefix hits)

Both kernels give each program the whole GQA group of query heads that share one KV head, so K/V
are read once per group, and walk the context BLOCK_N tokens at a time, looking each token's
slot up through the block table (BLOCK_N need not be the page size). Each step is two `tl.dot`s
and an online softmax in fp32 (`_attend`); decode pads the group to 16 rows and every kernel the
head dim to a power of two ≥ 16, since `tl.dot` needs 16 and `tl.arange` powers of two — masked
lanes load nothing, so the padding costs no bytes. Scores are in the log2 domain
(scale folded with log2 e, `exp2`).

With an FP8 cache (kv_cache/fp8.py: uint8, each (token, head) row head_dim e4m3 bytes then its
scale's exponent byte e) the kernels load the bytes and the exponent, upcast in registers to
fp8 * 2**e in q's dtype — the values the torch backend's `decode` gives — and attend as above;
a prefill chunk's own K/V are read back from the cache too, so it sees them decoded.

Launchers check shapes, dtypes, devices and strides and raise ValueError naming the argument;
`validate=False` skips only the checks that read device values (so a step can be graph-captured).
`*_reference` are the gather + softmax torch definitions the tests compare against.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from splitserve.engine.kernels.checks import need
from splitserve.engine.kv_cache import fp8 as kv_fp8

_LOG2E = 1.4426950408889634


@triton.jit
def _load_fp8(cache, row, d, ok, row_ok, q, D: tl.constexpr):
    """K or V from FP8 rows starting at `row` (values at row + d, the exponent byte at row + D),
    as fp8 * 2**e in q's dtype. `row` and `d` broadcast to the tile's shape."""
    vals = tl.load(cache + row + d, mask=ok, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    e = tl.load(cache + row + D, mask=row_ok, other=0).to(tl.int8, bitcast=True).to(tl.int32)
    return (vals * ((e + 127) << 23).to(tl.float32, bitcast=True)).to(q.dtype.element_ty)  # 2**e, exact


@triton.jit
def _attend(qv, m, l, acc, q, k_cache, v_cache, table_row, n0, kv_end, qpos, kvh, qk_scale,
            HKV: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr,
            PREC: tl.constexpr, DOT_F32: tl.constexpr, CAUSAL: tl.constexpr, FP8: tl.constexpr):
    """One online-softmax step over context tokens [n0, n0 + BLOCK_N) ∩ [0, kv_end). Head
    dims run to DP (a power of two, as tl.arange needs); lanes past D load zeros. `q` (the
    query pointer) names the dtype attention runs in; with FP8 a head's row is D + 1 bytes."""
    n = n0 + tl.arange(0, BLOCK_N)
    n_ok = n < kv_end
    slot = tl.load(table_row + n // BS, mask=n_ok, other=0).to(tl.int64) * BS + n % BS
    d = tl.arange(0, DP)
    d_ok = d < D
    if FP8:
        row = slot * (HKV * (D + 1)) + kvh * (D + 1)
        kt = _load_fp8(k_cache, row[None, :], d[:, None], n_ok[None, :] & d_ok[:, None], n_ok[None, :], q, D)
        v = _load_fp8(v_cache, row[:, None], d[None, :], n_ok[:, None] & d_ok[None, :], n_ok[:, None], q, D)
    else:
        kt = tl.load(k_cache + slot[None, :] * (HKV * D) + kvh * D + d[:, None], mask=n_ok[None, :] & d_ok[:, None],
                     other=0.0)
        v = tl.load(v_cache + slot[:, None] * (HKV * D) + kvh * D + d[None, :], mask=n_ok[:, None] & d_ok[None, :],
                    other=0.0)
    if DOT_F32:
        kt = kt.to(tl.float32)
    scores = tl.dot(qv, kt, input_precision=PREC) * qk_scale
    if CAUSAL:
        scores = tl.where(n_ok[None, :] & (n[None, :] <= qpos[:, None]), scores, float("-inf"))
    else:
        scores = tl.where(n_ok[None, :], scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    p = p.to(q.dtype.element_ty)  # rounded like the compiled kernel's second dot operand
    if DOT_F32:
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PREC)
    return m_new, l, acc


# -- decode ---------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["stride_bt", "num_splits"])
def _decode_partial(q, k_cache, v_cache, block_tables, context_lens, out, part_o, part_m, part_l, qk_scale,
                    stride_qs, stride_qh, stride_os, stride_oh, stride_bt, num_splits,
                    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BS: tl.constexpr,
                    HKV: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE: tl.constexpr, PREC: tl.constexpr,
                    DOT_F32: tl.constexpr, FP8: tl.constexpr):
    s, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ctx = tl.load(context_lens + s)
    g = tl.arange(0, GP)
    d = tl.arange(0, DP)
    rows_ok = (g < G)[:, None] & (d < D)[None, :]
    qv = tl.load(q + s * stride_qs + (kvh * G + g)[:, None] * stride_qh + d[None, :], mask=rows_ok, other=0.0)
    if DOT_F32:
        qv = qv.to(tl.float32)
    m = tl.full((GP,), float("-inf"), tl.float32)
    l = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, DP), tl.float32)
    # each sequence's own context is cut into num_splits even, BLOCK_N-aligned parts: balanced
    # work whatever the table's width (a captured graph's table is as wide as the longest context)
    per_split = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
    first = split * per_split
    last = tl.minimum(first + per_split, ctx)
    for n0 in range(first, last, BLOCK_N):  # an empty split keeps m = -inf: it weighs nothing
        m, l, acc = _attend(qv, m, l, acc, q, k_cache, v_cache, block_tables + s * stride_bt, n0, last, g, kvh,
                            qk_scale, HKV, D, DP, BS, BLOCK_N, PREC, DOT_F32, False, FP8)
    if SINGLE:  # one split: the result is final, no partials and no merge pass
        o = acc / l[:, None]
        tl.store(out + s * stride_os + (kvh * G + g)[:, None] * stride_oh + d[None, :], o.to(out.dtype.element_ty),
                 mask=rows_ok)
    else:
        row = (s * HKV + kvh) * num_splits + split
        tl.store(part_o + (row * GP + g)[:, None] * DP + d[None, :], acc, mask=rows_ok)
        tl.store(part_m + row * GP + g, m, mask=g < G)
        tl.store(part_l + row * GP + g, l, mask=g < G)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge(part_o, part_m, part_l, out, stride_os, stride_oh, num_splits,
                  G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, HKV: tl.constexpr):
    s, kvh = tl.program_id(0), tl.program_id(1)
    g = tl.arange(0, GP)
    d = tl.arange(0, DP)
    g_ok = g < G
    rows_ok = g_ok[:, None] & (d < D)[None, :]
    base = (s * HKV + kvh) * num_splits
    # padding rows (g >= G) have no partials: they read 0 and stay finite, their output is masked
    m_all = tl.full((GP,), float("-inf"), tl.float32)
    for i in range(num_splits):
        m_all = tl.maximum(m_all, tl.load(part_m + (base + i) * GP + g, mask=g_ok, other=0.0))
    l_all = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, DP), tl.float32)
    for i in range(num_splits):
        m_i = tl.load(part_m + (base + i) * GP + g, mask=g_ok, other=0.0)
        w = tl.where(m_i == float("-inf"), 0.0, tl.exp2(m_i - m_all))
        l_all += w * tl.load(part_l + (base + i) * GP + g, mask=g_ok, other=0.0)
        acc += w[:, None] * tl.load(part_o + ((base + i) * GP + g)[:, None] * DP + d[None, :], mask=rows_ok, other=0.0)
    o = acc / tl.where(g_ok, l_all, 1.0)[:, None]
    tl.store(out + s * stride_os + (kvh * G + g)[:, None] * stride_oh + d[None, :], o.to(out.dtype.element_ty),
             mask=rows_ok)


def decode_splits(num_seqs: int, num_kv_heads: int, max_context: int) -> int:
    """Enough (sequence, kv head, split) programs to fill a GPU (~256), each split ≥ 256 tokens,
    at most 16: a large batch needs no split (and no merge pass), a lone long sequence many."""
    want = triton.cdiv(256, max(1, num_seqs * num_kv_heads))
    return max(1, min(16, want, max_context // 256))


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, *,
                           num_splits: int | None = None, out: torch.Tensor | None = None,
                           block_n: int = 64, validate: bool = True) -> torch.Tensor:
    """`q` `[num_seqs, num_heads, head_dim]` (last dim contiguous) → `out` of the same shape.
    `block_tables` int32 `[num_seqs, max_blocks]`, `context_lens` int32 `[num_seqs]` (each ≥ 1).
    `num_splits`: context splits per sequence (None: `decode_splits`; it depends only on
    shapes, so a captured graph keeps it). The caches: `[num_blocks, block_size, num_kv_heads,
    head_dim]` of q's dtype, or FP8 (uint8, last dim head_dim + 1)."""
    nb, bs, hkv, d, fp8 = _check_common(q, k_cache, v_cache, block_tables, q.shape[0], context_lens)
    n, h = q.shape[0], q.shape[1]
    if validate and n:
        ctx = context_lens.cpu()
        need(int(ctx.min()) >= 1, "every sequence needs a context of at least 1 token")
        need(int(ctx.max()) <= block_tables.shape[1] * bs,
             f"a context of {int(ctx.max())} tokens does not fit {block_tables.shape[1]} blocks of {bs}")
    capacity = block_tables.shape[1] * bs
    num_splits = decode_splits(n, hkv, capacity) if num_splits is None else num_splits
    need(num_splits >= 1, f"num_splits must be >= 1, got {num_splits}")
    _check_block_n(block_n)
    out = _out_like(q, out)
    if n == 0:
        return out
    g = h // hkv
    gp = max(16, triton.next_power_of_2(g))
    dp = max(16, triton.next_power_of_2(d))  # tl.arange wants a power of two, tl.dot >= 16
    single = num_splits == 1
    rows = 0 if single else n * hkv * num_splits
    part_o = torch.empty((rows, gp, dp), dtype=torch.float32, device=q.device)
    part_m = torch.empty((rows, gp), dtype=torch.float32, device=q.device)
    part_l = torch.empty((rows, gp), dtype=torch.float32, device=q.device)
    _decode_partial[(n, hkv, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_o, part_m, part_l, float(scale) * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), num_splits,
        G=g, GP=gp, D=d, DP=dp, BS=bs, HKV=hkv, BLOCK_N=block_n, SINGLE=single, FP8=fp8, **_dot_args(q.dtype))
    if not single:
        _decode_merge[(n, hkv)](part_o, part_m, part_l, out, out.stride(0), out.stride(1), num_splits,
                                G=g, GP=gp, D=d, DP=dp, HKV=hkv)
    return out


def paged_attention_decode_reference(q, k_cache, v_cache, block_tables, context_lens, scale) -> torch.Tensor:
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32)
    return paged_attention_prefill_reference(q, k_cache, v_cache, block_tables, cu, context_lens, scale)


# -- prefill --------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_kernel(q, k_cache, v_cache, out, block_tables, cu_seqlens_q, context_lens, qk_scale,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BS: tl.constexpr,
                    HKV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
                    DOT_F32: tl.constexpr, FP8: tl.constexpr):
    s, tile, kvh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(cu_seqlens_q + s)
    q_len = tl.load(cu_seqlens_q + s + 1) - q_start
    if tile * BLOCK_M < q_len:
        ctx = tl.load(context_lens + s)
        past = ctx - q_len
        r = tl.arange(0, BLOCK_M * GP)  # rows: BLOCK_M new tokens x the group's heads, token major
        t = tile * BLOCK_M + r // GP
        g = r % GP
        d = tl.arange(0, DP)
        rows_ok = ((t < q_len) & (g < G))[:, None] & (d < D)[None, :]
        q_off = (q_start + t).to(tl.int64)[:, None] * stride_qt + (kvh * G + g)[:, None] * stride_qh + d[None, :]
        qv = tl.load(q + q_off, mask=rows_ok, other=0.0)
        if DOT_F32:
            qv = qv.to(tl.float32)
        qpos = past + t  # rows past the chunk's end see every key: no row is all -inf
        m = tl.full((BLOCK_M * GP,), float("-inf"), tl.float32)
        l = tl.zeros((BLOCK_M * GP,), tl.float32)
        acc = tl.zeros((BLOCK_M * GP, DP), tl.float32)
        kv_end = past + tl.minimum((tile + 1) * BLOCK_M, q_len)  # one past the tile's last query
        for n0 in range(0, kv_end, BLOCK_N):
            m, l, acc = _attend(qv, m, l, acc, q, k_cache, v_cache, block_tables + s * stride_bt, n0, kv_end, qpos,
                                kvh, qk_scale, HKV, D, DP, BS, BLOCK_N, PREC, DOT_F32, True, FP8)
        o = acc / l[:, None]
        o_off = (q_start + t).to(tl.int64)[:, None] * stride_ot + (kvh * G + g)[:, None] * stride_oh + d[None, :]
        tl.store(out + o_off, o.to(out.dtype.element_ty), mask=rows_ok)


def paged_attention_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                            scale: float, *, max_seqlen_q: int | None = None, out: torch.Tensor | None = None,
                            block_m: int | None = None, block_n: int = 64, validate: bool = True) -> torch.Tensor:
    """`q` `[total_new_tokens, num_heads, head_dim]` (last dim contiguous; rows may be strided,
    e.g. a slice of a fused qkv) → `out` of the same shape. Sequence i's new tokens are rows
    `cu_seqlens_q[i]:cu_seqlens_q[i+1]` (int32 `[num_seqs + 1]`); `context_lens` (int32
    `[num_seqs]`) counts all its tokens, the new ones included; `block_tables` int32
    `[num_seqs, max_blocks]`; the caches as `paged_attention_decode` takes them. `max_seqlen_q`
    saves a device→host read of the longest chunk."""
    need(cu_seqlens_q.dim() == 1 and cu_seqlens_q.shape[0] >= 1 and cu_seqlens_q.dtype == torch.int32
         and cu_seqlens_q.is_contiguous(), f"cu_seqlens_q must be contiguous int32 [num_seqs + 1], "
         f"got {cu_seqlens_q.dtype} {tuple(cu_seqlens_q.shape)}")
    n = cu_seqlens_q.shape[0] - 1
    nb, bs, hkv, d, fp8 = _check_common(q, k_cache, v_cache, block_tables, n, context_lens, cu_seqlens_q)
    if validate and n:
        _check_chunks(q.shape[0], cu_seqlens_q.cpu(), context_lens.cpu(), block_tables.shape[1] * bs)
    g = q.shape[1] // hkv
    gp = triton.next_power_of_2(g)
    dp = max(16, triton.next_power_of_2(d))  # tl.arange wants a power of two, tl.dot >= 16
    # tl.dot needs >= 16 rows (new tokens x group heads) per tile; ~128 keeps K/V reuse high.
    block_m = block_m or max(1, 16 // gp, (128 if dp <= 128 else 64) // gp)
    need(block_m & (block_m - 1) == 0 and block_m * gp >= 16,
         f"block_m must be a power of two with block_m * {gp} (the padded GQA group) >= 16, got {block_m}")
    _check_block_n(block_n)
    out = _out_like(q, out)
    if n == 0 or q.shape[0] == 0:
        return out
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    grid = (n, triton.cdiv(max_seqlen_q, block_m), hkv)
    _prefill_kernel[grid](q, k_cache, v_cache, out, block_tables, cu_seqlens_q, context_lens, float(scale) * _LOG2E,
                          q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
                          G=g, GP=gp, D=d, DP=dp, BS=bs, HKV=hkv, BLOCK_M=block_m, BLOCK_N=block_n, FP8=fp8,
                          num_warps=4 if block_m * gp * dp <= 64 * 128 else 8,
                          num_stages=2 if dp > 128 else 3,  # K+V tiles of d 256 in 3 stages overflow shared memory
                          **_dot_args(q.dtype))
    return out


def paged_attention_prefill_reference(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale):
    """Per sequence: gather its context (an FP8 cache's decoded to q's dtype, as the torch backend
    reads it), mask causally offset by the cached prefix, softmax in fp32."""
    d = q.shape[2]
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    if k_cache.dtype == kv_fp8.STORAGE_DTYPE:
        k_cache, v_cache = kv_fp8.decode(k_cache, q.dtype), kv_fp8.decode(v_cache, q.dtype)
    group = q.shape[1] // hkv
    out = torch.empty_like(q)
    for s in range(cu_seqlens_q.shape[0] - 1):
        a, b, ctx = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1]), int(context_lens[s])
        blocks = block_tables[s, : -(-ctx // bs)].long()
        k = k_cache[blocks].reshape(-1, hkv, d)[:ctx].float().repeat_interleave(group, dim=1)
        v = v_cache[blocks].reshape(-1, hkv, d)[:ctx].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[a:b].float() * scale, k)
        qpos = torch.arange(b - a)[:, None] + (ctx - (b - a))
        scores = scores.masked_fill((torch.arange(ctx)[None, :] > qpos).to(scores.device), float("-inf"))
        out[a:b] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v).to(q.dtype)
    return out


# -- shared launcher pieces -----------------------------------------------------------------------
def _dot_args(dtype: torch.dtype) -> dict:
    # fp32 inputs: exact fp32 products, not tf32. The interpreter's tl.dot reads bf16 operands as
    # raw 16-bit integers (numpy has no bf16), so there they are widened to fp32 first — after
    # the same rounding the compiled kernel applies.
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    return {"PREC": "ieee" if dtype == torch.float32 else "tf32",
            "DOT_F32": dtype == torch.bfloat16 and interpreting}


def _out_like(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty_like(q)
    need(out.shape == q.shape and out.dtype == q.dtype and out.device == q.device and out.stride(2) == 1,
         f"out must match q {tuple(q.shape)} {q.dtype} with a contiguous last dim, "
         f"got {tuple(out.shape)} {out.dtype}")
    return out



def _check_block_n(block_n: int) -> None:
    need(block_n >= 16 and block_n & (block_n - 1) == 0, f"block_n must be a power of two >= 16, got {block_n}")


def _check_common(q, k_cache, v_cache, block_tables, num_seqs: int, context_lens,
                  *extra) -> tuple[int, int, int, int, bool]:
    need(k_cache.dim() == 4 and v_cache.shape == k_cache.shape,
         f"k_cache / v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
         f"got {tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    nb, bs, hkv, d = k_cache.shape
    fp8 = k_cache.dtype == kv_fp8.STORAGE_DTYPE
    d -= fp8  # an FP8 row: head_dim values, then the exponent byte
    need(k_cache.is_contiguous() and v_cache.is_contiguous(), "k_cache and v_cache must be contiguous")
    need(q.dim() == 3 and q.shape[2] == d, f"q must be [num_tokens, num_heads, {d}], got {tuple(q.shape)}")
    need(q.stride(2) == 1, f"q's last dimension must be contiguous, strides {q.stride()}")
    need(q.shape[1] % hkv == 0, f"num_heads ({q.shape[1]}) must be a multiple of num_kv_heads ({hkv})")
    need(1 <= d <= 256, f"head_dim must be at most 256, got {d}")
    need(bs & (bs - 1) == 0, f"block_size must be a power of two, got {bs}")
    need(v_cache.dtype == k_cache.dtype and (fp8 or q.dtype == k_cache.dtype),
         f"dtypes differ: q {q.dtype}, cache {k_cache.dtype} / {v_cache.dtype}")
    need(q.dtype in (torch.float16, torch.bfloat16, torch.float32), f"unsupported dtype {q.dtype}")
    need(block_tables.dim() == 2 and block_tables.shape[0] == num_seqs and block_tables.dtype == torch.int32
         and block_tables.stride(1) == 1, f"block_tables must be int32 [{num_seqs}, max_blocks] with contiguous "
         f"rows, got {block_tables.dtype} {tuple(block_tables.shape)}")
    need(context_lens.shape == (num_seqs,) and context_lens.dtype == torch.int32 and context_lens.is_contiguous(),
         f"context_lens must be int32 [{num_seqs}], got {context_lens.dtype} {tuple(context_lens.shape)}")
    devices = {t.device for t in (q, k_cache, v_cache, block_tables, context_lens, *extra)}
    need(len(devices) == 1, f"tensors on different devices: {devices}")
    return nb, bs, hkv, d, fp8


def _check_chunks(num_rows: int, cu: torch.Tensor, ctx: torch.Tensor, capacity: int) -> None:
    lens = cu[1:] - cu[:-1]
    need(int(cu[0]) == 0 and bool((lens >= 0).all()) and int(cu[-1]) == num_rows,
         f"cu_seqlens_q must rise from 0 to {num_rows} (the rows of q), got {cu.tolist()}")
    need(bool((ctx >= lens).all()) and bool((ctx >= 1).all()),
         "context_lens must count the new tokens too (each >= its chunk length, and >= 1)")
    need(int(ctx.max()) <= capacity, f"a context of {int(ctx.max())} tokens does not fit the block table ({capacity})")
