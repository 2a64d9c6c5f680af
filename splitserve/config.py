"""Frozen, validated configuration of the ground floor: the engine's (`EngineConfig`) and where
splitserve keeps what it builds. Every component takes a frozen config; a bad value fails at
construction with a message naming the field, never later in the middle of a request. An app's
configuration (pools, policy, tenants, autoscaler) is `control.deploy_config.DeployConfig`."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitserve.types import ConfigError


def default_cache_dir() -> Path:
    """Where splitserve keeps what it builds once (demo model, compiled kernels):
    `$SPLITSERVE_CACHE`, else `~/.cache/splitserve`."""
    env = os.environ.get("SPLITSERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "splitserve"


ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton", "flash_attn")  # engine/attention/backend.py
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # fp8 is fp8_e4m3 (engine/kv_cache/fp8.py)
QUANTIZED_WEIGHTS = ("auto", "dequantize", "keep")  # engine/quant/linear.py
SPECULATIVE_METHODS = ("ngram", "suffix", "draft")  # engine/speculative/registry.py; draft: draft.py


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (engine/speculative/): each step a running sequence may carry up to
    `k` proposed tokens, verified in the same forward pass. `ngram` (prompt lookup) matches the
    last n tokens, n from `max_n` down to `min_n`, against the sequence's earlier tokens.
    `adaptive`: each request's k follows its recent acceptance (down to 0, probing again now and
    then; back up to `k`). `suffix` also matches against the recent prompts and outputs of the
    request's tenant (its cache_salt) on this worker: at most `suffix_tokens_per_tenant` tokens
    held per tenant, `suffix_tokens` in all, oldest evicted first. `draft` runs a draft head,
    one decoder layer over the target's hidden states (engine/speculative/draft.py): the
    EAGLE-style head in the directory `draft_path`, or with `draft_path` null the checkpoint's own
    multi-token-prediction layer (DeepSeek-V3's `num_nextn_predict_layers`); its KV is one more
    layer of the paged cache, so a PD handoff carries it and both pools need this same config."""

    method: str = "ngram"
    k: int = 4
    min_n: int = 2
    max_n: int = 5
    adaptive: bool = True
    suffix_tokens_per_tenant: int = 1 << 15
    suffix_tokens: int = 1 << 17  # about 1.5 KB of host memory each at the default n range
    draft_path: str | None = None  # method draft: an EAGLE head's directory; None: the checkpoint's MTP layer

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError(f"speculative.method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                              f"got {self.method!r}")
        for name, lo, hi in (("k", 1, 16), ("min_n", 1, 64), ("max_n", 1, 64),
                             ("suffix_tokens_per_tenant", 1, 1 << 26), ("suffix_tokens", 1, 1 << 28)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise ConfigError(f"speculative.{name} must be an integer in [{lo}, {hi}], got {v!r}")
        if self.min_n > self.max_n:
            raise ConfigError(f"speculative.min_n ({self.min_n}) must not exceed max_n ({self.max_n})")
        if self.suffix_tokens_per_tenant > self.suffix_tokens:
            raise ConfigError(f"speculative.suffix_tokens_per_tenant ({self.suffix_tokens_per_tenant}) must not exceed "
                              f"suffix_tokens ({self.suffix_tokens}), the worker's bound")
        if not isinstance(self.adaptive, bool):
            raise ConfigError(f"speculative.adaptive must be true or false, got {self.adaptive!r}")
        if self.draft_path is not None:
            if self.method != "draft":
                raise ConfigError(f"speculative.draft_path is for method draft, not {self.method!r}")
            if not isinstance(self.draft_path, str) or not Path(self.draft_path).is_dir():
                raise ConfigError(f"speculative.draft_path {self.draft_path!r} is not a directory (an EAGLE head's: "
                                  "config.json and its weights)")

    @classmethod
    def of(cls, v: Any) -> "SpeculativeConfig | None":
        """None, a SpeculativeConfig, or its fields as a dict (a config file's)."""
        if v is None or isinstance(v, cls):
            return v
        if not isinstance(v, dict):
            raise ConfigError(f"speculative must be a mapping of its fields or null, got {v!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(v) - known
        if unknown:
            raise ConfigError(f"unknown speculative keys {sorted(unknown)}; known: {sorted(known)}")
        return cls(**v)


@dataclass(frozen=True)
class EngineConfig:
    model: str  # a local Hugging Face directory
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda
    block_size: int = 16
    # the KV cache's element: the model's dtype (auto), or fp8 (e4m3 with a per-token-and-head
    # scale, engine/kv_cache/fp8.py): twice the tokens per byte, half the bytes per handoff
    kv_cache_dtype: str = "auto"
    num_kv_blocks: int | None = None  # None: from gpu_memory_utilization on CUDA if set, else kv_cache_memory_gib
    kv_cache_memory_gib: float = 2.0
    gpu_memory_utilization: float | None = None  # CUDA: the KV cache takes what is left of this share of the GPU
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048  # per-step token budget (decode tokens + prefill chunks)
    max_model_len: int | None = None  # None: the model's context length
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    cuda_graphs: bool = True  # decode steps replay captured graphs (CUDA with the triton backend)
    fused_kernels: bool = True  # residual + RMSNorm and rotary fused: Triton kernels (CUDA), native ones (CPU bf16)
    seed: int = 0
    kv_shared_memory: bool = False  # KV storage in a /dev/shm file, readable by same-host peers
    host_kv_blocks: int = 0  # a host-memory KV tier of this many blocks below the device pool (0: none)
    tensor_parallel_size: int = 1  # ranks (processes) one engine's model is split over (parallel/)
    expert_parallel: bool = False  # a mixture of experts under TP: whole experts per rank, not slices of each
    # stages (processes) one engine's layers are cut into, contiguous ranges (engine/parallel/stages.py)
    pipeline_parallel_size: int = 1
    pipeline_micro_batches: int = 1  # a step cut into this many micro-batches in flight through the stages
    # data-parallel attention + expert parallelism (engine/parallel/dp_engine.py; mixture-of-experts
    # models): this many engine replicas (processes), each with its own requests, scheduler and KV
    # cache and the whole attention and dense layers, the experts spread over them; each MoE layer
    # sends every token to its experts' replicas and back (all-to-all)
    data_parallel_size: int = 1
    # steps in flight through the stages at once, each of its own share of the running sequences
    # (engine/core.py): the stage count keeps every stage busy across steps. 1 by default: exact
    # either way, but slower on this 2-core host (results/pipeline_bubble.json), unmeasured on GPUs
    pipeline_steps_in_flight: int = 1
    # expert load balancing (engine/expert_balance.py): extra physical expert slots per MoE layer,
    # spread evenly over the expert-parallel ranks, for replicas of hot experts; and how often
    # (engine steps; 0: never) the placement is re-planned from the measured tokens per expert
    redundant_experts: int = 0
    expert_rebalance_interval_steps: int = 0
    # a quantized checkpoint's weights: kept as stored, multiplied by the quantized GEMM kernels
    # (keep), or dequantized once at load (dequantize); auto: keep on CUDA where the kernels run
    # (engine/quant/linear.py). keep on a CPU needs TRITON_INTERPRET=1 (tests)
    quantized_weights: str = "auto"
    # speculative decoding (SpeculativeConfig, or its fields as a dict); None: off
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")

        for name in ("block_size", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                     "tensor_parallel_size", "pipeline_parallel_size", "pipeline_micro_batches",
                     "pipeline_steps_in_flight", "data_parallel_size"):
            positive(name)
        if self.data_parallel_size > 1 and (self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1):
            raise ConfigError("data_parallel_size > 1 is not supported with tensor_parallel_size or "
                              "pipeline_parallel_size > 1 yet: each replica is one process")
        object.__setattr__(self, "speculative", SpeculativeConfig.of(self.speculative))
        if self.speculative is not None and self.pipeline_parallel_size > 1:
            raise ConfigError("speculative decoding is not supported with pipeline_parallel_size > 1 yet")
        if self.speculative is not None and self.data_parallel_size > 1:
            raise ConfigError("speculative decoding is not supported with data_parallel_size > 1 "
                              "(data-parallel attention) yet")
        if self.pipeline_parallel_size > 1 and self.host_kv_blocks:
            raise ConfigError("host_kv_blocks is not supported with pipeline_parallel_size > 1 yet")
        if self.pipeline_micro_batches > 1 and self.pipeline_parallel_size == 1:
            raise ConfigError("pipeline_micro_batches > 1 needs pipeline_parallel_size > 1")
        if self.pipeline_steps_in_flight > 1 and self.pipeline_parallel_size == 1:
            raise ConfigError("pipeline_steps_in_flight > 1 needs pipeline_parallel_size > 1")
        if self.tensor_parallel_size > 1 and self.host_kv_blocks:
            raise ConfigError("host_kv_blocks is not supported with tensor_parallel_size > 1 yet")
        h = self.host_kv_blocks
        if not isinstance(h, int) or isinstance(h, bool) or h < 0:
            raise ConfigError(f"host_kv_blocks must be a non-negative integer, got {h!r}")
        if h and not self.enable_prefix_caching:
            raise ConfigError("host_kv_blocks needs enable_prefix_caching: the tier holds cached prefixes")
        for name in ("enable_prefix_caching", "cuda_graphs", "fused_kernels", "kv_shared_memory", "expert_parallel"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("redundant_experts", "expert_rebalance_interval_steps"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ConfigError(f"{name} must be a non-negative integer, got {v!r}")
        if self.quantized_weights not in QUANTIZED_WEIGHTS:
            raise ConfigError(f"quantized_weights must be one of {', '.join(QUANTIZED_WEIGHTS)}, "
                              f"got {self.quantized_weights!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if not self.kv_cache_memory_gib > 0:
            raise ConfigError(f"kv_cache_memory_gib must be positive, got {self.kv_cache_memory_gib}")
        u = self.gpu_memory_utilization
        if u is not None and not (isinstance(u, (int, float)) and not isinstance(u, bool) and 0 < u <= 1):
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {u!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if not Path(self.model).is_dir():
            raise ConfigError(f"model directory {self.model!r} does not exist")

    @property
    def fp8_kv(self) -> bool:
        return self.kv_cache_dtype.startswith("fp8")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EngineConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"unknown engine config keys {sorted(unknown)}; known: {sorted(known)}")
        return cls(**d)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "EngineConfig":
        import yaml  # here: the engine itself (and the GPU script) runs without PyYAML

        data = yaml.safe_load(Path(path).read_text()) or {}
        return cls.from_dict(data.get("engine", data))


KV_TRANSPORTS = ("shm", "tcp", "nixl")  # kv_transfer/: the transports, by name
