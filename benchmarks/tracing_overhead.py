"""What tracing costs (issue 33): the same load through a 1P+1D cluster of the demo model with
tracing off and on (sample ratio 1.0, exporting every span to an in-process OTLP receiver),
clusters started in turn off, on, off, on...: requests per second and output tokens per second
of `--requests` concurrent completions over the HTTP ingress (in this process), and how many
spans arrived. Writes results/tracing_overhead.json.

    python benchmarks/tracing_overhead.py [--requests 16] [--max-tokens 32] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from splitserve import tracing  # noqa: E402
from splitserve.ingress.http import OpenAIServer  # noqa: E402
from splitserve.orchestrator import Cluster  # noqa: E402
from tests.otlp_receiver import OTLPReceiver  # noqa: E402


def run_once(model: str, endpoint: str | None, n: int, max_tokens: int) -> dict:
    with Cluster.start(model=model, transport="tcp", disagg_min_tokens=0, pd_decider="threshold",
                       otlp_traces_endpoint=endpoint) as c:
        app = OpenAIServer(c.backend).app

        async def one(h, i):
            r = await h.post("/v1/completions", json={"model": c.backend.model_name, "prompt": f"Request {i}: tell me",
                                                      "max_tokens": max_tokens, "ignore_eos": True})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["completion_tokens"]

        async def load():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                         timeout=600) as h:
                await one(h, -1)  # warm-up
                started = time.perf_counter()
                tokens = await asyncio.gather(*(one(h, i) for i in range(n)))
                return time.perf_counter() - started, sum(tokens)

        took, tokens = c.run(load())
    tracing.shutdown()  # flushes this process's spans; the workers' went with them
    return {"seconds": took, "requests_per_s": n / took, "output_tokens_per_s": tokens / took}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="results/tracing_overhead.json")
    a = ap.parse_args()
    import ray

    from splitserve.engine.model.demo import ensure_demo_model

    model = a.model or str(ensure_demo_model())
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    receiver = OTLPReceiver().start()
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    try:
        for _ in range(a.rounds):
            runs["off"].append(run_once(model, None, a.requests, a.max_tokens))
            runs["on"].append(run_once(model, receiver.endpoint, a.requests, a.max_tokens))
            print(json.dumps({k: v[-1] for k, v in runs.items()}), flush=True)
    finally:
        receiver.stop()
    med = {k: statistics.median(r["output_tokens_per_s"] for r in v) for k, v in runs.items()}
    out = {"requests": a.requests, "max_tokens": a.max_tokens, "rounds": a.rounds, "runs": runs,
           "median_output_tokens_per_s": med, "overhead": 1 - med["on"] / med["off"],
           "spans_received": len(receiver.spans), "services": sorted({s.service for s in receiver.spans})}
    Path(a.out).write_text(json.dumps(out, indent=2))
    print(json.dumps({k: out[k] for k in ("median_output_tokens_per_s", "overhead", "spans_received", "services")}))


if __name__ == "__main__":
    main()
