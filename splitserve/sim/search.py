"""The two questions a simulator is asked most, DistServe's way:

  goodput      the highest request rate (a multiple of the workload's own) at which at least
               `target` of the requests meet both SLOs — exponential search up, then bisection;
               per GPU it is that rate over the run's mean GPUs
  sweep_ratio  that search for every prefill:decode split of a fixed GPU count, and for the
               same GPUs aggregated
  goodput_scan the same answer for a system whose attainment is not monotonic in the rate
               (autoscaled pools): every rate on a grid, the best per GPU that meets the target
"""

from __future__ import annotations

from typing import Any, Callable

Run = Callable[[float], dict[str, Any]]  # rate scale -> summary


def goodput(run: Run, start: float = 1.0, target: float = 0.9, iters: int = 7, max_scale: float = 1e6,
            min_scale: float | None = None) -> dict[str, Any]:
    """`min_scale`: give up below this rate scale (default start / 1024): some SLOs no rate meets,
    e.g. a TTFT target shorter than the longest prompts' prefill."""
    probes: list[dict[str, Any]] = []

    def ok(scale: float) -> bool:
        s = run(scale)
        probes.append({"rate_scale": scale, "slo_attainment": s["slo_attainment"], "gpus": s["gpus"],
                       "rate_rps": s["workload"]["rate_rps"],  # of the scaled workload
                       "ttft_p90_ms": s["ttft_ms"]["p90"], "tpot_p90_ms": s["tpot_ms"]["p90"]})
        return (s["slo_attainment"] or 0.0) >= target

    if ok(start):  # double until it misses
        lo = start
        while lo * 2 <= max_scale and ok(lo * 2):
            lo *= 2
        hi = lo * 2
    else:  # halve until it meets
        lo, hi = 0.0, start
        while hi / 2 >= (start / 1024 if min_scale is None else min_scale):
            if ok(hi / 2):
                lo = hi / 2
                break
            hi /= 2
    if lo > 0:
        for _ in range(iters):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    best = next((p for p in probes if p["rate_scale"] == lo), None)
    most = max((p["slo_attainment"] or 0.0 for p in probes), default=0.0)
    per_gpu = best["rate_rps"] / best["gpus"] if best and best["rate_rps"] and best["gpus"] else 0.0
    return {"target": target, "rate_scale": lo, "rate_rps": best["rate_rps"] if best else 0.0,
            "gpus": best["gpus"] if best else None, "goodput_rps_per_gpu": per_gpu, "best_attainment_seen": most,
            "probes": sorted(probes, key=lambda p: p["rate_scale"])}


def sweep_ratio(run_split: Callable[[int, int], Run], gpus: int, **search) -> dict[str, Any]:
    """`run_split(prefill, decode)` gives the run for one split; prefill 0 is aggregated."""
    rows = []
    for p in range(0, gpus):
        res = goodput(run_split(p, gpus - p), **search)
        rows.append({"prefill": p, "decode": gpus - p, **{k: v for k, v in res.items() if k != "probes"}})
    pd_rows = [r for r in rows if r["prefill"] > 0]
    best = max(pd_rows, key=lambda r: r["goodput_rps_per_gpu"], default=None)
    return {"gpus": gpus, "splits": rows, "best": best, "aggregated": rows[0]}


def goodput_scan(run: Run, target: float = 0.9, lo: float = 1 / 8, hi: float = 16.0, step: float = 2 ** 0.5,
                 give_up_below: float = 0.1, iters: int = 3) -> dict[str, Any]:
    """`goodput` for a system whose attainment is not monotonic in the rate — an autoscaled one
    shrinks its pools under a light load and may miss there what it meets under a heavier one,
    which would stop a bisection early: every rate scale from `lo` to `hi` on a geometric grid
    (stopping once attainment falls `give_up_below` under the target), then `iters` bisection
    steps between the highest rate that met it and the grid's next; goodput per GPU is the best
    rate per mean GPU held among the rates that met the target."""
    probes: list[dict[str, Any]] = []

    def ok(scale: float) -> bool:
        s = run(scale)
        probes.append({"rate_scale": scale, "slo_attainment": s["slo_attainment"], "gpus": s["gpus"],
                       "rate_rps": s["workload"]["rate_rps"], "ttft_p90_ms": s["ttft_ms"]["p90"],
                       "tpot_p90_ms": s["tpot_ms"]["p90"]})
        return (s["slo_attainment"] or 0.0) >= target

    scale, top = lo, None
    while scale <= hi * (1 + 1e-9):
        if ok(scale):
            top = scale
        elif top is not None and (probes[-1]["slo_attainment"] or 0.0) < target - give_up_below:
            break
        scale *= step
    if top is not None and top * step <= hi * (1 + 1e-9):
        a, b = top, top * step
        for _ in range(iters):
            mid = (a + b) / 2
            a, b = (mid, b) if ok(mid) else (a, mid)
    per_gpu = lambda p: p["rate_rps"] / p["gpus"] if p["rate_rps"] and p["gpus"] else 0.0  # noqa: E731
    met = [p for p in probes if (p["slo_attainment"] or 0.0) >= target]
    best = max(met, key=per_gpu, default=None)
    return {"target": target, "rate_scale": best["rate_scale"] if best else 0.0,
            "rate_rps": best["rate_rps"] if best else 0.0, "gpus": best["gpus"] if best else None,
            "goodput_rps_per_gpu": per_gpu(best) if best else 0.0,
            "best_attainment_seen": max((p["slo_attainment"] or 0.0 for p in probes), default=0.0), "probes": probes}
