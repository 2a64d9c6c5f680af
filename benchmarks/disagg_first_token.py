"""When does the caller get its first token on the disaggregated path? Per request, on a local
Ray cluster (1 prefill + 1 decode worker, the demo model): (prefill worker sampled the first
token → the caller has it) and (caller has the first token → the caller has the second, which
includes pulling the KV). Requests run one at a time so the numbers are latencies, not queueing.

    python benchmarks/disagg_first_token.py [--transports shm tcp] [--prompt-len 512]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--transports", nargs="+", default=["shm", "tcp", "nixl"])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--out", default="results/disagg_first_token.json")
    a = ap.parse_args()
    import ray

    from splitserve import SamplingParams
    from splitserve.orchestrator import Cluster

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (a.prompt_len,), generator=g).tolist() for _ in range(a.requests)]
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    results = []
    for t in a.transports:
        try:
            c = Cluster.start(model=a.model, transport=t, disagg_min_tokens=0, kv_cache_memory_gib=0.5)
        except Exception as e:  # e.g. nixl not installed
            results.append({"transport": t, "error": str(e)[:200]})
            continue
        with c:
            c.generate(prompts[:1], sp)  # warm-up
            c.timings.clear()
            for p in prompts:
                c.generate([p], sp)
            first = [x.prefill_done_to_first_token_s * 1e3 for x in c.timings]
            second = [x.first_to_second_token_s * 1e3 for x in c.timings]
            results.append({"transport": t, "prompt_len": a.prompt_len,
                            "prefill_done_to_first_token_ms_p50": statistics.median(first),
                            "first_to_second_token_ms_p50": statistics.median(second)})
        print(json.dumps(results[-1]), flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
