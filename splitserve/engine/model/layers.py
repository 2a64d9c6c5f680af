"""Building blocks of the Llama-family decoder: RMSNorm, rotary embeddings, the SwiGLU MLP.

The arithmetic follows Hugging Face's order of operations (fp32 variance, cast back before the
weight; cos/sin computed in fp32 and cast to the activation dtype) so that greedy tokens match
transformers exactly, not just approximately.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.model.config import RopeConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    # computed on the CPU even when the model is built on the meta device (engine.model.loader):
    # arithmetic on meta tensors imports torch._dynamo, ~3 s of every worker's start
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    if rope.scaling_type == "linear":
        return inv / rope.factor
    if rope.scaling_type == "llama3":
        return _llama3_scale(inv, rope)
    return inv


def _llama3_scale(inv: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between
    # interpolated smoothly.
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to `max_positions`, looked up per token."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        inv = rope_inv_freq(rope, head_dim)
        pos = torch.arange(max_positions, dtype=torch.float32, device="cpu")
        freqs = pos[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        half = inv.shape[0]
        sin = emb.sin()
        # rotate_half(x) * sin == swap_halves(x) * [-sin | sin], bit for bit (a sign flip is exact),
        # one op fewer per call.
        sin[:, :half] = -sin[:, :half]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [num_tokens, 1, head_dim], broadcastable over heads."""
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, heads, head_dim] (rotate-half layout, as in HF checkpoints); `signed_sin`
    as RotaryEmbedding returns it (first half negated)."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos + swapped * signed_sin


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.inter = inter
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split([self.inter, self.inter], dim=-1)
        return self.down_proj(F.silu(gate) * up)
