"""How much of the KV hand-over does streaming hide? Per transport and prompt length, on a local
Ray cluster (1 prefill + 1 decode worker, the demo model), the same prompts with streaming on
and off, one request at a time (latencies, not queueing):

  * exposed transfer — from the end of the prefill's last forward pass to the KV verified on
    the decode worker (the decode worker's `exposed_transfer_s`), median; hidden share =
    1 − exposed(on) / exposed(off);
  * the client-seen gap between the first and the second token, less the median gap between
    later tokens (what the hand-over adds to it);
  * bytes moved, GB/s of the off mode's pull, and the prefill's own time on against off (the
    cost of publishing while it computes).

The prefill takes `--chunk` tokens a step in both modes (what streams behind it is the chunks
before the last). Writes results/kv_streaming.json and .png.

    python benchmarks/kv_streaming.py [--transports shm tcp nixl] [--lengths 1024 4096 7168]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch


def run(model, transport: str, streaming: bool, prompts: dict[int, list], chunk: int) -> dict:
    from splitserve import SamplingParams
    from splitserve.orchestrator import Cluster

    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = {}
    with Cluster.start(model=model, transport=transport, disagg_min_tokens=0, kv_cache_memory_gib=2.0,
                       max_num_batched_tokens=chunk, kv_streaming=streaming, kv_streaming_min_tokens=0) as c:
        c.generate([prompts[min(prompts)][0]], sp)  # warm-up
        for n, ps in prompts.items():
            c.timings.clear()
            texts = [c.generate([p], sp)[0].outputs[0].token_ids for p in ps]
            t = list(c.timings)
            itl = statistics.median([g for x in t for g in x.inter_token_s])
            out[n] = {
                "tokens": texts,
                "exposed_ms": statistics.median(x.exposed_transfer_s for x in t) * 1e3,
                "transfer_ms": statistics.median(x.transfer_s for x in t) * 1e3,
                "first_to_second_ms": statistics.median(x.first_to_second_token_s for x in t) * 1e3,
                "itl_ms": itl * 1e3,
                "handover_gap_ms": (statistics.median(x.first_to_second_token_s for x in t) - itl) * 1e3,
                "prefill_ms": statistics.median(x.prefill_s for x in t) * 1e3,
                "bytes": t[0].transfer_bytes,
                "per_request": [{"exposed_ms": x.exposed_transfer_s * 1e3, "first_to_second_ms": x.first_to_second_token_s * 1e3,
                                 "first_token_path_ms": x.prefill_done_to_first_token_s * 1e3} for x in t],
            }
        decode = c.check_invariants()[-1]
        out["pieces_landed"] = decode.get("pieces_landed", 0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--transports", nargs="+", default=["shm", "tcp", "nixl"])
    ap.add_argument("--lengths", nargs="+", type=int, default=[1024, 4096, 7168])
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=512, help="prefill tokens per step (both modes)")
    ap.add_argument("--out", default="results/kv_streaming.json")
    a = ap.parse_args()
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    g = torch.Generator().manual_seed(0)
    prompts = {n: [torch.randint(100, 40000, (n,), generator=g).tolist() for _ in range(a.requests)]
               for n in a.lengths}
    rows = []
    for transport in a.transports:
        try:
            on, off = (run(a.model, transport, s, prompts, a.chunk) for s in (True, False))
        except Exception as e:  # e.g. nixl not installed here
            rows.append({"transport": transport, "error": f"{type(e).__name__}: {e}"[:300]})
            print(json.dumps(rows[-1]), flush=True)
            continue
        for n in a.lengths:
            r_on, r_off = on[n], off[n]
            row = {"transport": transport, "prompt_len": n, "same_tokens": r_on.pop("tokens") == r_off.pop("tokens"),
                   "on": r_on, "off": r_off,
                   "hidden_share": 1 - r_on["exposed_ms"] / r_off["exposed_ms"],
                   "off_gb_per_s": r_off["bytes"] / (r_off["transfer_ms"] / 1e3) / 1e9,
                   "prefill_slowdown": r_on["prefill_ms"] / r_off["prefill_ms"] - 1,
                   "pieces_landed": on["pieces_landed"]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"chunk": a.chunk, "requests": a.requests, "machine": machine(a.chunk),
                               "rows": rows}, indent=2))
    plot(rows, out.with_suffix(".png"))


def machine(chunk: int) -> str:
    import os
    import platform

    from splitserve.engine.engine import KV_LAYER_GROUPS

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return (f"{os.cpu_count()}-core {cpu}, CPU workers, demo model, prefill {chunk} tokens a step, "
            f"{KV_LAYER_GROUPS} layer groups a step")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "error" not in r]
    transports = sorted({r["transport"] for r in rows})
    fig, axes = plt.subplots(1, max(1, len(transports)), figsize=(5 * max(1, len(transports)), 4), squeeze=False)
    for ax, t in zip(axes[0], transports):
        rs = [r for r in rows if r["transport"] == t]
        xs = range(len(rs))
        ax.bar([x - 0.2 for x in xs], [r["off"]["exposed_ms"] for r in rs], 0.4, label="streaming off")
        ax.bar([x + 0.2 for x in xs], [r["on"]["exposed_ms"] for r in rs], 0.4, label="streaming on")
        ax.set_xticks(list(xs), [f"{r['prompt_len']}" for r in rs])
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("exposed KV transfer, median ms")
        ax.set_title(t)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
