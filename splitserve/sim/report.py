"""A simulation's result: the summary JSON (`summarize`), its one-paragraph print
(`format_summary`), and the PNG (latency CDFs and the pools over time). Latencies are in ms as
mean / p50 / p90 / p99 (`bench.metrics.Distribution`, the same definitions `splitserve bench`
uses); TPOT is (last token - first token) / (tokens - 1) per request. SLO attainment is over
every request — refused and failed ones miss — and goodput is the requests that met both
targets per second of the run (first arrival to last end), as DistServe counts it."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from splitserve.bench.metrics import Distribution
from splitserve.sim.simulation import Outcome, Simulation
from splitserve.types import Role


def met(o: Outcome, ttft_ms: float | None, tpot_ms: float | None) -> bool:
    if o.status != "ok":
        return False
    if ttft_ms is not None and (o.ttft_s is None or o.ttft_s * 1e3 > ttft_ms):
        return False
    return tpot_ms is None or o.tpot_s is None or o.tpot_s * 1e3 <= tpot_ms


def summarize(sim: Simulation) -> dict[str, Any]:
    c, outs = sim.config, sim.outcomes
    ok = [o for o in outs if o.status == "ok"]
    start = min((o.arrival_s for o in outs), default=0.0)
    end = max((o.end_s for o in outs), default=0.0)
    span = max(end - start, 1e-9)
    gpu_s = sim.pools.gpu_seconds(end)
    gpus = gpu_s / end if end > 0 else float(len(sim.pools.workers))
    good = sum(met(o, c.ttft_slo_ms, c.tpot_slo_ms) for o in outs)
    prompt = sum(o.prompt_tokens for o in ok)
    workers = sim.pools.all_workers()
    steps = sum(w.steps for w in workers)
    return {
        "gpus": round(gpus, 3),
        "gpus_max": max((p + d for _, p, d in sim.pools.history), default=0),
        "requests": len(outs),
        "completed": len(ok),
        "rejected": sum(o.status == "rejected" for o in outs),
        "failed": sum(o.status == "failed" for o in outs),
        "ttft_ms": _dist([o.ttft_s for o in ok if o.ttft_s is not None]),
        "tpot_ms": _dist([o.tpot_s for o in ok if o.tpot_s is not None]),
        "e2e_ms": _dist([o.end_s - o.arrival_s for o in ok]),
        "slo": {"ttft_ms": c.ttft_slo_ms, "tpot_ms": c.tpot_slo_ms},
        "slo_attainment": good / len(outs) if outs else None,
        "goodput_rps": good / span,
        "goodput_rps_per_gpu": good / span / gpus if gpus else 0.0,
        "throughput_rps": len(ok) / span,
        "output_tokens_per_s": sum(o.output_tokens for o in ok) / span,
        "prefix_hit_rate": sum(o.cached_tokens for o in ok) / prompt if prompt else 0.0,
        "disaggregated_share": sum(o.disaggregated for o in ok) / len(ok) if ok else 0.0,
        "preemptions": sum(w.engine.scheduler.num_preemptions for w in workers),
        "migrations": sum(o.migrations for o in outs),
        "busy_share": {r.value: _busy(sim, r, end) for r in Role},
        "sim_s": end,
        "wall_s": sim.wall_s,
        "events": sim.loop.events,
        "events_per_s": sim.loop.events / sim.wall_s if sim.wall_s else None,
        "steps": steps,
        "router_decisions": sim.router.decisions,
        "pool_sizes": [{"t": round(t, 3), "prefill": p, "decode": d} for t, p, d in sim.pools.history],
        "autoscale": sim.pool_sizes,
        "config": _plain(dataclasses.asdict(c)),
        "cost_model": _plain(sim.cost.describe()),
        **({"prefill_cost_model": _plain(sim.costs.prefill.describe())} if sim.costs.prefill is not sim.costs.decode
           else {}),
        "workload": {"name": sim.workload.name, "requests": len(sim.workload.requests),
                     "duration_s": sim.workload.duration_s,
                     "rate_rps": len(sim.workload.requests) / sim.workload.duration_s
                     if sim.workload.duration_s else None},
    }


def _busy(sim: Simulation, role: Role, end: float) -> float | None:
    ws = [w for w in sim.pools.all_workers() if w.role is role]
    alive = sum(w.held_s(end) for w in ws)
    return sum(w.busy_s for w in ws) / alive if alive > 0 else None


def _dist(values_s: list[float]) -> dict[str, float | None]:
    d = Distribution.of(values_s)
    return {"mean": d.mean, "p50": d.p50, "p90": d.p90, "p99": d.p99}


def _plain(x: Any) -> Any:
    """JSON-able: enums and other values by their str."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return str(x)


def format_summary(s: dict[str, Any]) -> str:
    def ms(d: dict) -> str:
        return "  ".join(f"{k} {d[k]:.1f}" if d[k] is not None else f"{k} -" for k in ("p50", "p90", "p99"))

    att = s["slo_attainment"]
    return "\n".join([
        f"{s['requests']} requests on {s['gpus']:.1f} GPUs (mean): {s['completed']} ok, {s['rejected']} refused, "
        f"{s['failed']} failed; {s['sim_s']:.1f} simulated s in {s['wall_s']:.1f} s "
        f"({s['events']} events, {s['events_per_s'] or 0:.0f}/s)",
        f"TTFT ms  {ms(s['ttft_ms'])}",
        f"TPOT ms  {ms(s['tpot_ms'])}",
        f"throughput {s['throughput_rps']:.2f} req/s, {s['output_tokens_per_s']:.0f} output tok/s; prefix hits "
        f"{s['prefix_hit_rate']:.1%}; disaggregated {s['disaggregated_share']:.0%}",
        f"SLO attainment {'-' if att is None else f'{att:.1%}'}; goodput {s['goodput_rps']:.3f} req/s "
        f"({s['goodput_rps_per_gpu']:.4f} per GPU)",
    ])


def plot(s: dict[str, Any], outcomes: list[Outcome], path: str | Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from splitserve.bench.plot import draw_cdf, save

    ok = [o for o in outcomes if o.status == "ok"]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for ax, (name, vals) in zip(axes, (("TTFT", [o.ttft_s for o in ok if o.ttft_s is not None]),
                                        ("TPOT", [o.tpot_s for o in ok if o.tpot_s is not None]))):
        draw_cdf(ax, name, sorted(v * 1e3 for v in vals))
        slo = s["slo"][f"{name.lower()}_ms"]
        if slo:
            ax.axvline(slo, color="red", ls="--", lw=1, label=f"SLO {slo:g} ms")
            ax.legend(loc="lower right")
        ax.set_xscale("log")
    ax = axes[2]
    hist = s["pool_sizes"]
    if hist:
        ts = [h["t"] for h in hist]
        for role in ("prefill", "decode"):
            ax.step(ts, [h[role] for h in hist], where="post", label=role)
        ax.legend()
    ax.set(title="workers READY", xlabel="simulated s", ylabel="workers")
    ax.grid(alpha=0.3)
    return save(fig, path, title)
