"""GPU attention backends over the paged cache: `triton` (our kernels, splitserve.engine.kernels)
and `flash_attn` (flash-attn 2's varlen kernel with a block table, when it imports on CUDA).

Both turn a step's `AttentionBatch` into one `PagedMeta` (block tables, context lengths, query
offsets as int32 device tensors, built on the host and copied once per step), shared by every
layer. Decodes come first in the flat batch, then prefill chunks (backend.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from splitserve.engine.attention.backend import AttentionBatch, SeqSlice


@dataclass
class PagedMeta:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_decodes: int
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, decodes first (padding: block 0)
    context_lens: torch.Tensor  # [num_seqs] int32
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32 over the whole flat batch
    cu_seqlens_k: torch.Tensor  # [num_seqs + 1] int32: running sum of context_lens
    prefill_cu_seqlens_q: torch.Tensor  # [num_prefills + 1] int32, rows of the prefill part
    max_seqlen_q: int
    max_context: int
    decode_splits: int | None = None  # None: the kernel's choice


def build_paged_meta(batch: AttentionBatch, device: torch.device) -> PagedMeta:
    seqs: tuple[SeqSlice, ...] = batch.decodes + batch.prefills
    width = max((len(s.block_ids) for s in seqs), default=1)
    table = np.zeros((len(seqs), width), dtype=np.int32)  # row by row at C speed: 256 x 8K contexts
    for i, s in enumerate(seqs):
        table[i, : len(s.block_ids)] = s.block_ids
    cu_q, cu_k = [0], [0]
    for s in seqs:
        cu_q.append(cu_q[-1] + s.q_len)
        cu_k.append(cu_k[-1] + s.ctx_len)
    nd = len(batch.decodes)
    # one host-to-device copy for the small int vectors, sliced apart on the device
    parts = [cu_q, [c - cu_q[nd] for c in cu_q[nd:]], cu_k, [s.ctx_len for s in seqs]]
    ints = torch.tensor([x for p in parts for x in p], dtype=torch.int32).to(device)
    cu_seqlens_q, prefill_cu, cu_seqlens_k, context_lens = ints.split([len(p) for p in parts])
    return PagedMeta(
        slot_mapping=batch.slot_mapping,
        num_decodes=nd,
        block_tables=torch.from_numpy(table).to(device),
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        prefill_cu_seqlens_q=prefill_cu,
        context_lens=context_lens,
        max_seqlen_q=max((s.q_len for s in batch.prefills), default=1),
        max_context=max((s.ctx_len for s in seqs), default=1),
    )


class _PagedBackend:
    """What both GPU backends share: the step's `PagedMeta`, and our `store_kv` (`_kv`), which
    writes the new tokens' K/V into the cache before attention."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        from splitserve.engine.kernels import triton_kv

        self._kv = triton_kv
        self.dtype, self.device = dtype, device

    def prepare(self, batch: AttentionBatch) -> PagedMeta:
        return build_paged_meta(batch, self.device)


class TritonBackend(_PagedBackend):
    """store_kv, then decode rows through the split-K decode kernel and prefill rows through the
    prefill kernel, each reading the cache in place. A speculative verify step's rows (a short
    chunk per sequence: its last token and k proposals) all go through one prefill launch, which
    takes a batch of chunks with per-chunk causal offsets: verification is batched already. The kernels' device-reading checks are off:
    the metadata is built here from the scheduler's slices, and a check that reads the device
    would stall the host once per layer (and cannot run inside a CUDA graph).

    With an FP8 cache (uint8 rows, kv_cache/fp8.py) the same calls: store_kv encodes each row as
    it writes it, the attention kernels upcast fp8 * 2**e in registers; a prefill chunk's own K/V
    are read back from the cache, so it attends to them decoded, as the torch backend does."""

    name = "triton"

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(dtype, device)
        from splitserve.engine.kernels import triton_attention

        self._att = triton_attention

    def forward(self, q, k, v, k_cache, v_cache, meta: PagedMeta, scale: float) -> torch.Tensor:
        self._kv.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            self._att.paged_attention_decode(q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.context_lens[:nd],
                                             scale, num_splits=meta.decode_splits, out=out[:nd], validate=False)
        if q.shape[0] > nd:
            self._att.paged_attention_prefill(q[nd:], k_cache, v_cache, meta.block_tables[nd:], meta.prefill_cu_seqlens_q,
                                              meta.context_lens[nd:], scale, max_seqlen_q=meta.max_seqlen_q,
                                              out=out[nd:], validate=False)
        return out


class FlashAttnBackend(_PagedBackend):
    """flash-attn 2: `store_kv` (ours), then one `flash_attn_varlen_func` over every sequence with
    the block table; its causal mask aligns bottom-right, so a chunk sees its cached prefix.
    flash-attn 2 pages KV only in blocks of a multiple of 256 tokens and only in fp16 / bf16."""

    name = "flash_attn"

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(dtype, device)
        from flash_attn import flash_attn_varlen_func

        self._varlen = flash_attn_varlen_func

    def forward(self, q, k, v, k_cache, v_cache, meta: PagedMeta, scale: float) -> torch.Tensor:
        self._kv.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return self._varlen(q, k_cache, v_cache, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q,
                            meta.max_context, softmax_scale=scale, causal=True, block_table=meta.block_tables)


def triton_unavailable(device: torch.device) -> str | None:
    """Why the triton backend cannot run here, or None."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed (pip install 'splitserve[gpu]')"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return (f"the triton backend runs on CUDA; on {device.type} only under the Triton interpreter "
                "(TRITON_INTERPRET=1, for tests: very slow)")
    return None


def triton_fp8_unavailable(device: torch.device) -> str | None:
    """Why the triton backend cannot read an FP8 KV cache here, or None: its kernels convert e4m3
    with the GPU's own instructions (Triton's float8e4nv), which start at compute capability 8.9."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        return (f"its FP8 KV kernels convert e4m3 in hardware, from compute capability 8.9 (Ada, Hopper); "
                f"this GPU is {major}.{minor}")
    return None


def flash_attn_unavailable(device: torch.device, dtype: torch.dtype, block_size: int,
                           head_dim: int | None = None) -> str | None:
    """Why the flash_attn backend cannot run here, or None."""
    if device.type != "cuda":
        return f"flash-attn runs only on CUDA, the device is {device.type}"
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return "flash-attn is not installed (pip install 'splitserve[gpu]')"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"flash-attn needs float16 or bfloat16, the engine runs {dtype}"
    if head_dim is not None and (head_dim % 8 or head_dim > 256):
        return f"flash-attn takes head_dim a multiple of 8 up to 256, the model has {head_dim}"
    if block_size % 256:
        return f"flash-attn 2 pages KV only in blocks of a multiple of 256 tokens, block_size is {block_size}"
    return triton_unavailable(device)  # our store_kv writes the cache
