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


def stored_tensors(prefix: str, names: set[str], get, quant: WeightQuant) -> dict[str, torch.Tensor]:
    """The tensors one quantized projection is stored as, by their role: FP8 `weight` and `scale`
    (whatever the format calls it); AWQ / GPTQ `qweight`, `qzeros`, `scales` and GPTQ's `g_idx`
    where stored. Refuses, naming it, a projection whose companions are missing."""
    if f"{prefix}.qweight" in names:
        if quant.method not in (QuantMethod.AWQ, QuantMethod.GPTQ):
            raise ConfigError(f"checkpoint tensor {prefix}.qweight is integer-packed, but the config says {quant.label}")
        needed = ("qzeros", "scales") + (("g_idx",) if quant.method is QuantMethod.GPTQ and f"{prefix}.g_idx" in names else ())
        missing = [f"{prefix}.{p}" for p in needed if f"{prefix}.{p}" not in names]
        if missing:
            raise ConfigError(f"checkpoint tensor {prefix}.qweight comes without {', '.join(missing)}")
        return {"qweight": get(f"{prefix}.qweight"), **{p: get(f"{prefix}.{p}") for p in needed}}
    return {"weight": get(f"{prefix}.weight"), "scale": get(_fp8_scale_name(prefix, names, quant))}


def _fp8_scale_name(prefix: str, names: set[str], quant: WeightQuant) -> str:
    scale_name = f"{prefix}.{_FP8_SCALE.get(quant.method, 'weight_scale_inv')}"
    if quant.method not in _FP8_SCALE or scale_name not in names:
        raise ConfigError(f"checkpoint tensor {prefix}.weight is FP8 but has no {scale_name} "
                          f"(the config says {quant.label})")
    return scale_name


def stored_names(prefix: str, names: set[str], quant: WeightQuant) -> set[str]:
    """The checkpoint names one quantized projection's `stored_tensors` come from."""
    leaves = ("weight", "qweight", _FP8_SCALE.get(quant.method, "weight_scale_inv")) + _INT_PARTS
    return {f"{prefix}.{leaf}" for leaf in leaves} & names


def is_stored_quantized(prefix: str, leaf: str, names: set[str], quant: WeightQuant) -> bool:
    """Whether `prefix.leaf` is a quantized projection's values (judged by name: FP8 weights by
    their scale beside them)."""
    if leaf == "qweight":
        return True
    return leaf == "weight" and f"{prefix}.{_FP8_SCALE.get(quant.method, '')}" in names


def _fp8_weight(prefix: str, weight: torch.Tensor, names: set[str], get, quant: WeightQuant) -> torch.Tensor:
    scale = get(_fp8_scale_name(prefix, names, quant))
    try:
        return fp8.dequantize(weight, scale, quant.block)
    except ValueError as e:
        raise ConfigError(f"{prefix}.weight: {e}") from None


def _int_weight(prefix: str, names: set[str], get, quant: WeightQuant) -> torch.Tensor:
    t = stored_tensors(prefix, names, get, quant)
    try:
        if quant.method is QuantMethod.AWQ:
            return int4.dequantize_awq(t["qweight"], t["qzeros"], t["scales"], quant.group_size)
        return int4.dequantize_gptq(t["qweight"], t["qzeros"], t["scales"], t.get("g_idx"),
                                    quant.bits, quant.group_size, quant.zeros_minus_one)
    except (ValueError, RuntimeError) as e:
        raise ConfigError(f"{prefix}.qweight: {e}") from None
