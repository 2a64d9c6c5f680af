"""FP8 weights back to floats: each stored e4m3/e5m2 value times its scale, one scale per tensor,
per output channel, or per (rows x cols) block — DeepSeek-V3's 128 x 128, whose edge blocks may be
partial (a 576-row projection has a last block of 64 rows). The product is taken in fp32, as
transformers' own dequantization does, then cast."""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def expand_block_scales(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """Per-block scales [ceil(rows/br), ceil(cols/bc)] as one scale per element [rows, cols]."""
    br, bc = block
    want = (-(-rows // br), -(-cols // bc))
    if tuple(scale.shape) != want:
        raise ValueError(f"block scales of shape {tuple(scale.shape)} do not tile a {rows}x{cols} weight "
                         f"in {br}x{bc} blocks (expected {want})")
    return scale.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`weight` [rows, cols] FP8; `scale` a scalar, [rows, 1] (per channel) or per block."""
    w, s = weight.to(torch.float32), scale.to(torch.float32)
    if block is not None and s.numel() > 1:
        s = expand_block_scales(s, *w.shape, block)
    elif s.dim() == 1 and s.numel() == w.shape[0] > 1:  # per channel, stored flat
        s = s[:, None]
    return (w * s).to(dtype)
