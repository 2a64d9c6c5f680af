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
from splitserve.types import ConfigError


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
    """The inverse frequencies transformers' ROPE_INIT_FUNCTIONS compute at start (no sequence
    length given: dynamic NTK unscaled, longrope's short factors)."""
    # computed on the CPU even when the model is built on the meta device (engine.model.loader):
    # arithmetic on meta tensors imports torch._dynamo, ~3 s of every worker's start
    if rope.scaling_type == "yarn":
        return _yarn_inv_freq(rope, head_dim)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    if rope.scaling_type == "longrope":
        return 1.0 / (_factors(rope.short_factor, head_dim) * rope.theta ** exponents)
    inv = 1.0 / (rope.theta ** exponents)
    if rope.scaling_type == "linear":
        return inv / rope.factor
    if rope.scaling_type == "llama3":
        return _llama3_scale(inv, rope)
    return inv


def grown_inv_freq(rope: RopeConfig, head_dim: int, seq_lens: torch.Tensor) -> torch.Tensor:
    """[len(seq_lens), head_dim / 2]: the inverse frequencies transformers switches to in a
    forward whose longest sequence is seq_len > original_max_position_embeddings (dynamic NTK:
    a larger base for each length; longrope: the long factors)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    if rope.scaling_type == "longrope":
        return (1.0 / (_factors(rope.long_factor, head_dim) * rope.theta ** exponents)).expand(len(seq_lens), -1)
    assert rope.scaling_type == "dynamic", rope.scaling_type
    # transformers' own arithmetic on a 0-dim tensor seq_len (fp32). The power goes one length at
    # a time: torch's vectorised pow differs from its scalar one in the last bit (~0.6 s per
    # 100k lengths, once per start)
    f, n = rope.factor, rope.original_max_position_embeddings
    stretch = (f * seq_lens / n) - (f - 1)
    e = head_dim / (head_dim - 2)
    base = rope.theta * torch.stack([s ** e for s in stretch.unbind()])
    return 1.0 / (base[:, None] ** exponents[None, :])


def _factors(factors: tuple[float, ...], head_dim: int) -> torch.Tensor:
    if len(factors) != head_dim // 2:
        raise ConfigError(f"longrope factors have {len(factors)} entries; a rotary dimension of {head_dim} needs {head_dim // 2}")
    return torch.tensor(factors, dtype=torch.float32, device="cpu")


def _yarn_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    # YaRN: dimensions that turn fewer than beta_slow times over the original length are
    # interpolated (slowed by `factor`), those that turn more than beta_fast times kept, a linear
    # ramp between. transformers' _compute_yarn_parameters, step for step.
    base, old_len = rope.theta, rope.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (rope.factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


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
    """cos/sin tables for every position up to `max_positions`, looked up per token, times the
    scaling's attention factor (yarn, longrope).

    Dynamic NTK and longrope change their frequencies with the sequence: transformers computes
    a forward with the frequencies of its longest sequence's length (max position + 1) when that
    exceeds original_max_position_embeddings, and keeps the keys already cached as they were
    rotated. A table per position cannot follow a whole batch's (or a whole prompt's) length:
    row p holds what transformers computes for a forward whose last position is p. That is
    exactly transformers' result for every sequence whose prompt fits in the original length
    (the decode steps past it included), and for any sequence fed one token per forward; a
    longer prompt's tokens before its last are rotated at their own length here, at the
    prompt's in transformers. Per position, not per step, so that a token's keys do not depend
    on how its prompt was chunked, batched, cached or recomputed."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        inv = rope_inv_freq(rope, head_dim)
        pos = torch.arange(max_positions, dtype=torch.float32, device="cpu")
        freqs = pos[:, None] * inv[None, :]
        grows_at = rope.original_max_position_embeddings
        if rope.scaling_type in ("dynamic", "longrope") and max_positions > grows_at:
            lengths = torch.arange(grows_at + 1, max_positions + 1, dtype=torch.int64, device="cpu")
            freqs[grows_at:] = pos[grows_at:, None] * grown_inv_freq(rope, head_dim, lengths)
        emb = torch.cat((freqs, freqs), dim=-1)
        half = inv.shape[0]
        scaling = rope.attention_scaling
        cos, sin = emb.cos(), emb.sin()
        if scaling != 1.0:  # (a product by 1.0 is exact: skipped)
            cos, sin = cos * scaling, sin * scaling
        # rotate_half(x) * sin == swap_halves(x) * [-sin | sin], bit for bit (a sign flip is exact),
        # one op fewer per call.
        sin[:, :half] = -sin[:, :half]
        self.register_buffer("cos", cos, persistent=False)
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
