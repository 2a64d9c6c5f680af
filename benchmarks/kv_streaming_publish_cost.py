"""What streaming the KV costs the prefill itself (issue 32: under 5 %), without Ray and without
a reader: one engine prefills the same prompt with `stream_kv` off and on, alternating, and the
prefill's wall time is compared. Two ways on:

  * engine  — the engine thread reports its progress (mid-forward, layer group by layer group,
    and at each step's end) to a sink that only queues it: the cost on the engine thread itself;
  * publish — a second thread also checksums each newly reported run of blocks, as the prefill
    worker does off the engine thread: the cost a 2-core machine also pays in CPU contention
    (on a GPU worker that work is the host's, beside the device's forward).

Writes results/kv_streaming_publish_cost.json.

    python benchmarks/kv_streaming_publish_cost.py [--length 4096] [--chunk 512] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from splitserve.config import EngineConfig  # noqa: E402
from splitserve.engine.engine import KV_LAYER_GROUPS, Engine  # noqa: E402
from splitserve.kv_transfer.regions import kv_checksum  # noqa: E402
from splitserve.types import Request, SamplingParams  # noqa: E402
from splitserve.worker.kv_layout import layout_of  # noqa: E402


def prefill_s(eng: Engine, prompt: list[int], mode: str, rid: str) -> float:
    """Seconds from the request's admission to its first token (the prefill), in `mode`."""
    work: queue.Queue = queue.Queue()
    done = threading.Event()
    layout = layout_of(eng)

    def publisher() -> None:  # what the prefill worker's publish does, off the engine thread
        while not done.is_set() or not work.empty():
            try:
                p = work.get(timeout=0.01)
            except queue.Empty:
                continue
            blocks = p.computing or p.block_ids
            if blocks:
                kv_checksum(eng.kv.storage, layout, blocks, range(p.layers) if p.computing else None)

    worker = threading.Thread(target=publisher, daemon=True) if mode == "publish" else None
    eng.kv_progress = work.put if mode != "off" else None
    if worker is not None:
        worker.start()
    started = time.perf_counter()
    eng.add_request(Request(rid, prompt, SamplingParams(temperature=0, max_tokens=1)), prefill_only=True,
                    stream_kv=mode != "off")
    while eng.has_unfinished():
        eng.step()
    took = time.perf_counter() - started
    done.set()
    if worker is not None:
        worker.join()
    eng.release_detached(rid)
    eng.kv_progress = None
    eng.pool.reset_prefix_cache()  # every run computes the whole prompt
    return took


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="results/kv_streaming_publish_cost.json")
    a = ap.parse_args()
    if a.model is None:
        from splitserve.engine.model.demo import ensure_demo_model

        a.model = str(ensure_demo_model())
    eng = Engine(EngineConfig(model=a.model, max_num_batched_tokens=a.chunk, kv_cache_memory_gib=1.0))
    prompt = torch.randint(100, 40000, (a.length,), generator=torch.Generator().manual_seed(0)).tolist()
    prefill_s(eng, prompt[:a.chunk], "off", "warm-up")
    times: dict[str, list[float]] = {"off": [], "engine": [], "publish": []}
    for rep in range(a.reps):  # interleaved: a drift in the machine's speed hits every mode alike
        for mode in times:
            times[mode].append(prefill_s(eng, prompt, mode, f"{mode}-{rep}"))
    med = {m: statistics.median(t) for m, t in times.items()}
    out = {"length": a.length, "chunk": a.chunk, "layer_groups": KV_LAYER_GROUPS, "reps": a.reps, "seconds": times,
           "median_s": med, "slowdown": {m: med[m] / med["off"] - 1 for m in ("engine", "publish")}}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
