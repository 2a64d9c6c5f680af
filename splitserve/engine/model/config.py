"""What the engine needs to know about a Hugging Face checkpoint, read once from config.json.

Llama 2/3, Qwen2/2.5 (q/k/v bias, tied embeddings), Qwen3 (q/k RMSNorm, explicit `head_dim`)
and Mistral share one decoder; so do the mixture-of-experts models Mixtral, Qwen2-MoE (with a
gated shared expert), Qwen3-MoE and DeepSeek-V3, whose feed-forward is a `MoEConfig`. This file
turns their configs into one `ModelConfig` so the model code has no per-architecture branches
beyond flags.

Rotary scaling (`rope_scaling` / `rope_parameters`), as transformers' ROPE_INIT_FUNCTIONS:
`default`, `linear`, `dynamic` (NTK), `yarn` (with DeepSeek's `mscale` / `mscale_all_dim`),
`longrope` and `llama3`; the tables are built in `layers.RotaryEmbedding`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitserve.engine.quant import config as quant_config
from splitserve.engine.quant.config import WeightQuant
from splitserve.types import ConfigError

# architecture name -> (q/k/v bias always on, q/k norm). Qwen2 hard-codes q/k/v bias; Llama and
# Qwen3 follow `attention_bias` for q/k/v/o; Mistral has none.
SUPPORTED_ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
    "MixtralForCausalLM": (False, False),
    "Qwen2MoeForCausalLM": (True, False),
    "Qwen3MoeForCausalLM": (False, True),
    "DeepseekV3ForCausalLM": (False, False),
}
_MOE = {"MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM"}
_MLA = {"DeepseekV3ForCausalLM"}


ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """YaRN's attention temperature, 0.1 · mscale · ln(scale) + 1 (transformers' own)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    scaling_type: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    # the pre-training length: llama3 / yarn / longrope's; for dynamic, max_position_embeddings
    # (past which transformers starts scaling)
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0  # yarn: the ramp between extrapolated and interpolated dimensions
    beta_slow: float = 1.0
    truncate: bool = True  # yarn: the ramp's ends rounded to whole dimensions
    mscale: float | None = None  # yarn (DeepSeek): with mscale_all_dim, the cos/sin factor's numerator
    mscale_all_dim: float | None = None  # and denominator; MLA also scales its softmax by it, squared
    attention_factor: float | None = None  # yarn / longrope: cos and sin times this; None: derived
    short_factor: tuple[float, ...] = ()  # longrope: per-frequency divisors up to the original length
    long_factor: tuple[float, ...] = ()  # and past it

    def __post_init__(self) -> None:
        if self.scaling_type not in ROPE_TYPES:
            raise ConfigError(f"unsupported rope scaling type {self.scaling_type!r}; supported: {', '.join(ROPE_TYPES)}")
        if self.scaling_type == "longrope" and (not self.short_factor or len(self.short_factor) != len(self.long_factor)):
            raise ConfigError("longrope rope scaling needs short_factor and long_factor lists of one length, "
                              f"got {len(self.short_factor)} and {len(self.long_factor)}")

    @property
    def attention_scaling(self) -> float:
        """What cos and sin are multiplied by (transformers' `attention_scaling`)."""
        if self.scaling_type == "yarn":
            if self.attention_factor is not None:
                return self.attention_factor
            if self.mscale and self.mscale_all_dim:
                return float(yarn_get_mscale(self.factor, self.mscale) / yarn_get_mscale(self.factor, self.mscale_all_dim))
            return yarn_get_mscale(self.factor)
        if self.scaling_type == "longrope":
            if self.attention_factor is not None:
                return self.attention_factor
            if self.factor <= 1.0:
                return 1.0
            return math.sqrt(1 + math.log(self.factor) / math.log(self.original_max_position_embeddings))
        return 1.0

    def softmax_scale(self, scale: float) -> float:
        """A latent attention's softmax scale: DeepSeek's `mscale_all_dim` multiplies it by
        yarn_get_mscale(factor, mscale_all_dim) squared (transformers' `yarn_apply_mscale`)."""
        if self.scaling_type != "default" and self.mscale_all_dim:
            m = yarn_get_mscale(self.factor, self.mscale_all_dim)
            scale = scale * m * m
        return scale


