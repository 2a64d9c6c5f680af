"""`splitserve simulate`: arguments → workload + cost model + SimConfig → one run, a goodput
search, a prefill:decode sweep, or a plan (`--plan`: the starting configuration for a sample of
the expected traffic, sim/planner.py) → summary printed, JSON (+ PNG) written. `--calibrate` instead
measures this machine's engine (sim/calibrate.py) and writes the cost model JSON."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from splitserve.sim import planner, search
from splitserve.sim.cost import ByRole
from splitserve.sim.cost.hardware import gpu
from splitserve.sim.cost.linear import LinearCost
from splitserve.sim.cost.profiled import profiled_cost
from splitserve.sim.cost.comm import SCHEDULES
from splitserve.sim.cost.parallel import Layout, ParallelCost
from splitserve.sim.cost.roofline import RooflineCost
from splitserve.sim.cost.shapes import ModelShape, model_shape
from splitserve.sim.pools import LAYOUTS
from splitserve.sim.report import format_summary, plot, summarize
from splitserve.sim.simulation import SimConfig, Simulation
from splitserve.sim.speculation import SpecSim
from splitserve.sim.workload import Workload, from_bench, from_trace
from splitserve.types import ConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload")
    w.add_argument("--trace", default=None, help="a Mooncake JSONL trace (e.g. ../shared/data/mooncake/conversation_trace.jsonl)")
    w.add_argument("--dataset", choices=("mooncake", "random", "shared-prefix"), default="mooncake",
                   help="without --trace: a splitserve bench dataset (default: mooncake, which needs --trace)")
    w.add_argument("--max-requests", type=int, default=None, help="the first N requests of the workload")
    w.add_argument("--rate-scale", type=float, default=1.0, help="arrivals this many times denser (default: 1)")
    w.add_argument("--length-scale", type=float, default=1.0,
                   help="trace prompts and hash blocks x this (1/32: 512-token blocks become 16; default 1)")
    w.add_argument("--max-output-len", type=int, default=None, help="cap each output length")
    w.add_argument("--rate", type=float, default=4.0, help="random / shared-prefix: requests per second")
    w.add_argument("--num-requests", type=int, default=200, help="random / shared-prefix: how many")
    w.add_argument("--input-len", type=int, nargs=2, default=[128, 512], metavar=("LO", "HI"))
    w.add_argument("--output-len", type=int, nargs=2, default=[32, 128], metavar=("LO", "HI"))
    w.add_argument("--grammar-share", type=float, default=0.0,
                   help="this share of requests carry a structured-output grammar (default 0)")
    w.add_argument("--grammar-kinds", type=int, default=16, help="distinct grammars among them (default 16)")
    w.add_argument("--grammar-compile-ms", type=float, default=1.1,
                   help="a grammar's compile on a worker that has not cached it (default 1.1, measured here)")
    c = p.add_argument_group("cost model (one of)")
    c.add_argument("--gpu", default=None, help="roofline: h100, h200, a100, h20, h800, l40s")
    c.add_argument("--model", default="llama-3-8b",
                   help="roofline model shape: llama-3-8b, llama-3-70b, qwen2.5-7b, qwen2.5-72b, deepseek-v3, "
                        "deepseek-r1 or a config.json "
                        "(with --calibrate: the checkpoint directory to measure)")
    c.add_argument("--calibrated", default=None, metavar="FILE", help="a cost model JSON from --calibrate")
    c.add_argument("--calibrated-prefill", default=None, metavar="FILE",
                   help="the prefill pool's own cost model JSON (default: --calibrated's)")
    c.add_argument("--profiled", default=None, metavar="FILE", help="a benchmarks/gpu/bench_gpu.py JSON (with --gpu)")
    c.add_argument("--compute-efficiency", type=float, default=0.6, help="roofline: of peak FLOP/s (default 0.6)")
    c.add_argument("--memory-efficiency", type=float, default=0.8, help="roofline: of HBM bandwidth (default 0.8)")
    c.add_argument("--step-overhead-ms", type=float, default=2.0, help="roofline: per step (default 2)")
    c.add_argument("--tensor-parallel", type=int, default=1, help="roofline: GPUs per worker (default 1)")
    c.add_argument("--pipeline-parallel", type=int, default=1,
                   help="roofline: pipeline stages per worker, across nodes where they do not fit one (default 1)")
    c.add_argument("--micro-batches", type=int, default=1,
                   help="roofline: a pipelined step's micro-batches (default 1)")
    c.add_argument("--pp-schedule", choices=SCHEDULES, default="flush",
                   help="flush: every step drains the pipeline (the bubble); async: micro-batches of successive "
                        "steps overlap (default flush)")
    c.add_argument("--dp-attention", type=int, default=1,
                   help="roofline: attention replicas per stage, each with its own requests and KV (default 1)")
    c.add_argument("--expert-parallel", action="store_true",
                   help="roofline: routed experts spread over the stage's tp x dp ranks, all-to-all a MoE layer")
    c.add_argument("--expert-imbalance", type=float, default=1.0,
                   help="roofline, expert parallel: the busiest rank's routed tokens over the mean (default 1)")
    k = p.add_argument_group("cluster")
    k.add_argument("--prefill", type=int, default=1, help="prefill workers (default 1)")
    k.add_argument("--decode", type=int, default=1, help="decode workers (default 1)")
    k.add_argument("--aggregated", type=int, default=None, metavar="N", help="N workers that prefill and decode")
    k.add_argument("--autoscale", default=None, metavar="JSON",
                   help='autoscale the pools: {"prefill": {"min": 1, "max": 16}, "decode": {...}, "interval_s": 10}')
    k.add_argument("--gpus-per-node", type=int, default=8)
    k.add_argument("--layout", choices=LAYOUTS, default="by-role")
    k.add_argument("--worker-start-s", type=float, default=30.0, help="autoscaled worker start-up (default 30)")
    k.add_argument("--host-cores", type=int, default=None, help="CPU serving: cores a node's workers share")
    e = p.add_argument_group("engine")
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--max-num-seqs", type=int, default=256)
    e.add_argument("--max-num-batched-tokens", type=int, default=2048)
    e.add_argument("--max-model-len", type=int, default=131072)
    e.add_argument("--dtype", default="auto", help="--calibrate: the engine's dtype")
    e.add_argument("--kv-cache-memory-gib", type=float, default=1.0, help="--calibrate: the engine's KV cache")
    e.add_argument("--threads", type=int, default=None, help="--calibrate: torch threads (a Ray worker has 1)")
    e.add_argument("--spec-k", type=int, default=0,
                   help="speculative decoding: proposals per sequence and step (default 0: none)")
    e.add_argument("--spec-acceptance", type=float, default=0.0,
                   help="speculative decoding: each proposal's acceptance rate, i.i.d. (e.g. 0.7 code edits, "
                        "0.4 tool JSON, 0.15 open chat with the n-gram proposer, results/speculative.json)")
    r = p.add_argument_group("router")
    r.add_argument("--policy", default="cache_aware", help="round_robin, least_loaded, power_of_two, cache_aware")
    r.add_argument("--disagg-min-tokens", type=int, default=32)
    r.add_argument("--pd-decider", choices=("slo", "threshold"), default="slo",
                   help="which requests go through a prefill worker (router/pd_decider.py; default slo)")
    r.add_argument("--kv-streaming", choices=("on", "off"), default="on",
                   help="the KV moves while the prompt is computed (on: only the last chunk's after it)")
    r.add_argument("--kv-streaming-min-tokens", type=int, default=2048)
    r.add_argument("--ttft-slo-ms", type=float, default=None)
    r.add_argument("--tpot-slo-ms", type=float, default=None)
    r.add_argument("--no-admission", action="store_true", help="admit everything")
    r.add_argument("--max-inflight", type=int, default=1_000_000)
    r.add_argument("--ingress-ms", type=float, default=0.0, help="arrival -> a worker's queue")
    r.add_argument("--handoff-ms", type=float, default=0.0, help="first token -> the decode worker's pull starts")
    r.add_argument("--stream-ms", type=float, default=0.0, help="engine -> client, per token")
    m = p.add_argument_group("mode")
    m.add_argument("--goodput", action="store_true", help="search the highest rate with >= 90%% SLO attainment")
    m.add_argument("--sweep-ratio", type=int, default=None, metavar="GPUS",
                   help="the goodput search for every prefill:decode split of GPUS (and aggregated)")
    m.add_argument("--plan", action="store_true",
                   help="choose the start for the workload (a sample of the expected traffic) on the workers given "
                        "(--prefill + --decode or --aggregated): each aggregated budget and static split, the most "
                        "goodput per GPU at --attainment; prints the DeployConfig values")
    m.add_argument("--plan-deciders", nargs="+", choices=("threshold", "slo"), default=["threshold"],
                   help="--plan: the PD deciders a split is tried with (default threshold)")
    m.add_argument("--attainment", type=float, default=0.9, help="the goodput search's target (default 0.9)")
    m.add_argument("--calibrate", action="store_true", help="measure this machine's engine (--model DIR) instead")
    m.add_argument("--budget-s", type=float, default=90.0, help="--calibrate: seconds to spend")
    m.add_argument("--out", default="results/simulate.json", help="JSON path; the PNG goes next to it")
    m.add_argument("--no-plot", action="store_true")


def workload_of(a: argparse.Namespace) -> Workload:
    if a.trace is not None:
        w = from_trace(a.trace, a.max_requests, length_scale=a.length_scale, max_output_len=a.max_output_len)
    elif a.dataset == "mooncake":
        raise ConfigError("--dataset mooncake needs --trace FILE")
    else:
        from splitserve.bench.datasets import random_requests, shared_prefix_requests

        gen = (random_requests(a.input_len, a.output_len) if a.dataset == "random"
               else shared_prefix_requests(output_len=a.output_len[0]))
        reqs = [b for _, b in zip(range(a.max_requests or a.num_requests), gen)]
        w = from_bench(reqs, rate=a.rate, name=a.dataset)
    if not w.requests:
        raise ConfigError("the workload has no requests")
    if a.grammar_share:
        w = w.with_grammars(a.grammar_share, a.grammar_kinds)
    return w.scaled(a.rate_scale) if a.rate_scale != 1.0 else w


def cost_of(a: argparse.Namespace):
    if a.calibrated is not None:
        cost = LinearCost.load(a.calibrated)
        return cost if a.calibrated_prefill is None else ByRole(LinearCost.load(a.calibrated_prefill), cost)
    if a.calibrated_prefill is not None:
        raise ConfigError("--calibrated-prefill goes with --calibrated (the decode pool's)")
    if a.gpu is None:
        raise ConfigError("give a cost model: --gpu NAME (roofline, with --model), --calibrated FILE or --profiled FILE")
    shape = model_shape(a.model)
    layout = Layout(tp=a.tensor_parallel, pp=a.pipeline_parallel, dp_attention=a.dp_attention,
                    expert_parallel=a.expert_parallel, micro_batches=a.micro_batches, schedule=a.pp_schedule,
                    gpus_per_node=a.gpus_per_node)
    if not isinstance(shape, ModelShape) or layout != Layout(tp=a.tensor_parallel, gpus_per_node=a.gpus_per_node):
        if a.profiled is not None:
            raise ConfigError("--profiled fits a single-stage dense roofline; not with pipeline, DP attention, "
                              "experts or latent attention")
        return ParallelCost(gpu(a.gpu), shape, layout, a.compute_efficiency, a.memory_efficiency,
                            a.step_overhead_ms / 1e3, expert_imbalance=a.expert_imbalance)
    roof = RooflineCost(gpu(a.gpu), shape, a.compute_efficiency, a.memory_efficiency,
                        a.step_overhead_ms / 1e3, tensor_parallel=a.tensor_parallel)
    return profiled_cost(a.profiled, roof, a.block_size) if a.profiled is not None else roof


def config_of(a: argparse.Namespace) -> SimConfig:
    from splitserve.control.autoscale import AutoscaleConfig

    prefill, decode = (0, a.aggregated) if a.aggregated is not None else (a.prefill, a.decode)
    autoscale = None
    if a.autoscale is not None:
        try:
            d = json.loads(a.autoscale)
        except ValueError as e:
            raise ConfigError(f"--autoscale must be a JSON object ({e})") from None
        autoscale = AutoscaleConfig.from_dict(d, a.ttft_slo_ms and a.ttft_slo_ms / 1e3,
                                              a.tpot_slo_ms and a.tpot_slo_ms / 1e3)
    return SimConfig(prefill=prefill, decode=decode, policy=a.policy, disagg_min_tokens=a.disagg_min_tokens,
                     pd_decider=a.pd_decider, kv_streaming=a.kv_streaming == "on",
                     kv_streaming_min_tokens=a.kv_streaming_min_tokens,
                     block_size=a.block_size, max_num_seqs=a.max_num_seqs,
                     max_num_batched_tokens=a.max_num_batched_tokens, max_model_len=a.max_model_len,
                     ttft_slo_ms=a.ttft_slo_ms, tpot_slo_ms=a.tpot_slo_ms, admission=not a.no_admission,
                     max_inflight=a.max_inflight, autoscale=autoscale, gpus_per_node=a.gpus_per_node,
                     layout=a.layout, worker_start_s=a.worker_start_s, ingress_s=a.ingress_ms / 1e3,
                     handoff_s=a.handoff_ms / 1e3, stream_s=a.stream_ms / 1e3, host_cores=a.host_cores,
                     grammar_compile_s=a.grammar_compile_ms / 1e3,
                     speculation=SpecSim(a.spec_k, a.spec_acceptance))


def run_once(config: SimConfig, cost, workload: Workload) -> tuple[dict[str, Any], Simulation]:
    sim = Simulation(config, cost, workload).run()
    return summarize(sim), sim


def run_from_args(a: argparse.Namespace) -> int:
    try:
        return _run(a)
    except (ConfigError, ValueError) as e:
        print(f"splitserve simulate: {e}", file=sys.stderr)
        return 2


def _run(a: argparse.Namespace) -> int:
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if a.calibrate:
        return _calibrate(a, out)
    workload, cost, config = workload_of(a), cost_of(a), config_of(a)
    if a.plan:
        return _plan(a, workload, cost, config, out)
    if a.sweep_ratio is not None or a.goodput:
        if config.ttft_slo_ms is None and config.tpot_slo_ms is None:
            raise ConfigError("--goodput and --sweep-ratio need --ttft-slo-ms and/or --tpot-slo-ms")

        def runner(cfg: SimConfig):
            return lambda scale: run_once(cfg, cost, workload.scaled(scale))[0]

        if a.sweep_ratio is not None:
            result = search.sweep_ratio(lambda p, d: runner(dataclasses.replace(config, prefill=p, decode=d)), a.sweep_ratio,
                                        target=a.attainment)
            for r in result["splits"]:
                print(f"P{r['prefill']}:D{r['decode']}  {r['rate_rps']:.3f} req/s  "
                      f"{r['goodput_rps_per_gpu']:.4f} req/s per GPU")
        else:
            result = search.goodput(runner(config), target=a.attainment)
            print(f"goodput: {result['rate_rps']:.3f} req/s at >= {a.attainment:.0%} SLO attainment on "
                  f"{result['gpus']} GPUs: {result['goodput_rps_per_gpu']:.4f} req/s per GPU")
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")
        return 0
    summary, sim = run_once(config, cost, workload)
    print(format_summary(summary))
    out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {out}")
    if not a.no_plot:
        print(f"wrote {plot(summary, sim.outcomes, out.with_suffix('.png'), workload.name)}")
    return 0


def _plan(a: argparse.Namespace, workload: Workload, cost, config: SimConfig, out: Path) -> int:
    if config.ttft_slo_ms is None and config.tpot_slo_ms is None:
        raise ConfigError("--plan needs --ttft-slo-ms and/or --tpot-slo-ms")
    workers = config.prefill + config.decode
    cands = planner.candidates(workers, deciders=tuple(a.plan_deciders))
    p = planner.plan(cost, workload, config, workers, a.attainment, cands)
    for s in p.scored:
        print(f"{s.candidate.name:<18} {s.goodput:.4f} req/s per GPU (x{s.rate_scale:g} the sample's rate, "
              f"{s.attainment:.0%} attained)")
    print(f"plan: {p.name}, {p.goodput:.4f} req/s per GPU at >= {a.attainment:.0%} SLO attainment")
    values = p.deploy_values()
    print(f"DeployConfig: {json.dumps(values)}")
    out.write_text(json.dumps({"plan": p.name, "goodput_rps_per_gpu": p.goodput, "target": p.target,
                               "deploy": values, "scored": [{"name": s.candidate.name, **dataclasses.asdict(s)}
                                                            for s in p.scored]}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def _calibrate(a: argparse.Namespace, out: Path) -> int:
    from splitserve.config import EngineConfig
    from splitserve.engine.model.demo import ensure_demo_model
    from splitserve.sim.calibrate import calibrate

    model = a.model if Path(a.model).is_dir() else str(ensure_demo_model(progress=False))
    cfg = EngineConfig(model=model, dtype=a.dtype, device="cpu", block_size=a.block_size,
                       kv_cache_memory_gib=a.kv_cache_memory_gib, max_num_seqs=a.max_num_seqs,
                       max_num_batched_tokens=a.max_num_batched_tokens)
    cost, fit = calibrate(cfg, a.threads, a.budget_s)
    cost.save(out)
    print(f"c0 {cost.c0 * 1e3:.3f} ms + c1 {cost.c1 * 1e6:.2f} us/prefill token + c2 {cost.c2 * 1e6:.1f} us/decode "
          f"seq + c3 {cost.c3 * 1e9:.2f} ns/context token + c4 {cost.c4 * 1e9:.2f} ns/attention pair; {fit['steps']} steps, median error "
          f"{fit['median_rel_error']:.1%}, p90 {fit['p90_rel_error']:.1%}")
    print(f"wrote {out}")
    return 0
