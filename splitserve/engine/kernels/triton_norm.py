"""Fused Triton kernels for the decoder's elementwise layers (model/layers.py):

  rms_norm      RMSNorm of each row, optionally fused with the residual add before it
                (`h = x + residual; out = RMSNorm(h)`, both returned), one program per row
  apply_rotary  rotary embedding of q and k together, `qk * cos + swap_halves(qk) * signed_sin`,
                one program per (token, block of heads); in place when `out=qk`

Both replicate the torch order of operations, including every rounding to the activation dtype:
RMSNorm takes its variance in fp32 and casts back to the input dtype *before* the weight; rotary
rounds each product and the sum to the dtype as torch's separate ops do. A product or sum of two
fp16/bf16 values done in fp32 and rounded once equals the correctly rounded half-precision op, so
the half-precision steps match torch bit for bit; only fp32 rounding noise (the row reduction,
rsqrt, FMA contraction on GPU) differs, which flips a half-precision rounding rarely.

Each launcher checks shapes, dtypes, devices and strides and raises ValueError naming the
argument; `*_reference` are the torch definitions the tests compare against (and prove equal to
layers.RMSNorm / layers.apply_rope). On CPU the kernels run under the Triton interpreter
(`TRITON_INTERPRET=1`, set before triton is imported).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.engine.kernels.checks import need

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_HIDDEN = 32768  # one program holds the whole row in registers
_MAX_HEAD_DIM = 256


@triton.jit
def _rms_norm_kernel(x, residual, new_residual, weight, out, stride_x, stride_r, N, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """Program r normalizes row r; `out` and `new_residual` are contiguous [num_tokens, N]."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    h = tl.load(x + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual + row * stride_r + offs, mask=mask, other=0.0)
        # torch's `x + residual`: exact in fp32, then one rounding to the dtype.
        h = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype)
        tl.store(new_residual + row * N + offs, h, mask=mask)
    hf = h.to(tl.float32)
    var = tl.sum(hf * hf, axis=0) / N  # masked lanes loaded 0, so they add nothing
    y = (hf * tl.rsqrt(var + eps)).to(h.dtype)  # cast back BEFORE the weight, as layers.RMSNorm
    w = tl.load(weight + offs, mask=mask, other=0.0)
    tl.store(out + row * N + offs, (w.to(tl.float32) * y.to(tl.float32)).to(h.dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x `[num_tokens, hidden]` (rows may be strided, the last dim contiguous) with
    `weight` `[hidden]`. With `residual` (same shape as x) returns `(out, new_residual)` where
    `new_residual = x + residual` in x's dtype and `out = RMSNorm(new_residual)`; else `out`.
    Outputs are new contiguous tensors."""
    need(x.dim() == 2, f"x must be [num_tokens, hidden], got {tuple(x.shape)}")
    n, hidden = x.shape
    need(x.dtype in _DTYPES, f"x must be float32, float16 or bfloat16, got {x.dtype}")
    need(0 < hidden <= _MAX_HIDDEN, f"x's hidden size must be in [1, {_MAX_HIDDEN}], got {hidden}")
    need(x.stride(1) == 1 or hidden == 1, f"x's last dim must be contiguous, strides {x.stride()}")
    need(weight.dim() == 1 and weight.shape[0] == hidden, f"weight must be [{hidden}], got {tuple(weight.shape)}")
    # layers.RMSNorm would promote a float32 weight's product to float32; the kernel writes x's dtype.
    need(weight.dtype == x.dtype, f"weight is {weight.dtype}, x {x.dtype}: weight must have x's dtype")
    need(weight.device == x.device, f"weight is on {weight.device}, x on {x.device}")
    need(weight.stride(0) == 1 or hidden == 1, f"weight must be contiguous, stride {weight.stride()}")
    need(eps >= 0, f"eps must be >= 0, got {eps}")
    if residual is not None:
        need(residual.shape == x.shape, f"residual must be {tuple(x.shape)} like x, got {tuple(residual.shape)}")
        need(residual.dtype == x.dtype, f"residual is {residual.dtype}, x {x.dtype}")
        need(residual.device == x.device, f"residual is on {residual.device}, x on {x.device}")
        need(residual.stride(1) == 1 or hidden == 1,
             f"residual's last dim must be contiguous, strides {residual.stride()}")
    out = torch.empty((n, hidden), dtype=x.dtype, device=x.device)
    new_res = torch.empty_like(out) if residual is not None else out  # `out` is an unused placeholder
    if n > 0:
        res = residual if residual is not None else x
        block = triton.next_power_of_2(hidden)
        # More warps for long rows, so each thread keeps few registers (Liger's heuristic).
        warps = 16 if block >= 8192 else 8 if block >= 2048 else 4
        _rms_norm_kernel[(n,)](x, res, new_res, weight, out, x.stride(0), res.stride(0), hidden, float(eps),
                               HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=warps)
    return (out, new_res) if residual is not None else out


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """layers.RMSNorm.forward, op for op, after the residual add."""
    h0 = x + residual if residual is not None else x
    h = h0.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(h0.dtype)
    return (out, h0) if residual is not None else out


@triton.jit
def _mul_round(a, b):
    """a * b rounded to a's dtype (exact product in fp32, one rounding: torch's half-precision mul)."""
    return (a.to(tl.float32) * b.to(tl.float32)).to(a.dtype)


@triton.jit
def _add_round(a, b):
    return (a.to(tl.float32) + b.to(tl.float32)).to(a.dtype)


@triton.jit
def _rotary_kernel(qk, cos, sin, out, stride_qk, stride_cos, stride_sin, stride_out, H,
                   HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Program (t, b) rotates heads [b * BLOCK_H, ...) of token t. Heads are contiguous
    [H, 2 * HALF] within a token. Everything is loaded before anything is stored, so out may be qk."""
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    dmask = d < HALF
    mask = (heads < H)[:, None] & dmask[None, :]
    lo = heads[:, None] * (2 * HALF) + d[None, :]  # first half of each head; second at lo + HALF
    x1 = tl.load(qk + t * stride_qk + lo, mask=mask, other=0.0)
    x2 = tl.load(qk + t * stride_qk + lo + HALF, mask=mask, other=0.0)
    # Both halves of both tables are read: the reference is defined for any tables, not only
    # RotaryEmbedding's (where cos halves are equal and sin halves opposite).
    c1 = tl.load(cos + t * stride_cos + d, mask=dmask, other=0.0)[None, :]
    c2 = tl.load(cos + t * stride_cos + HALF + d, mask=dmask, other=0.0)[None, :]
    s1 = tl.load(sin + t * stride_sin + d, mask=dmask, other=0.0)[None, :]
    s2 = tl.load(sin + t * stride_sin + HALF + d, mask=dmask, other=0.0)[None, :]
    # x * cos + swapped * signed_sin, where swapped = [x2 | x1]; each op rounded like torch's.
    o1 = _add_round(_mul_round(x1, c1), _mul_round(x2, s1))
    o2 = _add_round(_mul_round(x2, c2), _mul_round(x1, s2))
    tl.store(out + t * stride_out + lo, o1, mask=mask)
    tl.store(out + t * stride_out + lo + HALF, o2, mask=mask)


def apply_rotary(qk: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """layers.apply_rope on qk `[num_tokens, heads, head_dim]` (tokens may be strided, each
    token's heads contiguous: e.g. a view of the fused qkv output). cos / signed_sin
    `[num_tokens, 1, head_dim]` or `[num_tokens, head_dim]` in qk's dtype, as
    RotaryEmbedding returns them. Writes `out` (a new contiguous tensor by default; may be qk
    itself, for in place) and returns it."""
    need(qk.dim() == 3, f"qk must be [num_tokens, heads, head_dim], got {tuple(qk.shape)}")
    n, h, d = qk.shape
    need(qk.dtype in _DTYPES, f"qk must be float32, float16 or bfloat16, got {qk.dtype}")
    need(d % 2 == 0 and 0 < d <= _MAX_HEAD_DIM, f"qk's head_dim must be even and in [2, {_MAX_HEAD_DIM}], got {d}")
    need(_heads_contiguous(qk), f"qk's heads must be contiguous per token (strides (*, {d}, 1)), got {qk.stride()}")
    strides = []
    for name, tab in (("cos", cos), ("signed_sin", signed_sin)):
        need(tuple(tab.shape) in ((n, 1, d), (n, d)),
             f"{name} must be [{n}, 1, {d}] or [{n}, {d}] to match qk, got {tuple(tab.shape)}")
        need(tab.dtype == qk.dtype, f"{name} is {tab.dtype}, qk {qk.dtype}: the tables must be in qk's dtype")
        need(tab.device == qk.device, f"{name} is on {tab.device}, qk on {qk.device}")
        need(tab.stride(-1) == 1, f"{name}'s last dim must be contiguous, strides {tab.stride()}")
        strides.append(tab.stride(0))
    if out is None:
        out = torch.empty((n, h, d), dtype=qk.dtype, device=qk.device)
    need(out.shape == qk.shape, f"out must be {tuple(qk.shape)} like qk, got {tuple(out.shape)}")
    need(out.dtype == qk.dtype and out.device == qk.device,
         f"out is {out.dtype} on {out.device}, qk {qk.dtype} on {qk.device}")
    need(_heads_contiguous(out),
         f"out's heads must be contiguous per token (strides (*, {d}, 1)), got {out.stride()}")
    if n > 0 and h > 0:
        block_h = min(triton.next_power_of_2(h), 16)
        grid = (n, triton.cdiv(h, block_h))
        _rotary_kernel[grid](qk, cos, signed_sin, out, qk.stride(0), strides[0], strides[1], out.stride(0), h,
                             HALF=d // 2, BLOCK_H=block_h, BLOCK_HALF=triton.next_power_of_2(d // 2))
    return out


def apply_rotary_reference(qk: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """layers.apply_rope, with [num_tokens, head_dim] tables broadcast over heads too."""
    if cos.dim() == 2:
        cos, signed_sin = cos[:, None], signed_sin[:, None]
    half = qk.shape[-1] // 2
    swapped = torch.cat((qk[..., half:], qk[..., :half]), dim=-1)
    return qk * cos + swapped * signed_sin


# -- checks ---------------------------------------------------------------------------------------

def _heads_contiguous(t: torch.Tensor) -> bool:
    n, h, d = t.shape
    return t.stride(2) == 1 and (t.stride(1) == d or h == 1)  # a lone head's stride is irrelevant
