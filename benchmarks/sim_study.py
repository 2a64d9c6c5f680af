"""Where disaggregation wins: goodput per GPU at 90% attainment of TTFT 1 s / TPOT 50 ms, on a
simulated H200 (roofline) serving Llama-3-8B, for the Mooncake conversation and synthetic traces.

Per trace (its first `--requests` requests, the rate multiplied until 90% no longer meet both
SLOs, DistServe's method), at `--gpus` GPUs:

  aggregated   every GPU prefills and decodes (cache-aware router); the token budget per step
               decides how much a long prompt's chunk slows the decodes sharing its step, so
               each of 512 / 1024 / 2048 is searched and the best kept
  pd           every static prefill:decode split (cache-aware router, PD decider), the best kept
  autoscaler   the pools sized by our autoscaler (bounds 1..GPUS each, from half and half),
               goodput per GPU over the GPUs it held on average

Writes results/sim_study.json and results/sim_study.png.

    python benchmarks/sim_study.py [--traces conversation synthetic] [--gpus 8] [--requests 2000]
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from splitserve.autoscale import AutoscaleConfig, Bounds  # noqa: E402
from splitserve.sim import search  # noqa: E402
from splitserve.sim.cost.hardware import gpu  # noqa: E402
from splitserve.sim.cost.roofline import RooflineCost  # noqa: E402
from splitserve.sim.cost.shapes import model_shape  # noqa: E402
from splitserve.sim.report import summarize  # noqa: E402
from splitserve.sim.simulation import SimConfig, Simulation  # noqa: E402
from splitserve.sim.workload import from_trace  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "mooncake"
TTFT_MS, TPOT_MS = 1000.0, 50.0


def search_one(job: tuple) -> dict:
    trace, requests, name, cfg_kw, iters = job
    w = from_trace(DATA / f"{trace}_trace.jsonl", requests)
    cost = RooflineCost(gpu("h200"), model_shape("llama-3-8b"))
    base = dict(block_size=64, ttft_slo_ms=TTFT_MS, tpot_slo_ms=TPOT_MS)
    cfg = SimConfig(**{**base, **cfg_kw})
    last: dict = {}

    def run(scale: float) -> dict:
        s = summarize(Simulation(cfg, cost, w.scaled(scale)).run())
        last[scale] = {k: s[k] for k in ("gpus", "slo_attainment", "ttft_ms", "tpot_ms", "prefix_hit_rate",
                                         "disaggregated_share", "pool_sizes", "busy_share")}
        return s

    res = search.goodput(run, start=1.0, iters=iters)
    at = last.get(res["rate_scale"], {})
    return {"trace": trace, "name": name, "config": {k: str(v) for k, v in cfg_kw.items()}, **res,
            "at_best": {k: v for k, v in at.items() if k != "pool_sizes"},
            "pool_sizes_at_best": at.get("pool_sizes", [])[-40:]}


def jobs(trace: str, gpus: int, requests: int, iters: int) -> list[tuple]:
    out = []
    for budget in (512, 1024, 2048):
        out.append((trace, requests, f"aggregated/{budget}", dict(prefill=0, decode=gpus, max_num_batched_tokens=budget), iters))
    for p in range(1, gpus):
        out.append((trace, requests, f"pd/{p}:{gpus - p}", dict(prefill=p, decode=gpus - p), iters))
    auto = AutoscaleConfig(prefill=Bounds(1, gpus), decode=Bounds(1, gpus), interval_s=2.0, ttft_slo_s=TTFT_MS / 1e3,
                           tpot_slo_s=TPOT_MS / 1e3, up_cooldown_s=6.0, down_cooldown_s=30.0, window_s=10.0,
                           rate_window_s=6.0)
    out.append((trace, requests, "autoscaler", dict(prefill=gpus // 2, decode=gpus - gpus // 2, autoscale=auto,
                                                    worker_start_s=10.0), iters))
    return out


def summarize_trace(rows: list[dict]) -> dict:
    def best(prefix: str) -> dict | None:
        rs = [r for r in rows if r["name"].startswith(prefix)]
        return max(rs, key=lambda r: r["goodput_rps_per_gpu"], default=None)

    agg, pd, auto = best("aggregated"), best("pd/"), best("autoscaler")
    ratio = lambda r: r["goodput_rps_per_gpu"] / agg["goodput_rps_per_gpu"] if agg and agg["goodput_rps_per_gpu"] else None  # noqa: E731
    return {"aggregated": agg and agg["name"], "aggregated_goodput_per_gpu": agg and agg["goodput_rps_per_gpu"],
            "best_pd": pd and pd["name"], "best_pd_goodput_per_gpu": pd and pd["goodput_rps_per_gpu"],
            "autoscaler_goodput_per_gpu": auto and auto["goodput_rps_per_gpu"],
            "pd_over_aggregated": pd and ratio(pd), "autoscaler_over_aggregated": auto and ratio(auto)}


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = list(res["traces"])
    fig, axes = plt.subplots(1, len(traces), figsize=(7 * len(traces), 4), squeeze=False)
    for ax, t in zip(axes[0], traces):
        rows = res["traces"][t]["rows"]
        names = [r["name"] for r in rows]
        colors = ["tab:gray" if n.startswith("agg") else "tab:green" if n == "autoscaler" else "tab:blue" for n in names]
        ax.bar(range(len(rows)), [r["goodput_rps_per_gpu"] for r in rows], color=colors)
        ax.set_xticks(range(len(rows)), names, rotation=60, ha="right", fontsize=8)
        ax.set(title=f"{t}: goodput per GPU at 90% of TTFT {TTFT_MS:g} ms / TPOT {TPOT_MS:g} ms",
               ylabel="req/s per GPU")
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", nargs="+", default=["conversation", "synthetic"])
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--iters", type=int, default=5, help="bisection steps after the doubling (default 5)")
    ap.add_argument("--workers", type=int, default=2, help="searches run in parallel (default 2)")
    ap.add_argument("--out", default=str(ROOT / "results" / "sim_study.json"))
    a = ap.parse_args()
    out = Path(a.out)
    res = {"gpu": "h200", "model": "llama-3-8b", "gpus": a.gpus, "requests": a.requests,
           "slo": {"ttft_ms": TTFT_MS, "tpot_ms": TPOT_MS, "attainment": 0.9}, "traces": {}}
    with ProcessPoolExecutor(a.workers) as pool:
        for t in a.traces:
            rows = list(pool.map(search_one, jobs(t, a.gpus, a.requests, a.iters)))
            res["traces"][t] = {"summary": summarize_trace(rows), "rows": rows}
            print(t, json.dumps(res["traces"][t]["summary"]), flush=True)
            out.write_text(json.dumps(res, indent=2) + "\n")
    plot(res, out.with_suffix(".png"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
