"""What a checkpoint's `quantization_config` says about its weights, read once into a frozen value.

Served: FP8 (e4m3 / e5m2) as transformers writes it (`quant_method: fp8`, per-tensor or block-wise
`weight_scale_inv`, DeepSeek-V3's `weight_block_size: [128, 128]`); compressed-tensors FP8
(`float-quantized` / `naive-quantized`, per-tensor, per-channel or block `weight_scale`); AWQ int4
(the GEMM packing); GPTQ int4 / int8 (with or without act-order `g_idx`; format v1 stores each
zero less one). Anything else is refused by name rather than loaded as garbage."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from splitserve.types import ConfigError


class QuantMethod(enum.Enum):
    FP8 = "fp8"  # transformers' FineGrainedFP8: weight * weight_scale_inv
    COMPRESSED_FP8 = "compressed-tensors"  # weight * weight_scale
    AWQ = "awq"
    GPTQ = "gptq"


@dataclass(frozen=True)
class WeightQuant:
    method: QuantMethod
    block: tuple[int, int] | None = None  # FP8 block-wise scales: (rows, cols) per scale
    bits: int = 8
    group_size: int = -1  # int4: input rows per scale/zero group (-1: one group)
    zeros_minus_one: bool = False  # GPTQ format v1: a stored zero is the real one less one

    def __post_init__(self) -> None:
        if self.block is not None and (len(self.block) != 2 or min(self.block) < 1):
            raise ConfigError(f"weight_block_size must be two positive sizes, got {list(self.block)}")

    @property
    def label(self) -> str:
        """How the start-up log names the format."""
        if self.method in (QuantMethod.AWQ, QuantMethod.GPTQ):
            return f"{self.method.value} int{self.bits} (group {self.group_size})"
        scales = f"{self.block[0]}x{self.block[1]} blocks" if self.block else "per tensor/channel"
        return f"{self.method.value} fp8 ({scales})"


def parse(cfg: dict[str, Any]) -> WeightQuant | None:
    """The checkpoint's weight format; None for plain weights."""
    q = cfg.get("quantization_config")
    if not q:
        return None
    method = str(q.get("quant_method", "")).lower()
    readers = {"fp8": _fp8, "compressed-tensors": _compressed, "awq": _awq, "gptq": _gptq}
    if method not in readers:
        raise ConfigError(f"unsupported quantization method {method!r}; supported: {', '.join(readers)}")
    return readers[method](q)


def _fp8(q: dict[str, Any]) -> WeightQuant:
    fmt = q.get("fmt", "e4m3")
    if fmt not in ("e4m3", "e5m2"):
        raise ConfigError(f"unsupported fp8 format {fmt!r}; supported: e4m3, e5m2")
    block = q.get("weight_block_size")
    return WeightQuant(QuantMethod.FP8, block=tuple(block) if block else None)


def _compressed(q: dict[str, Any]) -> WeightQuant:
    fmt = q.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise ConfigError(f"unsupported compressed-tensors format {fmt!r}; supported: float-quantized "
                          "and naive-quantized FP8 weights")
    groups = list((q.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise ConfigError(f"compressed-tensors checkpoints with {len(groups)} config groups are not supported; one is")
    w = groups[0].get("weights") or {}
    if w.get("type") != "float" or w.get("num_bits") != 8:
        raise ConfigError(f"unsupported compressed-tensors weights {w.get('type')!r} x {w.get('num_bits')} bits; "
                          "supported: float x 8 (FP8)")
    strategy = w.get("strategy")
    if strategy not in ("tensor", "channel", "block"):
        raise ConfigError(f"unsupported compressed-tensors weight strategy {strategy!r}; supported: tensor, channel, block")
    block = tuple(w["block_structure"]) if strategy == "block" else None
    return WeightQuant(QuantMethod.COMPRESSED_FP8, block=block)


def _int_bits(q: dict[str, Any], allowed: tuple[int, ...], name: str) -> tuple[int, int]:
    bits = q.get("bits", q.get("w_bit", 4))
    if bits not in allowed:
        raise ConfigError(f"unsupported {name} width {bits} bits; supported: {', '.join(map(str, allowed))}")
    group = int(q.get("group_size", q.get("q_group_size", 128)))
    if group == 0 or group < -1:
        raise ConfigError(f"{name} group_size must be positive or -1, got {group}")
    return bits, group


def _awq(q: dict[str, Any]) -> WeightQuant:
    bits, group = _int_bits(q, (4,), "awq")
    version = str(q.get("version", "gemm")).lower()
    if version != "gemm":
        raise ConfigError(f"unsupported awq version {version!r}; supported: gemm")
    if q.get("zero_point") is False:
        raise ConfigError("awq without zero points is not supported")
    return WeightQuant(QuantMethod.AWQ, bits=bits, group_size=group)


def _gptq(q: dict[str, Any]) -> WeightQuant:
    bits, group = _int_bits(q, (4, 8), "gptq")
    fmt = str(q.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ConfigError(f"unsupported gptq checkpoint_format {fmt!r}; supported: gptq, gptq_v2")
    return WeightQuant(QuantMethod.GPTQ, bits=bits, group_size=group, zeros_minus_one=fmt == "gptq")
