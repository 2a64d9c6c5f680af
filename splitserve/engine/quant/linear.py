"""A linear layer whose weight stays as the checkpoint stored it (FP8 with its scales, AWQ / GPTQ
int4 packed with zeros and scales): `QuantLinear` holds the stored tensors (quant/stored.py) as
buffers and multiplies through the quantized GEMM kernels (kernels/triton_fp8_gemm.py,
kernels/triton_int4_gemm.py), which dequantize tile by tile in registers. The weights take the
checkpoint's bytes, not the serving dtype's (FP8: half of bf16's; int4: about a quarter).

Whether an engine keeps its weights so is `EngineConfig.quantized_weights`: "dequantize" (every
weight dense, computed once at load: checkpoint.dense_tensors), "keep" (QuantLinear wherever it
can — on a CPU only under the Triton interpreter, for tests), "auto" (keep on CUDA where the kernels
run, dequantize elsewhere). A format the kernels do not take (GPTQ 8-bit, FP8 scale blocks narrower
than 16 columns, FP8 on a GPU older than sm89) is dequantized whatever the setting, said in a log
line. Even kept, some weights are dense (`Holding` says which): a mixture of experts' stacked
expert tensors (model/moe.py: a first version), MLA's kv_b_proj (model/mla.py reads its weight,
absorbed into the queries), and a projection whose fusion or tensor-parallel cut would split a
scale block, a packed word or act-order groups (quant/stored.py; a log line names it)."""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from splitserve.engine.quant.config import QuantMethod, WeightQuant
from splitserve.engine.quant.stored import StoredWeight
from splitserve.types import ConfigError

log = logging.getLogger(__name__)


def kernels_unavailable(device: torch.device) -> str | None:
    """Why the quantized GEMM kernels cannot run on `device`, or None."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed (pip install 'splitserve[gpu]')"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"the quantized GEMM kernels run on CUDA (on {device.type} only under TRITON_INTERPRET=1, for tests)"
    return None


def format_unsupported(quant: WeightQuant, device: torch.device) -> str | None:
    """Why the kernels cannot take this checkpoint's format, or None."""
    if quant.method is QuantMethod.GPTQ and quant.bits != 4:
        return f"the GPTQ kernel takes 4-bit weights, the checkpoint's are {quant.bits}-bit"
    if quant.method in (QuantMethod.FP8, QuantMethod.COMPRESSED_FP8):
        if quant.block is not None and quant.block[1] % 16:
            return (f"the FP8 kernel takes scale blocks of a multiple of 16 columns, "
                    f"the checkpoint's have {quant.block[1]}")
        if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            return "FP8 weights need a GPU of compute capability 8.9 or more (Ada, Hopper)"
    return None


def keep_quantized(setting: str, quant: WeightQuant | None, device: torch.device) -> bool:
    """Whether this engine keeps `quant`'s weights quantized (the module docstring). "keep" where
    the kernels cannot run at all is refused; a format they do not take is dequantized, said in
    a log line, whatever the setting."""
    if quant is None or setting == "dequantize" or (setting == "auto" and device.type != "cuda"):
        return False
    why = kernels_unavailable(device)
    if setting == "keep" and why is not None:
        raise ConfigError(f"quantized_weights keep: {why}")
    why = why or format_unsupported(quant, device)
    if why is not None:
        log.warning("%s weights dequantized at load: %s", quant.label, why)
        return False
    return True


class QuantLinear(nn.Module):
    """y = x Wᵀ + b with W as stored. Built empty (shapes and bias) where the model has its
    nn.Linear; `hold` gives it the stored tensors once they are read, cut and fused."""

    def __init__(self, in_features: int, out_features: int, bias: bool, device=None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = nn.Parameter(torch.empty(out_features, device=device)) if bias else None
        self.quant: WeightQuant | None = None
        self.block: tuple[int, int] | None = None

    def hold(self, w: StoredWeight, quant: WeightQuant, device: torch.device) -> None:
        if (w.out_features, w.in_features) != (self.out_features, self.in_features):
            raise ConfigError(f"stored weight is {w.out_features}x{w.in_features}, the layer "
                              f"{self.out_features}x{self.in_features}")
        for name, t in w.tensors.items():
            self.register_buffer(name, t.to(device), persistent=False)
        self.quant, self.block = quant, w.block

    def _apply(self, fn, recurse=True):
        # device moves reach the stored tensors, dtype casts (the loader's model.to(dtype)) do
        # not: FP8 values and their fp32 scales stay as they are; the bias follows the model
        held, self._buffers = self._buffers, {}
        try:
            super()._apply(fn, recurse)
        finally:
            self._buffers = {name: None if t is None else t.to(fn(t.new_empty(0)).device)
                             for name, t in held.items()}
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        y = self._gemm(x2)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def _gemm(self, x: torch.Tensor) -> torch.Tensor:
        q = self.quant
        if q.method is QuantMethod.AWQ:
            from splitserve.engine.kernels.triton_int4_gemm import awq_gemm  # triton: a GPU extra

            return awq_gemm(x, self.qweight, self.qzeros, self.scales, q.group_size)
        if q.method is QuantMethod.GPTQ:
            from splitserve.engine.kernels.triton_int4_gemm import gptq_gemm

            # g_idx was checked at load: no device read (a sync) inside a step or a CUDA graph
            return gptq_gemm(x, self.qweight, self.qzeros, self.scales, getattr(self, "g_idx", None),
                             group_size=q.group_size, sym=False, validate=False,
                             checkpoint_format="gptq" if q.zeros_minus_one else "gptq_v2")
        from splitserve.engine.kernels.triton_fp8_gemm import fp8_gemm

        return fp8_gemm(x, self.weight, self.scale, block_size=self.block)

    def extra_repr(self) -> str:
        fmt = self.quant.label if self.quant else "empty"
        return f"in_features={self.in_features}, out_features={self.out_features}, {fmt}"


@dataclass(frozen=True)
class Holding:
    """How a quantized checkpoint's weights are held once loaded: how many projections stay
    quantized, and which weights were dequantized and why (the memory report's words)."""

    quantized: int
    dequantized: tuple[tuple[str, str], ...] = ()  # (our weight, why)

    @property
    def label(self) -> str:
        if not self.quantized:
            return "dequantized at load"
        why = Counter(reason for _, reason in self.dequantized)
        rest = "; ".join(f"{n} {reason}" for reason, n in sorted(why.items()))
        return f"held quantized in {self.quantized} projections" + (f"; dequantized: {rest}" if rest else "")
