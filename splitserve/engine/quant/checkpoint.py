"""A quantized checkpoint's tensors as the dense ones the loader copies: each quantized weight
(FP8 `weight` with its scale, or AWQ/GPTQ `qweight` with zeros, scales and g_idx) becomes the
plain `<module>.weight` it stands for; the tensors that only serve it are consumed; everything
else (norms, embeddings, an unquantized LM head or router) passes through as stored."""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

import torch

from splitserve.engine.quant import fp8, int4
from splitserve.engine.quant.config import QuantMethod, WeightQuant
from splitserve.types import ConfigError

# companions of a quantized weight (consumed with it) and the activation / KV-cache scales of
# static-scale checkpoints: this engine computes those itself, so they have no place in the model
_FP8_SCALE = {QuantMethod.FP8: "weight_scale_inv", QuantMethod.COMPRESSED_FP8: "weight_scale"}
_INT_PARTS = ("qzeros", "scales", "g_idx")
_UNUSED = ("input_scale", "activation_scale", "k_scale", "v_scale", "weight_zero_point")


def dense_tensors(names: Iterable[str], get: Callable[[str], torch.Tensor],
                  quant: WeightQuant | None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every weight the model has, dequantized to fp32 where stored quantized."""
    names = set(names)
    for name in sorted(names):
        if quant is None:
            yield name, get(name)
            continue
        prefix, _, leaf = name.rpartition(".")
        if _is_companion(prefix, leaf, names, quant):
            continue
        if leaf == "qweight":
            yield f"{prefix}.weight", _int_weight(prefix, names, get, quant)
            continue
        t = get(name)
        if leaf == "weight" and t.dtype in fp8.FP8_DTYPES:
            t = _fp8_weight(prefix, t, names, get, quant)
        yield name, t


def _is_companion(prefix: str, leaf: str, names: set[str], quant: WeightQuant) -> bool:
    if leaf in _UNUSED:
        return True
    if leaf == _FP8_SCALE.get(quant.method):
        return f"{prefix}.weight" in names
    return leaf in _INT_PARTS and f"{prefix}.qweight" in names


def _fp8_weight(prefix: str, weight: torch.Tensor, names: set[str], get, quant: WeightQuant) -> torch.Tensor:
    scale_name = f"{prefix}.{_FP8_SCALE.get(quant.method, 'weight_scale_inv')}"
    if quant.method not in _FP8_SCALE or scale_name not in names:
        raise ConfigError(f"checkpoint tensor {prefix}.weight is FP8 but has no {scale_name} "
                          f"(the config says {quant.label})")
    try:
        return fp8.dequantize(weight, get(scale_name), quant.block)
    except ValueError as e:
        raise ConfigError(f"{prefix}.weight: {e}") from None


def _int_weight(prefix: str, names: set[str], get, quant: WeightQuant) -> torch.Tensor:
    if quant.method not in (QuantMethod.AWQ, QuantMethod.GPTQ):
        raise ConfigError(f"checkpoint tensor {prefix}.qweight is integer-packed, but the config says {quant.label}")
    needed = ("qzeros", "scales") + (("g_idx",) if quant.method is QuantMethod.GPTQ and f"{prefix}.g_idx" in names else ())
    missing = [f"{prefix}.{p}" for p in needed if f"{prefix}.{p}" not in names]
    if missing:
        raise ConfigError(f"checkpoint tensor {prefix}.qweight comes without {', '.join(missing)}")
    parts = {p: get(f"{prefix}.{p}") for p in needed}
    try:
        if quant.method is QuantMethod.AWQ:
            return int4.dequantize_awq(get(f"{prefix}.qweight"), parts["qzeros"], parts["scales"], quant.group_size)
        return int4.dequantize_gptq(get(f"{prefix}.qweight"), parts["qzeros"], parts["scales"], parts.get("g_idx"),
                                    quant.bits, quant.group_size, quant.zeros_minus_one)
    except (ValueError, RuntimeError) as e:
        raise ConfigError(f"{prefix}.qweight: {e}") from None
