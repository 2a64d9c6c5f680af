"""Expert load balancing on a skewed workload: the expert-parallel ranks' load imbalance (the
busiest rank's routed tokens / the mean, per MoE layer, summed over layers: how much longer the
MoE layers take than with an even spread) before and after the engine rebalances its experts,
with 0 to 8 redundant expert slots.

Real expert parallelism at EP 2: an engine of two rank processes (gloo), each holding whole
experts (engine/expert_balance.py). A tiny DeepSeek-V3-shaped checkpoint with 16 routed experts
(4 groups, the best 2 groups' top 4, a shared expert; 4 layers, the first dense). Two skewed
workloads:

  patterns     prompts repeating 3 tokens drawn from 6 (the same few experts fire), unmodified model
  router_bias  random prompts; the router's e_score_correction_bias raised by +0.6 for experts
               0-3 in every layer (all on rank 0 in the starting placement): a synthetic hot set

Per case: sample A runs on the starting placement (rank r: experts 8r..8r+7, spare slots copies
of them) -> `engine.rebalance_experts()` plans from A's measured counts and moves the weights
between the ranks -> sample B (fresh prompts from the same distribution, so not the counts the
plan was made from) runs on the new placement. Both measured by the worker's stats
(`ExpertBalance`, what /metrics exports). The planner's prediction for EP 4 and 8 from A's
counts is added, marked simulated (no processes: model/expert_placement.plan only).

    python benchmarks/expert_balance.py [--redundant 0 2 4 8] [--out results/expert_balance.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from splitserve import LLM, SamplingParams  # noqa: E402
from splitserve.engine.model.expert_placement import ExpertPlacement, plan  # noqa: E402

EXPERTS, LAYERS = 16, 4
SHAPE = "deepseek_v3_16"
SP = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def build(root: Path) -> dict[str, Path]:
    """The checkpoint, and the same with the router biased towards experts 0-3."""
    from safetensors.torch import load_file, save_file

    import tiny_models

    tiny_models.SHAPES[SHAPE] = dict(tiny_models.SHAPES["deepseek_v3"], n_routed_experts=EXPERTS, n_group=4,
                                     topk_group=2, num_experts_per_tok=4, num_hidden_layers=LAYERS)
    plain = tiny_models.build_checkpoint(SHAPE, root / "plain")
    biased = tiny_models.build_checkpoint(SHAPE, root / "biased")
    w = load_file(str(biased / "model.safetensors"))
    for name, t in w.items():
        if name.endswith("e_score_correction_bias"):
            t[:4] += 0.6
    save_file(w, str(biased / "model.safetensors"), metadata={"format": "pt"})
    return {"patterns": plain, "router_bias": biased}


def prompts(workload: str, seed: int, n: int = 32, length: int = 64) -> list[list[int]]:
    """A sample of the workload: `seed` draws the prompts, not the distribution (the same 6
    tokens for every sample of `patterns`)."""
    rng = random.Random(seed)
    if workload == "patterns":
        few = random.Random(0).sample(range(3, 384), 6)
        return [[rng.choice(few) for _ in range(3)] * (length // 3) for _ in range(n)]
    return [[rng.randrange(3, 384) for _ in range(length)] for _ in range(n)]


def layer_imbalance(counts: list[list[float]], placements) -> float:
    """Sum over layers of the busiest rank's predicted load / the mean's."""
    busiest = sum(max(p.rank_loads(c)) for c, p in zip(counts, placements))
    mean = sum(sum(c) / p.ranks for c, p in zip(counts, placements))
    return busiest / mean if mean else 0.0


def run_case(model: Path, workload: str, redundant: int) -> dict:
    with LLM(str(model), num_kv_blocks=512, max_num_batched_tokens=256, enable_prefix_caching=False,
             tensor_parallel_size=2, expert_parallel=True, redundant_experts=redundant,
             expert_rebalance_interval_steps=10**9) as llm:  # rebalanced here, by hand, once
        eng = llm.engine
        bal = eng.expert_balancer
        t0 = time.perf_counter()
        llm.generate(prompts(workload, seed=1), SP)
        before = eng.stats().expert_balance
        counts = bal.window_counts()
        expert_before = _expert_imbalance(eng.stats().expert_tokens_total)
        start = bal.placements
        t1 = time.perf_counter()
        moved = eng.rebalance_experts()
        rebalance_s = time.perf_counter() - t1
        predicted = layer_imbalance(counts, bal.placements)
        tokens_before = eng.stats().expert_tokens_total
        llm.generate(prompts(workload, seed=2), SP)
        after = eng.stats().expert_balance
        expert_after = _expert_imbalance([b - a for a, b in zip(tokens_before, eng.stats().expert_tokens_total)])
        simulated = {}
        for ranks in (4, 8):
            slots = (EXPERTS + redundant) // ranks if (EXPERTS + redundant) % ranks == 0 else None
            if slots is None:
                continue
            contiguous = [ExpertPlacement.contiguous(EXPERTS, ranks, slots)] * len(counts)
            planned = [plan(c, ranks, slots) for c in counts]
            simulated[f"ep{ranks}"] = dict(before=round(layer_imbalance(counts, contiguous), 4),
                                           after=round(layer_imbalance(counts, planned), 4))
        moves = sum(a != b for p, q in zip(start, bal.placements) for a, b in zip(p.flat(), q.flat()))
        return dict(workload=workload, redundant_experts=redundant, slots_per_rank=before.slots_per_rank,
                    rebalanced=moved, slots_changed=moves, rebalance_s=round(rebalance_s, 4),
                    rank_imbalance_before=round(before.imbalance, 4), rank_imbalance_after=round(after.imbalance, 4),
                    planned_on_sample_a=round(predicted, 4),
                    rank_tokens_before=list(before.rank_tokens), rank_tokens_after=list(after.rank_tokens),
                    expert_imbalance_before=round(expert_before, 4), expert_imbalance_after=round(expert_after, 4),
                    replicas_after=list(after.replicas), placements_after=[p.slots for p in bal.placements],
                    simulated_planner=simulated, wall_s=round(time.perf_counter() - t0, 2))


def run_online(model: Path, workload: str, redundant: int, interval: int) -> dict:
    """The engine's own loop: the planner every `interval` steps while samples A and B run as one
    stream of requests (none dropped: every request gets its 16 tokens)."""
    with LLM(str(model), num_kv_blocks=512, max_num_batched_tokens=256, enable_prefix_caching=False,
             tensor_parallel_size=2, expert_parallel=True, redundant_experts=redundant,
             expert_rebalance_interval_steps=interval) as llm:
        outs = llm.generate(prompts(workload, seed=1) + prompts(workload, seed=2), SP)
        b = llm.engine.stats().expert_balance
        return dict(workload=workload, redundant_experts=redundant, interval_steps=interval,
                    steps=llm.engine.stats().steps_total, rebalances=b.rebalances_total,
                    finished=sum(len(o.outputs[0].token_ids) == SP.max_tokens for o in outs), requests=len(outs),
                    rank_imbalance_before_last=round(b.imbalance_before, 4),
                    rank_imbalance_since_last=round(b.imbalance, 4))


def _expert_imbalance(tokens) -> float:
    mean = sum(tokens) / len(tokens)
    return max(tokens) / mean if mean else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--redundant", type=int, nargs="+", default=[0, 2, 4, 8])
    ap.add_argument("--workloads", nargs="+", default=["patterns", "router_bias"])
    ap.add_argument("--online-interval", type=int, default=4, help="steps between the online case's rebalances")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "expert_balance.json")
    args = ap.parse_args()
    rows, online = [], []
    with tempfile.TemporaryDirectory() as tmp:
        models = build(Path(tmp))
        for workload in args.workloads:
            for r in args.redundant:
                rows.append(run_case(models[workload], workload, r))
                print(json.dumps({k: v for k, v in rows[-1].items() if k not in ("placements_after",)}), flush=True)
            online.append(run_online(models[workload], workload, max(args.redundant), args.online_interval))
            print(json.dumps(online[-1]), flush=True)
    report = dict(
        setup=f"{platform.processor() or platform.machine()}; EP 2 = two real rank processes (gloo, CPU); tiny "
              f"DeepSeek-V3 shape: {EXPERTS} routed experts in 4 groups, top 2 groups, top 4 experts, a shared "
              f"expert, {LAYERS} layers (3 MoE); 32 prompts x 64 tokens + 16 generated per sample, fp32",
        metric="rank imbalance = sum over MoE layers of the busiest EP rank's routed tokens / sum of the mean "
               "rank's (1.0: even); measured by the engine's slot counters over sample A (starting placement) "
               "and over a fresh sample B after one rebalance planned from A's counts",
        simulated="simulated_planner: the planner alone on A's per-layer counts for EP 4 / EP 8 (no processes)",
        rows=rows, online=online)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    plot(rows, args.out.with_suffix(".png"))


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({r["workload"] for r in rows}, key=[r["workload"] for r in rows].index)
    fig, axes = plt.subplots(1, len(workloads) + 1, figsize=(5.5 * (len(workloads) + 1), 4), squeeze=False)
    sim = axes[0][-1]  # the planner alone for more ranks, on sample A's counts
    labels, before, after = [], [], []
    for r in rows:
        for ep, v in r["simulated_planner"].items():
            labels.append(f"{r['workload'][:8]}\n{ep.upper()} +{r['redundant_experts']}")
            before.append(v["before"])
            after.append(v["after"])
    xs = range(len(labels))
    sim.bar([x - 0.2 for x in xs], before, 0.4, label="contiguous")
    sim.bar([x + 0.2 for x in xs], after, 0.4, label="planned")
    sim.axhline(1.0, color="gray", lw=0.8, ls="--")
    sim.set_xticks(list(xs), labels, fontsize=7)
    sim.set_title("simulated: planner only, EP 4 / 8 (+redundant)")
    sim.legend(fontsize=8)
    for ax, w in zip(axes[0][:-1], workloads):
        sub = [r for r in rows if r["workload"] == w]
        xs = range(len(sub))
        ax.bar([x - 0.2 for x in xs], [r["rank_imbalance_before"] for r in sub], 0.4, label="before (sample A)")
        ax.bar([x + 0.2 for x in xs], [r["rank_imbalance_after"] for r in sub], 0.4, label="after rebalance (sample B)")
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_xticks(list(xs), [f"{r['redundant_experts']} redundant\n({r['slots_per_rank']} slots/rank)"
                                 for r in sub])
        ax.set_ylabel("EP 2 rank imbalance (max / mean)")
        ax.set_title(f"{w}")
        ax.set_ylim(0.9, max(r["rank_imbalance_before"] for r in sub) * 1.1)
        ax.legend(fontsize=8)
    fig.suptitle("Expert rebalancing at EP 2 (tiny DeepSeek-V3, 16 experts)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
