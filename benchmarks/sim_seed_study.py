"""The seed's setting in the simulator: DeepSeek-R1 (FP8) on 16 H20s — two nodes of 8 — under
full tensor parallelism, tensor × pipeline parallelism and data-parallel attention + expert
parallelism (with and without a pipeline), aggregated and prefill/decode-disaggregated, against
the seed talk's figures (total output tokens/s on the 16 GPUs: vLLM / SGLang 4-6K, TensorRT-LLM
11.2K, Yinian 14.6K, "theoretical" 30K).

The workload, as far as the talk describes it (long prompts, reasoning outputs) — assumed here:
prompts uniform in 1024..3072 tokens (mean 2K), outputs uniform in 512..2560 (mean 1.5K), no
shared prefixes, Poisson arrivals. SLOs assumed: TTFT 3 s and TPOT 50 ms (20 tokens/s a user),
90% of requests within both (DistServe's goodput).

Each strategy is one cost model per pool (splitserve/sim/cost/parallel.py: the roofline for
DeepSeek's shape on H20 at 60% of peak FLOP/s and 80% of HBM bandwidth, 95% of HBM usable less
2 GB for activations), and gets
  capacity   the steady state the formulas give (splitserve/sim/capacity.py): the largest
             batch within the TPOT target and the KV, at TPOT 50 and 100 ms
  ceiling    the same for decode alone at 100% of peak and no step overhead, the batch as large
             as the KV holds (what a "theoretical" figure counts)
  sensitivity the capacity at TPOT 50 ms with one assumption changed (SENSITIVITY)
  simulated  the event simulation (the real scheduler, router, admission, KV hand-over) at the
             highest rate at which 90% of the requests meet both SLOs: the output tokens/s of
             the requests that met them there (`--no-sim`: skip); an aggregated worker's step
             budget from the TPOT target (`step_budget`)
PD rows need workers of their own: a worker of 96 GB H20s holds the 671 GB model on 8 GPUs only
just (5 GB each left for KV), so a 16-GPU PD is 8 + 8 with TP 8 on each side, and the layouts
the H20 deployments use (Ant Group's: TP 8 prefill, 16-GPU EP decode) take 24 or 32 GPUs —
compared per GPU.

Writes results/sim_seed_study.json and .png.

    python benchmarks/sim_seed_study.py [--requests 1500] [--workers 2] [--no-sim] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from splitserve.sim import search  # noqa: E402
from splitserve.sim.capacity import decode_capacity, pd_capacity, steady_shape  # noqa: E402
from splitserve.sim.cost import ByRole  # noqa: E402
from splitserve.sim.cost.hardware import gpu  # noqa: E402
from splitserve.sim.cost.parallel import Layout, ParallelCost  # noqa: E402
from splitserve.sim.cost.shapes import model_shape  # noqa: E402
from splitserve.sim.report import summarize  # noqa: E402
from splitserve.sim.simulation import SimConfig, Simulation  # noqa: E402
from splitserve.sim.workload import SimRequestSpec, Workload  # noqa: E402

MODEL, GPU = "deepseek-r1", "h20"
INPUT, OUTPUT = (1024, 3072), (512, 2560)
MEAN_IN, MEAN_OUT = sum(INPUT) / 2, sum(OUTPUT) / 2
TTFT_MS, TPOT_MS, TARGET = 3000.0, 50.0, 0.9
SEQS_PER_REPLICA, TOKENS_PER_REPLICA = 256, 2048  # each scheduler's limits (vLLM / SGLang defaults)
BLOCK = 64
COST_KW = dict(memory_utilization=0.95, activation_reserve_bytes=2e9)
TALK = {"vLLM / SGLang": (4000, 6000), "TensorRT-LLM": 11200, "Yinian (the seed)": 14600, "theoretical": 30000}
SEED_GPUS = 16
SENSITIVITY = {"compute_efficiency 0.8": {"compute_efficiency": 0.8},
               "cross-node latency 60 us": {"cross_node_latency_s": 60e-6},
               "step overhead 0": {"step_overhead_s": 0.0}}


@dataclass(frozen=True)
class Strategy:
    name: str
    decode: Layout  # the aggregated worker's layout, or the decode pool's
    prefill: Layout | None = None  # PD: the prefill pool's
    prefill_workers: int = 0
    expert_imbalance: float = 1.0

    @property
    def pd(self) -> bool:
        return self.prefill is not None

    @property
    def gpus(self) -> int:
        return self.decode.gpus + (self.prefill.gpus * self.prefill_workers if self.prefill else 0)

    def cost(self, layout: Layout, **kw) -> ParallelCost:
        imb = self.expert_imbalance if layout.expert_parallel else 1.0
        return ParallelCost(gpu(GPU), model_shape(MODEL), layout, expert_imbalance=imb, **{**COST_KW, **kw})

    def max_seqs(self) -> int:
        """Each replica's scheduler, and each micro-batch's (as vLLM's virtual engines under PP)."""
        return SEQS_PER_REPLICA * max(x.dp_attention * x.micro_batches for x in (self.decode, self.prefill) if x)


A = "async"
DP16 = Layout(dp_attention=16, expert_parallel=True)
STRATEGIES = (
    Strategy("tp16", Layout(tp=16)),
    Strategy("tp8-pp2", Layout(tp=8, pp=2)),
    Strategy("tp8-pp2-m2", Layout(tp=8, pp=2, micro_batches=2)),
    Strategy("tp8-pp2-m2-async", Layout(tp=8, pp=2, micro_batches=2, schedule=A)),
    Strategy("dp16-ep16", DP16),
    Strategy("dp16-ep16 (imbalance 1.3)", DP16, expert_imbalance=1.3),
    Strategy("dp8-ep8-pp2-m2-async", Layout(dp_attention=8, expert_parallel=True, pp=2, micro_batches=2, schedule=A)),
    Strategy("pd tp8 | tp8", Layout(tp=8), Layout(tp=8), 1),
    Strategy("pd tp8 | dp16-ep16", DP16, Layout(tp=8), 1),
    Strategy("pd tp8 x2 | dp16-ep16", DP16, Layout(tp=8), 2),
)


def workload(n: int, rate: float, seed: int = 0) -> Workload:
    rng, t, reqs = random.Random(seed), 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        reqs.append(SimRequestSpec(i, t, rng.randint(*INPUT), rng.randint(*OUTPUT)))
    return Workload(tuple(reqs), BLOCK, "seed-reasoning")


def capacity(s: Strategy, tpot_ms: float, **cost_kw) -> dict:
    """The steady state the formulas give (capacity.py), total and per GPU."""
    d = s.cost(s.decode, **cost_kw)
    if s.pd:
        c = pd_capacity(s.cost(s.prefill, **cost_kw), d, s.prefill_workers, 1, MEAN_IN, MEAN_OUT, tpot_ms / 1e3,
                        s.max_seqs(), TOKENS_PER_REPLICA * s.prefill.dp_attention, BLOCK)
    else:
        c = decode_capacity(d, MEAN_IN, MEAN_OUT, tpot_ms / 1e3, s.max_seqs(), BLOCK)
    terms, hop, m = d.terms(steady_shape(max(c.batch, 1), MEAN_IN, MEAN_OUT, with_prompts=not s.pd))
    return {"batch": c.batch, "step_ms": c.step_s * 1e3, "output_tok_s": c.output_tokens_per_s,
            "per_gpu": c.per_gpu, "bound": c.bound,
            "decode_step_terms_ms": {"stages": [{k: v * 1e3 for k, v in t._asdict().items()} for t in terms],
                                     "stage_transfer": hop * 1e3, "micro_batches": m}}


def ceiling(s: Strategy) -> dict:
    """Decode alone at 100% of peak, no step overhead, as large a batch as the KV holds (PD: the
    decode pool's, over all the strategy's GPUs)."""
    d = s.cost(s.decode, compute_efficiency=1.0, memory_efficiency=1.0, step_overhead_s=0.0)
    c = decode_capacity(d, MEAN_IN, MEAN_OUT, 1e9, 10 ** 6, BLOCK, with_prompts=False)
    return {"batch": c.batch, "output_tok_s": c.output_tokens_per_s, "per_gpu": c.output_tokens_per_s / s.gpus}


def describe(s: Strategy) -> dict:
    d = s.cost(s.decode).describe()
    out = {"gpus": s.gpus, "decode_layout": s.decode.name, "kv_tokens": d["kv_tokens"], "step_budget": step_budget(s),
           "weight_gb_per_gpu": d["weight_bytes_per_gpu"] / 1e9, "allreduces_per_pass": d["allreduces_per_pass"],
           "all_to_alls_per_pass": d["all_to_alls_per_pass"], "expert_imbalance": s.expert_imbalance}
    if s.pd:
        out.update(prefill_layout=s.prefill.name, prefill_workers=s.prefill_workers)
    return out


def step_budget(s: Strategy) -> int:
    """An aggregated worker's tokens a step: per replica, the largest chunk (whole blocks) whose
    step by the worker's linear fit stays within 0.6 of the TPOT target — a decode step carrying
    a full chunk of a prompt must not blow the target — between 256 and 2048 (as
    benchmarks/sim_study.py's `tpot_budget`); a PD decode worker's, 2048 (it prefills nothing)."""
    dp = s.decode.dp_attention
    if s.pd:
        return TOKENS_PER_REPLICA * dp
    c0, c1 = s.cost(s.decode).coeffs()[:2]
    per = int((0.6 * TPOT_MS / 1e3 - c0) / c1 / dp) // BLOCK * BLOCK if c1 > 0 else TOKENS_PER_REPLICA
    return min(TOKENS_PER_REPLICA, max(256, per)) * dp


def sim_config(s: Strategy) -> SimConfig:
    return SimConfig(prefill=s.prefill_workers, decode=1, pd_decider="threshold", block_size=BLOCK,
                     max_num_seqs=s.max_seqs(), max_num_batched_tokens=step_budget(s),
                     prefill_max_num_batched_tokens=TOKENS_PER_REPLICA * s.prefill.dp_attention if s.pd else None,
                     ttft_slo_ms=TTFT_MS, tpot_slo_ms=TPOT_MS, gpus_per_node=8)


def simulate(job: tuple[Strategy, int, int]) -> dict:
    """The event simulation's goodput: the highest rate (a multiple of ~4K output tokens/s) at
    which 90% of the requests meet both SLOs."""
    s, requests, iters = job
    cost = ByRole(s.cost(s.prefill), s.cost(s.decode)) if s.pd else s.cost(s.decode)
    base = workload(requests, 4000 / MEAN_OUT)
    cfg, probes = sim_config(s), {}

    def run(scale: float) -> dict:
        out = summarize(Simulation(cfg, cost, base.scaled(scale)).run())
        probes[scale] = {k: out[k] for k in ("slo_attainment", "output_tokens_per_s", "preemptions", "wall_s")}
        probes[scale].update(ttft_p90_ms=out["ttft_ms"]["p90"], tpot_p90_ms=out["tpot_ms"]["p90"],
                             rejected=out["rejected"])
        return out

    res = search.goodput(run, start=1.0, target=TARGET, iters=iters, min_scale=1 / 8)
    rate, at = res["rate_rps"], probes.get(res["rate_scale"])
    good = rate * MEAN_OUT * (at["slo_attainment"] if at else 0.0)  # the requests within both SLOs' tokens
    return {"name": s.name, "rate_rps": rate, "rate_scale": res["rate_scale"], "offered_tok_s": rate * MEAN_OUT,
            "output_tok_s": good, "per_gpu": good / s.gpus,
            "best_attainment_seen": res["best_attainment_seen"], "at_best": probes.get(res["rate_scale"]),
            "probes": {f"{k:g}": v for k, v in sorted(probes.items())}}


def compare(rows: list[dict]) -> dict:
    """Where each strategy lands against the talk's figures (per 16 GPUs, at equal GPU count)."""
    out = {}
    for r in rows:
        per16 = {k: (r[k]["per_gpu"] * SEED_GPUS if r.get(k) else None) for k in ("capacity_tpot50", "capacity_tpot100",
                                                                                 "ceiling", "simulated")}
        out[r["name"]] = {"per_16_gpus": per16,
                          "capacity_over_yinian": per16["capacity_tpot50"] / TALK["Yinian (the seed)"],
                          "ceiling_over_theoretical": per16["ceiling"] / TALK["theoretical"]}
    ranked = sorted(rows, key=lambda r: -r["capacity_tpot50"]["per_gpu"])
    return {"by_capacity_per_gpu": [r["name"] for r in ranked], "rows": out}


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    names = [r["name"] for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(13, 5.5))
    series = [("capacity_tpot50", "capacity, TPOT 50 ms", "tab:blue"), ("capacity_tpot100", "capacity, TPOT 100 ms",
              "tab:cyan"), ("simulated", "simulated goodput (TTFT 3 s, TPOT 50 ms, 90%)", "tab:green"),
              ("ceiling", "ceiling: decode at 100% of peak", "tab:gray")]
    w = 0.2
    for i, (k, label, color) in enumerate(series):
        ax.bar([j + (i - 1.5) * w for j in x], [(r[k]["per_gpu"] * SEED_GPUS if r.get(k) else 0) / 1e3 for r in rows],
               w, label=label, color=color)
    for (label, v), style in zip(TALK.items(), (":", "--", "-", "-.")):
        for y in (v if isinstance(v, tuple) else (v,)):
            ax.axhline(y / 1e3, color="tab:red", ls=style, lw=1)
        ax.text(len(rows) - 0.5, (v[1] if isinstance(v, tuple) else v) / 1e3, f" {label}", color="tab:red",
                fontsize=8, va="bottom")
    ax.set_xticks(list(x), [f"{n}\n({r['gpus']} GPUs)" for n, r in zip(names, rows)], rotation=30, ha="right",
                  fontsize=8)
    ax.set_ylabel("output K tokens/s per 16 GPUs")
    ax.set_title(f"DeepSeek-R1 on H20: prompts {INPUT[0]}-{INPUT[1]}, outputs {OUTPUT[0]}-{OUTPUT[1]} tokens "
                 "(roofline at 60% FLOP/s, 80% HBM)", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _kept_simulations(out: Path, a: argparse.Namespace) -> dict[str, dict]:
    """The simulated rows of an earlier run with the same workload size and search."""
    if not out.exists():
        return {}
    done = json.loads(out.read_text())
    if done.get("workload", {}).get("requests") != a.requests or done.get("iters", a.iters) != a.iters:
        return {}
    return {r["name"]: r["simulated"] for r in done.get("rows", []) if "simulated" in r}


def _earlier_commands(out: Path) -> list[str]:
    return json.loads(out.read_text()).get("commands", [])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1500)
    ap.add_argument("--iters", type=int, default=3, help="bisection steps after the doubling (default 3)")
    ap.add_argument("--workers", type=int, default=2, help="simulations in parallel (default 2)")
    ap.add_argument("--no-sim", action="store_true", help="the formulas only")
    ap.add_argument("--only", nargs="+", default=None, help="only the strategies named so")
    ap.add_argument("--reuse", action="store_true",
                    help="keep the simulated rows the JSON at --out holds (same requests and iters); compute the rest")
    ap.add_argument("--out", default=str(ROOT / "results" / "sim_seed_study.json"))
    a = ap.parse_args()
    picked = [s for s in STRATEGIES if a.only is None or s.name in a.only]
    rows = [{"name": s.name, **describe(s), "capacity_tpot50": capacity(s, TPOT_MS),
             "capacity_tpot100": capacity(s, 2 * TPOT_MS), "ceiling": ceiling(s),
             "sensitivity_tpot50": {k: capacity(s, TPOT_MS, **kw)["output_tok_s"] for k, kw in SENSITIVITY.items()}}
            for s in picked]
    out = Path(a.out)
    kept = _kept_simulations(out, a) if a.reuse else {}
    for r in rows:
        if r["name"] in kept:
            r["simulated"] = kept[r["name"]]
    todo = [s for s, r in zip(picked, rows) if not a.no_sim and "simulated" not in r]
    if todo:
        with ProcessPoolExecutor(a.workers) as pool:
            for s, sim in zip(todo, pool.map(simulate, [(s, a.requests, a.iters) for s in todo])):
                next(r for r in rows if r["name"] == s.name)["simulated"] = sim
                print(f"{s.name}: simulated {sim['output_tok_s']:.0f} tok/s", flush=True)
    res = {"model": MODEL, "gpu": GPU, "seed_gpus": SEED_GPUS, "iters": a.iters,
           "workload": {"input_len": INPUT, "output_len": OUTPUT, "arrivals": "poisson", "requests": a.requests,
                        "prefix_sharing": None},
           "slo": {"ttft_ms": TTFT_MS, "tpot_ms": TPOT_MS, "attainment": TARGET},
           "engine": {"max_num_seqs_per_replica": SEQS_PER_REPLICA, "max_num_batched_tokens_per_replica":
                      TOKENS_PER_REPLICA, "block_size": BLOCK},
           "cost_model": {k: v for k, v in STRATEGIES[0].cost(STRATEGIES[0].decode).describe().items()
                          if k not in ("layout", "model")},
           "talk_tok_s_16_gpus": TALK, "rows": rows, "comparison": compare(rows),
           "commands": (_earlier_commands(out) if kept else []) + [" ".join(sys.argv)]}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    plot(res, out.with_suffix(".png"))
    for r in rows:
        c, c2, ce, sim = r["capacity_tpot50"], r["capacity_tpot100"], r["ceiling"], r.get("simulated")
        print(f"{r['name']:<28} {r['gpus']:>2} GPUs  capacity@50ms {c['output_tok_s']:>7.0f} "
              f"({c['bound']}, B={c['batch']})"
              f"  @100ms {c2['output_tok_s']:>7.0f}  ceiling {ce['output_tok_s']:>7.0f}"
              + (f"  simulated {sim['output_tok_s']:>7.0f}" if sim else ""))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
