"""The attention backend protocol: how a layer's new K/V enter the paged cache and how queries
attend to it. The engine builds one `AttentionBatch` per step; each backend turns it, once per
step, into whatever metadata it needs (`prepare`), then runs every layer with it (`forward`).

Flat batch layout: decode sequences (one new token each) come first, then prefill chunks. A
prefill chunk may follow cached context (prefix-cache hit or an earlier chunk).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from splitserve.config import ATTENTION_BACKENDS
from splitserve.types import ConfigError


@dataclass(frozen=True)
class SeqSlice:
    q_start: int  # offset of the sequence's first new token in the flat batch
    q_len: int  # new tokens this step
    ctx_len: int  # tokens in context after this step, the new ones included
    block_ids: tuple[int, ...]  # the sequence's blocks covering ctx_len


@dataclass(frozen=True)
class AttentionBatch:
    num_tokens: int
    slot_mapping: torch.Tensor  # [num_tokens] int64: block * block_size + offset of each new token
    decodes: tuple[SeqSlice, ...]  # q_len == 1, occupying tokens [0, len(decodes))
    prefills: tuple[SeqSlice, ...]
    block_size: int

    @property
    def num_decode_tokens(self) -> int:
        return len(self.decodes)


class AttentionBackend(Protocol):
    name: str

    def prepare(self, batch: AttentionBatch) -> Any:
        """Per-step metadata shared by all layers (index tensors, masks)."""

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: Any,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Store k/v at the batch's slots, then attend."""


BACKENDS = ATTENTION_BACKENDS[1:]  # after "auto"


def get_backend(name: str, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None, *,
                block_size: int = 16, head_dim: int | None = None, fp8_kv: bool = False) -> AttentionBackend:
    """`torch`: pure PyTorch (the reference); `cpu`: PyTorch plus native CPU kernels; `triton`:
    our Triton kernels (CUDA; on CPU only under TRITON_INTERPRET=1); `flash_attn`: flash-attn 2
    on CUDA. `auto`: on CUDA flash_attn where it can run (installed, fp16/bf16, pages of a
    multiple of 256 tokens), else triton, else torch; on CPU `cpu` where its kernel builds, else
    `torch`. With an FP8 KV cache (`fp8_kv`), triton (its kernels read the FP8 rows; on CUDA from
    compute capability 8.9), torch and cpu (gathering: its native kernel reads plain dtypes), not
    flash_attn; auto picks among those. A backend named but unable to run here raises ConfigError
    saying why."""
    from splitserve.engine.attention import paged_backends as paged
    from splitserve.engine.attention.torch_backend import CpuBackend, TorchBackend
    from splitserve.engine.kernels import paged_decode_cpu

    device = torch.device(device or "cpu")
    why_not = {
        "torch": lambda: None,
        "cpu": lambda: None if paged_decode_cpu.available() else
        "its native kernel could not be built here (no C compiler?)",
        "triton": lambda: paged.triton_unavailable(device) or _head_dim_problem(head_dim),
        "flash_attn": lambda: paged.flash_attn_unavailable(device, dtype, block_size, head_dim),
    }
    if fp8_kv:
        plain_triton = why_not["triton"]
        why_not["triton"] = lambda: plain_triton() or paged.triton_fp8_unavailable(device)
        why_not["flash_attn"] = lambda: (
            "it does not read an FP8 KV cache: flash-attn 2 takes fp16/bf16 K/V only, not e4m3 rows that each "
            "carry their scale's exponent byte (kv_cache_dtype fp8 runs on triton, torch or cpu)")
    if name == "auto":
        order = ("flash_attn", "triton", "torch") if device.type == "cuda" else ("cpu", "torch")
        name = next(n for n in order if why_not[n]() is None)
    if name not in why_not:
        raise ConfigError(f"unknown attention backend {name!r}; known: auto, {', '.join(BACKENDS)}")
    problem = why_not[name]()
    if problem:
        raise ConfigError(f"attention backend {name!r} cannot run here: {problem}; use 'auto' or 'torch'")
    if name in ("torch", "cpu"):
        return {"torch": TorchBackend, "cpu": CpuBackend}[name](dtype, fp8_kv)
    return {"triton": paged.TritonBackend, "flash_attn": paged.FlashAttnBackend}[name](dtype, device)


def _head_dim_problem(head_dim: int | None) -> str | None:
    if head_dim is not None and head_dim > 256:
        return f"its kernels take head_dim up to 256, the model has {head_dim}"
    return None
