"""The host-memory KV tier on a shared-prefix workload whose working set is 3× the device pool:
`--groups` system prompts of `--prefix` tokens (together 3× `--device-blocks` blocks), each asked
`--rounds` times round robin with a fresh question, one request at a time. Without the tier a
group's blocks are evicted before it comes round again; with it they are loaded back. Same
engine, same requests, both runs in one process: prefix-hit tokens, host-hit tokens, mean / p50 /
p90 TTFT (add → first token), and the outputs must be equal. Writes results/host_tier.json.

    python benchmarks/host_tier.py [--model DIR] [--device-blocks 256] [--prefix 512]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine_throughput import machine  # noqa: E402


def workload(groups: int, rounds: int, prefix: int, question: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    heads = [torch.randint(100, vocab - 100, (prefix,), generator=g).tolist() for _ in range(groups)]
    return [heads[i % groups] + torch.randint(100, vocab - 100, (question,), generator=g).tolist()
            for i in range(groups * rounds)]


def run(model: str, prompts: list[list[int]], device_blocks: int, host_blocks: int, dtype: str) -> dict:
    from splitserve import LLM, SamplingParams
    from splitserve.types import Request

    llm = LLM(model, dtype=dtype, num_kv_blocks=device_blocks, host_kv_blocks=host_blocks)
    eng = llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ttft, outs = [], []
    for i, p in enumerate(prompts):
        t0 = time.perf_counter()
        eng.add_request(Request(f"r{i}", p, sp))
        first, toks = None, []
        while eng.has_unfinished():
            for c in eng.step():
                if c.token_ids and first is None:
                    first = time.perf_counter() - t0
                toks += c.token_ids
        eng.check_invariants()
        ttft.append(first)
        outs.append(toks)
    s = eng.stats()
    ms = sorted(t * 1e3 for t in ttft)
    return {"host_kv_blocks": host_blocks, "prompt_tokens": sum(map(len, prompts)),
            "prefix_hit_tokens": s.prefix_hit_tokens_total, "host_hit_tokens": s.host_hit_tokens_total,
            "ttft_ms": {"mean": statistics.fmean(ms), "p50": ms[len(ms) // 2], "p90": ms[int(len(ms) * 0.9)]},
            "outputs": outs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device-blocks", type=int, default=256)
    ap.add_argument("--prefix", type=int, default=512, help="tokens per shared system prompt")
    ap.add_argument("--question", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="results/host_tier.json")
    a = ap.parse_args()
    if a.model is None:
        from splitserve.engine.model.demo import ensure_demo_model

        a.model = str(ensure_demo_model())
    vocab = json.loads((Path(a.model) / "config.json").read_text())["vocab_size"]
    groups = 3 * a.device_blocks * 16 // a.prefix  # the prefixes' working set: 3× the device pool
    prompts = workload(groups, a.rounds, a.prefix, a.question, vocab)
    host_blocks = 4 * a.device_blocks
    without = run(a.model, prompts, a.device_blocks, 0, a.dtype)
    with_tier = run(a.model, prompts, a.device_blocks, host_blocks, a.dtype)
    same = without.pop("outputs") == with_tier.pop("outputs")
    res = {"benchmark": "host_tier", "model": a.model, "dtype": a.dtype, "device_blocks": a.device_blocks,
           "groups": groups, "prefix_tokens": a.prefix, "rounds": a.rounds, "requests": len(prompts),
           "without_tier": without, "with_tier": with_tier, "outputs_equal": same,
           "hit_ratio": with_tier["prefix_hit_tokens"] / max(1, without["prefix_hit_tokens"]),
           "ttft_ratio": with_tier["ttft_ms"]["mean"] / without["ttft_ms"]["mean"], "machine": machine()}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "machine"}, indent=1))


if __name__ == "__main__":
    main()
