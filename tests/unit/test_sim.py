"""The simulator (splitserve/sim/): it runs the real scheduler and block pool (its engine steps
the same as the torch Engine's, step for step), the real router (the same placements as the live
Directory on a recorded event sequence), the real admission and autoscaler; its timings follow
its cost model exactly; it imports neither torch nor Ray; and the CLI writes what the issue asks."""

import asyncio
import json
import subprocess
import sys

import pytest

from splitserve.control.autoscale import AutoscaleConfig, Bounds
from splitserve.bench.datasets import TraceRecord
from splitserve.sim import search
from splitserve.engine.step_shape import StepShape
from splitserve.sim.cost import Link
from splitserve.engine.least_squares import nonneg_least_squares
from splitserve.sim.cost.hardware import gpu
from splitserve.sim.cost.linear import LinearCost
from splitserve.sim.cost.profiled import profiled_cost
from splitserve.sim.cost.roofline import RooflineCost
from splitserve.sim.cost.shapes import model_shape
from splitserve.sim.engine import SimEngine
from splitserve.sim.events import EventLoop
from splitserve.sim.report import summarize
from splitserve.sim.simulation import SimConfig, Simulation
from splitserve.sim.workload import SimRequestSpec, Workload, from_records
from splitserve.types import ConfigError, Request, Role, SamplingParams

C = (0.01, 1e-4, 2e-3, 1e-6)  # c0 s, c1 s/prefill token, c2 s/decode seq, c3 s/context token


def linear(blocks=4096, link=Link(1e9, 1e8, 1e-3, 2e-3), kvb=1000, bs=16) -> LinearCost:
    return LinearCost(*C, num_kv_blocks=blocks, block_size=bs, kv_bytes_per_token=kvb, link=link)


def records(n=60, every_ms=150, seed=3):
    """A Mooncake-shaped trace: 4 conversations whose turns extend each other's hash ids."""
    import random

    rng = random.Random(seed)
    convs = [[c * 1000 + k for k in range(3)] for c in range(4)]
    out = []
    for i in range(n):
        conv = convs[rng.randrange(4)]
        conv.append(max(conv) + 1)
        out.append(TraceRecord(i * every_ms, 16 * len(conv) + rng.randrange(1, 16), rng.randrange(2, 12),
                               tuple(conv)))
    return out


