"""What one engine (one tensor-parallel rank) holds in memory, said once at start so that an
operator can size pools: its weights (and what the checkpoint stored, when a quantized one was
dequantized at load), its KV cache and the tokens that holds, and an estimate of the largest
step's activations."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from splitserve.engine.model.config import ModelConfig

GIB = float(1 << 30)


@dataclass(frozen=True)
class MemoryReport:
    weights_bytes: int  # as held, in the serving dtype
    weights_dtype: str
    stored_bytes: int  # the checkpoint's safetensors files (all ranks' together)
    stored_format: str  # "plain" or the quantized format's label
    kv_bytes: int
    kv_tokens: int
    kv_dtype: str
    activation_bytes: int  # an estimate: the largest step's live intermediates and logits

    def describe(self) -> str:
        stored = ("" if self.stored_format == "plain" else
                  f" (checkpoint {self.stored_format}: {_size(self.stored_bytes)} stored, dequantized at load)")
        return (f"memory: weights {_size(self.weights_bytes)} {self.weights_dtype}{stored}; "
                f"KV cache {_size(self.kv_bytes)} {self.kv_dtype} = {self.kv_tokens} tokens; "
                f"activations ~{_size(self.activation_bytes)} per step")


def report(model: nn.Module, mc: ModelConfig, model_dir: str | Path, kv_bytes: int, kv_tokens: int,
           kv_dtype: str, dtype: torch.dtype, max_batched_tokens: int, max_seqs: int) -> MemoryReport:
    seen, weights = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:  # tied embeddings count once
            seen.add(t.data_ptr())
            weights += t.numel() * t.element_size()
    stored = sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))
    return MemoryReport(weights, _name(dtype), stored, mc.quant.label if mc.quant else "plain", kv_bytes,
                        kv_tokens, kv_dtype, activation_estimate(mc, dtype, max_batched_tokens, max_seqs))


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


def _size(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / (1 << 20):.1f} MiB"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
