"""The loader's part for a quantized checkpoint whose projections stay quantized
(`EngineConfig.quantized_weights`, quant/linear.py). Three moments of `load_model`:

  plan     (model still on the meta device) which of our nn.Linear layers every part of which is
           stored quantized — q/k/v for qkv_proj, gate/up for gate_up_proj, else the one projection
           — each swapped for an empty `QuantLinear`, so no dense weight is ever allocated for it;
           the checkpoint names they take are left out of the dense pass
  read     (the checkpoint open) each part's stored tensors, cut to this rank's rows / columns
           (`shard.narrow` says which, on an index tensor: one statement of the split); a part
           whose cut would split a scale block or a packed word is dequantized and narrowed
           instead
  install  (after model.to(dtype)) the parts fused along the output and held; where a part is
           dense or the parts cannot share scales, that one projection becomes a dense nn.Linear,
           said in a log line

Dense whatever the setting: stacked MoE experts (a first version), MLA's kv_b_proj (its weight is
read, not multiplied), the embeddings, norms, routers and LM head (stored plain)."""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from splitserve.engine.model.config import ModelConfig
from splitserve.engine.parallel.shard import Shard, narrow
from splitserve.engine.quant.checkpoint import is_stored_quantized, stored_names, stored_tensors
from splitserve.engine.quant.fp8 import FP8_DTYPES
from splitserve.engine.quant.linear import Holding, QuantLinear
from splitserve.engine.quant.stored import StoredWeight, cut, fuse
from splitserve.types import ConfigError

log = logging.getLogger(__name__)

_PIECES = {"qkv_proj": 3, "gate_up_proj": 2}  # our fused projections: how many checkpoint parts
EXPERTS, LATENT, FALLBACK = "MoE expert tensors", "MLA kv_b_proj (read as a weight)", "fallbacks (see the log)"


@dataclass
class _Projection:
    path: str  # our module, e.g. layers.0.self_attn.qkv_proj
    prefixes: dict[int | None, str]  # piece -> the checkpoint's projection
    parts: list[StoredWeight | torch.Tensor] = field(default_factory=list)  # stored, or dense (fp32)
    why_dense: str | None = None


class KeptWeights:
    def __init__(self, model: nn.Module, names: set[str], cfg: ModelConfig, shard: Shard | None,
                 target: Callable[[str], tuple[str, tuple[int | None, int | None]] | None]) -> None:
        """The plan: `target` maps a checkpoint name to our parameter and its (expert, piece)."""
        self.cfg, self.quant, self.shard = cfg, cfg.quant, shard
        self.projections: dict[str, _Projection] = {}
        dense: dict[str, str] = {}
        for name in sorted(names):
            prefix, _, leaf = name.rpartition(".")
            hit = is_stored_quantized(prefix, leaf, names, self.quant) and target(f"{prefix}.weight")
            if not hit:
                continue
            pname, (expert, piece) = hit
            path = pname.removesuffix(".weight")
            if expert is not None:
                dense[path] = EXPERTS
            elif cfg.mla is not None and path.endswith("self_attn.kv_b_proj"):
                dense[path] = LATENT
            else:
                self.projections.setdefault(path, _Projection(path, {})).prefixes[piece] = prefix
        for path, p in list(self.projections.items()):
            module = _module(model, path)
            want = _PIECES.get(path.rpartition(".")[2], 1) if isinstance(module, nn.Linear) else 0
            if len(p.prefixes) != want or (want == 1 and None not in p.prefixes):
                del self.projections[path]  # a part stored plain, or no linear layer: the dense pass's
                continue
            _swap(model, path, QuantLinear(module.in_features, module.out_features, module.bias is not None,
                                           device="meta"))
        self.dense = dense
        self.consumed = {n for p in self.projections.values() for pre in p.prefixes.values()
                         for n in stored_names(pre, names, self.quant)}

    def read(self, names: set[str], get: Callable[[str], torch.Tensor]) -> None:
        """Every kept part's stored tensors, cut to this rank's."""
        for p in self.projections.values():
            for piece in sorted(p.prefixes, key=lambda x: -1 if x is None else x):
                p.parts.append(self._read_part(p, piece, p.prefixes[piece], names, get))

    def _read_part(self, p: _Projection, piece, prefix: str, names, get) -> StoredWeight | torch.Tensor:
        pname = f"{p.path}.weight"
        raw = stored_tensors(prefix, names, get, self.quant)
        if "weight" in raw and raw["weight"].dtype not in FP8_DTYPES:  # a scale beside a plain weight:
            p.why_dense = p.why_dense or f"{prefix}.weight is stored {raw['weight'].dtype}"  # plain, as dense_tensors
            return raw["weight"] if self.shard is None else narrow(pname, raw["weight"], self.cfg, self.shard, piece)
        try:
            w = StoredWeight.of(raw, self.quant)
        except ValueError as e:
            raise ConfigError(f"{prefix}: {e}") from None
        rows, cols = _this_rank(pname, w, self.cfg, self.shard, piece)
        part = cut(w, rows, cols, self.quant)
        if isinstance(part, str):
            p.why_dense = p.why_dense or part
            dense = w.dequantize(self.quant)
            return dense if self.shard is None else narrow(pname, dense, self.cfg, self.shard, piece)
        return part

    def install(self, model: nn.Module, dtype: torch.dtype, device: torch.device) -> Holding:
        """Each kept projection held (fused), or made dense where it cannot be; what was held how."""
        dense = [(path, why) for path, why in self.dense.items()]
        fallbacks = defaultdict(list)
        for p in self.projections.values():
            shell = _module(model, p.path)
            fused = p.why_dense or fuse(p.parts)
            if not isinstance(fused, str):
                shell.hold(fused, self.quant, device)
                continue
            fallbacks[fused].append(p.path)
            dense.append((p.path, FALLBACK))
            w = torch.cat([x if isinstance(x, torch.Tensor) else x.dequantize(self.quant) for x in p.parts])
            linear = torch.nn.utils.skip_init(nn.Linear, shell.in_features, shell.out_features, bias=False,
                                              device=device, dtype=dtype)
            with torch.no_grad():
                linear.weight.copy_(w)
            linear.bias = shell.bias
            _swap(model, p.path, linear)
        for why, paths in fallbacks.items():
            log.warning("%d %s projection(s) dequantized at load (%s%s): %s", len(paths), self.quant.label,
                        ", ".join(paths[:4]), " ..." if len(paths) > 4 else "", why)
        return Holding(len(self.projections) - sum(map(len, fallbacks.values())), tuple(dense))


def _module(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _swap(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent), leaf, module)


def _this_rank(pname: str, w: StoredWeight, cfg: ModelConfig, shard: Shard | None, piece) -> tuple[slice, slice]:
    """The rows and columns of the dense weight this rank holds, as `narrow` cuts them (applied to
    index tensors that take no memory)."""
    n, k = w.out_features, w.in_features
    if shard is None:
        return slice(0, n), slice(0, k)
    rows = narrow(pname, torch.arange(n).view(n, 1).expand(n, k), cfg, shard, piece)[:, 0]
    cols = narrow(pname, torch.arange(k).view(1, k).expand(n, k), cfg, shard, piece)[0]
    return slice(int(rows[0]), int(rows[-1]) + 1), slice(int(cols[0]), int(cols[-1]) + 1)