def test_the_simulator_imports_neither_torch_nor_ray():
    code = ("import sys, splitserve.sim.command, splitserve.sim.simulation, splitserve.sim.report; "
            "bad = {'torch', 'ray', 'numpy'} & set(sys.modules); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_events_run_in_time_order_and_ties_in_the_order_scheduled():
    loop, seen = EventLoop(), []
    for t, name in ((2.0, "c"), (1.0, "a"), (1.0, "b"), (0.5, "first")):
        loop.at(t, seen.append, name)
    loop.run()
    assert seen == ["first", "a", "b", "c"] and loop.now == 2.0 and loop.events == 4
    with pytest.raises(ValueError):
        loop.at(1.0, seen.append, "past")


def test_the_sim_engine_schedules_step_for_step_as_the_real_engine(tiny_checkpoint):
    """The same requests through the torch Engine and the SimEngine (same pool, budget, block
    size): every step schedules the same sequences and token counts and preempts the same ones —
    a pool small enough to force preemptions, chunked prefill and prefix hits included."""
    from splitserve.config import EngineConfig
    from splitserve.engine.engine import Engine

    kw = dict(block_size=16, max_num_seqs=8, max_num_batched_tokens=64)
    real = Engine(EngineConfig(model=str(tiny_checkpoint("llama")), dtype="float32", device="cpu",
                               num_kv_blocks=14, **kw))
    sim = SimEngine(linear(), num_blocks=14, max_model_len=real.max_model_len, **kw)
    shared = list(range(3, 35))
    prompts = [shared + list(range(100 + 7 * i, 100 + 7 * i + 10 + 9 * i)) for i in range(6)]
    for e in (real, sim):
        for i, p in enumerate(prompts):
            e.add_request(Request(f"q{i}", p, SamplingParams(temperature=0.0, max_tokens=12 + 3 * i, ignore_eos=True)))

    def trace(e):
        steps = []
        while e.scheduler.has_work():
            sched = e.scheduler.schedule()
            steps.append((tuple((s.seq.request_id, s.num_new_tokens) for s in sched.scheduled),
                          tuple(s.request_id for s in sched.preempted)))
            if sched.scheduled:
                e._complete(sched, e._forward(sched))
        e.check_invariants()
        return steps

    real_steps, sim_steps = trace(real), trace(sim)
    assert real_steps == sim_steps
    assert any(pre for _, pre in real_steps), "the pool was meant to force a preemption"
    assert real.scheduler.prefix_hit_tokens == sim.scheduler.prefix_hit_tokens > 0
    assert sim.pool.num_in_use == real.pool.num_in_use == 0


def test_timings_follow_the_cost_model_exactly_on_the_disaggregated_path():
    """One request, 100 prompt tokens, 3 output tokens, a prefill and a decode worker on
    different nodes: first token after the prefill step; the second after the handoff, the KV
    transfer (latency + bytes / cross-node bandwidth) and one decode step; the third one step on."""
    cost = linear()
    spec = SimRequestSpec(0, 0.0, 100, 3)
    cfg = SimConfig(prefill=1, decode=1, handoff_s=0.004, ingress_s=0.002, stream_s=0.001)
    sim = Simulation(cfg, cost, Workload((spec,), 16)).run()
    (o,) = sim.outcomes
    c0, c1, c2, c3 = C
    prefill = c0 + 100 * c1
    transfer = 2e-3 + 100 * 1000 / 1e8
    second = cfg.ingress_s + prefill + cfg.handoff_s + transfer + (c0 + c2 + 100 * c3) + cfg.stream_s
    third = second + (c0 + c2 + 101 * c3)
    assert o.status == "ok" and o.disaggregated and o.output_tokens == 3
    assert o.ttft_s == pytest.approx(cfg.ingress_s + prefill + cfg.stream_s, rel=1e-12)
    assert o.tpot_s == pytest.approx((third - o.ttft_s) / 2, rel=1e-12)
    assert o.end_s == pytest.approx(third - cfg.stream_s, rel=1e-12)


def test_a_streamed_handoff_exposes_only_the_last_steps_kv():
    """A 5000-token prompt at 2048 tokens a step: streamed, only the last step's 904 tokens' KV
    moves after the prefill (the rest moved behind it), so the request ends earlier by exactly
    the transfer of the other 4096 tokens' bytes; below kv_streaming_min_tokens all of it moves."""
    cost = linear()
    ends = {}
    for streaming, least in ((True, 2048), (False, 2048), (True, 8192)):
        cfg = SimConfig(prefill=1, decode=1, kv_streaming=streaming, kv_streaming_min_tokens=least)
        (o,) = Simulation(cfg, cost, Workload((SimRequestSpec(0, 0.0, 5000, 3),), 16)).run().outcomes
        assert o.status == "ok" and o.disaggregated
        ends[(streaming, least)] = o.end_s
    assert ends[(False, 2048)] - ends[(True, 2048)] == pytest.approx(4096 * 1000 / 1e8, rel=1e-9)
    assert ends[(True, 8192)] == ends[(False, 2048)]


def test_a_grammar_compile_delays_a_request_where_it_is_not_cached():
    """Three requests with one json_schema, spaced out, over 1P+1D: the first pays the compile
    on the prefill worker (its TTFT) and again on the decode worker (after the KV lands); the
    second finds both cached; a third with another grammar pays again. Admission counted it."""
    cost, compile_s = linear(), 0.05
    specs = (SimRequestSpec(0, 0.0, 100, 3, grammar="a"), SimRequestSpec(1, 1.0, 100, 3, grammar="a"),
             SimRequestSpec(2, 2.0, 100, 3, grammar="b"), SimRequestSpec(3, 3.0, 100, 3))
    sim = Simulation(SimConfig(prefill=1, decode=1, grammar_compile_s=compile_s), cost, Workload(specs, 16)).run()
    first, cached, other, free = sim.outcomes
    prefill = C[0] + 100 * C[1]
    assert first.ttft_s == pytest.approx(compile_s + prefill, rel=1e-9)
    assert other.ttft_s == pytest.approx(first.ttft_s, rel=1e-9)
    assert cached.ttft_s == free.ttft_s == pytest.approx(prefill, rel=1e-9)
    assert first.tpot_s > cached.tpot_s + compile_s / 2 - 1e-9  # the decode worker's compile, spread over 2
    assert [w.engine.grammars.compiles for w in sim.pools.all_workers()] == [2, 2]
    assert len(sim.admission.compiled) == 2  # (the prefill worker, a) and (…, b): later ones counted as cached


def test_a_workload_with_grammars_runs_and_drains():
    w = from_records(records(), tokens_per_hash=16).with_grammars(0.5, 3, seed=1)
    with_g = [r for r in w.requests if r.grammar is not None]
    assert 15 < len(with_g) < 45 and {r.grammar for r in with_g} <= {"g0", "g1", "g2"}
    s = summarize(Simulation(SimConfig(prefill=1, decode=2, disagg_min_tokens=16), linear(), w).run())
    assert s["completed"] == 60
    with pytest.raises(ConfigError):
        w.with_grammars(1.5, 3)


def test_a_trace_runs_aggregated_and_disaggregated_with_prefix_hits_and_every_request_done():
    w = from_records(records(), tokens_per_hash=16)
    for p, d in ((0, 2), (1, 2)):
        sim = Simulation(SimConfig(prefill=p, decode=d, disagg_min_tokens=16), linear(), w).run()  # checks drained
        s = summarize(sim)
        assert s["completed"] == s["requests"] == 60 and s["failed"] == s["rejected"] == 0
        assert sum(o.output_tokens for o in sim.outcomes) == sum(r.output_len for r in w.requests)
        assert s["prefix_hit_rate"] > 0.3  # later turns reuse earlier turns' blocks
        assert (s["disaggregated_share"] > 0.9) == (p > 0)
        assert s["ttft_ms"]["p50"] > 0 and s["tpot_ms"]["p90"] >= s["tpot_ms"]["p50"]


def test_a_pool_too_small_for_the_load_preempts_and_still_finishes_everything():
    w = from_records(records(n=40, every_ms=5), tokens_per_hash=16)
    sim = Simulation(SimConfig(prefill=0, decode=1), linear(blocks=40), w).run()
    s = summarize(sim)
    assert s["preemptions"] > 0 and s["completed"] == 40


def test_admission_refuses_what_would_miss_the_ttft_target():
    w = from_records(records(n=60, every_ms=2), tokens_per_hash=16)
    loose = summarize(Simulation(SimConfig(prefill=0, decode=1, ttft_slo_ms=60_000), linear(), w).run())
    tight = summarize(Simulation(SimConfig(prefill=0, decode=1, ttft_slo_ms=80), linear(), w).run())
    assert loose["rejected"] == 0 and tight["rejected"] > 0
    assert tight["ttft_ms"]["p90"] < loose["ttft_ms"]["p90"]


def test_the_autoscaler_grows_the_pools_under_load_and_shrinks_them_after():
    burst = [TraceRecord(i * 20, 400 + (i % 7), 30, (i,)) for i in range(300)]
    calm = [TraceRecord(6000 + 2000 * i, 40, 4, (10_000 + i,)) for i in range(30)]
    w = from_records(burst + calm, tokens_per_hash=16)
    auto = AutoscaleConfig(prefill=Bounds(1, 6), decode=Bounds(1, 6), interval_s=1.0, ttft_slo_s=0.5,
                           tpot_slo_s=0.05, up_cooldown_s=1.0, down_cooldown_s=5.0, window_s=5.0, rate_window_s=2.0)
    sim = Simulation(SimConfig(prefill=1, decode=1, autoscale=auto, worker_start_s=2.0, admission=False),
                     linear(), w).run()
    ready = [(h["prefill"], h["decode"]) for h in summarize(sim)["pool_sizes"]]
    assert max(p for p, _ in ready) > 1, ready
    assert ready[-1][0] < max(p for p, _ in ready)  # scaled back down once the burst was over
    assert sim.pools.stopped  # drained workers stopped, their pools checked


def test_cost_models_agree_with_their_formulas():
    r = RooflineCost(gpu("h200"), model_shape("llama-3-8b"))
    m = r.model
    assert m.weight_bytes == pytest.approx(16.06e9, rel=0.01)  # 8.03 B parameters in bf16
    decode = r.step_s(StepShape(decode_seqs=1, decode_context=1000, sampled=1))
    assert decode == pytest.approx((m.weight_bytes + m.kv_bytes_per_token * 1001) / (4.8e12 * 0.8) + 0.002)
    prefill = r.step_s(StepShape(prefill_tokens=8192, prefill_attended=8192 * 4096.5, prefill_context=8192, sampled=1))
    assert prefill > 10 * decode  # compute-bound
    assert 0.6e6 < r.kv_blocks(16) * 16 < 0.9e6  # KV tokens left on 141 GB after 16 GB of weights
    with pytest.raises(Exception, match="tensor parallelism"):
        RooflineCost(gpu("l40s"), model_shape("llama-3-70b"))
    rows = [(1.0, float(p), float(b), float(b * c)) for p in (0, 512) for b in (1, 8) for c in (100, 900)]
    ys = [sum(a * x for a, x in zip(C, row)) for row in rows]
    assert nonneg_least_squares(rows, ys) == pytest.approx(list(C), rel=1e-6)


def test_a_calibrated_model_round_trips_and_a_gpu_bench_json_is_fitted(tmp_path):
    cost = linear()
    cost.save(tmp_path / "c.json")
    assert LinearCost.load(tmp_path / "c.json") == cost
    bench = {"decode": [{"batch": b, "context": c, "step_ms": 1e3 * (C[0] + C[2] * b + C[3] * b * c),
                         "backend": "triton"} for b in (1, 16, 64) for c in (512, 8192)],
             "prefill": [{"tokens": t, "seconds": C[0] + C[1] * t, "backend": "triton"} for t in (512, 2048, 8192)]}
    (tmp_path / "gpu.json").write_text(json.dumps(bench))
    prof = profiled_cost(tmp_path / "gpu.json", RooflineCost(gpu("h200"), model_shape("llama-3-8b")))
    assert prof.coeffs() == pytest.approx((*C, 0.0), rel=1e-4)  # a bench JSON has no attention term


def test_the_goodput_search_finds_the_highest_rate_meeting_the_target():
    def run(scale):  # attainment falls below 90% past 3.3x
        return {"slo_attainment": 0.95 if scale <= 3.3 else 0.5, "gpus": 4.0, "workload": {"rate_rps": 2.0 * scale},
                "ttft_ms": {"p90": 1.0}, "tpot_ms": {"p90": 1.0}}

    res = search.goodput(run, iters=8)
    assert 3.3 * 0.99 < res["rate_scale"] <= 3.3
    assert res["goodput_rps_per_gpu"] == pytest.approx(res["rate_scale"] * 2.0 / 4.0)


def test_the_cli_writes_the_summary_json_and_png(tmp_path):
    from splitserve.cli.main import main

    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length * 32,
                                         "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n"
                             for r in records(n=30)))
    out = tmp_path / "s.json"
    assert main(["simulate", "--trace", str(trace), "--length-scale", str(1 / 32), "--gpu", "h200", "--model",
                 "llama-3-8b", "--prefill", "1", "--decode", "2", "--ttft-slo-ms", "1000", "--tpot-slo-ms", "50",
                 "--out", str(out)]) == 0
    s = json.loads(out.read_text())
    for key in ("gpus", "requests", "completed", "slo_attainment", "goodput_rps", "prefix_hit_rate", "wall_s",
                "pool_sizes"):
        assert key in s
    assert s["gpus"] == 3 and s["requests"] == s["completed"] == 30
    assert all(s[m][q] is not None for m in ("ttft_ms", "tpot_ms") for q in ("p50", "p90", "p99"))
    assert out.with_suffix(".png").stat().st_size > 0
    assert main(["simulate", "--trace", str(trace), "--gpu", "nope", "--out", str(out)]) == 2  # a clear error


