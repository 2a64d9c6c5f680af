"""Issue 4's two router measurements, end to end: `splitserve serve` (demo model, Ray, Serve
ingress) driven by `splitserve bench` over the OpenAI streaming API, each server in its own
subprocess, numbers read from the bench JSON and the server's /metrics.

  prefix    2 prefill + 1 decode workers, shared-prefix workload (8 groups × 8 prompts, 512-token
            system prompt, 64-token questions): prefix-cache hit tokens / query tokens from
            /metrics, as a fraction of the analytic maximum (every prompt but the first of its
            group reuses the whole system prompt), `cache_aware` vs `round_robin`.
  overload  1 prefill + 1 decode worker, Poisson arrivals well above capacity, a TTFT SLO: the
            share of requests refused (429) and the share of admitted ones that met the SLO,
            admission on vs off.

    python benchmarks/router_acceptance.py prefix   [--out results/router_prefix.json]
    python benchmarks/router_acceptance.py overload [--rate 4 --ttft-slo-ms 2000 --num-requests 120]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

MODEL = "SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(*flags: str):
    """`splitserve serve` with these flags, up and ready; yields its base URL."""
    port, gport = free_port(), free_port()
    log = open(f"/tmp/splitserve-acceptance-{port}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "splitserve.cli.main", "serve", "--port", str(port),
                             "--grpc-port", str(gport), *flags], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"splitserve serve exited with {proc.returncode}; see {log.name}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            time.sleep(1)
        else:
            raise RuntimeError(f"splitserve serve not ready after 300 s; see {log.name}")
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def bench(url: str, out: Path, *flags: str) -> dict:
    subprocess.run([sys.executable, "-m", "splitserve.cli.main", "bench", "--url", url, "--model", MODEL,
                    "--vocab-size", "49152", "--out", str(out), "-q", *flags], check=True)
    return json.loads(out.read_text())


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(rf"^{name} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def run_prefix(args: argparse.Namespace) -> dict:
    groups, per, sys_len, q_len = 8, 8, 512, 64
    analytic = groups * (per - 1) * sys_len / (groups * per * (sys_len + q_len))
    out = {"workload": {"groups": groups, "prompts_per_group": per, "system_prompt_len": sys_len,
                        "question_len": q_len, "concurrency": args.concurrency},
           "analytic_max_hit_rate": analytic}
    for policy in ("cache_aware", "round_robin"):
        with server("--prefill", "2", "--decode", "1", "--policy", policy, "--no-admission") as url:
            res = bench(url, Path(args.out).with_name(f"router_prefix_bench_{policy}.json"),
                        "--dataset", "shared-prefix", "--num-groups", str(groups), "--prompts-per-group", str(per),
                        "--system-prompt-len", str(sys_len), "--question-len", str(q_len), "--output-len", "4",
                        "--concurrency", str(args.concurrency))
            hit, query = metric(url, "splitserve_prefix_cache_hit_tokens_total"), metric(
                url, "splitserve_prefix_cache_query_tokens_total")
        rate = hit / query if query else 0.0
        out[policy] = {"hit_tokens": hit, "query_tokens": query, "hit_rate": rate,
                       "fraction_of_analytic": rate / analytic, "completed": res["summary"]["completed"]}
        print(f"{policy}: hit rate {rate:.3f} = {rate / analytic:.1%} of the analytic {analytic:.3f}", flush=True)
    return out


def run_overload(args: argparse.Namespace) -> dict:
    out = {"workload": {"rate": args.rate, "num_requests": args.num_requests, "ttft_slo_ms": args.ttft_slo_ms,
                        "input_len": args.input_len, "output_len": args.output_len}}
    for mode, flags in (("admission", ()), ("no_admission", ("--no-admission",))):
        if mode not in args.modes:
            continue
        with server("--ttft-slo-ms", str(args.ttft_slo_ms), *flags) as url:
            res = bench(url, Path(args.out).with_name(f"router_overload_bench_{mode}.json"),
                        "--dataset", "random", "--rate", str(args.rate), "--num-requests", str(args.num_requests),
                        "--input-len", *map(str, args.input_len), "--output-len", str(args.output_len),
                        "--ttft-slo-ms", str(args.ttft_slo_ms), "--seed", "1")
        s = res["summary"]
        out[mode] = {"sent": s["num_requests"], "rejected_429": s["rejected"], "completed": s["completed"],
                     "errors": s["errors"], "admitted_meeting_ttft_slo": s["slo_attainment"],
                     "ttft_ms": s["ttft_ms"], "goodput_req_s": s["goodput"]}
        print(f"{mode}: {s['rejected']}/{s['num_requests']} rejected; admitted within the TTFT SLO: "
              f"{s['slo_attainment']:.1%}; TTFT p50 {s['ttft_ms']['p50']:.0f} ms p90 {s['ttft_ms']['p90']:.0f} ms",
              flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("prefix", "overload"))
    p.add_argument("--out", default=None)
    p.add_argument("--concurrency", type=int, default=4, help="prefix: closed-loop clients")
    p.add_argument("--rate", type=float, default=4.0, help="overload: Poisson req/s")
    p.add_argument("--num-requests", type=int, default=120)
    p.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    p.add_argument("--input-len", type=int, nargs=2, default=[128, 512])
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--modes", nargs="+", default=["admission", "no_admission"], help="overload: which runs")
    args = p.parse_args()
    args.out = args.out or f"results/router_{args.what}.json"
    result = run_prefix(args) if args.what == "prefix" else run_overload(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
