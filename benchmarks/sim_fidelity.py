"""How close the simulator comes to the real service on this machine.

For three deployments of the demo model — aggregated in-process (`serve --prefill 0 --decode
0`), 1 prefill + 1 decode worker, 2 prefill + 1 decode — on one workload (the first requests of
the Mooncake conversation trace, prompts and hash blocks x 1/32 so 512-token blocks become the
engine's 16, outputs capped, arrivals slowed to this box): run `splitserve serve` + `splitserve
bench`, then `splitserve simulate` on the same trace and deployment, and compare TTFT and TPOT
p50 / p90 and output throughput.

The simulator's numbers come from measurements that are not the compared run:
  * the step-time model: `splitserve simulate --calibrate` on this machine right before each
    deployment's run (the VM's speed drifts): 2 torch threads, as the in-process engine runs,
    or 1, as a Ray worker with num_cpus=1 runs;
  * the fixed costs around the engine (HTTP + routing before a request reaches its engine, the
    serving loop's per-step cost beyond `Engine.step`, the handoff's RPCs): two probes of six
    sequential 64-token requests (2 and 12 output tokens) and one of 8 concurrent ones (12
    tokens) on each deployment, against the same probes simulated with none: ingress = the TTFT
    difference; handoff and per-step cost from the sequential probes' TPOT (12 tokens: handoff +
    11 steps; 2: handoff + 1 step), and a per-sequence cost from the concurrent one (the
    streams' share of the cores grows with the batch).
  * the 2 cores the workers share: `--host-cores 2` (a step slows while more workers step).

A second simulation of each run takes its step-time model from the served engines themselves:
each worker's online fit (engine/step_model.py, the same five-term form) as the router exports
it on /metrics — read after the probes for the probe corrections, and after the trace for the
trace (averaged over a role's workers; prefill and decode pools each their own, via
`--calibrated-prefill`). That fit comes from the measured run's own steps, so it cannot drift
away from them; what the simulator must still get right is everything else (queueing,
batching, chunking, the prefix cache, the handoff). Both are reported.

The served fits are simulated without `--host-cores`: those steps were timed while the workers
shared the cores, so the slowdown is in them already.

Writes results/sim_fidelity.json (+ PNG). About 25 minutes; `--resimulate` redoes only the
simulations, from the measurements saved beside it (a minute).

    python benchmarks/sim_fidelity.py [--requests 80] [--time-scale 6] [--only aggregated 1p1d 2p1d] [--resimulate]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).parent))
from serve_vs_vllm import stop, wait_ready  # noqa: E402  (same folder)

TRACE = ROOT.parent / "shared" / "data" / "mooncake" / "conversation_trace.jsonl"
DEPLOYMENTS = {"aggregated": (0, 0), "1p1d": (1, 1), "2p1d": (2, 1)}
PROBE = ("--input-len", "64", "64")
PROBES = ((1, 2), (1, 12), (8, 12))  # (concurrency, output tokens)
CLI = [sys.executable, "-m", "splitserve.cli.main"]


def run(cmd: list[str], **kw) -> None:
    subprocess.run(cmd, cwd=ROOT, check=True, timeout=3600, **kw)


def calibrated(out: Path, threads: int, budget_s: float) -> Path:
    run(CLI + ["simulate", "--calibrate", "--threads", str(threads), "--budget-s", str(budget_s), "--out", str(out)])
    return out


@contextlib.contextmanager
def serving(a, name: str, out_dir: Path):
    p, d = DEPLOYMENTS[name]
    cmd = CLI + ["serve", "--port", str(a.port), "--grpc-port", str(a.port + 1), "--served-model-name", "demo",
                 "--prefill", str(p), "--decode", str(d), "--no-admission"]
    log = open(out_dir / f"{name}.log", "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "RAY_AUTH_MODE": "disabled"}, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_ready(f"http://127.0.0.1:{a.port}/ready", proc, 300)
        yield cmd
    finally:
        stop(proc)
        if p or d:  # the Ray cluster `serve` started stays up: take it down before the next
            subprocess.run([str(Path(sys.executable).parent / "ray"), "stop", "--force"], capture_output=True)


def bench(a, out: Path, *args: str) -> dict:
    run(CLI + ["bench", "--url", f"http://127.0.0.1:{a.port}", "--model", "demo", "--seed", "0", "--out", str(out),
               "--no-plot", "-q", *args], stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["summary"]


def trace_args(a) -> list[str]:
    return ["--trace", str(TRACE), "--max-requests", str(a.requests), "--length-scale", str(a.length_scale),
            "--max-output-len", str(a.max_output_len)]


def probe_args(out_len: int, concurrency: int = 1) -> list[str]:
    n = 6 if concurrency == 1 else concurrency
    return ["--dataset", "random", *PROBE, "--output-len", str(out_len), str(out_len), "--num-requests", str(n)]


def simulate(out: Path, cost: Path | tuple[Path, Path], p: int, d: int, *args: str, shared_cores: bool = True) -> dict:
    """`shared_cores`: model the 2 cores the workers share (a step slows while more step) — for
    a cost measured in isolation; a served fit already measured its steps slowed so."""
    pools = ["--aggregated", "1"] if p == 0 else ["--prefill", str(p), "--decode", str(d)]
    costs = ["--calibrated", str(cost)] if isinstance(cost, Path) else \
        ["--calibrated-prefill", str(cost[0]), "--calibrated", str(cost[1])]
    cores = ["--host-cores", "2"] if shared_cores else []
    run(CLI + ["simulate", *costs, *pools, "--layout", "mixed", "--gpus-per-node", "64",
               *cores, "--no-admission", "--no-plot", "--out", str(out), *args],
        stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def overheads(real: dict, sim: dict) -> dict[str, float]:
    """From the probes — (concurrency, output tokens) (1, 2), (1, 12), (8, 12) — what the
    simulation lacks: the time before the engine (ingress), per handoff, how much slower a
    serving step is than the calibrated one (`slowdown`: the serving loop, the streams and the
    client on the same cores, and the VM's speed at the time), and a per-sequence cost that grows
    with the batch (each stream's share of the cores)."""
    def costs(p: dict) -> tuple[float, float, float, float]:
        t2, t12, t12_8 = (p[k]["tpot_ms"]["p50"] / 1e3 for k in ((1, 2), (1, 12), (8, 12)))
        step1 = (11 * t12 - t2) / 10  # t12 = (handoff + 11 steps) / 11, t2 = handoff + 1 step
        handoff = t2 - step1
        step8 = t12_8 - handoff / 11
        return p[(1, 12)]["ttft_ms"]["p50"] / 1e3, handoff, step1, step8

    ri, rh, r1, r8 = costs(real)
    si, sh, s1, s8 = costs(sim)
    slowdown = max(1.0, r1 / s1)
    return {"ingress_s": max(0.0, ri - si * slowdown), "handoff_s": max(0.0, rh - sh * slowdown),
            "slowdown": slowdown, "per_seq_s": max(0.0, (r8 - s8 * slowdown) / 7)}


def with_overheads(cost: Path, extra: dict, out: Path) -> Path:
    d = json.loads(cost.read_text())
    for c in TERMS:
        d[c] *= extra["slowdown"]
    d["c2"] += extra["per_seq_s"]
    d["source"] += (f"; x {extra['slowdown']:.2f} and + {extra['per_seq_s'] * 1e3:.2f} ms per decode sequence "
                    "(serving vs calibration, from the probes)")
    out.write_text(json.dumps(d, indent=2) + "\n")
    return out


TERMS = ("c0", "c1", "c2", "c3", "c4")  # the order of engine/step_model.FEATURES
FIT_LINE = re.compile(r'^splitserve_worker_step_time_coefficient\{role="(\w+)",term="(\w+)",worker="([^"]+)"\} (\S+)$')


def served_fits(a) -> dict[str, list[float]]:
    """Each role's online step-time fit, averaged over its workers, from the router's /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{a.port}/metrics", timeout=30).read().decode()
    by: dict[tuple[str, str], dict[str, float]] = {}
    for line in text.splitlines():
        m = FIT_LINE.match(line)
        if m:
            by.setdefault((m[1], m[3]), {})[m[2]] = float(m[4])
    roles: dict[str, list[list[float]]] = {}
    for (role, _), terms in by.items():
        roles.setdefault(role, []).append(list(terms.values()))
    return {role: [sum(col) / len(col) for col in zip(*fits)] for role, fits in roles.items()}


def served_cost(base: Path, fits: dict[str, list[float]], when: str, out_dir: Path, name: str) -> Path | tuple[Path, Path]:
    """The calibration's KV facts with a served role's online fit for its coefficients; a
    (prefill, decode) pair where the deployment has both pools."""
    def one(role: str) -> Path:
        d = json.loads(base.read_text())
        d.update(zip(TERMS, fits[role]))
        d["source"] = f"the served {role} workers' online step-time fit, read from /metrics after the {when}"
        path = out_dir / f"{name}_served_{role}_{when}.json"
        path.write_text(json.dumps(d, indent=2) + "\n")
        return path

    return (one("prefill"), one("decode")) if "prefill" in fits else one("decode")


def compare(real: dict, sim: dict) -> dict:
    rows = {}
    for metric, real_v, sim_v in (
            ("ttft_p50_ms", real["ttft_ms"]["p50"], sim["ttft_ms"]["p50"]),
            ("ttft_p90_ms", real["ttft_ms"]["p90"], sim["ttft_ms"]["p90"]),
            ("tpot_p50_ms", real["tpot_ms"]["p50"], sim["tpot_ms"]["p50"]),
            ("tpot_p90_ms", real["tpot_ms"]["p90"], sim["tpot_ms"]["p90"]),
            ("output_tok_s", real["output_token_throughput"], sim["output_tokens_per_s"])):
        rows[metric] = {"measured": real_v, "simulated": sim_v, "error": (sim_v - real_v) / real_v}
    return rows


def simulate_corrected(a, name: str, out_dir: Path, tag: str, cost_probe, cost_trace, real_probe: dict,
                       shared_cores: bool) -> tuple[dict, dict]:
    """Simulate the probes on `cost_probe`, derive the corrections, and simulate the trace on
    `cost_trace` with them: (the trace's summary, the corrections)."""
    p, d = DEPLOYMENTS[name]
    sim_probe = {(c, n): simulate(out_dir / f"{name}_{tag}_sim_probe{c}x{n}.json", cost_probe, p, d, "--dataset",
                                  "random", *PROBE, "--num-requests", str(6 if c == 1 else c),
                                  "--rate", "0.1" if c == 1 else "1e6", "--output-len", str(n), str(n),
                                  shared_cores=shared_cores)
                 for c, n in PROBES}
    extra = overheads(real_probe, sim_probe)
    tuned = (tuple(with_overheads(x, extra, x.with_name(x.stem + "_tuned.json")) for x in cost_trace)
             if isinstance(cost_trace, tuple) else with_overheads(cost_trace, extra, out_dir / f"{name}_{tag}_cost.json"))
    sim = simulate(out_dir / f"{name}_{tag}_sim.json", tuned, p, d, *trace_args(a), "--rate-scale", str(1 / a.time_scale),
                   "--ingress-ms", str(extra["ingress_s"] * 1e3), "--handoff-ms", str(extra["handoff_s"] * 1e3),
                   shared_cores=shared_cores)
    return sim, extra


def measure(a, name: str, out_dir: Path, before: dict | None) -> dict:
    """Measure `name` and simulate it; with `before` (this deployment's entry of an earlier
    result) only simulate again, from that run's saved measurements."""
    p, d = DEPLOYMENTS[name]
    if before is not None:
        cost = out_dir / f"{name}_calibration.json"
        real_probe = {(c, n): json.loads((out_dir / f"{name}_probe{c}x{n}.json").read_text())["summary"]
                      for c, n in PROBES}
        real = json.loads((out_dir / f"{name}_real.json").read_text())["summary"]
        fit_probe, fit_trace = before["served_fit"]["after_probes"], before["served_fit"]["after_trace"]
    else:
        cost, real_probe, real, fit_probe, fit_trace = measure_served(a, name, out_dir)
    sim, extra = simulate_corrected(a, name, out_dir, "calibrated", cost, cost, real_probe, shared_cores=True)
    served = (served_cost(cost, fit_probe, "probes", out_dir, name), served_cost(cost, fit_trace, "trace", out_dir, name))
    sim_served, extra_served = simulate_corrected(a, name, out_dir, "served", *served, real_probe, shared_cores=False)
    return {"deployment": name, "prefill": p, "decode": d, "calibration": json.loads(cost.read_text()),
            "overheads": extra, "compare": compare(real, sim),
            "served_fit": {"after_probes": fit_probe, "after_trace": fit_trace, "overheads": extra_served,
                           "compare": compare(real, sim_served)},
            "measured_completed": real["completed"], "measured_errors": real["errors"],
            "simulated_completed": sim["completed"], "prefix_hit_rate_sim": sim["prefix_hit_rate"],
            "sim_wall_s": sim["wall_s"]}


def measure_served(a, name: str, out_dir: Path):
    """The real run: calibrate, serve, probe, read the fits, replay the trace, read them again."""
    p, d = DEPLOYMENTS[name]
    # calibrated right before its run: this VM's speed drifts over tens of minutes
    cost = calibrated(out_dir / f"{name}_calibration.json", 2 if p == 0 else 1, a.calibration_budget_s)
    with serving(a, name, out_dir):
        bench(a, out_dir / f"{name}_warmup.json", *probe_args(4), "--concurrency", "1")
        real_probe = {(c, n): bench(a, out_dir / f"{name}_probe{c}x{n}.json", *probe_args(n, c), "--concurrency", str(c))
                      for c, n in PROBES}
        fit_probe = served_fits(a)
        real = bench(a, out_dir / f"{name}_real.json", "--dataset", "mooncake", *trace_args(a), "--time-scale",
                     str(a.time_scale), "--drain-timeout", "600")
        fit_trace = served_fits(a)
    return cost, real_probe, real, fit_probe, fit_trace


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = ["ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms", "output_tok_s"]
    fig, axes = plt.subplots(1, len(metrics), figsize=(16, 3.6))
    for ax, m in zip(axes, metrics):
        names = [r["deployment"] for r in res["runs"]]
        xs = range(len(names))
        ax.bar([x - 0.27 for x in xs], [r["compare"][m]["measured"] for r in res["runs"]], 0.27, label="measured")
        ax.bar(list(xs), [r["compare"][m]["simulated"] for r in res["runs"]], 0.27, label="simulated (calibrated)")
        ax.bar([x + 0.27 for x in xs], [r["served_fit"]["compare"][m]["simulated"] for r in res["runs"]], 0.27,
               label="simulated (served fit)")
        ax.set_xticks(list(xs), names)
        ax.set_title(m)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=80)
    ap.add_argument("--time-scale", type=float, default=12.0, help="trace timestamps x this (default 12)")
    ap.add_argument("--length-scale", type=float, default=1 / 32)
    ap.add_argument("--max-output-len", type=int, default=32)
    ap.add_argument("--only", nargs="+", choices=list(DEPLOYMENTS), default=list(DEPLOYMENTS))
    ap.add_argument("--calibration-budget-s", type=float, default=60.0)
    ap.add_argument("--port", type=int, default=8350)
    ap.add_argument("--out", default=str(ROOT / "results" / "sim_fidelity.json"))
    ap.add_argument("--resimulate", action="store_true",
                    help="measure nothing: simulate --out's runs again from their saved measurements")
    a = ap.parse_args()
    out = Path(a.out)
    work = out.parent / out.stem
    work.mkdir(parents=True, exist_ok=True)
    before = {r["deployment"]: r for r in json.loads(out.read_text())["runs"]} if a.resimulate else {}
    res = {"workload": {"trace": TRACE.name, "requests": a.requests, "length_scale": a.length_scale,
                        "max_output_len": a.max_output_len, "time_scale": a.time_scale}, "runs": []}
    for name in a.only:
        res["runs"].append(measure(a, name, work, before.get(name) if a.resimulate else None))
        out.write_text(json.dumps(res, indent=2) + "\n")
        r = res["runs"][-1]
        for m, row in r["compare"].items():
            served = r["served_fit"]["compare"][m]
            print(f"{name:10s} {m:14s} measured {row['measured']:9.1f}  simulated {row['simulated']:9.1f} "
                  f"({row['error']:+.1%}), on the served fit {served['simulated']:9.1f} ({served['error']:+.1%})",
                  flush=True)
    plot(res, out.with_suffix(".png"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