# -- the same placements as the live router --------------------------------------------------------
def test_the_simulated_router_places_as_the_live_directory_on_a_recorded_event_sequence():
    """Record a simulation's router inputs — each worker's reports (load + KV events) and each
    decision's pending counts — and replay them into the live router (router/directory.py, over
    fake workers answering its polls): every decision is the same pair of workers."""
    from splitserve.router.policy import make_router
    from tests.fakes.cluster import FakeSource

    w = from_records(records(n=50, every_ms=40), tokens_per_hash=16)
    sim = Simulation(SimConfig(prefill=2, decode=3, disagg_min_tokens=16), linear(), w)
    log: list = []
    report, place = sim.router.report, sim.router.place

    def recording_report(wid, stats, events, at):
        log.append(("report", wid, stats, list(events)))
        report(wid, stats, events, at)

    def recording_place(rr):
        views = sim.router.views(Role.PREFILL) + sim.router.views(Role.DECODE)  # the ones place() uses
        st = sim.router.stats
        pending = {v.worker_id: v.num_waiting - (st[v.worker_id].num_waiting if v.worker_id in st else 0)
                   for v in views}
        pl, tickets = place(rr)
        log.append(("place", rr, pending, (pl.prefill, pl.decode)))
        return pl, tickets

    sim.router.report, sim.router.place = recording_report, recording_place
    sim.run()
    decisions = [e for e in log if e[0] == "place"]
    assert len(decisions) == 50

    async def replay():
        src = FakeSource()
        for worker in sim.pools.all_workers():  # the same ids, roles and nodes
            src.registry.add(worker.id, src.workers.setdefault(worker.id, _Fake()))
            src.registry.move(worker.id, _ready(), info=_info(worker.node))
        from splitserve.router.directory import Directory

        d = Directory(src, make_router("cache_aware", disagg_min_tokens=16), 16, registry_interval_s=0.005,
                      load_interval_s=0.001, answer_timeout_s=1.0)
        await d.start()
        got = []
        for e in log:
            if e[0] == "report":
                _, wid, stats, events = e
                fake = src.workers[wid]
                fake.give(stats, events)
                while d.stats(wid) is not stats or fake.new:
                    await asyncio.sleep(0.001)
            else:
                _, rr, pending, _ = e
                tickets = [(wid, d.pending.add(wid)) for wid, n in pending.items() for _ in range(n)]
                req = Request(rr.request_id, (1,) * rr.num_tokens, SamplingParams(max_tokens=1),
                              prompt_hashes=_hashes(rr))
                route = d.place(req)
                got.append((route.prefill.id if route.prefill else None, route.decode.id))
                route.close()
                for wid, t in tickets:
                    d.pending.done(wid, t)
        d.stop()
        return got

    live = asyncio.run(replay())
    simulated = [e[3] for e in decisions]
    assert live == simulated
    assert len({d for _, d in simulated}) == 3 and len({p for p, _ in simulated}) == 2  # every worker chosen
    assert summarize(sim)["prefix_hit_rate"] > 0.3  # and the prefix scorer had hits to weigh