@dataclass(frozen=True)
class MoEConfig:
    """A sparse feed-forward: each token goes to its `top_k` of `num_experts` experts, weighted
    by the router's softmax (renormalised over the chosen when `renormalize`), plus a shared
    expert gated by a sigmoid where the architecture has one (Qwen2-MoE)."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    renormalize: bool
    shared_expert_intermediate_size: int = 0  # 0: none
    # the top-k weights multiply the expert outputs in fp32 (Mixtral) or in the activation
    # dtype (Qwen): rounding, so that bf16 matches Hugging Face too
    weights_in_fp32: bool = False
    dense_layers: tuple[int, ...] = ()  # layers whose feed-forward is a plain MLP instead
    # DeepSeek-V3's router: sigmoid scores, a per-expert bias added for the choice only, the
    # experts chosen within the `topk_group` best of `n_group` groups, weights scaled after
    scoring: str = "softmax"  # "softmax" | "sigmoid"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    score_bias: bool = False  # the router has an e_score_correction_bias
    shared_expert_gated: bool = True  # Qwen2-MoE gates its shared expert by a sigmoid; DeepSeek does not

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok {self.top_k} must be in 1..num_experts {self.num_experts}")

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): keys and values come from one compressed
    latent per token (`kv_lora_rank`) plus a shared rotated key part (`qk_rope_head_dim`); the
    cache holds those (`latent_dim` per token), not per-head keys and values."""

    q_lora_rank: int | None  # None: queries by one projection, else through a low-rank one
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # the rope dimensions come in interleaved pairs (DeepSeek's layout)
    attention_bias: bool = False

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None
    # sampling parameters generation_config.json recommends: what a request that omits them gets
    # (as vLLM serves them); greedy checkpoints (do_sample: false) recommend none
    sampling_defaults: tuple[tuple[str, float], ...] = ()
    max_new_tokens: int | None = None  # generation_config.json's: a request's default max_tokens (as vLLM)
    moe: MoEConfig | None = None  # None: every layer's feed-forward is a dense MLP
    mla: MLAConfig | None = None  # multi-head latent attention (DeepSeek-V3); None: grouped-query
    quant: WeightQuant | None = None  # how the checkpoint stores its weights; None: plain floats
    # layers the checkpoint holds past num_hidden_layers: DeepSeek-V3's multi-token-prediction
    # modules (num_nextn_predict_layers), which greedy decoding does not run; the loader skips them
    extra_layers: int = 0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads {self.num_kv_heads}")

    @property
    def rope_dim(self) -> int:
        """The dimensions rotary embeddings turn: a head's, or MLA's rope part."""
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def max_context(self) -> int:
        """Longest context served exactly: a sliding window is not implemented, so cap at it.
        Linear and dynamic rope scaling stretch max_position_embeddings by `factor`, yarn the
        original length (as vLLM derives a model's length; transformers sets no limit)."""
        n, rope = self.max_position_embeddings, self.rope
        if rope.scaling_type in ("linear", "dynamic"):
            n = max(n, int(n * rope.factor))
        elif rope.scaling_type == "yarn":
            n = max(n, int(rope.original_max_position_embeddings * rope.factor))
        return min(n, self.sliding_window) if self.sliding_window else n

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{model_dir} is not a Hugging Face model directory: no config.json")
        cfg = json.loads(path.read_text())
        gen_path = Path(model_dir) / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        return cls.from_hf(cfg, gen)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], gen: dict[str, Any] | None = None) -> "ModelConfig":
        arch = _architecture(cfg)
        bias_default, qk_norm = SUPPORTED_ARCHITECTURES[arch]
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        eos = _eos_ids(cfg, gen or {})
        mla = _mla(arch, cfg)
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            # MLA caches one latent "head" per token: the compressed KV and the rotated key part
            num_kv_heads=1 if mla else cfg.get("num_key_value_heads") or heads,
            head_dim=mla.latent_dim if mla else cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rope=_rope(cfg),
            qkv_bias=bias_default or bool(cfg.get("attention_bias", False)) and arch != "MistralForCausalLM",
            o_bias=bool(cfg.get("attention_bias", False)) and arch in ("LlamaForCausalLM", "Qwen3ForCausalLM"),
            qk_norm=qk_norm,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            sliding_window=_sliding_window(cfg),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            sampling_defaults=_sampling_defaults(gen or {}),
            max_new_tokens=_max_new_tokens(gen or {}),
            moe=_moe(arch, cfg),
            mla=mla,
            quant=quant_config.parse(cfg),
            extra_layers=int(cfg.get("num_nextn_predict_layers") or 0),
        )


