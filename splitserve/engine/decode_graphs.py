"""Decode steps replayed from captured CUDA graphs, one graph per batch-size bucket.

A decode step of a large model launches hundreds of small kernels; at small batches the GPU
waits on Python and the launch queue, not on memory. A graph replays the whole forward with one
launch. Its inputs live in static buffers: each step copies ids, positions, slots, block tables
and context lengths into them, pads the batch up to the next bucket (padding rows write no KV:
slot -1; read one token of block 0; their outputs are dropped) and replays. The step's shapes
therefore depend only on the bucket, which also fixes the decode kernel's split count.

Only backends whose per-step metadata is a `PagedMeta` (triton) can be captured. `capture` is
pluggable: `cuda_graph_capture` on a GPU; tests on CPU pass `eager_capture`, which re-runs the
function on the static buffers and so checks the bucketing, padding and buffer plumbing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from splitserve.engine.attention.paged_backends import PagedMeta

Replay = Callable[[], torch.Tensor]
Capture = Callable[[Callable[[], torch.Tensor]], Replay]


def default_buckets(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every 8 up to 64, every 32 beyond: padding wastes < 1/8 past 8 seqs."""
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(96, max_batch + 32, 32))
    return tuple(sorted({min(s, max_batch) for s in sizes}))


def cuda_graph_capture(fn: Callable[[], torch.Tensor], pool=None) -> Replay:
    fn()  # warm: Triton compiles and torch allocates outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    return replay


def eager_capture(fn: Callable[[], torch.Tensor]) -> Replay:
    return fn


@dataclass
class _Static:
    ids: torch.Tensor
    positions: torch.Tensor
    meta: PagedMeta
    replay: Replay | None = None


class DecodeGraphs:
    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor, PagedMeta], torch.Tensor], *,
                 num_kv_heads: int, block_size: int, max_blocks_per_seq: int, device: torch.device,
                 buckets: tuple[int, ...]) -> None:
        """`forward(ids, positions, meta) -> hidden [bucket, hidden_size]`: the model over the
        paged cache; it must not read device values from the host (no `.item()`, no `.cpu()`)."""
        self.forward = forward
        self.block_size = block_size
        self.width = max_blocks_per_seq
        self.buckets = tuple(sorted(buckets))
        self._static = {b: self._buffers(b, num_kv_heads, device) for b in self.buckets}
        self.replays = 0

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def _buffers(self, b: int, num_kv_heads: int, device: torch.device) -> _Static:
        from splitserve.engine.kernels.triton_attention import decode_splits  # triton: a GPU extra

        i32 = dict(dtype=torch.int32, device=device)
        meta = PagedMeta(
            slot_mapping=torch.full((b,), -1, dtype=torch.int64, device=device),
            num_decodes=b,
            block_tables=torch.zeros((b, self.width), **i32),
            context_lens=torch.ones((b,), **i32),
            cu_seqlens_q=torch.arange(b + 1, **i32),
            cu_seqlens_k=torch.zeros((b + 1,), **i32),  # unused by the triton decode path
            prefill_cu_seqlens_q=torch.zeros((1,), **i32),
            max_seqlen_q=1,
            max_context=self.width * self.block_size,
            decode_splits=decode_splits(b, num_kv_heads, self.width * self.block_size),
        )
        zeros = torch.zeros((b,), dtype=torch.int64, device=device)
        return _Static(ids=zeros, positions=zeros.clone(), meta=meta)

    def capture(self, capture: Capture) -> None:
        """Largest bucket first, so the smaller ones reuse its memory pool on a GPU."""
        for b in reversed(self.buckets):
            s = self._static[b]
            s.replay = capture(lambda s=s: self.forward(s.ids, s.positions, s.meta))

    def run(self, ids: torch.Tensor, positions: torch.Tensor, meta: PagedMeta) -> torch.Tensor | None:
        """Hidden states of a decode-only step, or None when the step cannot replay (prefill
        rows, more sequences than the largest bucket, or a table wider than captured)."""
        n = meta.num_decodes
        if n != ids.shape[0] or n > self.max_batch or meta.block_tables.shape[1] > self.width or n == 0:
            return None
        b = next(x for x in self.buckets if x >= n)
        s = self._static[b]
        if s.replay is None:
            raise RuntimeError("DecodeGraphs.run before capture")
        s.ids[:n].copy_(ids)
        s.positions[:n].copy_(positions)
        s.meta.slot_mapping[:n].copy_(meta.slot_mapping)
        s.meta.block_tables[:n, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        s.meta.context_lens[:n].copy_(meta.context_lens)
        if b > n:  # rows left over from a larger earlier step become padding again
            s.meta.slot_mapping[n:].fill_(-1)
            s.meta.context_lens[n:].fill_(1)
        self.replays += 1
        return s.replay()[:n]
