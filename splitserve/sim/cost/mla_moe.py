"""DeepSeek-V3 / R1's shape for the roofline: multi-head latent attention (MLA) and a
mixture of experts (256 routed, top 8, plus one shared expert every token passes through) after
three dense layers. Numbers from the published config.json (deepseek-ai/DeepSeek-V3, R1 is the
same architecture); `from_config` reads any such config (V2, V2-Lite, V3, R1, Kimi-K2).

Per layer and token (norms left out: a few thousand parameters):
  attention  q: hidden × q_lora + q_lora × heads × (qk_nope + qk_rope) (hidden × heads × … without
             a q LoRA); kv: hidden × (kv_lora + qk_rope) + kv_lora × heads × (qk_nope + v_head);
             out: heads × v_head × hidden; the router: experts × hidden
  KV cache   the latent, kv_lora + qk_rope values a token a layer (not per head: under tensor
             parallelism every rank holds all of it)
  pairs      prefill runs attention expanded: 2 · heads · (qk_nope + qk_rope + v_head) FLOPs a pair;
             decode runs it absorbed over the latent: 2 · heads · (kv_lora + qk_rope + kv_lora)
Weights FP8 (the released checkpoint: 1 byte a parameter, block scales left out), embeddings and
LM head bf16; the multi-token-prediction module (14 B parameters) is not served here.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.sim.cost.layers import LayerShape
from splitserve.types import ConfigError


@dataclass(frozen=True)
class MLAMoEShape:
    name: str
    num_layers: int = 61
    first_dense: int = 3  # layers before the first MoE layer
    hidden: int = 7168
    intermediate: int = 18432  # the dense layers' MLP
    num_heads: int = 128
    q_lora_rank: int = 1536  # 0: q projected directly
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    routed_experts: int = 256
    shared_experts: int = 1
    moe_intermediate: int = 2048
    top_k: int = 8
    vocab: int = 129280
    weight_dtype_bytes: int = 1  # FP8 weights
    embedding_dtype_bytes: int = 2
    kv_dtype_bytes: int = 2  # a bf16 latent cache
    tied_embeddings: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.first_dense <= self.num_layers or self.top_k > self.routed_experts:
            raise ConfigError(f"{self.name}: first_dense must be in [0, layers] and top_k <= routed experts")

    # -- layers -------------------------------------------------------------------------------------
    @property
    def attn_params(self) -> int:
        h, H = self.hidden, self.num_heads
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        q = h * self.q_lora_rank + self.q_lora_rank * H * qk if self.q_lora_rank else h * H * qk
        kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * H * (self.qk_nope_head_dim
                                                                                          + self.v_head_dim)
        return q + kv + H * self.v_head_dim * h

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.moe_intermediate

    def _layer(self, moe: bool) -> LayerShape:
        H, lat = self.num_heads, self.kv_lora_rank + self.qk_rope_head_dim
        router = self.routed_experts * self.hidden if moe else 0
        mlp = self.shared_experts * self.expert_params if moe else 3 * self.hidden * self.intermediate
        return LayerShape(self.attn_params + router, mlp, lat * self.kv_dtype_bytes,
                          2 * H * (self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim),
                          2 * H * (lat + self.kv_lora_rank), kv_by_heads=False,
                          experts=self.routed_experts if moe else 0, expert_params=self.expert_params if moe else 0,
                          top_k=self.top_k if moe else 0)

    def layers(self) -> tuple[LayerShape, ...]:
        dense, moe = self._layer(False), self._layer(True)
        return (dense,) * self.first_dense + (moe,) * (self.num_layers - self.first_dense)

    # -- totals ---------------------------------------------------------------------------------------
    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def total_params(self) -> int:
        return sum(x.params for x in self.layers()) + self.embedding_params

    @property
    def active_params(self) -> int:
        """Parameters one token goes through: its layers' (attention, dense MLP or shared + top_k
        experts), the embedding row and the LM head."""
        return sum(x.active_params for x in self.layers()) + self.embedding_params

    @property
    def weight_bytes(self) -> int:
        return (sum(x.params for x in self.layers()) * self.weight_dtype_bytes
                + self.embedding_params * self.embedding_dtype_bytes)

    @property
    def kv_bytes_per_token(self) -> int:
        return sum(x.kv_bytes for x in self.layers())

    def tp_error(self, t: int) -> str | None:
        """Why `t` tensor-parallel ranks cannot split this model (None: they can)."""
        return None if self.num_heads % t == 0 else f"{t} does not divide {self.name}'s {self.num_heads} heads"

    @staticmethod
    def from_config(c: dict, name: str) -> "MLAMoEShape":
        """From a DeepSeek-style config.json's dict (the keys transformers' DeepseekV3Config has)."""
        try:
            layers, experts = int(c["num_hidden_layers"]), int(c.get("n_routed_experts") or 0)
            fp8 = (c.get("quantization_config") or {}).get("quant_method") == "fp8"
            return MLAMoEShape(
                name, num_layers=layers, first_dense=int(c.get("first_k_dense_replace", 0)) if experts else layers,
                hidden=int(c["hidden_size"]), intermediate=int(c["intermediate_size"]),
                num_heads=int(c["num_attention_heads"]), q_lora_rank=int(c.get("q_lora_rank") or 0),
                kv_lora_rank=int(c["kv_lora_rank"]), qk_nope_head_dim=int(c["qk_nope_head_dim"]),
                qk_rope_head_dim=int(c["qk_rope_head_dim"]), v_head_dim=int(c["v_head_dim"]),
                routed_experts=experts, shared_experts=int(c.get("n_shared_experts") or 0),
                moe_intermediate=int(c.get("moe_intermediate_size") or 0),
                top_k=int(c.get("num_experts_per_tok") or 0), vocab=int(c["vocab_size"]),
                weight_dtype_bytes=1 if fp8 else 2, tied_embeddings=bool(c.get("tie_word_embeddings", False)))
        except (KeyError, ValueError, TypeError) as e:
            raise ConfigError(f"{name}: not a latent-attention config the roofline can read ({e!r})") from None


DEEPSEEK_V3 = MLAMoEShape("deepseek-v3")
DEEPSEEK_R1 = MLAMoEShape("deepseek-r1")  # the same architecture and weights' shape as V3

