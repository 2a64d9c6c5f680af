"""Triton kernels that move KV between tensors and the paged cache (DESIGN.md §4 cache layout:
per layer, K and V each `[num_blocks, block_size, num_kv_heads, head_dim]`).

  store_kv      new tokens' K/V → their cache slots (`slot = block * block_size + offset`,
                -1 = skip: padding, or tokens whose KV is already cached); into an FP8
                cache (uint8, rows of head_dim + 1 bytes) it writes each (token, head) row
                encoded as kv_cache/fp8.py `encode` does, byte for byte
  pack_blocks   the listed blocks of every layer → one contiguous buffer
                `[num_layers, 2, len(block_ids), block_size, num_kv_heads, head_dim]`
                (the staging the KV transfer sends)
  unpack_blocks that buffer → the listed blocks (the receiving side)

Each launcher checks shapes, dtypes, devices and strides and raises ValueError naming the
argument; `*_reference` are the torch definitions the tests compare against. On CPU the kernels
run under the Triton interpreter (`TRITON_INTERPRET=1`, set before triton is imported).

The FP8 encoding rounds to e4m3 in integer arithmetic rather than through Triton's float8 cast:
the same instructions on a GPU and in the interpreter (whose float8 cast neither carries a
rounded-up mantissa into the exponent nor breaks ties to even), so the CPU tests check the bytes
a GPU writes. The block moves copy bytes and need no FP8 case.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from splitserve.engine.kernels.checks import need
from splitserve.engine.kv_cache import fp8 as kv_fp8


@triton.jit
def _store_kv_kernel(key, value, k_cache, v_cache, slots, k_stride_t, v_stride_t, HD: tl.constexpr,
                     BLOCK: tl.constexpr):
    """Program t writes token t's [num_kv_heads * head_dim] row (contiguous on both sides)."""
    t = tl.program_id(0)
    slot = tl.load(slots + t)
    if slot >= 0:
        offs = tl.arange(0, BLOCK)
        mask = offs < HD
        k = tl.load(key + t * k_stride_t + offs, mask=mask)
        v = tl.load(value + t * v_stride_t + offs, mask=mask)
        dst = slot.to(tl.int64) * HD + offs
        tl.store(k_cache + dst, k, mask=mask)
        tl.store(v_cache + dst, v, mask=mask)


@triton.jit
def _e4m3_bytes(s):
    """fp32 values with |s| <= 448 → their e4m3fn bytes, rounded to nearest even (torch's cast)."""
    bits = s.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a_bits = bits & 0x7FFFFFFF
    # normal (>= 2**-6): round the 23-bit mantissa to 3 bits, half to even, the carry running
    # into the exponent; then rebias the exponent from 127 to 7
    normal = ((a_bits + 0x7FFFF + ((a_bits >> 20) & 1)) >> 20) - (120 << 3)
    # subnormal (< 2**-6): a multiple of 2**-9, its count rounded half to even by adding 2**23 in
    # fp32; a count of 8 is the byte of 2**-6, the smallest normal
    a = a_bits.to(tl.float32, bitcast=True)
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    return (tl.where(a < 0.015625, sub, normal) | sign).to(tl.uint8)


