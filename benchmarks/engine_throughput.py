"""Offline throughput: splitserve's engine vs Hugging Face `generate` on the same model and
workload — 64 requests, prompt lengths uniform in [64, 512], 128 new tokens, EOS ignored, fp32.

HF runs the way one gets the most out of it: left-padded batches (`--hf-batch-size`, default
all 64 at once), greedy, `min_new_tokens = max_new_tokens` so every row makes 128 tokens.
Writes one JSON object with both throughputs, the ratio and the machine.

    python benchmarks/engine_throughput.py [--model DIR] [--out results/engine_throughput.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch


def workload(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    # Ids from the body of the vocabulary: no special tokens in random prompts.
    return [torch.randint(100, vocab - 100, (n_,), generator=g).tolist() for n_ in lengths]


def run_splitserve(model: str, prompts, out_len: int, args) -> dict:
    from splitserve import LLM, SamplingParams

    llm = LLM(model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False)
    sp = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    dt = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    llm.engine.check_invariants()
    return {"seconds": dt, "output_tokens": n_out, "output_tok_s": n_out / dt,
            "total_tok_s": (n_out + sum(map(len, prompts))) / dt,
            "steps": llm.engine.stats().steps_total}


def run_hf(model: str, prompts, out_len: int, batch_size: int) -> dict:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0

    def gen(batch):
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            return hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=out_len,
                               min_new_tokens=out_len, pad_token_id=pad)[:, width:]

    gen(prompts[:2])  # warm-up
    t0 = time.perf_counter()
    n_out = 0
    for i in range(0, len(prompts), batch_size):
        n_out += gen(prompts[i:i + batch_size]).numel()
    dt = time.perf_counter() - t0
    return {"seconds": dt, "output_tokens": n_out, "output_tok_s": n_out / dt, "batch_size": batch_size}


def machine() -> dict:
    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF checkpoint dir (default: the demo model)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--out", default="results/engine_throughput.json")
    args = ap.parse_args()
    if args.model is None:
        from splitserve.engine.model.demo import ensure_demo_model

        args.model = str(ensure_demo_model())
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    prompts = workload(args.num_requests, args.min_len, args.max_len, vocab, args.seed)
    result = {"benchmark": "engine_throughput", "model": args.model, "num_requests": args.num_requests,
              "prompt_len": [args.min_len, args.max_len], "output_len": args.output_len, "dtype": args.dtype,
              "machine": machine()}
    result["splitserve"] = run_splitserve(args.model, prompts, args.output_len, args)
    print(json.dumps(result["splitserve"]), flush=True)
    if not args.skip_hf:
        result["hf_generate"] = run_hf(args.model, prompts, args.output_len, args.hf_batch_size)
        result["ratio"] = result["splitserve"]["output_tok_s"] / result["hf_generate"]["output_tok_s"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
