"""Load a Llama-family model from a local Hugging Face directory (safetensors, sharded or not;
quantized weights dequantized as they are read, engine/quant/, or kept as stored:
model/kept_weights.py).

HF parameter names are mapped onto our fused layout: q/k/v into `qkv_proj`, gate/up into
`gate_up_proj` (the shared expert's too), and a mixture-of-experts layer's experts into two
stacked tensors — from either the per-expert layout of hub checkpoints (Mixtral's
`block_sparse_moe.experts.N.w1/w2/w3`, Qwen-MoE's `mlp.experts.N.gate_proj/up_proj/down_proj`)
or the stacked one transformers 5 writes. Every element of every parameter must be filled;
anything missing is an error naming it, not a silently random weight.
"""

from __future__ import annotations

import json
import re
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.kept_weights import KeptWeights
from splitserve.engine.model.llama import LlamaModel
from splitserve.engine.model.moe import SparseMoE
from splitserve.engine.parallel.group import TPGroup
from splitserve.engine.parallel.shard import Shard, local_config, narrow
from splitserve.engine.parallel.stages import Stage
from splitserve.engine.quant.checkpoint import dense_tensors
from splitserve.engine.quant.linear import Holding
from splitserve.types import ConfigError

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
# HF projection -> (our fused projection, its shard within it)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight")
# an expert's projection -> (our stacked tensor, its half of the rows: 0 gate, 1 up, None all)
_EXPERT_PART = {"w1": ("gate_up_proj", 0), "gate_proj": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1),
                "up_proj": ("gate_up_proj", 1), "w2": ("down_proj", None), "down_proj": ("down_proj", None)}
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
               device: str | torch.device = "cpu", tp: TPGroup | None = None, shard: Shard | None = None,
               keep_quantized: bool = False, stage: Stage | None = None) -> LlamaModel:
    """The model, or under tensor parallelism this rank's `shard` of it (reading only the
    checkpoint's parts it holds into its parameters); under pipeline parallelism its `stage`'s
    layers (and embedding, or final norm and LM head) only. `keep_quantized`: a quantized
    checkpoint's projections stay as stored (model/kept_weights.py); else every weight is
    dequantized."""
    model_dir = Path(model_dir)
    local = cfg if shard is None else local_config(cfg, shard)
    with torch.device("meta"):
        model = LlamaModel(local, max_positions, tp, shard, stage)
    filled: dict[str, int] = {}
    with ExitStack() as files:
        where = open_tensors(files, safetensors_files(model_dir))
        names, get = set(where), lambda n: where[n].get_tensor(n)
        kept = (KeptWeights(model, names, cfg, shard, lambda n: _held_target(n, cfg, stage))
                if keep_quantized and cfg.quant is not None else None)  # before any weight is allocated
        model = model.to_empty(device=device)
        model.rotary.__init__(cfg.rope, cfg.rope_dim, max_positions)  # buffers are computed, not loaded
        model.rotary.to(device)
        for m in model.modules():  # counters are state, not weights: start at zero
            if isinstance(m, SparseMoE):
                m.expert_tokens.zero_()
        params = dict(model.named_parameters())
        for name, tensor in dense_tensors(names - (kept.consumed if kept else set()), get, cfg.quant):
            _copy_param(name, tensor, params, cfg, local, filled, shard, stage)
        if kept is not None:
            kept.read(names, get)
    if cfg.tie_word_embeddings:
        filled.pop("lm_head.weight", None)
        model.tie_weights()
        params.pop("lm_head.weight", None)
    _check_complete(params, filled, cfg)
    model = model.to(dtype).eval()
    if cfg.quant is not None:  # how the weights are held, for the memory report
        model.quant_holding = kept.install(model, dtype, device) if kept else Holding(0)
    return model


def open_tensors(files: ExitStack, paths) -> dict:
    """Tensor name -> the open safetensors file holding it, every file of `paths` open at once
    (closed with `files`): a quantized weight's scales may be stored in another shard."""
    where = {}
    for path in paths:
        f = files.enter_context(safe_open(str(path), framework="pt", device="cpu"))
        where.update(dict.fromkeys(f.keys(), f))
    return where


Region = tuple[int | None, int | None]  # (expert or None, shard of a fused tensor's rows or None)


def _target(name: str, cfg: ModelConfig) -> tuple[str, Region] | None:
    """Our parameter a checkpoint tensor fills, and which part of it."""
    if name.endswith(_IGNORED):
        return None
    if name.startswith("model."):
        m = _LAYER.fullmatch(name)
        if m is None:
            return name[len("model."):], (None, None)
        idx, rest = m.groups()
        if int(idx) >= cfg.num_layers + cfg.extra_layers:
            return f"layers.{idx}.{rest}", (None, None)  # no such layer: refused by the caller, named
        if int(idx) >= cfg.num_layers:
            return None  # a multi-token-prediction module (ModelConfig.extra_layers; model/mtp.py)
        pname, region = layer_param(rest, cfg)
        return f"layers.{idx}.{pname}", region
    if name == "lm_head.weight":
        return None if cfg.tie_word_embeddings else (name, (None, None))
    return None