@triton.jit
def _store_fp8_rows(src, dst, ok, D: tl.constexpr, DP: tl.constexpr):
    """Encode rows of D floats (row i at `src[i]`, contiguous) into rows of D + 1 bytes at
    `dst[i]`, as kv_fp8.encode: the values times 2**-e, e = frexp(amax / 448)'s exponent, then e."""
    d = tl.arange(0, DP)
    m = ok[:, None] & (d < D)[None, :]
    x = tl.load(src[:, None] + d[None, :], mask=m, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    y = tl.math.div_rn(amax, 448.0)  # rounded as torch divides
    e = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 126  # frexp's exponent (subnormal y: -126)
    e = tl.where(amax > 0, tl.minimum(e, 127), -126)  # a finite amax gives e <= 120
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2**-e, exact
    s = tl.minimum(tl.maximum(x * inv[:, None], -448.0), 448.0)
    tl.store(dst[:, None] + d[None, :], _e4m3_bytes(s), mask=m)
    tl.store(dst + D, (e & 0xFF).to(tl.uint8), mask=ok)


@triton.jit
def _store_kv_fp8_kernel(key, value, k_cache, v_cache, slots, num_rows, k_stride_t, v_stride_t,
                         H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, ROWS: tl.constexpr):
    """Program i encodes (token, head) rows [i * ROWS, (i + 1) * ROWS) of K and of V."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    t = r // H
    slot = tl.load(slots + t, mask=r < num_rows, other=-1)
    ok = slot >= 0
    dst = slot.to(tl.int64) * (H * (D + 1)) + (r % H) * (D + 1)
    t = t.to(tl.int64)
    _store_fp8_rows(key + t * k_stride_t + (r % H) * D, k_cache + dst, ok, D, DP)
    _store_fp8_rows(value + t * v_stride_t + (r % H) * D, v_cache + dst, ok, D, DP)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write key/value `[num_tokens, num_kv_heads, head_dim]` into the slots `slot_mapping`
    `[num_tokens]` (int64; -1 skips the token) of one layer's caches, in place. An FP8 cache
    (uint8, last dim head_dim + 1) takes key/value of any float dtype and stores them encoded."""
    _check_cache_pair(k_cache, v_cache)
    nb, bs, h, d = k_cache.shape
    fp8 = k_cache.dtype == kv_fp8.STORAGE_DTYPE
    d -= fp8  # an FP8 row: head_dim values, then the exponent byte
    for name, x in (("key", key), ("value", value)):
        need(x.dim() == 3 and tuple(x.shape[1:]) == (h, d),
             f"{name} must be [num_tokens, {h}, {d}] to match the cache, got {tuple(x.shape)}")
        if fp8:
            need(x.dtype in (torch.float32, torch.float16, torch.bfloat16),
                 f"{name} is {x.dtype}; an FP8 cache takes float32, float16 or bfloat16")
        else:
            need(x.dtype == k_cache.dtype, f"{name} is {x.dtype}, the cache is {k_cache.dtype}")
        need(x.device == k_cache.device, f"{name} is on {x.device}, the cache on {k_cache.device}")
        need(x.stride(2) == 1 and x.stride(1) == d, f"{name} must be contiguous per token, strides {x.stride()}")
    need(key.shape[0] == value.shape[0], f"key has {key.shape[0]} tokens, value {value.shape[0]}")
    need(slot_mapping.dim() == 1 and slot_mapping.shape[0] == key.shape[0],
         f"slot_mapping must be [{key.shape[0]}], got {tuple(slot_mapping.shape)}")
    need(slot_mapping.dtype == torch.int64, f"slot_mapping must be int64, got {slot_mapping.dtype}")
    need(slot_mapping.device == k_cache.device, f"slot_mapping is on {slot_mapping.device}")
    if key.shape[0] == 0:
        return
    slots = slot_mapping.contiguous()
    if fp8:
        dp = triton.next_power_of_2(d)
        rows = max(1, 2048 // dp)  # (token, head) rows per program: tiles of ~2K values
        grid = (triton.cdiv(key.shape[0] * h, rows),)
        _store_kv_fp8_kernel[grid](key, value, k_cache, v_cache, slots, key.shape[0] * h, key.stride(0),
                                   value.stride(0), H=h, D=d, DP=dp, ROWS=rows)
        return
    _store_kv_kernel[(key.shape[0],)](key, value, k_cache, v_cache, slots, key.stride(0), value.stride(0),
                                      HD=h * d, BLOCK=triton.next_power_of_2(h * d))


def store_kv_reference(key, value, k_cache, v_cache, slot_mapping) -> None:
    nb, bs, h, d = k_cache.shape
    keep = slot_mapping >= 0
    fp8 = k_cache.dtype == kv_fp8.STORAGE_DTYPE
    enc = kv_fp8.encode if fp8 else (lambda x: x)
    k_cache.view(nb * bs, h, d)[slot_mapping[keep]] = enc(key[keep])
    v_cache.view(nb * bs, h, d)[slot_mapping[keep]] = enc(value[keep])


@triton.jit
def _copy_blocks_kernel(src, dst, src_ids, dst_ids, BLOCK_NUMEL: tl.constexpr, CHUNK: tl.constexpr):
    """Copy block src_ids[i] of `src` to block dst_ids[i] of `dst` (blocks of BLOCK_NUMEL
    contiguous elements); program (i, c) moves chunk c."""
    i, c = tl.program_id(0), tl.program_id(1)
    s = tl.load(src_ids + i).to(tl.int64)
    t = tl.load(dst_ids + i).to(tl.int64)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    mask = offs < BLOCK_NUMEL
    tl.store(dst + t * BLOCK_NUMEL + offs, tl.load(src + s * BLOCK_NUMEL + offs, mask=mask), mask=mask)


_CHUNK = 1024


def _copy_blocks(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    numel = src[0].numel()
    grid = (src_ids.shape[0], triton.cdiv(numel, _CHUNK))
    _copy_blocks_kernel[grid](src, dst, src_ids, dst_ids, BLOCK_NUMEL=numel, CHUNK=_CHUNK)


def pack_blocks(k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor],
                block_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """The blocks `block_ids` of every layer, as one contiguous buffer
    `[num_layers, 2, len(block_ids), block_size, num_kv_heads, head_dim]`."""
    ids = _check_layers_and_ids(k_caches, v_caches, block_ids)
    nb, bs, h, d = k_caches[0].shape
    out = torch.empty((len(k_caches), 2, ids.shape[0], bs, h, d), dtype=k_caches[0].dtype, device=k_caches[0].device)
    if ids.shape[0] == 0:
        return out
    seq = torch.arange(ids.shape[0], dtype=torch.int64, device=ids.device)
    for layer, (k, v) in enumerate(zip(k_caches, v_caches)):
        _copy_blocks(k, out[layer, 0], ids, seq)
        _copy_blocks(v, out[layer, 1], ids, seq)
    return out


def unpack_blocks(buffer: torch.Tensor, k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor],
                  block_ids: torch.Tensor | Sequence[int]) -> None:
    """Write a `pack_blocks` buffer into the blocks `block_ids` of every layer, in place."""
    ids = _check_layers_and_ids(k_caches, v_caches, block_ids)
    nb, bs, h, d = k_caches[0].shape
    want = (len(k_caches), 2, ids.shape[0], bs, h, d)
    need(tuple(buffer.shape) == want, f"buffer must be {want}, got {tuple(buffer.shape)}")
    need(buffer.dtype == k_caches[0].dtype, f"buffer is {buffer.dtype}, the caches {k_caches[0].dtype}")
    need(buffer.device == k_caches[0].device, f"buffer is on {buffer.device}, the caches on {k_caches[0].device}")
    need(buffer.is_contiguous(), "buffer must be contiguous")
    if ids.shape[0] == 0:
        return
    seq = torch.arange(ids.shape[0], dtype=torch.int64, device=ids.device)
    for layer, (k, v) in enumerate(zip(k_caches, v_caches)):
        _copy_blocks(buffer[layer, 0], k, seq, ids)
        _copy_blocks(buffer[layer, 1], v, seq, ids)


def pack_blocks_reference(k_caches, v_caches, block_ids) -> torch.Tensor:
    ids = torch.as_tensor(block_ids, dtype=torch.int64, device=k_caches[0].device)
    return torch.stack([torch.stack([k[ids], v[ids]]) for k, v in zip(k_caches, v_caches)])


def unpack_blocks_reference(buffer, k_caches, v_caches, block_ids) -> None:
    ids = torch.as_tensor(block_ids, dtype=torch.int64, device=k_caches[0].device)
    for layer, (k, v) in enumerate(zip(k_caches, v_caches)):
        k[ids] = buffer[layer, 0]
        v[ids] = buffer[layer, 1]


# -- checks ---------------------------------------------------------------------------------------

def _check_cache_pair(k: torch.Tensor, v: torch.Tensor, what: str = "cache") -> None:
    need(k.dim() == 4, f"k_{what} must be [num_blocks, block_size, num_kv_heads, head_dim], got {tuple(k.shape)}")
    need(v.shape == k.shape, f"v_{what} is {tuple(v.shape)}, k_{what} {tuple(k.shape)}")
    need(v.dtype == k.dtype and v.device == k.device, f"k_{what} and v_{what} differ in dtype or device")
    need(k.is_contiguous() and v.is_contiguous(), f"k_{what} and v_{what} must be contiguous")


def _check_layers_and_ids(k_caches, v_caches, block_ids) -> torch.Tensor:
    need(len(k_caches) > 0 and len(k_caches) == len(v_caches),
         f"need one K and one V cache per layer, got {len(k_caches)} and {len(v_caches)}")
    for i, (k, v) in enumerate(zip(k_caches, v_caches)):
        _check_cache_pair(k, v, f"caches[{i}]")
        need(k.shape == k_caches[0].shape and k.dtype == k_caches[0].dtype,
             f"layer {i}'s cache {tuple(k.shape)} {k.dtype} differs from layer 0's")
    ids = torch.as_tensor(block_ids, dtype=torch.int64, device=k_caches[0].device).reshape(-1)
    nb = k_caches[0].shape[0]
    if not bool(((ids >= 0) & (ids < nb)).all()):  # the message (a device read) only on failure
        raise ValueError(f"block_ids must be in [0, {nb}), got {ids.tolist()}")
    return ids.contiguous()
