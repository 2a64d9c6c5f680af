"""Load a Llama-family model from a local Hugging Face directory (safetensors, sharded or not).

HF parameter names are mapped onto our fused layout: q/k/v into `qkv_proj`, gate/up into
`gate_up_proj`. Every parameter of the model must be filled exactly once; anything missing is
an error naming it, not a silently random weight.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.llama import LlamaModel
from splitserve.types import ConfigError

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
# HF suffix -> (our suffix, shard index within a fused tensor, shard count)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_IGNORED = ("rotary_emb.inv_freq",)


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles the OS lets torch use (oneDNN's bf16 matmuls run on them)."""
    init = getattr(torch._C._cpu, "_init_amx", None)
    return bool(init and init())


def resolve_dtype(dtype: str | torch.dtype, cfg: ModelConfig) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        # GPUs want the checkpoint's half type. On a CPU, bf16 pays only with AMX tiles: an
        # AVX-512-BF16 dot product retires no more flops than fp32 FMAs do, and oneDNN's bf16
        # matmuls measured ~0.6x MKL's fp32 ones on such a CPU (see model/widened_linear.py).
        # A float32 checkpoint stays float32 everywhere: it asked for full precision, and the
        # same checkpoint must give the same tokens whichever CPU the worker lands on.
        if not torch.cuda.is_available():
            half = (cfg.torch_dtype or "bfloat16") in ("bfloat16", "float16")
            return torch.bfloat16 if half and cpu_has_amx() else torch.float32
        return DTYPES.get(cfg.torch_dtype or "bfloat16", torch.bfloat16)
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; known: auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors weights in {model_dir}")
    return files


def load_model(model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype, max_positions: int,
               device: str | torch.device = "cpu") -> LlamaModel:
    model_dir = Path(model_dir)
    with torch.device("meta"):
        model = LlamaModel(cfg, max_positions)
    model = model.to_empty(device=device)
    model.rotary.__init__(cfg.rope, cfg.head_dim, max_positions)  # buffers are computed, not loaded
    model.rotary.to(device)
    params = dict(model.named_parameters())
    filled: dict[str, int] = {}
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                _copy_param(name, f.get_tensor(name), params, cfg, filled)
    if cfg.tie_word_embeddings:
        filled.pop("lm_head.weight", None)
        model.tie_weights()
        params.pop("lm_head.weight", None)
    _check_complete(params, filled, cfg)
    return model.to(dtype).eval()


def _target(name: str, cfg: ModelConfig) -> tuple[str, int | None] | None:
    if name.endswith(_IGNORED):
        return None
    if name.startswith("model."):
        m = _LAYER.fullmatch(name)
        if m is None:
            return name[len("model."):], None
        idx, rest = m.groups()
        stem, _, kind = rest.rpartition(".")
        if stem in _FUSED:
            ours, shard = _FUSED[stem]
            return f"layers.{idx}.{ours}.{kind}", shard
        return f"layers.{idx}.{rest}", None
    if name == "lm_head.weight":
        return None if cfg.tie_word_embeddings else (name, None)
    return None


def _shard_offsets(pname: str, cfg: ModelConfig) -> list[int]:
    if "qkv_proj" in pname:
        return [0, cfg.q_size, cfg.q_size + cfg.kv_size, cfg.q_size + 2 * cfg.kv_size]
    return [0, cfg.intermediate_size, 2 * cfg.intermediate_size]


def _copy_param(name: str, tensor: torch.Tensor, params: dict, cfg: ModelConfig, filled: dict[str, int]) -> None:
    target = _target(name, cfg)
    if target is None:
        return
    pname, shard = target
    if pname not in params:
        raise ConfigError(f"checkpoint tensor {name!r} has no place in the model (mapped to {pname!r})")
    param = params[pname]
    dst = param.data
    if shard is not None:
        offs = _shard_offsets(pname, cfg)
        dst = dst[offs[shard]: offs[shard + 1]]
    if tuple(dst.shape) != tuple(tensor.shape):
        raise ConfigError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(tensor)
    filled[pname] = filled.get(pname, 0) + 1


def _check_complete(params: dict, filled: dict[str, int], cfg: ModelConfig) -> None:
    missing = []
    for pname in params:
        need = 3 if "qkv_proj" in pname else 2 if "gate_up_proj" in pname else 1
        if filled.get(pname, 0) != need:
            missing.append(pname)
    if missing:
        raise ConfigError(f"checkpoint is missing weights for: {', '.join(missing[:8])}"
                          + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""))
