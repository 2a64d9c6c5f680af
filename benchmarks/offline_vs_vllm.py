"""Offline throughput against vLLM's CPU engine, both dtypes, in one run: engine_throughput.py's
workload (64 requests, prompts 64–512 tokens, 128 new tokens, EOS ignored) through splitserve's
engine here and through vLLM (vllm_cpu_throughput.py, in vLLM's own venv, its defaults: it keeps
one of the cores for its front end) one after the other, never at once. Writes
results/offline_vs_vllm.json: tok/s of each, the ratios, the CPU's model and its flags that
matter for bf16 (avx512_bf16, amx_bf16).

    python benchmarks/offline_vs_vllm.py --vllm-python /tmp/vllmenv/bin/python [--dtypes bfloat16 float32]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def cpu_flags() -> list[str]:
    try:
        line = next(ln for ln in open("/proc/cpuinfo") if ln.startswith("flags"))
    except (OSError, StopIteration):
        return []
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "amx_int8")
    return [f for f in line.split(":", 1)[1].split() if f in wanted]


def run(cmd: list[str], out: Path, env: dict | None = None) -> dict:
    subprocess.run(cmd, check=True, env={**os.environ, **(env or {})}, timeout=3600)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", default="/tmp/vllmenv/bin/python")
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--out", default="results/offline_vs_vllm.json")
    a = ap.parse_args()
    if a.model is None:
        from splitserve.engine.model.demo import ensure_demo_model

        a.model = str(ensure_demo_model())
    tmp = Path(tempfile.mkdtemp(prefix="offline_vs_vllm-"))
    rows = {}
    for dtype in a.dtypes:
        ours, theirs = tmp / f"splitserve-{dtype}.json", tmp / f"vllm-{dtype}.json"
        s = run([sys.executable, str(HERE / "engine_throughput.py"), "--model", a.model, "--dtype", dtype,
                 "--skip-hf", "--out", str(ours)], ours)
        v = run([a.vllm_python, str(HERE / "vllm_cpu_throughput.py"), "--model", a.model, "--dtype", dtype,
                 "--out", str(theirs)], theirs, {"VLLM_CPU_KVCACHE_SPACE": "2"})
        rows[dtype] = {"splitserve_tok_s": s["splitserve"]["output_tok_s"], "vllm_tok_s": v["output_tok_s"],
                       "ratio": s["splitserve"]["output_tok_s"] / v["output_tok_s"], "vllm": v["vllm"]}
        print(dtype, json.dumps(rows[dtype]), flush=True)
    machine = s["machine"]
    res = {"benchmark": "offline_vs_vllm", "model": a.model, "workload": "64 req, prompts 64-512, 128 out, EOS ignored",
           "results": rows, "machine": {**machine, "cpu_flags": cpu_flags()}}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
