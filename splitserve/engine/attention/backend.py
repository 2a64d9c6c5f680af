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


def get_backend(name: str, dtype: torch.dtype = torch.float32, device: torch.device | None = None) -> AttentionBackend:
    """`torch`: pure PyTorch (the reference); `cpu`: PyTorch plus native CPU kernels; `auto`:
    `cpu` on a CPU device where its kernels build, else `torch`."""
    from splitserve.engine.attention.torch_backend import CpuBackend, TorchBackend
    from splitserve.engine.kernels import paged_decode_cpu

    backends = {"torch": TorchBackend, "cpu": CpuBackend}
    if name == "auto":
        on_cpu = device is None or torch.device(device).type == "cpu"
        name = "cpu" if on_cpu and paged_decode_cpu.available() else "torch"
    if name == "cpu" and not paged_decode_cpu.available():
        raise ValueError("attention backend 'cpu' needs its native kernel, which could not be built here "
                         "(no C compiler?); use 'torch'")
    if name not in backends:
        raise ValueError(f"unknown attention backend {name!r}; known: auto, {', '.join(backends)}")
    return backends[name](dtype)