def _architecture(cfg: dict[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    for a in archs:
        if a in SUPPORTED_ARCHITECTURES:
            return a
    raise ConfigError(
        f"unsupported model architecture {archs or cfg.get('model_type')!r}; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _moe(arch: str, cfg: dict[str, Any]) -> MoEConfig | None:
    if arch not in _MOE:
        return None
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"unsupported expert activation {cfg.get('hidden_act')!r}; supported: silu")
    if arch == "DeepseekV3ForCausalLM":
        n = cfg["n_routed_experts"]
        return MoEConfig(num_experts=n, top_k=cfg["num_experts_per_tok"],
                         expert_intermediate_size=cfg["moe_intermediate_size"],
                         renormalize=bool(cfg.get("norm_topk_prob", True)),
                         shared_expert_intermediate_size=cfg["moe_intermediate_size"] * int(cfg.get("n_shared_experts") or 0),
                         weights_in_fp32=True, dense_layers=tuple(range(int(cfg.get("first_k_dense_replace") or 0))),
                         scoring="sigmoid", n_group=int(cfg.get("n_group") or 1),
                         topk_group=int(cfg.get("topk_group") or 1),
                         routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)), score_bias=True,
                         shared_expert_gated=False)
    if arch == "MixtralForCausalLM":
        return MoEConfig(num_experts=cfg["num_local_experts"], top_k=cfg["num_experts_per_tok"],
                         expert_intermediate_size=cfg["intermediate_size"], renormalize=True, weights_in_fp32=True)
    # hub configs say num_experts; transformers 5 writes some as num_local_experts
    n = cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"]
    step = cfg.get("decoder_sparse_step", 1) or 1
    only_mlp = set(cfg.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(cfg["num_hidden_layers"]) if i in only_mlp or n == 0 or (i + 1) % step)
    return MoEConfig(num_experts=n, top_k=cfg["num_experts_per_tok"],
                     expert_intermediate_size=cfg["moe_intermediate_size"],
                     renormalize=bool(cfg.get("norm_topk_prob", False)),
                     shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0)
                     if arch == "Qwen2MoeForCausalLM" else 0,
                     dense_layers=dense)


def _mla(arch: str, cfg: dict[str, Any]) -> "MLAConfig | None":
    if arch not in _MLA:
        return None
    return MLAConfig(q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=cfg["kv_lora_rank"],
                     qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
                     v_head_dim=cfg["v_head_dim"], rope_interleave=bool(cfg.get("rope_interleave", True)),
                     attention_bias=bool(cfg.get("attention_bias", False)))


SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _sampling_defaults(gen: dict[str, Any]) -> tuple[tuple[str, float], ...]:
    if gen.get("do_sample") is False:
        return ()
    return tuple((k, gen[k]) for k in SAMPLING_DEFAULT_KEYS
                 if isinstance(gen.get(k), (int, float)) and not isinstance(gen.get(k), bool))


def _max_new_tokens(gen: dict[str, Any]) -> int | None:
    n = gen.get("max_new_tokens")
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else None


def _eos_ids(cfg: dict[str, Any], gen: dict[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    for src in (gen.get("eos_token_id"), cfg.get("eos_token_id")):
        for t in src if isinstance(src, list) else [src]:
            if isinstance(t, int) and t not in ids:
                ids.append(t)
    return tuple(ids)


def _sliding_window(cfg: dict[str, Any]) -> int | None:
    # Qwen2 configs carry a sliding_window that is disabled unless use_sliding_window is set.
    if cfg.get("use_sliding_window") is False:
        return None
    sw = cfg.get("sliding_window")
    return sw if isinstance(sw, int) and sw > 0 else None


def _rope(cfg: dict[str, Any]) -> RopeConfig:
    # transformers >= 5 nests rope settings in `rope_parameters`; older configs use
    # `rope_theta` + `rope_scaling`.
    params = dict(cfg.get("rope_scaling") or {})
    params.update(cfg.get("rope_parameters") or {})
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in ROPE_TYPES:
        raise ConfigError(f"unsupported rope scaling type {kind!r}; supported: {', '.join(ROPE_TYPES)}")
    max_pos = cfg.get("max_position_embeddings", 4096)
    # as transformers: a top-level original_max_position_embeddings (Phi-3's) wins, then the
    # rope parameters', then max_position_embeddings; dynamic NTK scales past the latter
    original = cfg.get("original_max_position_embeddings") or params.get("original_max_position_embeddings") or max_pos
    factor = params.get("factor")
    if factor is None:  # yarn / longrope derive it from the two lengths
        factor = max_pos / original if kind in ("yarn", "longrope") else 1.0
    optional = {k: float(params[k]) for k in ("mscale", "mscale_all_dim", "attention_factor") if params.get(k) is not None}
    return RopeConfig(
        theta=float(theta),
        scaling_type=kind,
        factor=float(factor),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(max_pos if kind == "dynamic" else original),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        truncate=bool(params.get("truncate", True)),
        short_factor=tuple(float(x) for x in params.get("short_factor") or ()),
        long_factor=tuple(float(x) for x in params.get("long_factor") or ()),
        **optional,
    )
