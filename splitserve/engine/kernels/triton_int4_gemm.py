"""`y = x @ W` with W `[K, N]` kept as packed int4 (issue 34: quantized checkpoints stay
quantized on the GPU), in the two layouts real checkpoints ship:

  awq_gemm   AutoAWQ's GEMM version: `qweight` int32 `[K, N / 8]`, eight columns a word in AWQ's
             interleaved order (nibble i, bits 4i..4i+3, holds column `[0, 2, 4, 6, 1, 3, 5, 7][i]`
             of its eight); `qzeros` int32 `[K / g, N / 8]` packed the same way; `scales` `[K / g, N]`;
             `W[k, n] = (q[k, n] - z[k // g, n]) * s[k // g, n]`
  gptq_gemm  GPTQ: `qweight` int32 `[K / 8, N]` packed along K (row k in nibble k % 8 of word
             k // 8); `qzeros` int32 `[K / g, N / 8]` packed along N in plain order; `scales`
             `[K / g, N]`; `g_idx` int32 `[K]`, each input row's group (act-order / desc_act
             checkpoints permute it; default `k // g`); `W[k, n] = (q[k, n] - z[g_idx[k], n]) *
             s[g_idx[k], n]`. `checkpoint_format` says how zeros are stored: "gptq" (v1, what
             AutoGPTQ writes: the zero minus 1, so the zero used is stored + 1) or "gptq_v2" (the
             zero itself); `sym=True` uses the symmetric zero 8 and reads no qzeros (a symmetric
             checkpoint's stored zeros all say 8, v1's as 7).

Each program dequantizes its [BLOCK_K, BLOCK_N] tile of W in fp32 — nibbles shifted out of the
words, zero subtracted, scale applied — rounds it to x's dtype and `tl.dot`s it with x's tile,
accumulating in fp32 (as vLLM's Triton AWQ kernel does). Scales and zeros are read once per K tile
when the tile lies in one group (no g_idx, BLOCK_K dividing g), else per row through the tile's
group indices. Runs on any GPU Triton supports, and under the interpreter on CPU
(TRITON_INTERPRET=1).

Activations x `[M, K]` (last dim contiguous) in fp32 / fp16 / bf16; y `[M, N]` in x's dtype.
Launchers check shapes, dtypes, devices and strides and raise ValueError naming the argument;
`validate=False` skips only the check that reads device values (g_idx's range). The tests hold
their own torch statement of each layout (tests/kernels/test_triton_int4_gemm.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.engine.kernels.checks import need
from splitserve.engine.kernels.triton_fp8_gemm import check_activations, dot_args, gemm_out, gemm_tiles

SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CHECKPOINT_FORMATS = {"gptq": 1, "gptq_v2": 0}  # format -> what to add to a stored zero


@triton.jit
def _awq_nibble(j):
    """Which nibble of its word holds column j (0..7) of the word's eight: AWQ's order map
    [0, 2, 4, 6, 1, 3, 5, 7] inverted, i.e. [0, 4, 1, 5, 2, 6, 3, 7]."""
    return j // 2 + (j % 2) * 4


@triton.jit
def _group_rows(g_idx, k, k0, K, GROUP: tl.constexpr, HAS_G_IDX: tl.constexpr, BLOCK_K: tl.constexpr):
    """The scale / zero rows of the tile's K rows: [BLOCK_K, 1], or [1, 1] when they share one."""
    if HAS_G_IDX:
        rows = tl.load(g_idx + k, mask=k < K, other=0)[:, None]
    elif GROUP % BLOCK_K == 0:  # k0 is a multiple of BLOCK_K, so the whole tile is in one group
        rows = tl.zeros((1, 1), tl.int32) + k0 // GROUP
    else:  # rows past K read the last group: finite, and x's zeros cancel them
        rows = (tl.minimum(k, K - 1) // GROUP)[:, None]
    return rows.to(tl.int64)


@triton.jit
def _columns(words):
    """[R, W] words -> [R, 8 W]: each word repeated for the eight columns it packs. Loading the
    W words once and widening in registers keeps the loads contiguous (a load per column would
    read each word eight times, uncoalesced)."""
    words = tl.interleave(words, words)
    words = tl.interleave(words, words)
    return tl.interleave(words, words)


@triton.jit
def _nibbles(qw, k, rn, cw, k_ok, n_ok, cw_ok, stride_qw, n_shift, AWQ: tl.constexpr):
    """q[k, n] for the tile, as int32 in 0..15 (masked lanes 0). `cw`: the tile's word columns."""
    if AWQ:  # [K, N / 8]: column n in nibble _awq_nibble(n % 8) of word n // 8
        word = tl.load(qw + k[:, None].to(tl.int64) * stride_qw + cw[None, :], mask=k_ok[:, None] & cw_ok[None, :],
                       other=0)
        q = (_columns(word) >> n_shift[None, :]) & 0xF
    else:  # GPTQ [K / 8, N]: row k in nibble k % 8 of word k // 8 (contiguous along n already)
        word = tl.load(qw + (k // 8)[:, None].to(tl.int64) * stride_qw + rn[None, :],
                       mask=k_ok[:, None] & n_ok[None, :], other=0)
        q = (word >> ((k % 8) * 4)[:, None]) & 0xF
    return q  # `>>` is arithmetic on int32, so the mask also drops a negative word's sign bits


@triton.jit
def _zeros(qz, rows, cw, cw_ok, stride_qz, n_shift, SYM: tl.constexpr, ZERO_OFFSET: tl.constexpr):
    """The zero points of the tile's rows: [rows, BLOCK_N], or the scalar 8 when symmetric."""
    if SYM:
        z = 8
    else:  # [groups, N / 8], column n in nibble n_shift / 4 of word n // 8 (AWQ's or plain order)
        word = tl.load(qz + rows * stride_qz + cw[None, :], mask=cw_ok[None, :], other=0)
        z = ((_columns(word) >> n_shift[None, :]) & 0xF) + ZERO_OFFSET
    return z


@triton.jit
def _int4_gemm_kernel(x, qw, qz, scales, g_idx, y, M, N, K, stride_xm, stride_qw, stride_qz, stride_s, stride_ym,
                      GROUP: tl.constexpr, AWQ: tl.constexpr, HAS_G_IDX: tl.constexpr, SYM: tl.constexpr,
                      ZERO_OFFSET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, PREC: tl.constexpr, DOT_F32: tl.constexpr):
    """Program (i, j) computes y's tile [i * BLOCK_M, ...) x [j * BLOCK_N, ...)."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    cw = tl.program_id(1) * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)  # the tile's packed columns
    m_ok, n_ok, cw_ok = rm < M, rn < N, cw < N // 8
    # the bit offset of column n within its word (qzeros always; qweight too for AWQ)
    n_shift = 4 * (_awq_nibble(rn % 8) if AWQ else rn % 8)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        k_ok = k < K
        a = tl.load(x + rm[:, None].to(tl.int64) * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)
        rows = _group_rows(g_idx, k, k0, K, GROUP, HAS_G_IDX, BLOCK_K)
        q = _nibbles(qw, k, rn, cw, k_ok, n_ok, cw_ok, stride_qw, n_shift, AWQ)
        z = _zeros(qz, rows, cw, cw_ok, stride_qz, n_shift, SYM, ZERO_OFFSET)
        s = tl.load(scales + rows * stride_s + rn[None, :], mask=n_ok[None, :], other=0.0)
        b = ((q - z).to(tl.float32) * s.to(tl.float32)).to(a.dtype)
        if DOT_F32:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=PREC)
    tl.store(y + rm[:, None].to(tl.int64) * stride_ym + rn[None, :], acc.to(y.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def awq_gemm(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
             group_size: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ W` for an AWQ (GEMM version) layer: qweight int32 `[K, N / 8]`, qzeros int32
    `[ceil(K / g), N / 8]`, scales `[ceil(K / g), N]` (fp16 in checkpoints; bf16 / fp32 accepted).
    `group_size` g, or -1 for one group over all of K."""
    m, k = check_activations(x)
    need(qweight.dim() == 2 and qweight.shape[0] == k,
         f"qweight must be [{k}, N / 8] (x is [M, {k}]), got {tuple(qweight.shape)}")
    n = 8 * qweight.shape[1]
    g, groups = _groups(group_size, k)
    _check_packed(x, qweight, qzeros, scales, n, groups)
    return _launch(x, qweight, qzeros, scales, None, n, g, out, AWQ=True, SYM=False, ZERO_OFFSET=0)


def gptq_gemm(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor | None, scales: torch.Tensor,
              g_idx: torch.Tensor | None = None, *, group_size: int, sym: bool, checkpoint_format: str,
              out: torch.Tensor | None = None, validate: bool = True) -> torch.Tensor:
    """`x @ W` for a 4-bit GPTQ layer: qweight int32 `[K / 8, N]`, qzeros int32
    `[ceil(K / g), N / 8]` (None allowed when `sym`), scales `[ceil(K / g), N]`, g_idx int32 `[K]`
    or None (`k // g`). `checkpoint_format` "gptq" (v1: zero = stored + 1) or "gptq_v2";
    `sym`: the zero point is 8 and qzeros is not read."""
    m, k = check_activations(x)
    need(k % 8 == 0, f"x's K must be a multiple of 8 (qweight packs 8 rows a word), got {k}")
    need(qweight.dim() == 2 and qweight.shape[0] * 8 == k,
         f"qweight must be [{k // 8}, N] (x is [M, {k}]), got {tuple(qweight.shape)}")
    n = qweight.shape[1]
    need(n % 8 == 0, f"N must be a multiple of 8 (qzeros packs 8 columns a word), got {n}")
    need(checkpoint_format in CHECKPOINT_FORMATS,
         f"checkpoint_format must be one of {sorted(CHECKPOINT_FORMATS)}, got {checkpoint_format!r}")
    need(isinstance(sym, bool), f"sym must be a bool, got {sym!r}")
    g, groups = _groups(group_size, k)
    need(sym or qzeros is not None, "qzeros is needed unless sym=True")
    _check_packed(x, qweight, qzeros, scales, n, groups)
    if g_idx is not None:
        _check_g_idx(g_idx, x, k, groups, validate)
    return _launch(x, qweight, qzeros, scales, g_idx, n, g, out, AWQ=False, SYM=sym,
                   ZERO_OFFSET=CHECKPOINT_FORMATS[checkpoint_format])


def _launch(x, qweight, qzeros, scales, g_idx, n: int, group: int, out, **layout) -> torch.Tensor:
    m, k = x.shape
    out = gemm_out(out, m, n, x)
    if m == 0 or n == 0:
        return out
    bm, bn, bk, warps, stages = gemm_tiles(m, n)
    if g_idx is None and group >= 16 and group & (group - 1) == 0:
        bk = min(bk, group)  # a tile inside one group reads its scales and zeros once
    qz = qzeros if qzeros is not None else qweight  # symmetric: a placeholder the kernel never reads
    gi = g_idx if g_idx is not None else qweight  # likewise
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _int4_gemm_kernel[grid](x, qweight, qz, scales, gi, out, m, n, k, x.stride(0), qweight.stride(0),
                            qz.stride(0), scales.stride(0), out.stride(0), GROUP=group,
                            HAS_G_IDX=g_idx is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
                            num_stages=stages, **layout, **dot_args(x.dtype))
    return out


# -- checks ---------------------------------------------------------------------------------------
def _groups(group_size: int, k: int) -> tuple[int, int]:
    """(g, number of groups); -1 is one group over all of K (GPTQ's per-channel quantization)."""
    need(isinstance(group_size, int) and (group_size > 0 or group_size == -1),
         f"group_size must be a positive int or -1, got {group_size!r}")
    g = max(k, 1) if group_size == -1 else group_size
    return g, triton.cdiv(k, g)


def _check_packed(x, qweight, qzeros, scales, n: int, groups: int) -> None:
    need(qweight.dtype == torch.int32, f"qweight must be int32, got {qweight.dtype}")
    need(qweight.is_contiguous(), f"qweight must be contiguous, strides {qweight.stride()}")
    if qzeros is not None:
        need(tuple(qzeros.shape) == (groups, n // 8),
             f"qzeros must be [{groups}, {n // 8}] ([groups, N / 8]), got {tuple(qzeros.shape)}")
        need(qzeros.dtype == torch.int32, f"qzeros must be int32, got {qzeros.dtype}")
        need(qzeros.is_contiguous(), f"qzeros must be contiguous, strides {qzeros.stride()}")
    need(tuple(scales.shape) == (groups, n), f"scales must be [{groups}, {n}] ([groups, N]), got {tuple(scales.shape)}")
    need(scales.dtype in SCALE_DTYPES, f"scales must be float16, bfloat16 or float32, got {scales.dtype}")
    need(scales.is_contiguous(), f"scales must be contiguous, strides {scales.stride()}")
    for name, t in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales)):
        if t is not None:
            need(t.device == x.device, f"{name} is on {t.device}, x on {x.device}")


def _check_g_idx(g_idx: torch.Tensor, x: torch.Tensor, k: int, groups: int, validate: bool) -> None:
    need(tuple(g_idx.shape) == (k,) and g_idx.dtype == torch.int32,
         f"g_idx must be int32 [{k}], got {g_idx.dtype} {tuple(g_idx.shape)}")
    need(g_idx.device == x.device and g_idx.is_contiguous(), f"g_idx must be contiguous on {x.device}")
    if validate and k:
        lo, hi = int(g_idx.min()), int(g_idx.max())
        need(lo >= 0 and hi < groups, f"g_idx's groups must lie in [0, {groups}), got [{lo}, {hi}]")

