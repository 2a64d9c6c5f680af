"""What data-parallel attention + expert parallelism moves per step, against tensor parallelism
with expert parallelism, on the same model and workload, 2 processes each (gloo, this host).

  dp2_ep2  data_parallel_size 2: two replicas, each on its own half of the requests; every MoE
           layer 3 all_to_all_single (counts, rows out, outputs back) — replica 0's sends
           counted by its DPGroup (all, and those to the other rank: `remote`)
  tp2_ep2  tensor_parallel_size 2, expert_parallel: every rank on every token; 2 all-reduces a
           layer (+ the embedding's) and the logits' all-gather — rank 0's counted by wrapping
           its group's collectives (the tensor's bytes; a ring all-reduce sends 2(T-1)/T of them)

A tiny DeepSeek-V3-shaped checkpoint (hidden 64, 16 routed experts, top 4, a shared expert, 4
layers, the first dense); 32 prompts of 64 tokens, 16 tokens each, 3 times (the median wall time
of one; per-step means over every step rank 0 ran). Collective time on a 2-core host shared by both processes is mostly waiting for the
other rank to arrive (a rendezvous), not wire time: read the bytes, and the time only as an
upper bound of this host's.

    python benchmarks/dp_ep_all_to_all.py [--out results/dp_ep_all_to_all.json]
"""

from __future__ import annotations

import argparse
import json
import os
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

SHAPE = "deepseek_v3_16"
SP = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
REPEATS = 3


def build(root: Path) -> Path:
    import tiny_models

    tiny_models.SHAPES[SHAPE] = dict(tiny_models.SHAPES["deepseek_v3"], n_routed_experts=16, n_group=4,
                                     topk_group=2, num_experts_per_tok=4, num_hidden_layers=4)
    return tiny_models.build_checkpoint(SHAPE, root / SHAPE)


def prompts(n: int = 32, length: int = 64) -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(3, 384) for _ in range(length)] for _ in range(n)]


class Meter:
    """Rank 0's collectives of a TP group: calls, the tensors' bytes, seconds."""

    def __init__(self, group, names=("all_reduce", "all_gather")) -> None:
        self.calls, self.bytes, self.s = 0, 0, 0.0
        for name in names:
            setattr(group, name, self._wrap(getattr(group, name)))

    def _wrap(self, fn):
        def metered(x, *args, **kwargs):
            t = time.perf_counter()
            out = fn(x, *args, **kwargs)
            self.s += time.perf_counter() - t
            self.calls += 1
            self.bytes += x.numel() * x.element_size()
            return out
        return metered


def timed(llm) -> float:
    """The workload REPEATS times; the median wall time of one."""
    walls = []
    for _ in range(REPEATS):
        t = time.perf_counter()
        llm.generate(prompts(), SP)
        walls.append(time.perf_counter() - t)
    return sorted(walls)[REPEATS // 2]


def run_dp(model: Path) -> dict:
    with LLM(str(model), num_kv_blocks=512, max_num_batched_tokens=256, enable_prefix_caching=False,
             data_parallel_size=2) as llm:
        eng = llm.engine
        llm.generate(prompts(4, 16), SP)  # warm: first-call costs out of the counts
        g = eng.group
        g.a2a_bytes, g.a2a_remote_bytes, g.a2a_s, g.a2a_calls = 0, 0, 0.0, 0
        steps0 = eng.engine._steps
        wall = timed(llm)
        steps = (eng.engine._steps - steps0) // REPEATS
        per = eng.replica_stats()
        return dict(config="dp2_ep2", steps=steps, wall_s=round(wall, 3), collectives_per_step=g.a2a_calls / steps / REPEATS,
                    bytes_per_step=round(g.a2a_bytes / steps / REPEATS),
                    remote_bytes_per_step=round(g.a2a_remote_bytes / steps / REPEATS),
                    collective_s_per_step=round(g.a2a_s / steps / REPEATS, 5),
                    step_s=round(wall / steps, 5), prefill_tokens_per_replica=[s.prefill_tokens_total for s in per])


def run_tp(model: Path) -> dict:
    with LLM(str(model), num_kv_blocks=512, max_num_batched_tokens=256, enable_prefix_caching=False,
             tensor_parallel_size=2, expert_parallel=True) as llm:
        eng = llm.engine
        llm.generate(prompts(4, 16), SP)
        meter = Meter(eng.tp)
        steps0 = eng._steps
        wall = timed(llm)
        steps = (eng._steps - steps0) // REPEATS
        return dict(config="tp2_ep2", steps=steps, wall_s=round(wall, 3), collectives_per_step=meter.calls / steps / REPEATS,
                    bytes_per_step=round(meter.bytes / steps / REPEATS),
                    remote_bytes_per_step=round(meter.bytes / steps / REPEATS),
                    collective_s_per_step=round(meter.s / steps / REPEATS, 5), step_s=round(wall / steps, 5))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "results" / "dp_ep_all_to_all.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = build(Path(tmp))
        rows = [run_dp(model), run_tp(model)]
    out = dict(benchmark="dp_ep_all_to_all", host=platform.node(), cpus=os.cpu_count(),
               load_average=os.getloadavg(),
               model=dict(shape="deepseek_v3 tiny", hidden=64, routed_experts=16, top_k=4, layers=4, moe_layers=3),
               workload=dict(prompts=32, prompt_tokens=64, max_tokens=16), rows=rows,
               note="rank 0's sends per step; remote: what leaves the rank (a DP row for an expert it holds "
                    "stays); TP all-reduce bytes are the tensor's (a 2-rank ring sends the same amount); the "
                    "step times compare badly here: the host was shared (load_average); collective time on 2 shared cores is mostly waiting for the other rank")
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
