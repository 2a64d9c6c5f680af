"""Does the autoscaler follow a load ramp, and does it pay? The same scripted ramp of long
prompts (up, hold, down; open-loop Poisson arrivals from `splitserve bench`'s runner) against
two deployments of the real Serve app (`splitserve.deploy:build_app`, HTTP ingress) on a local
Ray cluster with room for 4 workers, one after the other:

  * fixed: 1 prefill + 1 decode worker;
  * autoscaled: `autoscale: {prefill: {min: 1, max: 3}, decode: {min: 1, max: 2}}` (more than
    the 4 workers there is room for: what does not fit waits, as on a KubeRay cluster at its limit), starting at 1P+1D.

The workers are the emulated fixed-speed devices of tests/fakes/workers.py (the real engine,
then a wait off the CPU as long as a device of that speed would take): on this 2-core machine N
CPU workers share the same two cores, so without them a bigger pool has no more capacity. Writes
results/autoscale_ramp.json (attainment of the TTFT SLO, failures, the pool sizes and p90 TTFT
over time for both) and results/autoscale_ramp.png.

    python benchmarks/autoscale_ramp.py [--hold-rate 5] [--ttft-slo-ms 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PACED = {"prefill": "tests.fakes.workers:PacedPrefill", "decode": "tests.fakes.workers:PacedDecode"}


def phases(a) -> list[tuple[str, float, float]]:
    """(name, rate req/s, seconds)."""
    return [("up", a.low_rate, a.low_s), ("hold", a.hold_rate, a.hold_s), ("down", a.low_rate, a.down_s)]


def app_args(model: str, name: str, a, autoscale: bool) -> dict:
    args = {"model": model, "served_model_name": "tiny", "name": name, "prefill": 1, "decode": 1,
            "disagg_min_tokens": 0, "ttft_slo_ms": a.ttft_slo_ms, "tpot_slo_ms": a.tpot_slo_ms,
            "admission": False, "worker_classes": PACED, "engine": {"num_kv_blocks": 2048, "device": "cpu"}}
    if autoscale:
        args["autoscale"] = {"prefill": {"min": 1, "max": 3}, "decode": {"min": 1, "max": 2},
                             "interval_s": a.interval_s, "up_cooldown_s": a.up_cooldown_s,
                             "down_cooldown_s": a.down_cooldown_s, "window_s": 10.0, "rate_window_s": 6.0}
    return args


class PoolWatch:
    """The pools' READY sizes and targets once a second, from the Controller's status."""

    def __init__(self, controller, t0: float) -> None:
        self.rows, self._stop = [], threading.Event()
        self._thread = threading.Thread(target=self._run, args=(controller, t0), daemon=True)
        self._thread.start()

    def _run(self, controller, t0: float) -> None:
        import ray

        while not self._stop.is_set():
            st = ray.get(controller.status.remote())
            ready = {r: sum(1 for w in st.workers if w.role == r and w.state == "ready") for r in ("prefill", "decode")}
            self.rows.append({"t": round(time.time() - t0, 2), "ready": ready, "targets": dict(st.targets)})
            self._stop.wait(1.0)

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join(5)
        return self.rows


async def ramp(url: str, a, t0: float) -> list[dict]:
    """Every phase's open-loop load, each starting at its offset (arrivals do not pause for a
    phase's stragglers); every request's start (s since t0), TTFT and status."""
    from splitserve.bench.datasets import random_requests
    from splitserve.bench.metrics import Slo
    from splitserve.bench.runner import BenchConfig, LoadConfig, run_bench_async

    async def phase(i: int, rate: float, seconds: float, offset: float) -> list[dict]:
        await asyncio.sleep(max(0.0, t0 + offset - time.time()))
        began = time.time() - t0
        cfg = BenchConfig(url, "tiny", LoadConfig(rate=rate, duration_s=seconds, drain_timeout_s=120, seed=i),
                          Slo(a.ttft_slo_ms, None), progress=False)
        reqs = random_requests(input_len=(a.input_lo, a.input_hi), output_len=(16, 32), vocab_size=384, seed=i)
        run = await run_bench_async(cfg, reqs)
        return [{"t": round(began + r.start_s, 3), "ttft_s": r.ttft_s, "status": r.status} for r in run.results]

    offsets, at = [], 0.0
    for _, _, seconds in phases(a):
        offsets.append(at)
        at += seconds
    runs = await asyncio.gather(*[phase(i, rate, s, off) for i, ((_, rate, s), off) in
                                  enumerate(zip(phases(a), offsets))])
    return sorted((r for run in runs for r in run), key=lambda r: r["t"])


def run_one(model: str, a, autoscale: bool) -> dict:
    import ray
    from ray import serve

    from splitserve.control import controller as controller_mod
    from splitserve.control.launch import wait_ready
    from splitserve.deploy import build_app

    name = "ramp-autoscaled" if autoscale else "ramp-fixed"
    serve.run(build_app(app_args(model, name, a, autoscale)), name=name, route_prefix="/")
    controller = controller_mod.find(name, "splitserve")
    wait_ready(controller, timeout_s=180)
    t0 = time.time()
    watch = PoolWatch(controller, t0)
    requests = asyncio.run(ramp(f"http://127.0.0.1:{a.port}", a, t0))
    time.sleep(a.tail_s)  # the autoscaled pools shrink after the ramp
    pools = watch.stop()
    ended = ray.get(controller.ended.remote())
    serve.delete(name)
    ok = [r for r in requests if r["status"] == "ok"]
    met = sum(1 for r in ok if r["ttft_s"] * 1000 <= a.ttft_slo_ms)
    return {"name": name, "requests": len(requests), "failed": len(requests) - len(ok),
            "ttft_slo_attainment": met / len(requests) if requests else 0.0,
            "ttft_p90_s_by_window": p90_by_window(requests, a.bin_s), "pools": pools,
            "drained": sum(1 for r in ended if r.reason == "drained"), "dead": sum(1 for r in ended if r.state.value == "dead"),
            "request_rows": requests}


def p90_by_window(requests: list[dict], bin_s: float) -> list[dict]:
    out, bins = [], {}
    for r in requests:
        bins.setdefault(int(r["t"] // bin_s), []).append(r["ttft_s"] if r["ttft_s"] is not None else float("inf"))
    for k in sorted(bins):
        v = sorted(bins[k])
        out.append({"t": (k + 0.5) * bin_s, "p90_s": v[min(len(v) - 1, int(0.9 * len(v)))], "n": len(v)})
    return out


def plot(report: dict, path: Path, a) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for run, style in ((report["autoscaled"], "-"), (report["fixed"], ":")):
        ts = [p["t"] for p in run["pools"]]
        for role, color in (("prefill", "tab:blue"), ("decode", "tab:orange")):
            top.step(ts, [p["ready"][role] for p in run["pools"]], style, color=color, where="post",
                     label=f"{run['name']}: {role} ready")
        w = run["ttft_p90_s_by_window"]
        bottom.plot([x["t"] for x in w], [min(x["p90_s"], 60) * 1000 for x in w], style, marker=".",
                    label=f"{run['name']}: p90 TTFT (attainment {100 * run['ttft_slo_attainment']:.0f}%)")
    at = 0.0
    for name, rate, seconds in phases(a):
        top.axvspan(at, at + seconds, alpha=0.06 if name != "hold" else 0.15, color="grey")
        top.text(at + 1, 0.02, f"{name}: {rate:g} req/s", fontsize=8, transform=top.get_xaxis_transform())
        at += seconds
    bottom.axhline(a.ttft_slo_ms, color="red", lw=0.8, label=f"TTFT SLO {a.ttft_slo_ms:g} ms")
    top.set_ylabel("workers READY")
    top.legend(fontsize=7, loc="upper right")
    bottom.set_ylabel("p90 TTFT per window (ms)")
    bottom.set_yscale("log")
    bottom.set_xlabel("seconds since the ramp began")
    bottom.legend(fontsize=7, loc="upper right")
    fig.suptitle("Autoscaled vs fixed 1P+1D under a ramp of long prompts (emulated fixed-speed devices)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--low-rate", type=float, default=1.5)
    ap.add_argument("--hold-rate", type=float, default=5.0)
    ap.add_argument("--low-s", type=float, default=20.0)
    ap.add_argument("--hold-s", type=float, default=60.0)
    ap.add_argument("--down-s", type=float, default=40.0)
    ap.add_argument("--tail-s", type=float, default=20.0)
    ap.add_argument("--input-lo", type=int, default=512)
    ap.add_argument("--input-hi", type=int, default=1000)
    ap.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    ap.add_argument("--tpot-slo-ms", type=float, default=200.0)
    ap.add_argument("--interval-s", type=float, default=2.0)
    ap.add_argument("--up-cooldown-s", type=float, default=5.0)
    ap.add_argument("--down-cooldown-s", type=float, default=20.0)
    ap.add_argument("--bin-s", type=float, default=5.0)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--out", default="results/autoscale_ramp.json")
    a = ap.parse_args()
    import ray
    from ray import serve

    from tests.tiny_models import build_checkpoint

    os.environ["RAY_AUTH_MODE"] = "disabled"
    model = str(build_checkpoint("llama", Path(tempfile.mkdtemp()) / "tiny"))
    ray.init(num_cpus=6, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})  # the workers import the emulated devices
    serve.start(http_options={"host": "127.0.0.1", "port": a.port})
    began = time.time()
    report = {"fixed": run_one(model, a, autoscale=False), "autoscaled": run_one(model, a, autoscale=True)}
    report["config"] = {**vars(a), "phases": phases(a), "workers": PACED, "wall_s": round(time.time() - began, 1)}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    plot(report, out.with_suffix(".png"), a)
    for k in ("fixed", "autoscaled"):
        r = report[k]
        peak = max(p["ready"]["prefill"] for p in r["pools"])
        print(f"{k:10s}: {r['requests']} requests, {r['failed']} failed, TTFT SLO attainment "
              f"{100 * r['ttft_slo_attainment']:.1f}%, prefill peak {peak}, drained {r['drained']}, dead {r['dead']}")
    print(f"wrote {out} and {out.with_suffix('.png')}")
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
