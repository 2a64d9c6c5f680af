"""Decode ITL with and without a concurrent prefill load, in each serving mode: the property
disaggregation exists for. Per mode (`splitserve serve --prefill 0 --decode 0`, one engine; and
the default 1 prefill + 1 decode worker), started fresh on the demo model:

  * quiet:  `--concurrency` decode streams (short prompts, long outputs), nothing else;
  * loaded: the same streams while a second client sends long prompts wanting one token each
            (`--prefill-rate` req/s), so prefill work runs all through the decode streams.

Both clients are `splitserve bench`; only the decode streams' ITL / TPOT are compared. Writes
results/decode_itl_under_prefill.json and a PNG.

    python benchmarks/decode_itl_under_prefill.py [--only aggregated pd]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).parent))
from serve_vs_vllm import labelled_bars, serving  # noqa: E402  (same folder)


def bench_cmd(a, out: Path, *load: str) -> list[str]:
    return [sys.executable, "-m", "splitserve.cli.main", "bench", "--url", f"http://127.0.0.1:{a.port}", "--model", "demo",
            "--dataset", "random", "--seed", "0", "--out", str(out), "--no-plot", "-q", *load]


def measure(a, out_dir: Path, mode: str, loaded: bool) -> dict:
    name = f"{mode}_{'loaded' if loaded else 'quiet'}"
    decode_out = out_dir / f"{name}_decode.json"
    streams = bench_cmd(a, decode_out, "--concurrency", str(a.concurrency), "--num-requests", str(a.decode_requests),
                        "--input-len", str(a.decode_input_len), "--output-len", str(a.decode_output_len))
    prefill = None
    if loaded:
        prefill = subprocess.Popen(bench_cmd(a, out_dir / f"{name}_prefill.json", "--rate", str(a.prefill_rate),
                                             "--duration", "3600", "--input-len", str(a.prefill_input_len),
                                             "--output-len", "1"), cwd=ROOT, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
    try:
        subprocess.run(streams, cwd=ROOT, check=True, timeout=1800, stdout=subprocess.DEVNULL)
    finally:
        if prefill is not None:
            prefill.kill()
            prefill.wait()
    s = json.loads(decode_out.read_text())["summary"]
    return {"completed": s["completed"], "errors": s["errors"], "itl_ms": s["itl_ms"], "tpot_ms": s["tpot_ms"],
            "output_token_throughput": s["output_token_throughput"]}


def run_mode(a, mode: str, out_dir: Path) -> dict:
    with serving(a, a.model, mode, out_dir) as cmd:
        measure(a, out_dir, mode, loaded=False)  # warm-up: first steps, first shapes
        return {"command": cmd, "quiet": measure(a, out_dir, mode, False), "loaded": measure(a, out_dir, mode, True)}


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, q in zip(axes, ("p50", "p99")):
        labels, vals = [], []
        for mode, r in res.items():
            for phase in ("quiet", "loaded"):
                labels.append(f"{mode}\n{phase}")
                vals.append(r[phase]["itl_ms"][q])
        labelled_bars(ax, labels, vals, ["#9ecae1", "#3182bd", "#a1d99b", "#31a354"], f"decode ITL {q} (ms)")
    fig.suptitle("decode streams alone vs with a concurrent prefill load")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the demo model)")
    ap.add_argument("--only", nargs="+", default=["aggregated", "pd"], choices=["aggregated", "pd"])
    ap.add_argument("--port", type=int, default=8331)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--decode-requests", type=int, default=12)
    ap.add_argument("--decode-input-len", type=int, default=32)
    ap.add_argument("--decode-output-len", type=int, default=64)
    ap.add_argument("--prefill-rate", type=float, default=0.5)
    ap.add_argument("--prefill-input-len", type=int, default=512)
    ap.add_argument("--start-timeout-s", type=float, default=600)
    ap.add_argument("--out", default="results/decode_itl_under_prefill.json")
    a = ap.parse_args()
    a.splitserve_args, a.vllm_python, a.vllm_args = [], sys.executable, []  # what servers() reads
    if a.model is None:
        from splitserve.engine.model.demo import ensure_demo_model

        a.model = str(ensure_demo_model())
    out_dir = Path(tempfile.mkdtemp(prefix="decode_itl-"))
    res = {}
    for mode in a.only:
        res[mode] = run_mode(a, mode, out_dir)
        print(mode, json.dumps({p: res[mode][p]["itl_ms"] for p in ("quiet", "loaded")}), flush=True)
    from engine_throughput import machine

    out = ROOT / a.out
    out.parent.mkdir(parents=True, exist_ok=True)
    workload = {k: getattr(a, k) for k in ("concurrency", "decode_requests", "decode_input_len", "decode_output_len",
                                           "prefill_rate", "prefill_input_len")}
    out.write_text(json.dumps({"workload": workload, "machine": machine(), "logs": str(out_dir), "modes": res},
                              indent=1))
    plot(res, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
