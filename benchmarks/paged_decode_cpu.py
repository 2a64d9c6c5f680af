"""CPU paged decode attention: the native kernel vs the PyTorch paths (block gather + SDPA, and
the per-sequence reference), at SmolLM2-135M's shape (9 heads, 3 KV heads, head_dim 64), batch
64, contexts uniform in [64, 640]. Writes JSON with ms per layer and effective GB/s of K/V read.

    python benchmarks/paged_decode_cpu.py [--out results/paged_decode_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from splitserve.engine.attention.backend import AttentionBatch, SeqSlice
from splitserve.engine.attention.torch_backend import TorchBackend
from splitserve.engine.kernels import paged_decode_cpu as K


def timed(fn, reps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="results/paged_decode_cpu.json")
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(64, 641, (a.batch,), generator=g)
    nblk = (lens + a.block_size - 1) // a.block_size
    num_blocks = int(nblk.sum()) + 64
    k = torch.randn(num_blocks, a.block_size, a.kv_heads, a.head_dim, generator=g)
    v = torch.randn_like(k)
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.zeros(a.batch, int(nblk.max()), dtype=torch.int64)
    slices, off = [], 0
    for i in range(a.batch):
        table[i, : nblk[i]] = perm[off: off + nblk[i]]
        slices.append(SeqSlice(i, 1, int(lens[i]), tuple(table[i, : nblk[i]].tolist())))
        off += int(nblk[i])
    q = torch.randn(a.batch, a.heads, a.head_dim, generator=g)
    scale = a.head_dim ** -0.5
    backend = TorchBackend()
    meta = backend.prepare(AttentionBatch(a.batch, torch.zeros(a.batch, dtype=torch.int64), tuple(slices), (),
                                          a.block_size))
    kv_bytes = int(lens.sum()) * a.kv_heads * a.head_dim * 4 * 2
    res = {"benchmark": "paged_decode_cpu", "batch": a.batch, "heads": a.heads, "kv_heads": a.kv_heads,
           "head_dim": a.head_dim, "mean_context": float(lens.float().mean()), "kv_bytes": kv_bytes,
           "threads": torch.get_num_threads()}
    res["torch_gather_sdpa_ms"] = timed(lambda: backend._decode(q, k, v, meta, scale), a.reps)
    if K.available():
        res["native_ms"] = timed(lambda: K.paged_decode(q, k, v, table, lens, scale), a.reps)
        res["native_gbps"] = kv_bytes / res["native_ms"] / 1e6
        res["speedup_vs_torch"] = res["torch_gather_sdpa_ms"] / res["native_ms"]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
