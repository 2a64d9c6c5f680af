"""Three independent load generators against the same server, in one run: our own
`splitserve bench`, NVIDIA's `aiperf` and `guidellm`, each sending the same closed-loop workload
(random prompts of `--input-len` tokens, `--output-len` output tokens with EOS ignored, streamed
/v1/completions, `--concurrency` clients, `--requests` requests after one shared warm-up) to

  * `splitserve serve --prefill 0 --decode 0`  (one in-process engine, no Ray), and
  * `splitserve serve`                          (the default: 1 prefill + 1 decode worker on Ray)

each started fresh on the demo model, checked ready, measured by the three tools one after the
other, stopped. Everything runs offline: aiperf and guidellm take the model directory as their
tokenizer. Writes results/load_generators.json (each tool's summary and where its raw output is)
and a PNG of TTFT and inter-token latency by tool and server.

What each tool calls what (the table in the README compares like with like):
  * TTFT — all three: request sent → first streamed token received.
  * per-request inter-token latency — splitserve bench `tpot_ms`, aiperf `inter_token_latency`,
    guidellm `inter_token_latency_ms`: (end-to-end − TTFT) / (output tokens − 1), per request,
    then its distribution over requests.
  * gaps between chunks — splitserve bench `itl_ms` (every gap of every request); aiperf's
    `inter_chunk_latency` is the same thing.
Token counts: splitserve bench and aiperf (`--use-server-token-count`) take the server's usage;
guidellm counts what it receives. Next to each tool's figures: what the server's own /metrics
recorded for the same requests (one yardstick for all three), and the CPU seconds the tool took.

aiperf and guidellm each live in a venv of their own (their pins differ from ours):

    python -m venv /tmp/venv-aiperf && /tmp/venv-aiperf/bin/pip install aiperf
    python -m venv /tmp/venv-guidellm && /tmp/venv-guidellm/bin/pip install guidellm
    python benchmarks/load_generators.py [--servers inprocess pd] [--tools splitserve aiperf guidellm]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import resource
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVERS = {"inprocess": ["--prefill", "0", "--decode", "0"], "pd": []}
TOOLS = ("splitserve", "aiperf", "guidellm")
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def ms(mean, p50, p90, p99) -> dict:
    return {"mean": mean, "p50": p50, "p90": p90, "p99": p99}


# -- the three clients: each returns {"ttft_ms", "request_itl_ms", "chunk_gap_ms"?, "completed", ...} --------
def bench_cmd(a, url: str, n: int, out: Path) -> list[str]:
    return [sys.executable, "-m", "splitserve.cli.main", "bench", "--url", url, "--model", "demo", "--dataset",
            "random", "--input-len", str(a.input_len), "--output-len", str(a.output_len), "--concurrency",
            str(a.concurrency), "--num-requests", str(n), "--seed", "0", "--out", str(out), "--no-plot", "-q"]


def run_splitserve(a, url: str, work: Path) -> dict:
    out = work / "splitserve_bench.json"
    cmd = bench_cmd(a, url, a.requests, out)
    subprocess.run(cmd, check=True, timeout=a.timeout_s)
    s = json.loads(out.read_text())["summary"]
    pick = lambda d: ms(d["mean"], d["p50"], d["p90"], d["p99"])  # noqa: E731
    return {"command": cmd, "raw": str(out), "completed": s["completed"], "errors": s["errors"] + s["rejected"],
            "ttft_ms": pick(s["ttft_ms"]), "request_itl_ms": pick(s["tpot_ms"]), "chunk_gap_ms": pick(s["itl_ms"]),
            "output_tok_s": s["output_token_throughput"]}


def run_aiperf(a, url: str, work: Path) -> dict:
    art = work / "aiperf"
    cmd = [str(Path(a.aiperf_venv) / "bin" / "aiperf"), "profile", "--model", "demo", "--url", url,
           "--endpoint-type", "completions", "--streaming", "--tokenizer", a.model,
           "--synthetic-input-tokens-mean", str(a.input_len), "--synthetic-input-tokens-stddev", "0",
           "--output-tokens-mean", str(a.output_len), "--output-tokens-stddev", "0", "--use-legacy-max-tokens",
           "--extra-inputs", "ignore_eos:true", "--use-server-token-count", "--concurrency", str(a.concurrency),
           "--request-count", str(a.requests), "--random-seed", "0",
           "--ui-type", "none", "--output-artifact-dir", str(art), "--no-auto-plot"]
    # Not HF_HUB_OFFLINE here: aiperf 0.13 then looks the tokenizer up in the hub's cache by repo id
    # and refuses a directory; given a directory, it loads it without the hub (none is reachable here).
    subprocess.run(cmd, check=True, timeout=a.timeout_s)
    raw = next(art.rglob("profile_export_aiperf.json"))
    d = json.loads(raw.read_text())
    pick = lambda m: ms(d[m]["avg"], d[m]["p50"], d[m]["p90"], d[m]["p99"])  # noqa: E731
    count = d.get("request_count", {}).get("avg")
    return {"command": cmd, "raw": str(raw), "completed": count, "errors": d.get("error_request_count", {}).get("avg", 0),
            "ttft_ms": pick("time_to_first_token"), "request_itl_ms": pick("inter_token_latency"),
            "chunk_gap_ms": pick("inter_chunk_latency") if "inter_chunk_latency" in d else None,
            "output_tok_s": d.get("output_token_throughput", {}).get("avg")}


def run_guidellm(a, url: str, work: Path) -> dict:
    out = work / "guidellm.json"
    cmd = [str(Path(a.guidellm_venv) / "bin" / "guidellm"), "run",
           "--backend", f"kind=openai_http,target={url},model=demo,request_format=/v1/completions",
           "--profile", f"kind=concurrent,streams={a.concurrency}",
           "--data", f"kind=synthetic_text,prompt_tokens={a.input_len},output_tokens={a.output_len}",
           "--tokenizer", f"kind=hf_auto,model={a.model}",
           "--constraint", f"kind=max_requests,count={a.requests}",
           "--output", f"kind=json,path={out}", "--disable-console-interactive"]
    subprocess.run(cmd, check=True, timeout=a.timeout_s, env={**os.environ, **OFFLINE})
    b = json.loads(out.read_text())["benchmarks"][0]
    m = b["metrics"]

    def pick(name: str) -> dict:
        d = m[name]["successful"]
        p = d["percentiles"]
        return ms(d["mean"], d["median"], p["p90"], p["p99"])

    totals = m["request_totals"] if "request_totals" in m else b.get("request_totals", {})
    return {"command": cmd, "raw": str(out), "completed": totals.get("successful"), "errors": totals.get("errored"),
            "ttft_ms": pick("time_to_first_token_ms"), "request_itl_ms": pick("inter_token_latency_ms"),
            "chunk_gap_ms": None, "output_tok_s": m["output_tokens_per_second"]["successful"]["mean"]}


CLIENTS = {"splitserve": run_splitserve, "aiperf": run_aiperf, "guidellm": run_guidellm}


def server_view(url: str) -> dict:
    """The server's own TTFT and TPOT sums and counts so far (its /metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    want = {"splitserve_time_to_first_token_seconds": "ttft", "splitserve_time_per_output_token_seconds": "tpot"}
    out = {}
    for fam in text_string_to_metric_families(text):
        if fam.name in want:
            for smp in fam.samples:
                if smp.name.endswith(("_sum", "_count")):
                    key = f"{want[fam.name]}_{smp.name.rsplit('_', 1)[1]}"
                    out[key] = out.get(key, 0.0) + smp.value
    return out


