"""The Llama-family decoder (Llama 2/3, Qwen2/2.5, Qwen3, Mistral, and with a sparse
feed-forward (model/moe.py) Mixtral, Qwen2-MoE, Qwen3-MoE; with latent attention (model/mla.py)
and DeepSeek's routing, DeepSeek-V3) over a flat, paged batch.

Input is one flat run of new tokens from many sequences (decodes first, then prefill chunks);
attention reads and writes the paged KV cache through an `AttentionBackend`. q/k/v and gate/up
projections are fused at load time (one matmul each instead of three / two).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from splitserve.engine.attention.backend import AttentionBackend
from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.layers import MLP, RMSNorm, RotaryEmbedding, apply_rope
from splitserve.engine.model.mla import MLAttention
from splitserve.engine.model.moe import SparseMoE
from splitserve.engine.parallel.group import TPGroup
from splitserve.engine.parallel.shard import Shard
from splitserve.engine.parallel.stages import Stage


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim**-0.5
        self.rope = apply_rope  # or a fused kernel (LlamaModel.use_triton_kernels / use_cpu_kernels)

    def forward(self, x, cos, sin, kv: tuple[torch.Tensor, torch.Tensor], backend: AttentionBackend, meta: Any):
        c = self.cfg
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        qk = qkv[:, : c.q_size + c.kv_size].view(n, c.num_heads + c.num_kv_heads, c.head_dim)
        v = qkv[:, c.q_size + c.kv_size:].view(n, c.num_kv_heads, c.head_dim)
        if self.q_norm is not None:
            q, k = qk.split([c.num_heads, c.num_kv_heads], dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        qk = self.rope(qk, cos, sin)  # q and k rotated in one pass
        q, k = qk.split([c.num_heads, c.num_kv_heads], dim=1)
        o = backend.forward(q, k, v.contiguous(), kv[0], kv[1], meta, self.scale)
        return self.o_proj(o.reshape(n, c.q_size))


class DecoderLayer(nn.Module):
    """Attention and feed-forward, each added to the residual stream. Under tensor parallelism
    each computes this rank's partial sum (row-parallel o_proj / down_proj) and the all-reduce
    here completes it: the one place a layer talks to the other ranks."""

    def __init__(self, cfg: ModelConfig, index: int, tp: TPGroup, shard: Shard | None) -> None:
        super().__init__()
        self.tp = tp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg) if cfg.mla is not None else Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        sparse = cfg.moe is not None and cfg.moe.is_sparse(index)
        self.mlp = SparseMoE(cfg, shard) if sparse else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.fused_rms_norm = None  # a fused kernel, set by LlamaModel.use_triton_kernels / use_cpu_kernels

    def forward(self, x, cos, sin, kv, backend, meta):
        x = x + self.tp.all_reduce(self.self_attn(self.input_layernorm(x), cos, sin, kv, backend, meta))
        return x + self.tp.all_reduce(self.mlp(self.post_attention_layernorm(x)))

    def forward_fused(self, residual, delta, cos, sin, kv, backend, meta):
        """The same arithmetic with each residual add fused into the RMSNorm after it (one
        kernel instead of ~7). `residual + delta` is the stream entering the layer (delta None
        for the first layer); returns the pair leaving it."""
        rms_norm = self.fused_rms_norm
        n1, n2 = self.input_layernorm, self.post_attention_layernorm
        if delta is None:
            h = rms_norm(residual, n1.weight, n1.eps)
        else:
            h, residual = rms_norm(delta, n1.weight, n1.eps, residual=residual)
        attn = self.tp.all_reduce(self.self_attn(h, cos, sin, kv, backend, meta))
        h, residual = rms_norm(attn, n2.weight, n2.eps, residual=residual)
        return residual, self.tp.all_reduce(self.mlp(h))


class LlamaModel(nn.Module):
    """`cfg`: the shapes this rank holds (parallel/shard.local_config; the model's own at
    tensor_parallel_size 1). `shard`: which vocab rows and experts, None for all. `stage`: a
    pipeline stage's layers only (`layers[i]` is global layer stage.layers[i]), the embedding
    on the first (and a tied LM head's last), the final norm and LM head on the last (the
    modules a stage lacks are None); None for all."""

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPGroup | None = None,
                 shard: Shard | None = None, stage: Stage | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp or TPGroup()
        self.shard = shard
        self.stage = stage
        rows = cfg.vocab_size if shard is None else len(shard.vocab)
        # given its (empty) weight, Embedding skips its random init: normal_ on the meta device the
        # loader builds under would import torch._dynamo, ~3 s of every worker's start
        self.embed_tokens = (nn.Embedding(rows, cfg.hidden_size, _weight=torch.empty(rows, cfg.hidden_size))
                             if stage is None or stage.holds_embedding(cfg.tie_word_embeddings) else None)
        held = range(cfg.num_layers) if stage is None else stage.layers
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, self.tp, shard) for i in held)
        last = stage is None or stage.last
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if last else None
        self.rotary = RotaryEmbedding(cfg.rope, cfg.rope_dim, max_positions)
        self.lm_head = nn.Linear(cfg.hidden_size, rows, bias=False) if last else None
        # called with i once layer i has run (its KV written): a streamed prefill's blocks move
        # layer group by layer group while the later layers compute (set for one step at a time)
        self.after_layer: Callable[[int], None] | None = None

    @property
    def fused(self) -> bool:
        """Whether the layers run fused kernels (`use_triton_kernels` / `use_cpu_kernels`)."""
        return self.layers[0].fused_rms_norm is not None

    def use_triton_kernels(self, enabled: bool = True) -> None:
        """Residual add + RMSNorm and rotary through the fused Triton kernels (same results:
        they round as the torch ops do), or back to the torch ops. Needs CUDA, or the Triton
        interpreter."""
        if enabled:
            from splitserve.engine.kernels.triton_norm import apply_rotary, rms_norm  # triton: a GPU extra
        else:
            apply_rotary, rms_norm = apply_rope, None
        self._use_kernels(rms_norm, apply_rotary)

    def use_cpu_kernels(self, enabled: bool = True) -> None:
        """The same two fused layers as native CPU kernels (kernels/norm_rope_cpu.py), or back to
        the torch ops."""
        if enabled:
            from splitserve.engine.kernels.norm_rope_cpu import apply_rotary, rms_norm
        else:
            apply_rotary, rms_norm = apply_rope, None
        self._use_kernels(rms_norm, apply_rotary)

    def _use_kernels(self, rms_norm, apply_rotary) -> None:
        for layer in self.layers:
            layer.fused_rms_norm = rms_norm
            layer.self_attn.rope = apply_rotary

    def tie_weights(self) -> None:
        if self.cfg.tie_word_embeddings and self.lm_head is not None:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend,
        meta: Any,
    ) -> torch.Tensor:
        x, delta = self.run_layers(self.embed(input_ids), None, positions, kv_caches, backend, meta)
        return x if delta is None else x + delta

    def run_layers(self, x: torch.Tensor, delta: torch.Tensor | None, positions: torch.Tensor,
                   kv_caches: list[tuple[torch.Tensor, torch.Tensor]], backend: AttentionBackend,
                   meta: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layers held on the stream `x` entering the first of them; the stream leaving the
        last. Fused, the stream is a pair: residual `x` and the last layer's output `delta`, not
        yet added (None entering the model's first layer); unfused, delta is None. A pipeline
        stage passes the pair on as it is, so that the next stage's first layer adds it where
        the whole model's would."""
        cos, sin = self.rotary(positions, x.dtype)
        after = self.after_layer
        if self.fused:
            for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
                x, delta = layer.forward_fused(x, delta, cos, sin, kv, backend, meta)
                if after is not None:
                    after(i)
            return x, delta
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
            x = layer(x, cos, sin, kv, backend, meta)
            if after is not None:
                after(i)
        return x, None

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return vocab_embed(self.embed_tokens, ids, self.shard, self.tp)

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """Final norm + LM head, only for the rows that need a next token; in fp32 (`upcast`,
        else the model's dtype: a pipeline's last stage sends half the bytes, upcast exactly)."""
        logits = vocab_logits(self.lm_head, self.norm(hidden), self.shard, self.tp, self.cfg.vocab_size)
        return logits.float() if upcast else logits


def vocab_embed(embedding: nn.Embedding, ids: torch.Tensor, shard: Shard | None, tp: TPGroup) -> torch.Tensor:
    """An embedding held whole (`shard` None) or by vocab rows (a draft head's own too)."""
    if shard is None:
        return embedding(ids)
    # vocab-parallel: this rank's rows, zeros for the others' ids, summed over the ranks
    local = ids - shard.vocab.start
    held = (local >= 0) & (local < len(shard.vocab))
    x = embedding(local.clamp(0, len(shard.vocab) - 1)) * held[:, None].to(embedding.weight.dtype)
    return tp.all_reduce(x)


def vocab_logits(lm_head: nn.Module, x: torch.Tensor, shard: Shard | None, tp: TPGroup, vocab: int) -> torch.Tensor:
    """An LM head held whole or by vocab rows: each rank's rows gathered, the padding dropped."""
    logits = lm_head(x)
    if shard is not None:
        logits = tp.all_gather(logits, dim=-1)[:, :vocab]
    return logits
