"""How fast the simulator runs, and how its runtime grows with the cluster: the full Mooncake
conversation trace (12,031 requests) on 64, 256, 1,024 and 4,096 simulated H200s serving
Llama-3-8B (roofline), half prefill and half decode, cache-aware router, admission on (TTFT 1 s,
TPOT 50 ms). Two loads per size:

  trace  the trace at its own rate (3.4 req/s): the cluster grows, the work does not — runtime
         is the per-step cost of ~4 M mostly lone decode steps plus the per-worker setup
  scaled the rate multiplied with the GPUs (GPUs / 16: each GPU sees the load 16 GPUs see at
         the trace's rate), so bigger clusters also carry more concurrent requests

Each row: wall seconds, simulated seconds, events, events/s, engine steps, router decisions and
the run's summary numbers. Writes results/sim_scale.json and a PNG.

    python benchmarks/sim_scale.py [--gpus 64 256 1024 4096] [--loads trace scaled]
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from splitserve.sim.cost.hardware import gpu  # noqa: E402
from splitserve.sim.cost.roofline import RooflineCost  # noqa: E402
from splitserve.sim.cost.shapes import model_shape  # noqa: E402
from splitserve.sim.report import summarize  # noqa: E402
from splitserve.sim.simulation import SimConfig, Simulation  # noqa: E402
from splitserve.sim.workload import from_trace  # noqa: E402

TRACE = ROOT.parent / "shared" / "data" / "mooncake" / "conversation_trace.jsonl"


def one(gpus: int, load: str, block_size: int) -> dict:
    w = from_trace(TRACE)
    if load == "scaled":
        w = w.scaled(gpus / 16)
    cost = RooflineCost(gpu("h200"), model_shape("llama-3-8b"))
    cfg = SimConfig(prefill=gpus // 2, decode=gpus - gpus // 2, block_size=block_size, ttft_slo_ms=1000,
                    tpot_slo_ms=50)
    sim = Simulation(cfg, cost, w).run()
    s = summarize(sim)
    keep = ("gpus", "requests", "completed", "rejected", "sim_s", "wall_s", "events", "events_per_s", "steps",
            "router_decisions", "slo_attainment", "goodput_rps", "prefix_hit_rate", "ttft_ms", "tpot_ms")
    return {"load": load, "rate_scale": gpus / 16 if load == "scaled" else 1.0, **{k: s[k] for k in keep},
            "max_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for load in ("trace", "scaled"):
        rs = [r for r in rows if r["load"] == load]
        if rs:
            axes[0].plot([r["gpus"] for r in rs], [r["wall_s"] for r in rs], "o-", label=load)
            axes[1].plot([r["gpus"] for r in rs], [r["events_per_s"] for r in rs], "o-", label=load)
    axes[0].axhline(120, color="red", ls="--", lw=1, label="2 minutes")
    axes[0].set(xscale="log", xlabel="simulated GPUs", ylabel="wall s", title="12,031 requests: runtime")
    axes[1].set(xscale="log", xlabel="simulated GPUs", ylabel="events / s", title="event rate")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, nargs="+", default=[64, 256, 1024, 4096])
    ap.add_argument("--loads", nargs="+", choices=("trace", "scaled"), default=["trace", "scaled"])
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "results" / "sim_scale.json"))
    a = ap.parse_args()
    out = Path(a.out)
    rows = json.loads(out.read_text())["rows"] if out.exists() else []
    for load in a.loads:
        for g in a.gpus:
            row = one(g, load, a.block_size)
            rows = [r for r in rows if not (r["gpus"] == row["gpus"] and r["load"] == load)] + [row]
            print(f"{load:6s} {g:5d} GPUs: {row['wall_s']:6.1f} s wall, {row['sim_s']:7.1f} s simulated, "
                  f"{row['events']} events ({row['events_per_s']:.0f}/s), {row['steps']} steps, "
                  f"attainment {row['slo_attainment']:.1%}", flush=True)
            rows.sort(key=lambda r: (r["load"], r["gpus"]))
            out.write_text(json.dumps({"trace": TRACE.name, "block_size": a.block_size, "rows": rows}, indent=2) + "\n")
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
