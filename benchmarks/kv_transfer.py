"""KV-transfer bandwidth between two processes, against this machine's memcpy bandwidth.

A spawned child plays the prefill worker: it owns a KV cache shaped like a small model (default
32 layers, 8 KV heads, head_dim 64, block 16, fp16: exactly 1 MiB per block over all layers),
filled with random data, and serves it through every transport available ("shm", "tcp", and
"nixl" where `splitserve.kv_transfer.nixl` imports and registers). This process plays the decode
worker: it pulls 1, 16 and 64 MiB worth of blocks into its own cache, timing read() → DONE, and
verifies the checksum of what landed once per case (outside the timing).

    python benchmarks/kv_transfer.py [--reps 50] [--pattern contiguous scattered] [--out results/kv_transfer.jsonl]

Each case prints and appends a JSON line: transport, pattern, bytes, gbps (at p50), p50_ms,
p99_ms, memcpy_gbps (the faster of a 64 MiB torch copy_ and a 64 MiB memmove: the ceiling),
ratio (gbps / memcpy_gbps), ratio_memmove (gbps / the single-threaded memmove alone: the C
memcpy's own bandwidth, the laxer reading of "memcpy bandwidth").
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
import statistics
import sys
import time
import traceback
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from splitserve.engine.kv_cache.tensors import KVCacheTensors  # noqa: E402
from splitserve.kv_transfer import (  # noqa: E402
    KVHandoff,
    KVLayout,
    TransferHeader,
    TransferState,
    kv_checksum,
    make_transport,
    verify_landed,
    wait_transfer,
)

MIB = 1 << 20
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def make_layout(args, num_blocks: int) -> KVLayout:
    dt = DTYPES[args.dtype]
    return KVLayout(args.layers, num_blocks, args.block_size, args.kv_heads, args.head_dim, args.dtype,
                    torch.empty((), dtype=dt).element_size(), "bench-model")


def allocate(args, num_blocks: int) -> KVCacheTensors:
    return KVCacheTensors.allocate(args.layers, num_blocks, args.block_size, args.kv_heads, args.head_dim,
                                   DTYPES[args.dtype], shm_path=f"/dev/shm/splitserve-bench-{uuid.uuid4().hex}")


def try_transport(name: str):
    """(transport, None) or (None, why not) — nixl may be missing or unusable on this machine."""
    try:
        return make_transport(name), None
    except Exception as e:  # noqa: BLE001 - any failure just means "not available here"
        return None, f"{type(e).__name__}: {e}"


# -- the child: prefill worker ----------------------------------------------------------------

def serve(conn, args, num_blocks: int, names: list[str]) -> None:
    kv = allocate(args, num_blocks)
    kv.storage.copy_(torch.randn(kv.storage.shape, generator=torch.Generator().manual_seed(0)).to(kv.storage.dtype))
    lay = make_layout(args, num_blocks)
    transports, endpoints = {}, {}
    for name in names:
        t, why = try_transport(name)
        try:
            endpoints[name] = t.register(kv, lay, platform.node()) if t else why
            transports[name] = t
        except Exception as e:  # noqa: BLE001
            endpoints[name] = f"{type(e).__name__}: {e}"
    conn.send(endpoints)
    try:
        while True:
            cmd, *rest = conn.recv()
            if cmd == "checksum":  # and a lease on those blocks, as a prefill worker grants
                token = os.urandom(16)
                for t in transports.values():
                    if t is not None:
                        t.allow(token, rest[0])
                conn.send((kv_checksum(kv.storage, lay, rest[0]), token))
            else:
                break
    finally:
        for t in transports.values():
            if t is not None:
                t.close()
        kv.close()


# -- this process: decode worker ----------------------------------------------------------------

def memcpy_gbps(nbytes: int = 64 * MIB, reps: int = 10) -> dict[str, float]:
    """The ceiling: a 64 MiB torch copy_ between two warm buffers, and the same bytes through a
    single-threaded memmove (numpy), which is what the shm transport does per segment. On a small
    busy box torch's multi-threaded copy_ can be the slower of the two; the limit is the faster."""
    a, b = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    an, bn = a.numpy(), b.numpy()
    out = {}
    for name, copy in (("torch", lambda: b.copy_(a)), ("memmove", lambda: bn.__setitem__(slice(None), an))):
        copy()  # fault in both buffers first
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            copy()
            times.append(time.perf_counter() - t0)
        out[name] = nbytes / statistics.median(times) / 1e9
    return out


def block_lists(pattern: str, n: int, num_blocks: int, rng: random.Random) -> tuple[list[int], list[int]]:
    if pattern == "contiguous":
        return list(range(3, 3 + n)), list(range(5, 5 + n))
    return rng.sample(range(num_blocks), n), rng.sample(range(num_blocks), n)  # a fragmented pool


