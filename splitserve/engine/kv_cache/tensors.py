"""The paged KV memory: per layer, K and V each [num_blocks, block_size, num_kv_heads, head_dim]
(flash-attn's paged layout), all views of one contiguous allocation so that a transport can
register the whole cache as a single region."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVCacheTensors:
    storage: torch.Tensor  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]

    @classmethod
    def allocate(cls, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str | torch.device = "cpu") -> "KVCacheTensors":
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device))

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return num_layers * 2 * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(self.storage[i, 0], self.storage[i, 1]) for i in range(self.storage.shape[0])]

    @property
    def num_blocks(self) -> int:
        return self.storage.shape[2]
