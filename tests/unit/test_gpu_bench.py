"""The one-shot GPU script (benchmarks/gpu/bench_gpu.py) runs end to end in its --smoke mode:
tiny shapes on CPU under the Triton interpreter, every section (kernels checked against their
references, decode over triton-graph / triton-eager / torch, a verify step, a draft head's update and chain, prefill, the host KV tier's save and
promote, a streamed piece's publish cost), JSON written, no error —
in a fresh interpreter where the packages the GPU machine lacks (Ray, PyYAML, ...) cannot be
imported."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "bench_gpu.py"


# what the GPU machine has is torch, triton and numpy; none of these
ABSENT_THERE = ["ray", "yaml", "xxhash", "transformers", "tokenizers", "safetensors", "grpc", "starlette",
                "uvicorn", "httpx", "nixl", "gguf", "prometheus_client", "matplotlib", "openai"]


def test_gpu_bench_smoke(tmp_path):
    out = tmp_path / "gpu.json"
    block = "; ".join(f"sys.modules[{m!r}] = None" for m in ABSENT_THERE)  # import m -> ImportError
    code = (f"import runpy, sys; {block}; sys.argv = ['bench_gpu.py', '--smoke', '--out', {str(out)!r}]; "
            f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["errors"] == [], res["errors"]
    k = res["kernels"]
    assert k["decode"]["max_abs_err"] < 1e-4 and k["prefill"]["max_abs_err"] < 1e-4
    assert k["store_kv"]["exact"] and k["pack_blocks"]["exact"]
    assert k["rms_norm_residual"]["max_abs_err"] < 1e-5 and k["rotary"]["max_abs_err"] < 1e-5
    modes = {(r["backend"], r["mode"]) for r in res["decode"]}
    assert modes == {("triton", "graph"), ("triton", "eager"), ("torch", "eager")}
    assert len(res["decode"]) == 2 * 2 * 3 and all(r["step_ms"] > 0 and r["bytes_read"] > 0 for r in res["decode"])
    (verify,) = res["verify"]  # a verify step of 2 sequences x (1 + 2) rows vs their decode step
    assert (verify["batch"], verify["k"]) == (2, 2) and verify["verify_ms"] > 0 and verify["decode_ms"] > 0
    draft = res["draft"]  # an EAGLE head's update and chains of 2 and 4 proposals vs the decode step
    assert [(r["batch"], r["k"]) for r in draft] == [(2, 2), (2, 4)]
    assert all(r["update_ms"] > 0 and r["chain_ms"] > 0 and r["decode_ms"] > 0 for r in draft)
    streaming = res["streaming"]  # a streamed piece's checksum and copies, per prefill chunk
    assert [r["tokens"] for r in streaming] == [32, 64]
    assert all(r["checksum_s"] > 0 and r["to_pinned_host_gb_per_s"] > 0 and r["device_to_device_gb_per_s"] > 0
               for r in streaming)
    (tp,) = res["tp"]  # the model over 2 ranks (gloo here, NCCL on GPUs), each with 1 of the 2 KV heads
    assert tp["tp"] == 2 and tp["kv_heads_per_rank"] == 1
    assert [r["batch"] for r in tp["decode"]] == [1, 2] and all(r["step_ms"] > 0 for r in tp["decode"])
    assert tp["prefill"]["seconds"] > 0
    assert {(r["tokens"], r["backend"]) for r in res["prefill"]} == {(16, "triton"), (16, "torch"),
                                                                      (32, "triton"), (32, "torch")}
    assert res["copy"]["gb_per_s"] > 0
    assert [r["fused"] for r in res["fused_ablation"]] == [True, False]
    assert all(r["decode_step_ms"] > 0 and r["prefill_ms"] > 0 for r in res["fused_ablation"])
    ht = res["host_tier"]
    assert ht["exact"] and ht["blocks"] > 0 and ht["save_gb_per_s"] > 0 and ht["promote_gb_per_s"] > 0
