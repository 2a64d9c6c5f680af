"""Paged decode attention on CPU (fp32 or bf16 cache): the native kernel's launcher and its
torch reference.

One new token per sequence attends to its whole context, read from the paged cache in place;
arithmetic in fp32 (q widened first, the output rounded back to q's dtype).
The launcher checks shapes, dtypes and strides and says what is wrong; `reference` is the
independent PyTorch implementation the kernel is tested against.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
import torch.nn.functional as F

from splitserve import native

_i64 = ctypes.c_int64
_p = ctypes.c_void_p


DTYPES = (torch.float32, torch.bfloat16)  # the caches the kernel reads


def _kernel(dtype: torch.dtype = torch.float32):
    lib = native.load(Path(__file__).parent / "csrc" / "paged_decode.c")
    if lib is None:
        return None
    fn = lib.paged_decode_f32 if dtype == torch.float32 else lib.paged_decode_bf16
    fn.restype = ctypes.c_int
    fn.argtypes = [_p, _p, _p, _p, _p, _p] + [_i64] * 8 + [ctypes.c_float, ctypes.c_int]
    return fn


def available() -> bool:
    return _kernel() is not None


def _check(q, k_cache, v_cache, block_table, context_lens) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"q must be [seqs, heads, dim] and k/v caches [blocks, block_size, kv_heads, dim]; "
                         f"got {tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    _, heads, dim = q.shape
    kvh = k_cache.shape[2]
    if k_cache.shape[3] != dim or heads % kvh:
        raise ValueError(f"head_dim {dim} vs cache {k_cache.shape[3]}, heads {heads} vs kv heads {kvh}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype not in DTYPES or t.device.type != "cpu":
            raise ValueError(f"{name} must be a float32 or bfloat16 CPU tensor, got {t.dtype} on {t.device}")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache is {k_cache.dtype} but v_cache {v_cache.dtype}")
    if not q.is_contiguous():
        raise ValueError("q must be contiguous")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride()[1:] != (kvh * dim, dim, 1):
            raise ValueError(f"{name} rows must be contiguous within a block, strides {t.stride()}")
    if block_table.dtype != torch.int64 or context_lens.dtype != torch.int64:
        raise ValueError("block_table and context_lens must be int64")
    if block_table.dim() != 2 or block_table.shape[0] != q.shape[0] or context_lens.shape != (q.shape[0],):
        raise ValueError(f"block_table {tuple(block_table.shape)} / context_lens {tuple(context_lens.shape)} "
                         f"do not match {q.shape[0]} sequences")
    if not (block_table.is_contiguous() and context_lens.is_contiguous()):
        raise ValueError("block_table and context_lens must be contiguous")
    if len(context_lens) and int(context_lens.max()) > block_table.shape[1] * k_cache.shape[1]:
        raise ValueError("a context is longer than its block table covers")


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """out[s, h] = softmax(q[s, h] · K_s^T · scale) · V_s over the first context_lens[s] tokens."""
    _check(q, k_cache, v_cache, block_table, context_lens)
    fn = _kernel(k_cache.dtype)
    if fn is None:
        raise RuntimeError("the native paged-decode kernel is not available on this machine")
    q32 = q.float().contiguous()
    out = torch.empty_like(q32)
    n, heads, dim = q.shape
    rc = fn(q32.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_table.data_ptr(), context_lens.data_ptr(),
            out.data_ptr(), n, heads, k_cache.shape[2], dim, k_cache.shape[1], block_table.shape[1],
            k_cache.stride(0), v_cache.stride(0), float(scale), torch.get_num_threads())
    if rc != 0:
        raise MemoryError("paged-decode kernel could not allocate its score buffer")
    return out.to(q.dtype)


def reference(q, k_cache, v_cache, block_table, context_lens, scale) -> torch.Tensor:
    """Per sequence: gather the context token by token, repeat K/V per query group, SDPA."""
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // kvh
    outs = []
    for s in range(q.shape[0]):
        n = int(context_lens[s])
        pos = torch.arange(n)
        blocks = block_table[s, pos // bs]
        k = k_cache[blocks, pos % bs].transpose(0, 1).repeat_interleave(group, 0)  # [heads, n, dim]
        v = v_cache[blocks, pos % bs].transpose(0, 1).repeat_interleave(group, 0)
        o = F.scaled_dot_product_attention(q[s][:, None, :].float(), k.float(), v.float(), scale=scale)
        outs.append(o[:, 0, :])
    return torch.stack(outs).to(q.dtype)
