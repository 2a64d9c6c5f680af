"""One decoder layer as the roofline sees it: the per-token numbers that decide its FLOPs, the
bytes it reads and how it splits over GPUs. A model shape (shapes.py, mla_moe.py) is a stack of
these; the parallel roofline (parallel.py) sums them over a pipeline stage's layers. Pure data."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerShape:
    attn_params: int  # attention projections and the MoE router: split over a TP group by heads
    mlp_params: int  # what every token goes through besides attention: the dense MLP or the shared expert(s)
    kv_bytes: int  # KV cache bytes per token of context
    prefill_pair_flops: float  # per causal (query, key) pair of a prefill chunk
    decode_pair_flops: float  # per context token a decoding sequence attends to
    kv_by_heads: bool = True  # the KV splits with TP's heads (GQA); MLA's one latent does not: each rank holds it
    experts: int = 0  # routed experts (0: a dense layer)
    expert_params: int = 0  # one routed expert's
    top_k: int = 0  # routed experts per token

    @property
    def params(self) -> int:
        return self.attn_params + self.mlp_params + self.experts * self.expert_params

    @property
    def active_params(self) -> int:
        """Parameters one token multiplies through."""
        return self.attn_params + self.mlp_params + self.top_k * self.expert_params
