"""The FP8 KV cache's encoding: each token's K (or V) of each KV head is stored as its head_dim
e4m3 values followed by one byte, the exponent e of its scale 2**e (a power of two, chosen per
token and head as the K/V are written so that the largest value lands in e4m3's top binade).

Why this shape: the scale sits inside the head's row, so everything that moves or slices the
cache as bytes — a handoff's blocks, a tensor-parallel rank's heads, the host tier, a
checksum — carries each value's scale with it and covers both, with no second tensor to keep
in step. A power-of-two scale costs one byte (head_dim 64: 65 bytes a row, 0.51x bf16's 128) and
loses no precision: multiplying by 2**e is exact, so the only rounding is e4m3's own."""

from __future__ import annotations

import torch

from splitserve.types import KV_FP8

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3fn's largest finite value
NAME = KV_FP8  # the KV dtype's name in configs, layouts and logs
STORAGE_DTYPE = torch.uint8  # the cache tensor's element: a byte (values and exponents)
_MIN_EXP = -126  # an all-zero row: any exponent encodes it; keep 2**e a normal float32


def row_bytes(head_dim: int) -> int:
    """Bytes of one token's row of one KV head."""
    return head_dim + 1


def encode(x: torch.Tensor) -> torch.Tensor:
    """[..., head_dim] floats -> [..., head_dim + 1] bytes."""
    amax = x.detach().abs().amax(dim=-1, keepdim=True).float()
    # amax / 448 = m * 2**e with m in [0.5, 1): scaled by 2**-e the largest value is m * 448 <= 448
    exp = torch.frexp(amax / FP8_MAX).exponent.clamp(min=_MIN_EXP, max=127)
    exp = torch.where(amax > 0, exp, torch.full_like(exp, _MIN_EXP))
    vals = torch.ldexp(x.float(), -exp).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return torch.cat((vals.view(torch.uint8), exp.to(torch.int8).view(torch.uint8)), dim=-1)


def decode(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., head_dim + 1] bytes -> [..., head_dim] of `dtype`."""
    vals = rows[..., :-1].view(FP8).float()
    exp = rows[..., -1:].view(torch.int8).to(torch.int32)
    return torch.ldexp(vals, exp).to(dtype)
