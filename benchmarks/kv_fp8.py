"""The FP8 KV cache against the 16-bit one, on the demo model: what a prefill-to-decode handoff
moves, how long it takes, and how many tokens a GiB of cache holds.

A prefill worker and a decode worker in this process (the real worker classes, no Ray), one
transport at a time; each prompt's KV is handed over and decoded, and the decode worker reports
the bytes it moved (`PhaseTimes.transfer_bytes`, what /metrics counts). Both caches run with
bfloat16 weights, so the only difference is the KV element.

    python benchmarks/kv_fp8.py [--transports shm tcp nixl] [--lengths 1024 4096] [--out results/kv_fp8.json]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from splitserve.config import EngineConfig  # noqa: E402
from splitserve.engine.kv_cache.tensors import KVCacheTensors  # noqa: E402
from splitserve.engine.model.config import ModelConfig  # noqa: E402
from splitserve.engine.model.demo import ensure_demo_model  # noqa: E402
from splitserve.types import Request, SamplingParams  # noqa: E402
from splitserve.worker.decode.worker import DecodeWorker  # noqa: E402
from splitserve.worker.prefill.worker import PrefillWorker  # noqa: E402

SP = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
GIB = 1 << 30


class Local:
    """An in-process prefill worker as the decode side calls it: `peer.ack.remote(x)`."""

    def __init__(self, obj) -> None:
        self._obj = obj

    def __getattr__(self, name):
        fn = getattr(self._obj, name)
        return type("Method", (), {"remote": staticmethod(lambda *a: asyncio.ensure_future(fn(*a)))})


async def hand_over(pre, dec, transport: str, prompt: tuple[int, ...], rid: str) -> tuple[int, float, list[int]]:
    req = Request(rid, prompt, SP)
    result = await pre.prefill(req, transport)
    moved, seconds, tokens = 0, 0.0, [result.handoff.first_token]
    async for c in dec.generate(req, result.handoff, Local(pre)):
        if c.phases is not None and c.phases.transfer_bytes is not None:
            moved, seconds = c.phases.transfer_bytes, c.phases.transfer_s
        tokens += c.token_ids
    return moved, seconds, tokens


def run_case(model: str, kv: str, transport: str, lengths: list[int], reps: int) -> list[dict]:
    cfg = EngineConfig(model=model, dtype="bfloat16", kv_cache_dtype=kv, kv_cache_memory_gib=0.25,
                       max_num_batched_tokens=1024, kv_shared_memory=transport == "shm")
    pre, dec = PrefillWorker(cfg, [transport]), DecodeWorker(cfg, [transport])
    rows = []
    try:
        for n in lengths:
            prompt = tuple(5 + (i * 7919) % 40000 for i in range(n))
            samples = [asyncio.run(hand_over(pre, dec, transport, prompt, f"{kv}-{n}-{r}")) for r in range(reps)]
            rows.append(dict(kv_cache_dtype=dec.layout.dtype, transport=transport, prompt_tokens=n,
                             bytes_moved=samples[0][0], transfer_ms=1e3 * statistics.median(s[1] for s in samples),
                             tokens=samples[0][2]))
    finally:
        pre.close()
        dec.close()
    return rows


def tokens_per_gib(model: str) -> dict[str, float]:
    mc = ModelConfig.from_dir(model)
    import torch

    per = {kv: KVCacheTensors.bytes_per_block(mc.num_layers, 16, mc.num_kv_heads, mc.head_dim, torch.bfloat16,
                                              fp8=kv == "fp8") / 16 for kv in ("bfloat16", "fp8")}
    return {kv: GIB / b for kv, b in per.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--transports", nargs="+", default=["shm", "tcp", "nixl"])
    ap.add_argument("--lengths", nargs="+", type=int, default=[1024, 4096])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="results/kv_fp8.json")
    args = ap.parse_args()
    model = args.model or str(ensure_demo_model())
    rows = []
    for transport in args.transports:
        for kv in ("auto", "fp8"):
            rows += run_case(model, kv, transport, args.lengths, args.reps)
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "tokens"}), flush=True)
    ratios = []
    for r in rows:
        if r["kv_cache_dtype"] == "fp8_e4m3":
            base = next(b for b in rows if b["kv_cache_dtype"] != "fp8_e4m3" and b["transport"] == r["transport"]
                        and b["prompt_tokens"] == r["prompt_tokens"])
            ratios.append(dict(transport=r["transport"], prompt_tokens=r["prompt_tokens"],
                               bytes_ratio=r["bytes_moved"] / base["bytes_moved"],
                               time_ratio=r["transfer_ms"] / base["transfer_ms"],
                               same_first_tokens=r["tokens"] == base["tokens"]))
    tpg = tokens_per_gib(model)
    report = dict(setup=f"{platform.processor() or platform.machine()}, demo model (bf16 weights), in-process "
                        f"prefill + decode workers, median of {args.reps} handoffs",
                  rows=rows, fp8_vs_bf16=ratios, tokens_per_gib=tpg, tokens_per_gib_ratio=tpg["fp8"] / tpg["bfloat16"])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps(dict(fp8_vs_bf16=ratios, tokens_per_gib=tpg), indent=2))
    plot(rows, out.with_suffix(".png"))


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    labels = sorted({(r["transport"], r["prompt_tokens"]) for r in rows})
    x = range(len(labels))
    for i, kv in enumerate(("bfloat16", "fp8_e4m3")):
        mine = {(r["transport"], r["prompt_tokens"]): r for r in rows if r["kv_cache_dtype"] == kv}
        xs = [j + (i - 0.5) * 0.4 for j in x]
        axes[0].bar(xs, [mine[k]["bytes_moved"] / 2**20 for k in labels], 0.4, label=kv)
        axes[1].bar(xs, [mine[k]["transfer_ms"] for k in labels], 0.4, label=kv)
    for ax, title in zip(axes, ("MiB moved per handoff", "handoff time, ms (median)")):
        ax.set_xticks(list(x), [f"{t}\n{n}" for t, n in labels])
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
