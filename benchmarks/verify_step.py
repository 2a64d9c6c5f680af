"""A speculative verify step's cost on the demo model (issue 36): a step of B sequences each with
its last token and k proposals (k + 1 query rows, logits for every row) against a plain decode step
(k = 0), at batch 1 / 4 / 16 and 512 tokens of context, on this machine's attention backends.
`per_sequence` is the path before batched verification (each verify row through the attention's
one-sequence prefill path; `multi_query_max = 0`), `batched` the path now (torch_backend.py).
Forward + logits only, synthetic block tables over the engine's own cache; per cell `--iters`
rounds running the three paths in turn, after one untimed round; median and minimum. (On this
shared 2-core machine a cell's median swings by 10x and more when other processes run: torch's
intra-op threads wait for a descheduled sibling. The cpu batch-1 cell of an earlier run — verify
1.5 s against 0.4 s per sequence — was that, not warm-up: on a quiet machine that cell measures 75–90 ms both
ways; the runs here interleave the paths so a burst hits all three alike, and report the minimum.)

    python benchmarks/verify_step.py   # -> results/verify_step.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import torch  # noqa: E402

from splitserve import LLM  # noqa: E402
from splitserve.engine.attention import AttentionBatch, SeqSlice  # noqa: E402


def step_fn(runner, b: int, ctx: int, q_len: int):
    """Forward + logits of b sequences of `ctx` cached tokens and q_len new ones."""
    bs = runner.block_size
    per = -(-(ctx + q_len) // bs)
    slices, slots = [], []
    for s in range(b):
        blocks = tuple(range(s * per, (s + 1) * per))
        slices.append(SeqSlice(s * q_len, q_len, ctx + q_len, blocks))
        slots += [blocks[p // bs] * bs + p % bs for p in range(ctx, ctx + q_len)]
    batch = AttentionBatch(b * q_len, torch.tensor(slots), tuple(slices) if q_len == 1 else (),
                           () if q_len == 1 else tuple(slices), bs)
    ids = torch.randint(0, runner.model.cfg.vocab_size, (b * q_len,))
    pos = torch.arange(ctx, ctx + q_len).repeat(b)

    def step():
        meta = runner.backend.prepare(batch)  # per step, as the engine does
        return runner.model.compute_logits(runner.model(ids, pos, runner.kv_layers, runner.backend, meta))
    return step


def once(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def cells(runner, b: int, a) -> dict:
    """A plain decode step and the verify step by each path, at batch b: `--iters` rounds, each
    running every path once in turn (so a burst of other load on a shared machine hits all three
    alike), after one untimed round (warm-up: a fresh shape's first call is slower); per path the
    median and the minimum (the least disturbed run) in ms."""
    mq_batched = type(runner.backend).multi_query_max
    paths = {"decode": (1, mq_batched), "verify_per_sequence": (a.k + 1, 0), "verify_batched": (a.k + 1, mq_batched)}
    fns = {name: step_fn(runner, b, a.context, q) for name, (q, _) in paths.items()}
    times: dict = {name: [] for name in paths}
    for r in range(a.iters + 1):
        for name, (_, mq) in paths.items():
            runner.backend.multi_query_max = mq
            t = once(fns[name])
            if r:
                times[name].append(t * 1e3)
    del runner.backend.multi_query_max  # back to the class's value
    row = {f"{name}_ms": statistics.median(ts) for name, ts in times.items()}
    row.update({f"{name}_min_ms": min(ts) for name, ts in times.items()})
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=9)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--k", type=int, default=4)
    a = ap.parse_args()
    rows = []
    report = {"model": "demo (SmolLM2-135M-Instruct)", "context": a.context, "k": a.k, "iters": a.iters,
              "load_average_at_start": os.getloadavg(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
              "rows": rows}
    for backend in ("cpu", "torch"):
        llm = LLM(kv_cache_memory_gib=0.5, attention_backend=backend)
        runner = llm.engine.runner
        report["dtype"] = str(llm.engine.dtype)
        with torch.inference_mode():
            for b in (1, 4, 16):
                row = {"backend": backend, "batch": b}
                row.update(cells(runner, b, a))
                row["speedup_batched_vs_per_sequence"] = row["verify_per_sequence_ms"] / row["verify_batched_ms"]
                row["verify_over_decode"] = row["verify_batched_ms"] / row["decode_ms"]
                row["verify_over_decode_min"] = row["verify_batched_min_ms"] / row["decode_min_ms"]
                rows.append(row)
                print(json.dumps(row), flush=True)
        del llm
    report["load_average_at_end"] = os.getloadavg()
    out = ROOT / "results" / "verify_step.json"
    out.write_text(json.dumps(report, indent=2))
    print("->", out)


if __name__ == "__main__":
    main()
