"""Several ingress replicas of one app over one pool, sharing a Redis (`--redis-url`): does a
shared-prefix workload spread over them get the prefix hits one replica gets, does a replica
started mid-run place with the full KV index at once, and what happens when Redis is killed
under load and started again?

On the local Ray cluster (tiny random-init Llama, 2 prefill + 2 decode workers); each phase
sends waves of concurrent requests, each prompt a group's fresh 128-token system prompt plus a
unique tail, round-robin over the phase's replicas. The hit rate is the prompt tokens the
engines reported cached (usage's cached_tokens) over all prompt tokens; errors are the streams
that ended with an error.

    python benchmarks/router_replicas.py [--waves 6] [--wave 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from splitserve.orchestrator import Cluster  # noqa: E402
from splitserve.orchestrator.cluster_backend import ClusterBackend, ControllerSource  # noqa: E402
from splitserve.ingress.frontend import Frontend  # noqa: E402
from splitserve.ingress.lease import RequestLease  # noqa: E402
from splitserve.ingress.protocol import RequestOptions  # noqa: E402
from splitserve.ingress.shared import SharedRateLimiter  # noqa: E402
from splitserve.types import Priority, SamplingParams  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402
from tests.tiny_models import build_checkpoint  # noqa: E402

SP = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


async def one(front: Frontend, prompt: list[int]) -> tuple[int, int, bool]:
    opts = RequestOptions("m", SP, True, False, None, Priority.STANDARD, None, None)
    _, choices, reqs = front.requests(opts, [tuple(prompt)])
    try:
        async with RequestLease(front, opts, reqs, choices, await front.prepay(opts.tenant, len(reqs))) as lease:
            async for _ in lease.streams[0]:
                pass
    except Exception:  # noqa: BLE001 - counted
        return len(prompt), 0, True
    return len(prompt), choices[0].text.num_cached_tokens, False


async def phase(fronts: list[Frontend], rng: random.Random, waves: int, wave: int, groups: int = 4) -> dict:
    systems = [[rng.randrange(3, 384) for _ in range(128)] for _ in range(groups)]
    got = []
    began = time.monotonic()
    for _ in range(waves):
        prompts = [systems[i % groups] + [rng.randrange(3, 384) for _ in range(24)] for i in range(wave)]
        got += await asyncio.gather(*[one(fronts[i % len(fronts)], p) for i, p in enumerate(prompts)])
    total, cached = sum(g[0] for g in got), sum(g[1] for g in got)
    # the best any router can do: every request but a group's first finds its system prompt cached
    best = (len(got) - groups) * 128 / total
    return {"replicas": len(fronts), "requests": len(got), "errors": sum(g[2] for g in got),
            "hit_rate": round(cached / total, 4), "best_hit_rate": round(best, 4),
            "wall_s": round(time.monotonic() - began, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--waves", type=int, default=6)
    ap.add_argument("--wave", type=int, default=16)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "router_replicas.json")
    args = ap.parse_args()
    redis = RedisServer()
    redis.start()
    rng = random.Random(0)
    out: dict = {"waves": args.waves, "wave": args.wave}
    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_checkpoint("llama", Path(tmp)))
        with Cluster.start(model=model, prefill=2, decode=2, disagg_min_tokens=0, num_kv_blocks=1024,
                           redis_url=redis.url) as c:
            def replica() -> Frontend:
                b = ClusterBackend(c.cfg, ControllerSource(c.controller))
                c._loop.run(b.start())
                return Frontend(b, limiter=SharedRateLimiter(b.redis))

            first = Frontend(c.backend, limiter=SharedRateLimiter(c.backend.redis))
            run = lambda fronts: c._loop.run(phase(fronts, rng, args.waves, args.wave))  # noqa: E731
            out["one_replica"] = run([first])
            second = replica()
            out["two_replicas"] = run([first, second])
            started = time.monotonic()
            third = replica()  # new mid-run: its first placements use what its first poll listed
            out["third_replica_ready_s"] = round(time.monotonic() - started, 3)
            out["three_replicas"] = run([first, second, third])
            redis.kill()
            out["redis_killed"] = run([first, second])
            redis.start()
            back = time.monotonic()
            links = [f.backend.redis for f in (first, second, third)]
            while not all(link.up for link in links):
                time.sleep(0.02)
            out["redis_back_noticed_s"] = round(time.monotonic() - back, 3)
            out["redis_back"] = run([first, second])
    redis.kill()
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
