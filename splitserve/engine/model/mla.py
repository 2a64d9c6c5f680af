"""Multi-head latent attention (DeepSeek-V2/V3), over the same paged cache as every model.

Each token's keys and values come from one compressed latent `c` (kv_lora_rank, RMS-normed) and
one rotated key part `k_pe` (qk_rope_head_dim) shared by all heads; the cache holds exactly
those, one "KV head" of `latent_dim` per token, instead of per-head keys and values (for
DeepSeek-V3's shapes 576 values per token and layer instead of 128 × 320).

Attention runs on the latent directly ("absorbed"): head h's key is W_UK[h] · c, so
q_nope[h] · k_nope[h] = (W_UK[h]ᵀ q_nope[h]) · c — each query is turned into latent space once,
and attends over [c, k_pe] like a multi-query attention with one KV head; its output, a
mixture of latents, becomes the head's value through W_UV[h]. Mathematically what Hugging Face
computes by expanding every cached latent into full keys and values; a different order of
operations, so fp32 results differ in the last bits. The cache's V plane holds the same latent
as its K plane (the attention backends read one of each); the V half is the price of keeping
one cache layout for every model."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from splitserve.engine.attention.backend import AttentionBackend
from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.layers import RMSNorm, apply_rope

LATENT_NORM_EPS = 1e-6  # DeepSeek's q_a / kv_a norms use their default eps, not rms_norm_eps


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        m = cfg.mla
        assert m is not None
        self.m, self.heads = m, cfg.num_heads
        q_out = cfg.num_heads * m.qk_head_dim
        if m.q_lora_rank:
            self.q_a_proj = nn.Linear(cfg.hidden_size, m.q_lora_rank, bias=m.attention_bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(m.q_lora_rank, q_out, bias=False)
        else:
            self.q_proj = nn.Linear(cfg.hidden_size, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, m.latent_dim, bias=m.attention_bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, cfg.num_heads * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * m.v_head_dim, cfg.hidden_size, bias=m.attention_bias)
        # the full query-key width's, as if keys were expanded; DeepSeek's yarn mscale_all_dim squared
        self.scale = cfg.rope.softmax_scale(m.qk_head_dim ** -0.5)
        self.rope = apply_rope  # or a fused kernel (LlamaModel.use_triton_kernels / use_cpu_kernels)

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.m.q_lora_rank:
            return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return self.q_proj(x)

    def forward(self, x, cos, sin, kv: tuple[torch.Tensor, torch.Tensor], backend: AttentionBackend, meta: Any):
        m, h, n = self.m, self.heads, x.shape[0]
        q_nope, q_pe = self._queries(x).view(n, h, m.qk_head_dim).split([m.qk_nope_head_dim, m.qk_rope_head_dim], -1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], -1)
        c = self.kv_a_layernorm(c)
        pe = torch.cat((q_pe, k_pe.view(n, 1, m.qk_rope_head_dim)), dim=1)
        if m.rope_interleave:  # pairs (x0, x1), (x2, x3)...: evens then odds is the rotate-half layout
            pe = torch.cat((pe[..., 0::2], pe[..., 1::2]), dim=-1)
        q_pe, k_pe = self.rope(pe.contiguous(), cos, sin).split([h, 1], dim=1)
        w = self.kv_b_proj.weight.view(h, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        w_uk, w_uv = w[:, : m.qk_nope_head_dim], w[:, m.qk_nope_head_dim:]
        q = torch.cat((torch.einsum("nhd,hdr->nhr", q_nope, w_uk), q_pe), dim=-1)  # [n, h, latent_dim]
        latent = torch.cat((c.view(n, 1, m.kv_lora_rank), k_pe), dim=-1).contiguous()  # [n, 1, latent_dim]
        o = backend.forward(q.contiguous(), latent, latent, kv[0], kv[1], meta, self.scale)[..., : m.kv_lora_rank]
        out = torch.einsum("nhr,hvr->nhv", o, w_uv)
        return self.o_proj(out.reshape(n, h * m.v_head_dim))
