"""Model shapes for the roofline: the few numbers of a config.json that decide a step's FLOPs
and bytes. Named ones are the published configs; any Hugging Face `config.json` works too (a
DeepSeek-style one with latent attention and experts becomes an `MLAMoEShape`, mla_moe.py).

Both kinds give the parallel roofline (parallel.py) the same view: `layers()` (one LayerShape
per decoder layer), `hidden`, `vocab`, `embedding_params`, the bytes a weight and an embedding
take, `weight_bytes`, `kv_bytes_per_token`, `total_params` / `active_params`, `tp_error`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from splitserve.sim.cost.layers import LayerShape
from splitserve.sim.cost.mla_moe import DEEPSEEK_R1, DEEPSEEK_V3, MLAMoEShape
from splitserve.types import ConfigError


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool = False
    dtype_bytes: int = 2  # bf16 weights and KV

    @property
    def layer_params(self) -> int:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.intermediate

    @property
    def matmul_params(self) -> int:
        """Parameters every token multiplies through (the layers; not the embedding or LM head)."""
        return self.num_layers * self.layer_params

    @property
    def weight_bytes(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return (self.matmul_params + embeddings) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    # -- the view the parallel roofline reads (as MLAMoEShape's) ---------------------------------------
    @property
    def weight_dtype_bytes(self) -> int:
        return self.dtype_bytes

    @property
    def embedding_dtype_bytes(self) -> int:
        return self.dtype_bytes

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def total_params(self) -> int:
        return self.matmul_params + self.embedding_params

    @property
    def active_params(self) -> int:
        return self.total_params

    def layers(self) -> tuple[LayerShape, ...]:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        pair = 4 * self.num_heads * self.head_dim
        layer = LayerShape(self.hidden * (q + 2 * kv) + q * self.hidden, 3 * self.hidden * self.intermediate,
                           2 * kv * self.dtype_bytes, pair, pair)
        return (layer,) * self.num_layers

    def tp_error(self, t: int) -> str | None:
        if self.num_kv_heads % t or self.num_heads % t:
            return (f"{t} does not divide {self.name}'s heads ({self.num_heads} query, "
                    f"{self.num_kv_heads} KV)")
        return None

    @staticmethod
    def from_config(path: str | Path, name: str | None = None) -> "ModelShape | MLAMoEShape":
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        try:
            c = json.loads(p.read_text())
            if "kv_lora_rank" in c:
                return MLAMoEShape.from_config(c, name or p.parent.name)
            heads = int(c["num_attention_heads"])
            return ModelShape(name or p.parent.name, int(c["num_hidden_layers"]), int(c["hidden_size"]), heads,
                              int(c.get("num_key_value_heads", heads)),
                              int(c.get("head_dim") or c["hidden_size"] // heads), int(c["intermediate_size"]),
                              int(c["vocab_size"]), bool(c.get("tie_word_embeddings", False)))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{p}: not a model config.json the roofline can read ({e!r})") from None


MODELS: dict[str, ModelShape | MLAMoEShape] = {m.name: m for m in (
    ModelShape("llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256),
    ModelShape("llama-3-70b", 80, 8192, 64, 8, 128, 28672, 128256),
    ModelShape("qwen2.5-7b", 28, 3584, 28, 4, 128, 18944, 152064),
    ModelShape("qwen2.5-72b", 80, 8192, 64, 8, 128, 29568, 152064),
    DEEPSEEK_V3, DEEPSEEK_R1,
)}


def model_shape(name_or_path: str) -> ModelShape | MLAMoEShape:
    """A named shape, or the config.json at a path (a file or a checkpoint directory)."""
    shape = MODELS.get(name_or_path.lower())
    if shape is not None:
        return shape
    if Path(name_or_path).exists():
        return ModelShape.from_config(name_or_path)
    raise ConfigError(f"unknown model {name_or_path!r}: give one of {', '.join(MODELS)} or a config.json path")
