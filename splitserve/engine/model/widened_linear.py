"""bf16 linear layers on a CPU without AMX: many-row matmuls (prefill chunks) in fp32.

On such a CPU oneDNN's bf16 matmul (AVX-512-BF16 dot products, no more flops per cycle than
fp32 FMAs) ran at ~0.6x MKL's fp32 one for prefill-sized inputs here. A bf16 x bf16 product is
exact in fp32 and both kernels accumulate in fp32, so multiplying the widened activations by a
widened copy of the weight and rounding the result to bf16 once is the bf16 matmul up to
summation order — at fp32 speed. Decode-sized inputs (few rows, bound by reading the weight)
keep the bf16 weight: half the bytes. The cost is the fp32 copy: 4 more bytes per parameter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

WIDE_ROWS = 128  # inputs with at least this many rows multiply in fp32


class WidenedLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = linear
        self.weight32 = linear.weight.detach().float()
        self.bias32 = None if linear.bias is None else linear.bias.detach().float()

    @property
    def weight(self) -> torch.Tensor:
        """The bf16 weight, for a model that reads it directly (latent attention's kv_b_proj)."""
        return self.linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < WIDE_ROWS:
            return self.linear(x)
        return F.linear(x.float(), self.weight32, self.bias32).to(x.dtype)


def widen_linears(model: nn.Module) -> int:
    """Wrap every bf16 nn.Linear inside the decoder layers (not the LM head: it only ever sees
    the rows that need a token); how many were wrapped."""
    found = [(parent, name, child) for layer in model.layers for parent in layer.modules()
             if not isinstance(parent, WidenedLinear) for name, child in parent.named_children()
             if isinstance(child, nn.Linear) and child.weight.dtype == torch.bfloat16]
    for parent, name, child in found:
        setattr(parent, name, WidenedLinear(child))
    return len(found)
