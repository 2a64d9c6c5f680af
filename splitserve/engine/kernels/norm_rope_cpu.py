"""The fused residual-add + RMSNorm and rotary kernels on CPU (csrc/norm_rope.c): the same
signatures and the same rounding as the Triton ones (triton_norm.py), for fp32 and bf16, so the
decoder runs them through its fused path (`LlamaModel.use_fused_kernels`). Each launcher checks
its arguments and raises ValueError naming the one that is wrong; the references are
triton_norm's `*_reference` (the torch definitions), which the tests compare against.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from splitserve import native
from splitserve.engine.kernels.checks import need

DTYPES = (torch.float32, torch.bfloat16)
_i64, _p = ctypes.c_int64, ctypes.c_void_p
_MAX_HIDDEN = 65536  # a row's fp32 copy lives on the kernel's stack
_MAX_HEAD_DIM = 1024


@functools.cache
def _lib():
    """The kernels, built and typed on first use (None: no compiler here)."""
    lib = native.load(Path(__file__).parent / "csrc" / "norm_rope.c")
    if lib is not None:
        lib.rms_norm.argtypes = [_p] * 5 + [_i64] * 4 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
        lib.rotary.argtypes = [_p] * 4 + [_i64] * 4 + [ctypes.c_int, ctypes.c_int]
        lib.rms_norm.restype = lib.rotary.restype = None
    return lib


def available() -> bool:
    return _lib() is not None


def _cpu(name: str, t: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    need(t.device.type == "cpu", f"{name} must be on the CPU, got {t.device}")
    need(t.dtype in DTYPES, f"{name} must be float32 or bfloat16, got {t.dtype}")
    need(dtype is None or t.dtype == dtype, f"{name} is {t.dtype}: it must be {dtype} like x")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """As triton_norm.rms_norm: RMSNorm of x `[num_tokens, hidden]` (rows may be strided);
    with `residual`, `(RMSNorm(x + residual), x + residual)`."""
    need(x.dim() == 2, f"x must be [num_tokens, hidden], got {tuple(x.shape)}")
    n, hidden = x.shape
    _cpu("x", x)
    need(0 < hidden <= _MAX_HIDDEN, f"x's hidden size must be in [1, {_MAX_HIDDEN}], got {hidden}")
    need(x.stride(1) == 1 or hidden == 1, f"x's last dim must be contiguous, strides {x.stride()}")
    _cpu("weight", weight, x.dtype)
    need(weight.shape == (hidden,) and weight.is_contiguous(), f"weight must be contiguous [{hidden}]")
    need(eps >= 0, f"eps must be >= 0, got {eps}")
    if residual is not None:
        _cpu("residual", residual, x.dtype)
        need(residual.shape == x.shape, f"residual must be {tuple(x.shape)} like x, got {tuple(residual.shape)}")
        need(residual.stride(1) == 1 or hidden == 1, "residual's last dim must be contiguous")
    out = torch.empty((n, hidden), dtype=x.dtype)
    new_res = torch.empty_like(out) if residual is not None else None
    if n:
        _lib().rms_norm(x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
                        out.data_ptr(), None if new_res is None else new_res.data_ptr(), n, hidden, x.stride(0),
                        0 if residual is None else residual.stride(0), float(eps), x.dtype == torch.bfloat16,
                        torch.get_num_threads())
    return out if residual is None else (out, new_res)


def apply_rotary(qk: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """As triton_norm.apply_rotary: layers.apply_rope on qk `[num_tokens, heads, head_dim]`
    (tokens may be strided, each token's heads contiguous), tables `[num_tokens, 1, head_dim]`
    or `[num_tokens, head_dim]` in qk's dtype; a new contiguous tensor."""
    need(qk.dim() == 3, f"qk must be [num_tokens, heads, head_dim], got {tuple(qk.shape)}")
    n, h, d = qk.shape
    _cpu("qk", qk)
    need(d % 2 == 0 and 0 < d <= _MAX_HEAD_DIM, f"qk's head_dim must be even and in [2, {_MAX_HEAD_DIM}], got {d}")
    need(qk.stride(2) == 1 and (qk.stride(1) == d or h == 1),
         f"qk's heads must be contiguous per token (strides (*, {d}, 1)), got {qk.stride()}")
    tabs = []
    for name, tab in (("cos", cos), ("signed_sin", signed_sin)):
        need(tuple(tab.shape) in ((n, 1, d), (n, d)), f"{name} must be [{n}, 1, {d}] or [{n}, {d}], got {tuple(tab.shape)}")
        _cpu(name, tab, qk.dtype)
        tabs.append(tab.reshape(n, d).contiguous())
    out = torch.empty((n, h, d), dtype=qk.dtype)
    if n and h:
        _lib().rotary(qk.data_ptr(), tabs[0].data_ptr(), tabs[1].data_ptr(), out.data_ptr(), n, h, d, qk.stride(0),
                      qk.dtype == torch.bfloat16, torch.get_num_threads())
    return out
