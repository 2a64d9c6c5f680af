"""`y = x @ dequant(W)^T` with the weight kept in FP8 (issue 34: quantized checkpoints stay
quantized on the GPU), for the two FP8 checkpoint formats:

  block-wise   DeepSeek-V3 (`quantization_config.weight_block_size = [128, 128]`): `W` float8_e4m3fn
               `[N, K]`, `weight_scale_inv` fp32 `[ceil(N / bn), ceil(K / bk)]`, and
               `W[i, j] = W_fp8[i, j] * scale[i // bn, j // bk]` (despite its name the scale is a
               multiplier; the last row / column of blocks may be partial)
  per-tensor / per-channel   compressed-tensors FP8: `weight_scale` a scalar (or `[1]`), or `[N, 1]`

What runs where:
  `fp8_gemm` (default)  weight-only: each program loads an FP8 tile, upcasts it to x's dtype (exact:
                every e4m3 / e5m2 value is a bf16 / fp16 / fp32 value), `tl.dot`s it with the activations'
                tile in fp32, then applies the scales in fp32 — per K tile for block-wise scales
                (hence a K tile never straddles two scale blocks: BLOCK_K divides bk, which must be
                a multiple of 16), once at the end for per-tensor / per-channel ones. Any GPU Triton
                compiles FP8 for (sm89+: Ada, Hopper), and the interpreter on CPU (TRITON_INTERPRET=1).
  `fp8_gemm(..., quantize_activations=True)`  x is quantized per tensor to e4m3 too (dynamic scale
                amax / 448) and the product runs on the FP8 tensor cores through `torch._scaled_mm`:
                a CUDA device of compute capability >= 8.9, a per-tensor weight scale, K and N
                multiples of 16. Not exact: x's own rounding to e4m3 (~3 bits of mantissa) adds error.
                Asked for elsewhere, it raises ValueError.

Activations x `[M, K]` (last dim contiguous) in fp32 / fp16 / bf16; y `[M, N]` in x's dtype.
The launcher checks shapes, dtypes, devices and strides and raises ValueError naming the argument.
The tests hold their own torch statement of each format (tests/kernels/test_triton_fp8_gemm.py).
The GEMM launch pieces the int4 kernels share (`check_activations`, `gemm_tiles`, `dot_args`,
`gemm_out`) live here.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from splitserve.engine.kernels.checks import need

ACT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
WEIGHT_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)  # both widen exactly to fp16 / bf16 / fp32
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


@triton.jit
def _fp8_gemm_kernel(x, w, scale, y, M, N, K, stride_xm, stride_wn, stride_sn, stride_sk, stride_ym,
                     SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, SCALE_PER_K: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PREC: tl.constexpr, DOT_F32: tl.constexpr):
    """Program (i, j) computes y's tile [i * BLOCK_M, ...) x [j * BLOCK_N, ...). Row n of W reads
    its scales at `scale + (n // SCALE_BN) * stride_sn + (k // SCALE_BK) * stride_sk`: per-tensor
    and per-channel scales are the case SCALE_BN = 1 with stride_sk = 0 (and stride_sn = 0)."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    s_row = scale + (rn // SCALE_BN).to(tl.int64) * stride_sn  # [BLOCK_N] pointers into the scales
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        k_ok = k < K
        a = tl.load(x + rm[:, None].to(tl.int64) * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)
        # W's tile transposed to [BLOCK_K, BLOCK_N]; masked lanes are FP8 zeros
        b = tl.load(w + rn[None, :].to(tl.int64) * stride_wn + k[:, None], mask=k_ok[:, None] & n_ok[None, :],
                    other=0.0)
        b = b.to(a.dtype)  # exact: e4m3 fits every activation dtype
        if DOT_F32:
            a, b = a.to(tl.float32), b.to(tl.float32)
        part = tl.dot(a, b, input_precision=PREC)
        if SCALE_PER_K:  # the whole K tile lies in scale column k0 // SCALE_BK (BLOCK_K divides SCALE_BK)
            s = tl.load(s_row + (k0 // SCALE_BK) * stride_sk, mask=n_ok, other=0.0)
            acc += part * s[None, :]
        else:
            acc += part
    if not SCALE_PER_K:
        acc *= tl.load(s_row, mask=n_ok, other=0.0)[None, :]
    tl.store(y + rm[:, None].to(tl.int64) * stride_ym + rn[None, :], acc.to(y.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, *,
             block_size: tuple[int, int] | None = None, quantize_activations: bool = False,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ dequant(weight)^T`. `weight` float8_e4m3fn (or float8_e5m2) `[N, K]`, contiguous. `weight_scale` fp32:
    with `block_size=(bn, bk)` the `[ceil(N / bn), ceil(K / bk)]` block scales (bk a multiple of
    16); without, a per-tensor scalar (`[]`, `[1]`, `[1, 1]`) or per-channel `[N, 1]` / `[N]`.
    `quantize_activations`: the FP8 tensor-core path (module docstring). Returns `out` (a new
    `[M, N]` tensor in x's dtype by default)."""
    m, k = check_activations(x)
    need(weight.dtype in WEIGHT_DTYPES, f"weight must be torch.float8_e4m3fn or float8_e5m2, got {weight.dtype}")
    need(weight.dim() == 2 and weight.shape[1] == k, f"weight must be [N, {k}] to match x, got {tuple(weight.shape)}")
    need(weight.is_contiguous(), f"weight must be contiguous, strides {weight.stride()}")
    n = weight.shape[0]
    layout = _scale_layout(weight_scale, n, k, block_size)
    for name, t in (("weight", weight), ("weight_scale", weight_scale)):
        need(t.device == x.device, f"{name} is on {t.device}, x on {x.device}")
    out = gemm_out(out, m, n, x)
    if quantize_activations:
        return _scaled_mm(x, weight, weight_scale, block_size, out)
    if m == 0 or n == 0:
        return out
    bm, bn, bk, warps, stages = gemm_tiles(m, n)
    if layout["SCALE_PER_K"]:
        # one K tile per scale block where bk allows (up to 128): one rescale of the partial sum
        # per block; on an H200 at M = 4096 that was 12% faster than 64-wide K tiles
        bk = min(128, layout["SCALE_BK"] & -layout["SCALE_BK"])
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    stride_sn, stride_sk = layout.pop("stride_sn"), layout.pop("stride_sk")
    _fp8_gemm_kernel[grid](x, weight, weight_scale, out, m, n, k, x.stride(0), weight.stride(0),
                           stride_sn, stride_sk, out.stride(0), **layout,
                           BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages,
                           **dot_args(x.dtype))
    return out


def _scale_layout(scale: torch.Tensor, n: int, k: int, block_size: tuple[int, int] | None) -> dict:
    """How the kernel indexes `scale`: strides and block sizes (see `_fp8_gemm_kernel`)."""
    need(scale.dtype == torch.float32, f"weight_scale must be float32, got {scale.dtype}")
    if block_size is not None:
        need(len(block_size) == 2 and all(isinstance(b, int) and b > 0 for b in block_size),
             f"block_size must be two positive ints (bn, bk), got {block_size}")
        bn, bk = block_size
        need(bk % 16 == 0, f"block_size's bk must be a multiple of 16 (a K tile of the dot), got {bk}")
        want = (triton.cdiv(n, bn), triton.cdiv(k, bk))
        need(tuple(scale.shape) == want,
             f"block scales for weight [{n}, {k}] in blocks {block_size} must be {list(want)}, "
             f"got {list(scale.shape)}")
        return {"stride_sn": scale.stride(0), "stride_sk": scale.stride(1), "SCALE_BN": bn, "SCALE_BK": bk,
                "SCALE_PER_K": True}
    if scale.numel() == 1 and scale.dim() <= 2:  # per-tensor: every row reads element 0
        return {"stride_sn": 0, "stride_sk": 0, "SCALE_BN": 1, "SCALE_BK": 1, "SCALE_PER_K": False}
    need(tuple(scale.shape) in ((n, 1), (n,)),
         f"weight_scale must be a scalar, [{n}, 1] or [{n}] (or block scales with block_size), "
         f"got {list(scale.shape)}")
    return {"stride_sn": scale.stride(0), "stride_sk": 0, "SCALE_BN": 1, "SCALE_BK": 1, "SCALE_PER_K": False}


def _scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               block_size: tuple[int, int] | None, out: torch.Tensor) -> torch.Tensor:
    """x quantized per tensor to e4m3, then cuBLASLt's FP8 GEMM with both per-tensor scales."""
    n, k = weight.shape
    need(x.is_cuda and torch.cuda.get_device_capability(x.device) >= (8, 9),
         f"quantize_activations needs a CUDA device of compute capability >= 8.9, x is on {x.device}")
    need(weight.dtype == torch.float8_e4m3fn, f"quantize_activations needs an e4m3 weight, got {weight.dtype}")
    need(block_size is None and weight_scale.numel() == 1,
         "quantize_activations needs a per-tensor weight scale (block-wise and per-channel run weight-only)")
    need(k % 16 == 0 and n % 16 == 0, f"quantize_activations needs K and N multiples of 16, got K={k} N={n}")
    if x.shape[0] == 0:
        return out
    # the dynamic scale: x's largest magnitude lands on e4m3's largest finite value
    x_scale = (x.abs().amax().float() / FP8_MAX).clamp(min=1e-12)
    xq = (x.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    # weight.t() is column-major [K, N], the layout cuBLASLt wants for the second operand
    y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=weight_scale.reshape(()).float(),
                         out_dtype=x.dtype)
    return out.copy_(y)


# -- shared GEMM launch pieces (the int4 kernels use them too) ------------------------------------
def check_activations(x: torch.Tensor) -> tuple[int, int]:
    """x `[M, K]` in an activation dtype with a contiguous last dim; returns (M, K)."""
    need(x.dim() == 2, f"x must be [M, K], got {tuple(x.shape)}")
    need(x.dtype in ACT_DTYPES, f"x must be float32, float16 or bfloat16, got {x.dtype}")
    need(x.stride(1) == 1 or x.shape[1] <= 1, f"x's last dim must be contiguous, strides {x.stride()}")
    return x.shape[0], x.shape[1]


def gemm_tiles(m: int, n: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). Decode-sized M gets one 16-row tile
    (tl.dot's minimum) and narrow N tiles, so a 4096-wide layer still spreads over every SM;
    prefill-sized M gets 128 x 128 tiles, the usual size for Hopper's MMA."""
    if m <= 16:
        return 16, (32 if n <= 8192 else 64), 128, 4, 4
    if m <= 64:
        return triton.next_power_of_2(m), 64, 64, 4, 3
    return 128, 128, 64, 8, 3


def dot_args(dtype: torch.dtype) -> dict:
    # fp32 activations: exact fp32 products, not tf32. The interpreter's tl.dot reads bf16 operands
    # as raw 16-bit integers (numpy has no bf16), so there they are widened to fp32 first.
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    return {"PREC": "ieee" if dtype == torch.float32 else "tf32",
            "DOT_F32": dtype == torch.bfloat16 and interpreting}


def gemm_out(out: torch.Tensor | None, m: int, n: int, x: torch.Tensor) -> torch.Tensor:
    """`out` checked to be y's `[M, N]` in x's dtype, or a new one."""
    if out is None:
        return torch.empty((m, n), dtype=x.dtype, device=x.device)
    need(tuple(out.shape) == (m, n) and out.dtype == x.dtype and out.device == x.device and
         (out.stride(1) == 1 or n <= 1),
         f"out must be [{m}, {n}] {x.dtype} on {x.device} with a contiguous last dim, "
         f"got {tuple(out.shape)} {out.dtype} on {out.device}")
    return out