def handoff(conn, endpoint, src: list[int], lay: KVLayout) -> KVHandoff:
    conn.send(("checksum", tuple(src)))
    header = TransferHeader("bench", lay.model_fingerprint, lay.dtype, lay.block_size, lay.num_layers, len(src), 1)
    checksum, token = conn.recv()
    return KVHandoff("bench", 0, None, len(src) * lay.block_size, 0, tuple(src), endpoint, "lease",
                     time.time() + 30, header, checksum, token)


def time_case(transport, ho: KVHandoff, dst: list[int], reps: int, poll_s: float, warmup: int = 2) -> list[float]:
    times = []
    for i in range(warmup + reps):
        t0 = time.perf_counter()
        h = transport.read(ho, dst)
        status = wait_transfer(transport, h, timeout=30, interval=poll_s)
        dt = time.perf_counter() - t0
        transport.release(h)
        if status.state is not TransferState.DONE:
            raise status.reason
        if i >= warmup:
            times.append(dt)
    return times


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def run(args) -> list[dict]:
    per_block = make_layout(args, 1).block_bytes * 2 * args.layers
    num_blocks = max(args.sizes_mib) * MIB // per_block + 32
    lay = make_layout(args, num_blocks)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=serve, args=(child, args, num_blocks, args.transports), daemon=True)
    proc.start()
    kv = allocate(args, num_blocks)
    rows: list[dict] = []
    try:
        if not parent.poll(120):
            raise RuntimeError("source process did not start")
        endpoints = parent.recv()
        print(f"{per_block / MIB:.2f} MiB per block; memcpy measured right before each case")
        for name in args.transports:
            ep = endpoints[name]
            reader, why = try_transport(name)
            if isinstance(ep, str) or reader is None:
                print(f"{name}: skipped ({ep if isinstance(ep, str) else why})")
                continue
            try:
                reader.register(kv, lay, platform.node())
                rows += bench_transport(args, name, reader, ep, parent, kv, lay, per_block)
            except Exception as e:  # noqa: BLE001 - one broken transport must not hide the others
                print(f"{name}: failed: {type(e).__name__}: {e}")
                traceback.print_exc()
            finally:
                reader.close()
    finally:
        parent.send(("stop",))
        proc.join(30)
        if proc.is_alive():
            proc.kill()
        kv.close()
    return rows


def bench_transport(args, name, reader, ep, conn, kv, lay, per_block) -> list[dict]:
    rows, rng = [], random.Random(0)
    for pattern in args.pattern:
        for mib in args.sizes_mib:
            n = max(1, mib * MIB // per_block)
            src, dst = block_lists(pattern, n, lay.num_blocks, rng)
            ho = handoff(conn, ep, src, lay)
            # The ceiling next to the case it bounds: on a small shared box memcpy itself drifts.
            copies = memcpy_gbps()
            ceiling = max(copies.values())
            times = time_case(reader, ho, dst, args.reps, args.poll_us * 1e-6)
            verify_landed(kv, lay, ho, dst)  # the bytes that were timed are the right bytes
            nbytes, p50 = n * per_block, percentile(times, 0.5)
            row = dict(transport=name, pattern=pattern, bytes=nbytes, reps=len(times),
                       gbps=round(nbytes / p50 / 1e9, 3), p50_ms=round(p50 * 1e3, 3),
                       p99_ms=round(percentile(times, 0.99) * 1e3, 3), memcpy_gbps=round(ceiling, 3),
                       memcpy_torch_gbps=round(copies["torch"], 3), memcpy_memmove_gbps=round(copies["memmove"], 3),
                       ratio=round(nbytes / p50 / 1e9 / ceiling, 3),
                       ratio_memmove=round(nbytes / p50 / 1e9 / copies["memmove"], 3), dtype=args.dtype, layers=args.layers,
                       cpus=os.cpu_count(), host=platform.node())
            print(json.dumps(row))
            rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transports", nargs="+", default=["shm", "tcp", "nixl"])
    p.add_argument("--sizes-mib", nargs="+", type=int, default=[1, 16, 64])
    p.add_argument("--pattern", nargs="+", default=["contiguous", "scattered"], choices=["contiguous", "scattered"])
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--poll-us", type=float, default=100.0, help="poll() interval while waiting (a decode step polls once)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="float16", choices=sorted(DTYPES))
    p.add_argument("--out", default="results/kv_transfer.jsonl")
    args = p.parse_args()
    rows = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:  # the latest run; earlier ones are in git history
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"wrote {len(rows)} rows to {out}")


if __name__ == "__main__":
    main()
