"""Quantized tiny checkpoints, made from tests/tiny_models.py's float ones the way the released
formats store them — written here independently of splitserve/engine/quant/, so that a loader
misreading a format cannot agree with a builder that misreads it the same way:

  fp8          transformers' FineGrainedFP8 (DeepSeek-V3's): e4m3 weights, `weight_scale_inv`
               per (rows x cols) block (dequantized = stored * scale)
  ct_fp8       compressed-tensors `float-quantized`: e4m3 weights, `weight_scale` per output channel
  awq          AWQ GEMM int4: qweight [in, out/8] packed in the order 0 2 4 6 1 3 5 7, qzeros, fp16 scales
  gptq         GPTQ int4, format v1 (zeros stored less one), act-order `g_idx`, symmetric

Every linear weight inside the decoder layers is quantized (the router, norms, embeddings and the
LM head stay as they were), as the released checkpoints do."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8_MAX = 448.0  # e4m3's largest finite value
_LINEAR = re.compile(r"model\.layers\.\d+\..*(proj|_mqa|experts\.\d+\.\w+)\.weight")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def quantize_checkpoint(src: Path, out: Path, fmt: str, block: tuple[int, int] = (8, 8), group: int = 32,
                        seed: int = 0, dense_out: Path | None = None) -> Path:
    """`src` (a float checkpoint) written to `out` with its decoder linears in `fmt`; with
    `dense_out`, also a plain float checkpoint of what the stored values mean (each weight
    computed from the integers and scales before they were packed) for a reference to load."""
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, out / f.name)
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    g = torch.Generator().manual_seed(seed)
    quantized, dense = {}, {}
    for name, w in tensors.items():
        if _LINEAR.fullmatch(name) and w.dim() == 2:
            stored, dense[name] = _QUANTIZERS[fmt](name[: -len(".weight")], w.float(), block=block, group=group, gen=g)
            quantized.update(stored)
        else:
            quantized[name] = dense[name] = w
    save_file(quantized, str(out / "model.safetensors"), metadata={"format": "pt"})
    if dense_out is not None:
        shutil.copytree(src, dense_out, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
        save_file({k: v.contiguous() for k, v in dense.items()}, str(dense_out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = _CONFIGS[fmt](block, group)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def _fp8_block(prefix, w, block, **_):
    rows, cols = w.shape
    br, bc = block
    nr, nc = -(-rows // br), -(-cols // bc)
    padded = torch.zeros(nr * br, nc * bc)
    padded[:rows, :cols] = w
    amax = padded.view(nr, br, nc, bc).abs().amax(dim=(1, 3))
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    full = scale[:, None, :, None].expand(nr, br, nc, bc).reshape(nr * br, nc * bc)[:rows, :cols]
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {f"{prefix}.weight": q, f"{prefix}.weight_scale_inv": scale.float()}, q.float() * full


def _fp8_channel(prefix, w, **_):
    scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {f"{prefix}.weight": q, f"{prefix}.weight_scale": scale.float()}, q.float() * scale


def _pack_columns(q: torch.Tensor, order) -> torch.Tensor:
    """[rows, cols] 4-bit values -> int32 [rows, cols/8], nibble i holding column 8j + order[i]."""
    rows, cols = q.shape
    q = q.view(rows, cols // 8, 8).to(torch.int64)
    word = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for i, c in enumerate(order):
        word |= q[:, :, c] << (4 * i)
    return _as_int32(word)


def _as_int32(word: torch.Tensor) -> torch.Tensor:
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def _awq(prefix, w, group, **_):
    wt = w.t().contiguous()  # [in, out]
    k, n = wt.shape
    grouped = wt.view(k // group, group, n)
    lo, hi = grouped.amin(dim=1), grouped.amax(dim=1)
    scale = ((hi - lo).clamp(min=1e-5) / 15).half()
    zero = torch.round(-lo / scale.float()).clamp(0, 15)
    q = (torch.round(grouped / scale.float()[:, None]) + zero[:, None]).clamp(0, 15).view(k, n)
    dense = ((q.view(k // group, group, n) - zero[:, None]) * scale.float()[:, None]).view(k, n).t()
    return {f"{prefix}.qweight": _pack_columns(q, AWQ_ORDER), f"{prefix}.qzeros": _pack_columns(zero, AWQ_ORDER),
            f"{prefix}.scales": scale}, dense


def _gptq(prefix, w, group, gen, **_):
    """Symmetric, act-order: rows are grouped in a random order (as GPTQ's descending-activation
    order would), `g_idx` says each row's group; zeros stored less one (format v1)."""
    wt = w.t().contiguous()
    k, n = wt.shape
    perm = torch.randperm(k, generator=gen)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = (torch.arange(k) // group).to(torch.int32)
    scales = torch.empty(k // group, n)
    for gi in range(k // group):
        scales[gi] = (wt[g_idx == gi].abs().amax(dim=0) / 7.5).clamp(min=1e-5)
    scales = scales.half()
    q = (torch.round(wt / scales.float()[g_idx.long()]) + 8).clamp(0, 15)
    word = torch.zeros(k // 8, n, dtype=torch.int64)
    for i in range(8):
        word |= q[i::8].to(torch.int64) << (4 * i)
    zeros = torch.full((k // group, n), 8 - 1)
    dense = ((q - 8) * scales.float()[g_idx.long()]).t()
    return {f"{prefix}.qweight": _as_int32(word), f"{prefix}.qzeros": _pack_columns(zeros, range(8)),
            f"{prefix}.scales": scales, f"{prefix}.g_idx": g_idx}, dense


_QUANTIZERS = {"fp8": _fp8_block, "ct_fp8": _fp8_channel, "awq": _awq, "gptq": _gptq}
_CONFIGS = {
    "fp8": lambda block, group: {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                 "weight_block_size": list(block)},
    "ct_fp8": lambda block, group: {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}}},
        "ignore": ["lm_head"]},
    "awq": lambda block, group: {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                 "version": "gemm"},
    "gptq": lambda block, group: {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": True,
                                  "sym": True, "checkpoint_format": "gptq"},
}
