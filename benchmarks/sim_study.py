"""Where disaggregation wins: goodput per GPU at 90% attainment of a TTFT target and TPOT 50 ms, on
a simulated H200 (roofline) serving Llama-3-8B, for the Mooncake conversation and synthetic traces.
The issue's TTFT target is 1 s; one H200 prefills ~27K tokens of Llama-3-8B in about 1 s at these
efficiencies, and a tenth of the conversation prompts (a sixth of the synthetic ones) are longer,
so 90% within 1 s is out of reach for any rate without parallelism inside a prefill (the best
attainment each configuration reached is reported); 3 s is studied as well.

Per trace (its first `--requests` requests, the rate multiplied until 90% no longer meet both
SLOs, DistServe's method), at `--gpus` GPUs:

  aggregated   every GPU prefills and decodes (cache-aware router); the token budget per step
               decides how much a long prompt's chunk slows the decodes sharing its step, so
               each of 512 / 1024 / 2048 is searched and the best kept
  pd           every static prefill:decode split (cache-aware router, PD decider), the best kept
  autoscaler   the pools sized by our autoscaler (bounds 1..GPUS each, from half and half),
               goodput per GPU over the GPUs it held on average

Writes results/sim_study.json and results/sim_study.png.

    python benchmarks/sim_study.py [--traces conversation synthetic] [--ttft-slo-ms 1000 3000] [--gpus 8]
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from splitserve.control.autoscale import AutoscaleConfig, Bounds  # noqa: E402
from splitserve.sim import search  # noqa: E402
from splitserve.sim.cost.hardware import gpu  # noqa: E402
from splitserve.sim.cost.roofline import RooflineCost  # noqa: E402
from splitserve.sim.cost.shapes import model_shape  # noqa: E402
from splitserve.sim.report import summarize  # noqa: E402
from splitserve.sim.simulation import SimConfig, Simulation  # noqa: E402
from splitserve.sim.workload import from_trace  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "mooncake"
TPOT_MS = 50.0


def search_one(job: tuple) -> dict:
    trace, requests, name, cfg_kw, iters, ttft_ms = job
    w = from_trace(DATA / f"{trace}_trace.jsonl", requests)
    cost = RooflineCost(gpu("h200"), model_shape("llama-3-8b"))
    base = dict(block_size=64, ttft_slo_ms=ttft_ms, tpot_slo_ms=TPOT_MS)
    cfg = SimConfig(**{**base, **cfg_kw})
    last: dict = {}

    def run(scale: float) -> dict:
        s = summarize(Simulation(cfg, cost, w.scaled(scale)).run())
        last[scale] = {k: s[k] for k in ("gpus", "slo_attainment", "ttft_ms", "tpot_ms", "prefix_hit_rate",
                                         "disaggregated_share", "pool_sizes", "busy_share")}
        return s

    res = search.goodput(run, start=1.0, iters=iters, min_scale=1 / 8)
    at = last.get(res["rate_scale"], {})
    return {"trace": trace, "name": name, "ttft_slo_ms": ttft_ms, "config": {k: str(v) for k, v in cfg_kw.items()}, **res,
            "at_best": {k: v for k, v in at.items() if k != "pool_sizes"},
            "pool_sizes_at_best": at.get("pool_sizes", [])[-40:]}


def jobs(trace: str, gpus: int, requests: int, iters: int, ttft_ms: float) -> list[tuple]:
    out = []
    for budget in (512, 1024, 2048):
        out.append(dict(prefill=0, decode=gpus, max_num_batched_tokens=budget))
    for p in range(1, gpus):
        out.append(dict(prefill=p, decode=gpus - p))
    auto = AutoscaleConfig(prefill=Bounds(1, gpus), decode=Bounds(1, gpus), interval_s=2.0, ttft_slo_s=ttft_ms / 1e3,
                           tpot_slo_s=TPOT_MS / 1e3, up_cooldown_s=6.0, down_cooldown_s=30.0, window_s=10.0,
                           rate_window_s=6.0)
    out.append(dict(prefill=gpus // 2, decode=gpus - gpus // 2, autoscale=auto, worker_start_s=10.0))
    return [(trace, requests, _name(kw), kw, iters, ttft_ms) for kw in out]


def _name(kw: dict) -> str:
    if "autoscale" in kw:
        return "autoscaler"
    if kw["prefill"] == 0:
        return f"aggregated/{kw['max_num_batched_tokens']}"
    return f"pd/{kw['prefill']}:{kw['decode']}"


def summarize_trace(rows: list[dict]) -> dict:
    def best(prefix: str) -> dict | None:
        rs = [r for r in rows if r["name"].startswith(prefix)]
        return max(rs, key=lambda r: r["goodput_rps_per_gpu"], default=None)

    agg, pd, auto = best("aggregated"), best("pd/"), best("autoscaler")
    ratio = lambda r: r["goodput_rps_per_gpu"] / agg["goodput_rps_per_gpu"] if agg and agg["goodput_rps_per_gpu"] else None  # noqa: E731
    return {"aggregated": agg and agg["name"], "aggregated_goodput_per_gpu": agg and agg["goodput_rps_per_gpu"],
            "best_pd": pd and pd["name"], "best_pd_goodput_per_gpu": pd and pd["goodput_rps_per_gpu"],
            "autoscaler_goodput_per_gpu": auto and auto["goodput_rps_per_gpu"],
            "pd_over_aggregated": pd and ratio(pd), "autoscaler_over_aggregated": auto and ratio(auto),
            "best_attainment_seen": {g: max((r["best_attainment_seen"] for r in rows if r["name"].startswith(g)),
                                            default=None) for g in ("aggregated", "pd/", "autoscaler")}}


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(res["traces"])
    fig, axes = plt.subplots(1, len(keys), figsize=(6 * len(keys), 4), squeeze=False)
    for ax, t in zip(axes[0], keys):
        rows = res["traces"][t]["rows"]
        names = [r["name"] for r in rows]
        colors = ["tab:gray" if n.startswith("agg") else "tab:green" if n == "autoscaler" else "tab:blue" for n in names]
        ax.bar(range(len(rows)), [r["goodput_rps_per_gpu"] for r in rows], color=colors)
        ax.set_xticks(range(len(rows)), names, rotation=60, ha="right", fontsize=8)
        ax.set(title=f"{t}: goodput/GPU, 90% within TTFT / TPOT {TPOT_MS:g} ms", ylabel="req/s per GPU")
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", nargs="+", default=["conversation", "synthetic"])
    ap.add_argument("--ttft-slo-ms", type=float, nargs="+", default=[1000.0, 3000.0],
                    help="TTFT targets to study (default: the issue's 1 s, and 3 s)")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--iters", type=int, default=4, help="bisection steps after the doubling (default 4)")
    ap.add_argument("--workers", type=int, default=2, help="searches run in parallel (default 2)")
    ap.add_argument("--out", default=str(ROOT / "results" / "sim_study.json"))
    a = ap.parse_args()
    out = Path(a.out)
    res = {"gpu": "h200", "model": "llama-3-8b", "gpus": a.gpus, "requests": a.requests, "block_size": 64,
           "slo": {"tpot_ms": TPOT_MS, "attainment": 0.9, "ttft_ms": a.ttft_slo_ms}, "traces": {}}
    if out.exists():  # go on from a run that stopped: what it finished stays
        done = json.loads(out.read_text())
        if all(done.get(k) == res[k] for k in ("gpus", "requests", "block_size")):
            res["traces"] = done["traces"]
    with ProcessPoolExecutor(a.workers) as pool:
        for ttft in a.ttft_slo_ms:
            for t in a.traces:
                if f"{t}@ttft{ttft:g}ms" in res["traces"]:
                    continue
                rows = list(pool.map(search_one, jobs(t, a.gpus, a.requests, a.iters, ttft)))
                key = f"{t}@ttft{ttft:g}ms"
                res["traces"][key] = {"summary": summarize_trace(rows), "rows": rows}
                print(key, json.dumps(res["traces"][key]["summary"]), flush=True)
                out.write_text(json.dumps(res, indent=2) + "\n")
    plot(res, out.with_suffix(".png"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