def layer_param(rest: str, cfg: ModelConfig) -> tuple[str, Region]:
    """A decoder layer's checkpoint tensor (`rest`: its name after `layers.N.`) -> our
    DecoderLayer's parameter it fills, and which part of it (a draft head's layer too)."""
    rest = rest.replace("block_sparse_moe.", "mlp.", 1)  # Mixtral's name for its sparse block
    rest = rest.replace("mlp.shared_experts.", "mlp.shared_expert.", 1)  # DeepSeek's for its shared one
    e = _EXPERT.fullmatch(rest)
    if e is not None:
        ours, shard = _EXPERT_PART[e[2]]
        return f"mlp.experts.{ours}", (int(e[1]), shard)
    stem, _, kind = rest.rpartition(".")
    head, _, proj = stem.rpartition(".")
    if proj in _FUSED and not (cfg.mla is not None and head == "self_attn"):  # MLA's q_proj stands alone
        ours, shard = _FUSED[proj]
        return f"{head}.{ours}.{kind}", (None, shard)
    return rest, (None, None)


def fill_params(params: dict[str, torch.Tensor], tensors, cfg: ModelConfig, where: str,
                shard: Shard | None = None) -> None:
    """Copy (our parameter name, region, checkpoint name, tensor) items into `params` (a draft
    head's own; under tensor parallelism this rank's `shard` of each, cut as a target layer's
    is), then refuse any parameter left unfilled, naming `where` the weights came from."""
    filled: dict[str, int] = {}
    local = cfg if shard is None else local_config(cfg, shard)
    for pname, (expert, piece), name, tensor in tensors:
        if pname not in params:
            raise ConfigError(f"{where}: tensor {name!r} has no place in the draft head (mapped to {pname!r})")
        _place(pname, (expert, piece), tensor, params, cfg, local, shard, filled, f"{where}: tensor {name!r}")
    missing = [pname for pname, p in params.items() if filled.get(pname, 0) != p.numel()]
    if missing:
        raise ConfigError(f"{where} is missing weights for: {', '.join(missing[:8])}"
                          + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""))


def _held_target(name: str, cfg: ModelConfig, stage: Stage | None) -> tuple[str, Region] | None:
    """`_target` on a pipeline `stage`: None for what another stage holds, a layer's parameter
    renamed to the stage's own index of it."""
    target = _target(name, cfg)
    if stage is None or target is None:
        return target
    pname, region = target
    if pname.startswith("layers."):
        _, idx, rest = pname.split(".", 2)
        if int(idx) >= cfg.num_layers:
            return target  # no such layer: refused by the caller, named
        local = stage.local(int(idx))
        return None if local is None else (f"layers.{local}.{rest}", region)
    if pname.startswith("embed_tokens."):
        return target if stage.holds_embedding(cfg.tie_word_embeddings) else None
    return target if stage.last else None  # the final norm, the LM head


def _region(pname: str, param: torch.Tensor, region: Region, cfg: ModelConfig) -> torch.Tensor:
    """The part of `param` (a rank's, shaped by its local `cfg`) that `region` names."""
    expert, shard = region
    dst = param.data if expert is None else param.data[expert]
    if shard is None:
        return dst
    if "qkv_proj" in pname:
        offs = [0, cfg.q_size, cfg.q_size + cfg.kv_size, cfg.q_size + 2 * cfg.kv_size]
    else:  # gate_up: two halves
        half = dst.shape[0] // 2
        offs = [0, half, 2 * half]
    return dst[offs[shard]: offs[shard + 1]]


def _copy_param(name: str, tensor: torch.Tensor, params: dict, cfg: ModelConfig, local: ModelConfig,
                filled: dict[str, int], shard: Shard | None = None, stage: Stage | None = None) -> None:
    """`local`: the shapes of the model being filled (`cfg`'s, or `shard`'s local_config)."""
    target = _held_target(name, cfg, stage)
    if target is None:
        return
    pname, (expert, piece) = target
    if pname not in params:
        raise ConfigError(f"checkpoint tensor {name!r} has no place in the model (mapped to {pname!r})")
    _place(pname, (expert, piece), tensor, params, cfg, local, shard, filled, f"checkpoint tensor {name!r}")


def _place(pname: str, region: Region, tensor: torch.Tensor, params: dict, cfg: ModelConfig, local: ModelConfig,
           shard: Shard | None, filled: dict[str, int], what: str) -> None:
    """`tensor` into `region` of parameter `pname` — on a tensor-parallel rank its `shard` of it
    (nothing: an expert another rank holds) — counted in `filled`; `what` names it in errors."""
    expert, piece = region
    if shard is not None:
        tensor = narrow(pname, tensor, cfg, shard, piece, expert)
        if tensor is None:  # an expert another rank holds
            return
        expert = None if expert is None else expert - shard.experts.start
    dst = _region(pname, params[pname], (expert, piece), local)
    if tuple(dst.shape) != tuple(tensor.shape):
        raise ConfigError(f"{what} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(tensor)
    filled[pname] = filled.get(pname, 0) + dst.numel()


def _check_complete(params: dict, filled: dict[str, int], cfg: ModelConfig) -> None:
    missing = [pname for pname, p in params.items() if filled.get(pname, 0) != p.numel()]
    if missing:
        raise ConfigError(f"checkpoint is missing weights for: {', '.join(missing[:8])}"
                          + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""))