def run_tool(a, tool: str, url: str, d: Path) -> dict:
    """One tool's run, with what the server itself measured meanwhile (the same requests, one
    yardstick for all three: mean TTFT and mean per-request inter-token latency, ms) and the CPU
    seconds the tool's processes took (on a 2-core machine they share the cores with the server)."""
    before, cpu0 = server_view(url), resource.getrusage(resource.RUSAGE_CHILDREN)
    res = CLIENTS[tool](a, url, d)
    after, cpu1 = server_view(url), resource.getrusage(resource.RUSAGE_CHILDREN)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    res["server_seen"] = {"requests": delta.get("ttft_count"),
                          "ttft_ms_mean": 1e3 * delta["ttft_sum"] / delta["ttft_count"] if delta.get("ttft_count") else None,
                          "request_itl_ms_mean": 1e3 * delta["tpot_sum"] / delta["tpot_count"] if delta.get("tpot_count") else None}
    res["client_cpu_s"] = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
    return res


def measure(a, name: str, work: Path) -> dict:
    """The server `name` started fresh; each tool in turn against it."""
    from serve_vs_vllm import stop, wait_ready  # noqa: E402  (same folder)

    url = f"http://127.0.0.1:{a.port}"
    cmd = [sys.executable, "-m", "splitserve.cli.main", "serve", "--model", a.model, "--port", str(a.port),
           "--grpc-port", str(a.port + 1), "--served-model-name", "demo", *SERVERS[name]]
    log = open(work / f"{name}.log", "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    res = {"command": cmd, "tools": {}}
    try:
        wait_ready(f"{url}/ready", proc, a.start_timeout_s)
        # one warm-up for all three (none of them warms up here, so the server counts only their requests)
        subprocess.run(bench_cmd(a, url, 2, work / f"{name}-warmup.json"), check=True, timeout=a.timeout_s)
        for tool in a.tools:
            d = work / f"{name}-{tool}"
            d.mkdir()
            res["tools"][tool] = run_tool(a, tool, url, d)
            print(name, tool, json.dumps({k: v for k, v in res["tools"][tool].items() if k != "command"}), flush=True)
    finally:
        stop(proc)
    return res


def spread(res: dict, metric: str, stat: str) -> dict:
    """Per server: the tools' values of one statistic and how far apart they are (max / min − 1)."""
    out = {}
    for server, r in res.items():
        vals = {t: v[metric][stat] for t, v in r["tools"].items() if v.get(metric)}
        if len(vals) > 1:
            out[server] = {**vals, "spread": max(vals.values()) / min(vals.values()) - 1}
    return out


def plot(res: dict, path: Path) -> None:
    """Each tool's mean TTFT and ITL (bars) and what the server recorded for its requests (dots)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    panels = [("ttft_ms", "ttft_ms_mean", "TTFT mean (ms)"), ("request_itl_ms", "request_itl_ms_mean",
                                                              "inter-token latency mean (ms)")]
    for ax, (metric, seen, label) in zip(axes, panels):
        servers = list(res)
        tools = [t for t in TOOLS if any(t in res[s]["tools"] for s in servers)]
        for i, tool in enumerate(tools):
            xs = [j + (i - (len(tools) - 1) / 2) * 0.25 for j in range(len(servers))]
            runs = [res[s]["tools"].get(tool, {}) for s in servers]
            ax.bar(xs, [(r.get(metric) or {}).get("mean") or 0 for r in runs], 0.25, label=tool)
            ax.plot(xs, [(r.get("server_seen") or {}).get(seen) or 0 for r in runs], "k.", markersize=10,
                    label="the server's record" if i == 0 else None)
        ax.set_xticks(range(len(servers)), servers)
        ax.set_title(label)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the demo model)")
    ap.add_argument("--servers", nargs="+", default=list(SERVERS), choices=list(SERVERS))
    ap.add_argument("--tools", nargs="+", default=list(TOOLS), choices=list(TOOLS))
    ap.add_argument("--aiperf-venv", default="/tmp/venv-aiperf")
    ap.add_argument("--guidellm-venv", default="/tmp/venv-guidellm")
    ap.add_argument("--port", type=int, default=8331)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--start-timeout-s", type=float, default=600)
    ap.add_argument("--timeout-s", type=float, default=1200, help="per tool run")
    ap.add_argument("--out", default="results/load_generators.json")
    a = ap.parse_args()
    if a.model is None:
        from splitserve.engine.model.demo import ensure_demo_model

        a.model = str(ensure_demo_model())
    work = Path(tempfile.mkdtemp(prefix="load_generators-"))
    res = {name: measure(a, name, work) for name in a.servers}
    from engine_throughput import machine  # noqa: E402  (same folder)

    out = ROOT / a.out
    out.parent.mkdir(parents=True, exist_ok=True)
    agree = {f"{m}.{s}": spread(res, m, s) for m in ("ttft_ms", "request_itl_ms") for s in ("mean", "p50")}
    out.write_text(json.dumps({"workload": {k: getattr(a, k) for k in ("input_len", "output_len", "concurrency",
                                                                       "requests")},
                               "machine": machine(), "work_dir": str(work), "agreement": agree, "servers": res},
                              indent=1))
    plot(res, out.with_suffix(".png"))
    print(json.dumps(agree, indent=1))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