class _Fake:
    """A worker answering the Directory's polls with the reports a simulation recorded."""

    def __init__(self):
        from splitserve.worker.kv_events import RouterOutboxes
        from tests.fakes.cluster import Call, stats

        self.outboxes, self.load, self.new, self.cached = RouterOutboxes(), stats(), [], []
        self.snapshot = Call(self._snapshot)

    def give(self, stats, events):
        self.load = stats
        self.new += events

    async def _snapshot(self, ack, router):
        from splitserve.types import BlockStored
        from splitserve.worker.kv_events import Snapshot

        new, self.new = self.new, []
        out = self.outboxes.take(router, ack, new, lambda: [BlockStored(())])
        return Snapshot(self.load, *out)


def _ready():
    from splitserve.types import WorkerState

    return WorkerState.READY


def _info(node):
    from splitserve.worker.info import WorkerInfo

    return WorkerInfo(node, node, 1, tuple(type("E", (), {"transport": t})() for t in ("shm", "tcp")))


def _hashes(rr):
    from splitserve.types import PromptHashes

    return PromptHashes(rr.block_size, rr.block_hashes)


def test_the_simulated_prompts_share_exactly_the_blocks_the_bench_prompts_share():
    """`splitserve bench --dataset mooncake --length-scale` and `splitserve simulate
    --length-scale` read one trace alike: any two prompts have as many equal leading blocks."""
    from splitserve.bench.datasets import scale_lengths, trace_requests
    from splitserve.hashing import block_hashes
    from splitserve.sim.workload import PrefixHasher

    recs = [TraceRecord(0, 1700, 4, (1, 2, 3, 4)), TraceRecord(0, 2100, 4, (1, 2, 9)),
            TraceRecord(0, 900, 4, (1, 2, 3)), TraceRecord(0, 3000, 4, (5,))]
    scale = 1 / 32
    bench = [block_hashes(r.prompt, 16) for r in trace_requests(scale_lengths(recs, scale), block_size=16)]
    hasher = PrefixHasher(16, 16)
    sim = [hasher.hashes(s) for s in from_records(recs, length_scale=scale).requests]

    def common(a, b):
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    assert [len(h) for h in bench] == [len(h) for h in sim]
    for i in range(len(recs)):
        for j in range(len(recs)):
            assert common(bench[i], bench[j]) == common(sim[i], sim[j]), (i, j)
    assert common(sim[0], sim[1]) == 2 and common(sim[0], sim[2]) == 1 and common(sim[0], sim[3]) == 0


