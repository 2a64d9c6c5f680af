"""What one routing decision costs on the ingress's hot path: hash the prompt's blocks as the
ingress does (KVIndex.routable_hashes: the native chain, as far as some worker may hold the
prefix; the engine continues the chain) and place it with the `cache_aware` policy over W
prefill + W decode workers, against a KV index populated with `--index-hashes` hashes (a quarter
of the workers hold a shared 2K-token system prompt, so the prefix scorer has matches to walk).
Reports p50 / p99 of the hashing, the placement and both together for each workers × prompt
length.

The native hash remembers its last 8 chains (hashing.py), so prompts behind one system prompt
hash their shared blocks by comparison. `--system-prompts 16` rotates more of them than it
remembers: every decision then hashes its prompt in full, the cost of a prefix the ingress has
not seen lately.

    python benchmarks/router_cost.py [--workers 8 64 512] [--prompt-tokens 1024 8192 32768] [--system-prompts 1]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from pathlib import Path

from splitserve.hashing import block_hashes
from splitserve.router.policy import RouteRequest, WorkerView, make_router
from splitserve.types import BlockStored, Role, WorkerId

BLOCK = 16


def populated(workers: int, index_hashes: int, shared: list[tuple[bytes, ...]], seed: int):
    router = make_router("cache_aware", disagg_min_tokens=32)
    rng = random.Random(seed)
    views = []
    for role in (Role.PREFILL, Role.DECODE):
        for i in range(workers):
            wid = WorkerId(role, f"{i:08x}")
            views.append(WorkerView(wid, role, f"10.0.{i // 256}.{i % 256}", num_waiting=rng.randrange(8),
                                    num_running=rng.randrange(32), kv_usage=rng.random()))
    per_worker = max(1, index_hashes // len(views))
    for k, v in enumerate(views):
        own = tuple(rng.randbytes(16) for _ in range(per_worker))
        router.index.apply(v.worker_id, [BlockStored(own + (shared[k // 4 % len(shared)] if k % 4 == 0 else ()))])
    # tuples, as the Directory hands them: the same object until a worker's facts change
    return (router, tuple(v for v in views if v.role is Role.PREFILL), tuple(v for v in views if v.role is Role.DECODE))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def interruptions(seconds: float = 1.0) -> dict:
    """How often this machine takes the CPU away from a busy loop for > 10 µs, and for how
    long: on a VM these land in any decision's p99 (a decision of ~60 µs is hit a few % of
    the time), so the report carries them next to the percentiles."""
    gaps, t = [], time.perf_counter()
    end = t + seconds
    while t < end:
        now = time.perf_counter()
        if now - t > 10e-6:
            gaps.append((now - t) * 1e6)
        t = now
    gaps.sort()
    return {"per_s": len(gaps) / seconds, "median_us": statistics.median(gaps) if gaps else 0.0,
            "p90_us": pct(gaps, 0.9) if gaps else 0.0, "max_us": gaps[-1] if gaps else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, nargs="+", default=[8, 64, 512])
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--index-hashes", type=int, default=1_000_000)
    ap.add_argument("--decisions", type=int, default=1000)
    ap.add_argument("--system-prompts", type=int, default=1)
    ap.add_argument("--out", default="results/router_cost.json")
    a = ap.parse_args()
    rng = random.Random(0)
    systems = [[rng.randrange(32000) for _ in range(2048)] for _ in range(a.system_prompts)]  # shared 2K-token prefixes
    # distinct tails, each copied out of a random stretch just before its decision (as a tokenizer
    # would have just produced it): generating ids one by one here would cost ~100x a decision
    # and leave the caches far colder than an ingress's own work between decisions does
    pool = [rng.randrange(32000) for _ in range(1 << 20)]
    rows = []
    for w in a.workers:
        shared = [tuple(block_hashes(system, BLOCK)) for system in systems]
        router, prefills, decodes = populated(w, a.index_hashes, shared, seed=w)
        gc.freeze()  # as the ingress does once started (orchestrator/cluster_backend.py)
        for n in a.prompt_tokens:
            hash_us, place_us = [], []
            for d in range(-20, a.decisions):  # the first 20 warm up (first use builds the pools)
                start = rng.randrange(len(pool) - n)
                # the system prompt's ids made anew, as each request's tokenization gives them
                # (equal ids that are one object would compare for free)
                system = systems[d % len(systems)]
                head = list(map((0).__add__, system[: min(n, len(system))]))
                prompt = tuple(head + pool[start : start + max(0, n - len(system))])
                t0 = time.perf_counter()
                hashes = router.index.routable_hashes(prompt, BLOCK)
                t1 = time.perf_counter()
                router.place(RouteRequest(f"r{d}", n, hashes, BLOCK), prefills, decodes)
                t2 = time.perf_counter()
                if d >= 0:
                    hash_us.append((t1 - t0) * 1e6)
                    place_us.append((t2 - t1) * 1e6)
            total = [h + p for h, p in zip(hash_us, place_us)]
            row = {"workers": w, "prompt_tokens": n, "index_hashes": len(router.index),
                   "hash_us": {"p50": statistics.median(hash_us), "p99": pct(hash_us, 0.99)},
                   "place_us": {"p50": statistics.median(place_us), "p99": pct(place_us, 0.99)},
                   "decision_us": {"p50": statistics.median(total), "p99": pct(total, 0.99)}}
            rows.append(row)
            print(f"{w:4d} workers × {n:6d} tokens: decision p50 {row['decision_us']['p50']:8.0f} µs, "
                  f"p99 {row['decision_us']['p99']:8.0f} µs (hash p50 {row['hash_us']['p50']:.0f}, "
                  f"place p50 {row['place_us']['p50']:.0f})")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    noise = interruptions()
    print(f"this machine's interruptions > 10 µs: {noise['per_s']:.0f}/s, median {noise['median_us']:.0f} µs, "
          f"p90 {noise['p90_us']:.0f} µs")
    out.write_text(json.dumps({"config": vars(a), "rows": rows, "interruptions": noise}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
