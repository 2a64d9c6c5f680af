"""Integer-packed weights (AWQ, GPTQ) back to floats: w = (q - zero) * scale, one zero and scale
per group of `group_size` input rows and per output column.

The two formats pack differently. AWQ (GEMM) packs eight 4-bit values of consecutive *output*
columns into an int32 in the interleaved order 0 2 4 6 1 3 5 7 (nibble i holds column
`_AWQ_ORDER[i]`); weights are [in, out/8]. GPTQ packs 32/bits values of consecutive *input* rows
per int32, lowest bits first (weights [in/8, out]), its zeros along output columns, and may
permute groups by activation order (`g_idx`: each input row's group). Its format v1 stores each
zero less one. The arithmetic is exact in fp32 (a <= 8-bit integer times an fp16 scale)."""

from __future__ import annotations

import torch

_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_AWQ_UNDO = tuple(_AWQ_ORDER.index(c) for c in range(8))  # column c sits in nibble _AWQ_UNDO[c]


def unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Each int32 as its 32/bits values, lowest bits first, laid out along `dim`."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    vals = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., per]
    vals = vals.movedim(-1, dim + 1 if dim >= 0 else dim)
    shape = list(packed.shape)
    shape[dim] *= per
    return vals.reshape(shape)


def _awq_columns(packed: torch.Tensor) -> torch.Tensor:
    vals = unpack(packed, 4, -1).view(*packed.shape[:-1], -1, 8)
    return vals[..., list(_AWQ_UNDO)].reshape(*packed.shape[:-1], -1)


def _check_groups(name: str, rows: int, groups: int, group_size: int) -> int:
    size = rows if group_size == -1 else group_size
    if -(-rows // size) != groups:
        raise ValueError(f"{name}: {groups} scale groups do not cover {rows} input rows in groups of {size}")
    return size


def dequantize_awq(qweight, qzeros, scales, group_size: int, dtype=torch.float32) -> torch.Tensor:
    """A linear weight [out, in] from AWQ's qweight [in, out/8], qzeros [groups, out/8], scales [groups, out]."""
    q, z = _awq_columns(qweight), _awq_columns(qzeros)
    size = _check_groups("awq", q.shape[0], scales.shape[0], group_size)
    group = torch.arange(q.shape[0]) // size
    w = (q - z[group]).to(torch.float32) * scales.to(torch.float32)[group]
    return w.t().contiguous().to(dtype)


def dequantize_gptq(qweight, qzeros, scales, g_idx, bits: int, group_size: int, zeros_minus_one: bool,
                    dtype=torch.float32) -> torch.Tensor:
    """A linear weight [out, in] from GPTQ's qweight [in*bits/32, out], qzeros [groups, out*bits/32],
    scales [groups, out] and g_idx [in] (None: row // group_size)."""
    q, z = unpack(qweight, bits, 0), unpack(qzeros, bits, -1)
    if zeros_minus_one:
        z = z + 1
    if g_idx is None:
        size = _check_groups("gptq", q.shape[0], scales.shape[0], group_size)
        g_idx = torch.arange(q.shape[0]) // size
    group = g_idx.long()
    if group.shape[0] != q.shape[0] or int(group.max()) >= scales.shape[0] or int(group.min()) < 0:
        raise ValueError(f"gptq: g_idx names groups outside the {scales.shape[0]} stored")
    w = (q - z[group]).to(torch.float32) * scales.to(torch.float32)[group]
    return w.t().contiguous().to(dtype)