def test_a_decode_worker_drained_while_its_request_prefills_hands_the_request_to_another():
    """The pools shrink while a prompt is computed: its decode worker, idle so far, drains and
    stops before the handoff; the request is placed again on a decode worker still there and
    ends with every token, nothing left held."""
    w = Workload((SimRequestSpec(0, 0.0, 30000, 5),), 16)  # its prefill outlasts the drain grace
    sim = Simulation(SimConfig(prefill=1, decode=2), linear(), w)
    drained = []

    def drain_its_decode_worker():
        (sr,) = sim.requests.values()
        drained.append(sr.decode)
        sim.pools.drain(sim.pools.workers[sr.decode])

    sim.loop.at(0.01, drain_its_decode_worker)
    sim.run()
    (o,) = sim.outcomes
    assert o.status == "ok" and o.output_tokens == 5 and o.migrations == 1
    assert [x.id for x in sim.pools.stopped] == drained


def test_roofline_tensor_parallel_divides_the_step_and_pools_the_kv():
    two, four = (RooflineCost(gpu("h200"), model_shape("llama-3-70b"), tensor_parallel=t) for t in (2, 4))
    m = four.model
    decode = StepShape(decode_seqs=1, decode_context=1000, sampled=1)
    weights = (m.weight_bytes + m.kv_bytes_per_token * 1001) / 4 / (4.8e12 * 0.8)
    allreduce = 2 * m.num_layers * (10e-6 + 2 * 3 / 4 * m.hidden * 2 / (450e9 * 0.8))
    assert four.step_s(decode) == pytest.approx(weights + allreduce + 0.002)
    assert four.step_s(decode) < two.step_s(decode)
    # each GPU keeps HBM × 0.9 - its weight shard - the reserve for KV; the worker pools them
    per_gpu = 141e9 * 0.9 - m.weight_bytes / 4 - 4e9
    assert four.kv_blocks(16) == int(4 * per_gpu // (m.kv_bytes_per_token * 16))
    assert (four.gpus_per_worker, four.link.cross_node_bandwidth) == (4, 4 * 50e9 * 0.8)
    c = four.coeffs()
    assert c[0] == pytest.approx(m.weight_bytes / 4 / (4.8e12 * 0.8) + 0.002 + 2 * m.num_layers * 10e-6)
    with pytest.raises(ConfigError, match="does not divide"):
        RooflineCost(gpu("h200"), model_shape("llama-3-70b"), tensor_parallel=3)
    with pytest.raises(ConfigError, match="tensor_parallel"):
        RooflineCost(gpu("h200"), model_shape("llama-3-8b"), tensor_parallel=0)


def test_goodput_per_gpu_counts_each_tensor_parallel_worker_as_its_gpus():
    w = from_records(records(n=20, every_ms=100), tokens_per_hash=16)
    cost = RooflineCost(gpu("h200"), model_shape("llama-3-70b"), tensor_parallel=4)
    s = summarize(Simulation(SimConfig(prefill=1, decode=1, admission=False), cost, w).run())
    assert s["gpus"] == pytest.approx(8.0)  # two workers of four GPUs
    assert s["completed"] == 20


def test_the_goodput_scan_finds_the_best_rate_per_gpu_past_a_dip():
    # an autoscaled fleet: under a light load it shrinks to 2 GPUs and misses (85%), from 1x it
    # holds 4 and meets up to 6x; past 8x it misses by far
    def run(scale):
        att = 0.85 if scale < 1 else 0.95 if scale <= 6 else 0.5
        return {"slo_attainment": att, "gpus": 2.0 if scale < 1 else 4.0, "workload": {"rate_rps": 2.0 * scale},
                "ttft_ms": {"p90": 1.0}, "tpot_ms": {"p90": 1.0}}

    res = search.goodput_scan(run, target=0.9, lo=0.25, hi=16.0, step=2.0, iters=2)
    # the grid stops past the cliff, then two bisection steps between 4x and 8x
    assert [p["rate_scale"] for p in res["probes"]] == [0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 6.0, 7.0]
    assert res["rate_scale"] == 6.0 and res["goodput_rps_per_gpu"] == pytest.approx(6.0 * 2.0 / 4.0)
    assert search.goodput(run, start=0.5)["goodput_rps_per_gpu"] == 0.0  # what a bisection from the dip finds
