"""`splitserve simulate --calibrate --model DIR`: measure this machine's engine step times over a
grid of step shapes — prefills of 16 … budget tokens, decode batches of 1 … 32 sequences over
short and long contexts, and the mixed steps in between — and fit the engine's linear form
(c0 + c1·prefill tokens + c2·decode seqs + c3·decode context tokens + c4·prefill attention
pairs, non-negative) to the wall time of whole `Engine.step()` calls (scheduling included:
what the serving loop pays); each step's shape is read off the scheduler's output. The
result is a `LinearCost` JSON the simulator takes with `--calibrated`. Needs torch (the real
engine); the rest of the simulator does not."""

from __future__ import annotations

import random
import time

from splitserve.config import EngineConfig
from splitserve.engine.least_squares import nonneg_least_squares
from splitserve.sim.cost.linear import LinearCost
from splitserve.engine.step_shape import shape_of
from splitserve.types import Request, SamplingParams


def calibrate(config: EngineConfig, threads: int | None = None, budget_s: float = 90.0, seed: int = 0
              ) -> tuple[LinearCost, dict]:
    import torch

    from splitserve.engine.engine import Engine
    from splitserve.engine.kv_cache import KVCacheTensors

    if threads is not None:
        torch.set_num_threads(threads)
    engine = Engine(config)
    engine.warmup()
    rng, vocab = random.Random(seed), engine.model_config.vocab_size
    rows: list[tuple[float, ...]] = []
    ys: list[float] = []
    deadline = time.monotonic() + budget_s
    limit = engine.max_model_len - 40
    budget = config.max_num_batched_tokens
    shapes = []
    schedule = engine.scheduler.schedule

    def schedule_and_record():  # the step's shape, as the simulator will compute it
        sched = schedule()
        shapes.append(shape_of(sched))
        return sched

    engine.scheduler.schedule = schedule_and_record

    def run(prompt_lens: list[int], max_tokens: int) -> None:
        for n in prompt_lens:
            # distinct prompts: nothing is a prefix hit, every token is computed
            ids = [rng.randrange(vocab) for _ in range(min(n, limit))]
            engine.add_request(Request(f"cal-{len(ys)}-{rng.random()}", ids,
                                       SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)))
        while engine.scheduler.has_work():
            t0 = time.perf_counter()
            chunks = engine.step()
            dt = time.perf_counter() - t0
            sh = shapes[-1]
            if chunks or sh.prefill_tokens:
                rows.append((1.0, sh.prefill_tokens, sh.decode_seqs, sh.decode_context, sh.prefill_attended))
                ys.append(dt)

    for _ in range(2):
        for n in (16, 32, 64, 128, 256, 512, 1024, 2048):
            if n <= budget and time.monotonic() < deadline:
                run([n], 1)
        for b in (1, 2, 4, 8, 16, 32):
            for ctx in (32, 128, 512, 1024):
                if b * ctx <= 8 * budget and time.monotonic() < deadline:
                    run([ctx] * b, 24)
    engine.scheduler.schedule = schedule
    c = _robust_fit(rows, ys)
    mc = engine.model_config
    per_block = KVCacheTensors.bytes_per_block(mc.num_layers, config.block_size, mc.num_kv_heads, mc.head_dim,
                                               engine.dtype)
    cost = LinearCost(*c[:4], c4=c[4], num_kv_blocks=engine.pool.num_blocks, block_size=config.block_size,
                      kv_bytes_per_token=per_block // config.block_size,
                      source=f"{config.model} on this machine, {torch.get_num_threads()} threads, {engine.dtype}")
    pred = [sum(a * b for a, b in zip(r, c)) for r in rows]
    err = sorted(abs(p - y) / y for p, y in zip(pred, ys) if y > 0)
    fit = {"steps": len(ys), "median_rel_error": err[len(err) // 2] if err else None,
           "p90_rel_error": err[int(0.9 * len(err))] if err else None, "threads": torch.get_num_threads()}
    engine.close()
    return cost, fit


def _robust_fit(rows: list, ys: list[float], trim: float = 0.15) -> list[float]:
    """Least squares, then again without the `trim` share of steps it fits worst: a shared VM
    stalls some steps 2x, and those outliers would tilt every coefficient."""
    c = nonneg_least_squares(rows, ys)
    err = [abs(sum(a * b for a, b in zip(r, c)) - y) / y for r, y in zip(rows, ys)]
    cut = sorted(err)[int((1 - trim) * len(err))]
    keep = [i for i, e in enumerate(err) if e <= cut]
    return nonneg_least_squares([rows[i] for i in keep], [ys[i] for i in keep])
