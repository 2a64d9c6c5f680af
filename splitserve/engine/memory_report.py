"""What one engine (one tensor-parallel rank) holds in memory, said once at start so that an
operator can size pools: its weights (and, for a quantized checkpoint, what it stored and whether
they are held quantized or were dequantized at load), its KV cache and the tokens that holds, and
an estimate of the largest step's activations."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from splitserve.engine.model.config import ModelConfig
from splitserve.types import MemoryReport


def report(model: nn.Module, mc: ModelConfig, model_dir: str | Path, kv_bytes: int, kv_tokens: int,
           kv_dtype: str, dtype: torch.dtype, max_batched_tokens: int, max_seqs: int) -> MemoryReport:
    seen, weights = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:  # tied embeddings count once
            seen.add(t.data_ptr())
            weights += t.numel() * t.element_size()
    stored = sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))
    holding = getattr(model, "quant_holding", None)  # set by the loader for a quantized checkpoint
    return MemoryReport(weights, _name(dtype), stored, mc.quant.label if mc.quant else "plain", kv_bytes,
                        kv_tokens, kv_dtype, activation_estimate(mc, dtype, max_batched_tokens, max_seqs),
                        holding.label if holding else "dequantized at load")


def activation_estimate(mc: ModelConfig, dtype: torch.dtype, tokens: int, seqs: int) -> int:
    """Per token the residual stream and norms (~4 hidden), q/k/v, the feed-forward's gate/up and
    its product (3 intermediate; the chosen experts' for a sparse one); logits in fp32 for at most
    one row per sequence."""
    inter = mc.intermediate_size
    if mc.moe is not None:
        inter = max(inter, mc.moe.expert_intermediate_size * mc.moe.top_k + mc.moe.shared_expert_intermediate_size)
    per_token = 4 * mc.hidden_size + mc.q_size + 2 * mc.kv_size + 3 * inter
    size = torch.empty((), dtype=dtype).element_size()
    return tokens * per_token * size + min(seqs, tokens) * mc.vocab_size * 4


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
