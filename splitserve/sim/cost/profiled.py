"""A cost model from a GPU's measured rows: `benchmarks/gpu/bench_gpu.py` JSON (decode steps at
batch × context, prefills of T tokens), fitted to the engine's linear form — decode rows give
c0 + c2·batch + c3·batch·context, prefill rows c0 + c1·T. The KV pool and links are the named
GPU's roofline (the bench does not measure them)."""

from __future__ import annotations

import json
from pathlib import Path

from splitserve.engine.least_squares import nonneg_least_squares
from splitserve.sim.cost.linear import LinearCost
from splitserve.sim.cost.roofline import RooflineCost
from splitserve.types import ConfigError


def profiled_cost(path: str | Path, roofline: RooflineCost, block_size: int = 16, backend: str = "triton"
                  ) -> LinearCost:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not a GPU bench JSON ({e})") from None
    rows, ys = [], []
    for r in data.get("decode", []):
        if r.get("step_ms") is not None and r.get("backend", backend).startswith(backend):
            b, c = r["batch"], r["context"]
            rows.append((1.0, 0.0, float(b), float(b * c)))
            ys.append(r["step_ms"] / 1e3)
    for r in data.get("prefill", []):
        if r.get("seconds") is not None and r.get("backend", backend).startswith(backend):
            rows.append((1.0, float(r["tokens"]), 0.0, 0.0))
            ys.append(r["seconds"])
    if len({row[1] > 0 for row in rows}) < 2:
        raise ConfigError(f"{path}: needs both decode and prefill rows of backend {backend!r} to fit a step model")
    c0, c1, c2, c3 = nonneg_least_squares(rows, ys)
    return LinearCost(c0, c1, c2, c3, roofline.kv_blocks(block_size), block_size, roofline.kv_bytes_per_token,
                      roofline.link, name="profiled", source=str(path))
