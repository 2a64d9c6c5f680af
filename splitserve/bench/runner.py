"""Drive a bench run: arrivals, bounds, progress, results.

Load is one of three shapes (exactly one):
    open loop, Poisson   requests arrive at `rate` req/s (exponential gaps, seeded), whatever the
                         server does — the way to find the point where latency breaks
    open loop, trace     requests arrive at their dataset offsets (a Mooncake trace's timestamps)
    closed loop          `concurrency` clients, each sending its next request when the last ends
A run is bounded by `num_requests` and/or `duration_s`: after `duration_s` no request starts, and
those still in flight get `drain_timeout_s` to finish before they are cancelled (status
"cancelled"). The results go to a JSON file (config, summary, one row per request) and a PNG of
the latency CDFs next to it.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable, Iterator

import httpx

from splitserve.bench.client import RequestResult, request_body, send_request
from splitserve.bench.datasets import BenchRequest
from splitserve.bench.metrics import BenchSummary, Slo, summarize

CANCELLED = "cancelled"
Send = Callable[[BenchRequest], Awaitable[None]]


@dataclass(frozen=True)
class LoadConfig:
    """How requests arrive and when the run ends."""

    rate: float | None = None  # open loop, Poisson, req/s (math.inf: all at once)
    concurrency: int | None = None  # closed loop
    trace_timestamps: bool = False  # open loop at each request's `arrival_s`
    num_requests: int | None = None
    duration_s: float | None = None
    drain_timeout_s: float = 60.0
    seed: int = 0

    def __post_init__(self) -> None:
        modes = [self.rate is not None, self.concurrency is not None, self.trace_timestamps]
        if sum(modes) != 1:
            raise ValueError("choose exactly one load: --rate R (open loop), --concurrency N (closed loop), "
                             "or trace timestamps (mooncake dataset without --rate/--concurrency)")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"--rate must be > 0 req/s, got {self.rate}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {self.concurrency}")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"--num-requests must be >= 1, got {self.num_requests}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"--duration must be > 0 s, got {self.duration_s}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain timeout must be >= 0 s, got {self.drain_timeout_s}")

    @property
    def mode(self) -> str:
        if self.concurrency is not None:
            return f"closed loop, concurrency {self.concurrency}"
        return "open loop, trace timestamps" if self.trace_timestamps else f"open loop, Poisson {self.rate} req/s"


@dataclass(frozen=True)
class BenchConfig:
    """Where to send, what to measure against, how to behave."""

    url: str
    model: str
    load: LoadConfig
    slo: Slo = Slo()
    request_timeout_s: float = 600.0
    ignore_eos: bool = True
    progress: bool = True

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"--url must start with http:// or https://, got {self.url!r}")
        if not self.model:
            raise ValueError("--model must be given (the name the server serves)")

    @property
    def endpoint(self) -> str:
        base = self.url.rstrip("/")
        return base if base.endswith("/v1/completions") else base + "/v1/completions"


@dataclass(frozen=True)
class BenchRun:
    """A finished run: every request's result, the wall time, the summary."""

    results: tuple[RequestResult, ...]
    duration_s: float
    summary: BenchSummary


def run_bench(config: BenchConfig, requests: Iterable[BenchRequest], total_hint: int | None = None) -> BenchRun:
    """Run the benchmark to completion (blocking); see the module docstring."""
    return asyncio.run(run_bench_async(config, requests, total_hint))


async def run_bench_async(config: BenchConfig, requests: Iterable[BenchRequest],
                          total_hint: int | None = None) -> BenchRun:
    from tqdm import tqdm

    load = config.load
    reqs: Iterator[BenchRequest] = iter(requests)
    if load.num_requests is not None:
        reqs = itertools.islice(reqs, load.num_requests)
        total_hint = min(load.num_requests, total_hint) if total_hint is not None else load.num_requests
    results: list[RequestResult] = []
    timeout = httpx.Timeout(config.request_timeout_s, connect=30.0)
    # No connection cap: a capped pool would queue open-loop requests on the client side and hide
    # that queueing inside the measured TTFT.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        with tqdm(total=total_hint, disable=not config.progress, unit="req", desc="bench") as bar:
            run_start = time.perf_counter()
            send = _make_send(client, config, run_start, results, bar)
            if load.concurrency is not None:
                await _closed_loop(reqs, send, load, run_start)
            else:
                await _open_loop(reqs, send, load, run_start)
            duration = time.perf_counter() - run_start
    ordered = tuple(sorted(results, key=lambda r: r.start_s))
    return BenchRun(ordered, duration, summarize(ordered, duration, config.slo))


def _make_send(client, config: BenchConfig, run_start: float, results: list[RequestResult], bar) -> Send:
    async def send(req: BenchRequest) -> None:
        t0 = time.perf_counter()
        try:
            body = request_body(config.model, req, config.ignore_eos)
            r = await send_request(client, config.endpoint, body, run_start)
        except asyncio.CancelledError:
            results.append(RequestResult(CANCELLED, t0 - run_start, time.perf_counter() - t0,
                                         error="cancelled at the end of the run"))
            raise
        results.append(r)
        bar.update(1)

    return send


def _arrival_offsets(reqs: Iterator[BenchRequest], load: LoadConfig) -> Iterator[tuple[float, BenchRequest]]:
    """(offset from start in s, request) in arrival order."""
    rng, t = random.Random(load.seed), 0.0
    for req in reqs:
        if load.trace_timestamps:
            yield (req.arrival_s or 0.0), req
        else:
            yield t, req
            t += 0.0 if math.isinf(load.rate) else rng.expovariate(load.rate)


async def _open_loop(reqs: Iterator[BenchRequest], send: Send, load: LoadConfig, run_start: float) -> None:
    tasks: list[asyncio.Task] = []
    for offset, req in _arrival_offsets(reqs, load):
        if load.duration_s is not None and offset >= load.duration_s:
            break
        delay = run_start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(send(req)))
    await _drain(tasks, load, run_start)


async def _closed_loop(reqs: Iterator[BenchRequest], send: Send, load: LoadConfig, run_start: float) -> None:
    async def client_loop() -> None:
        while load.duration_s is None or time.perf_counter() - run_start < load.duration_s:
            req = next(reqs, None)
            if req is None:
                return
            await send(req)

    await _drain([asyncio.create_task(client_loop()) for _ in range(load.concurrency)], load, run_start)


async def _drain(tasks: list[asyncio.Task], load: LoadConfig, run_start: float) -> None:
    """Wait for `tasks`; past duration + drain timeout, cancel what is left."""
    if not tasks:
        return
    timeout = None
    if load.duration_s is not None:
        timeout = max(0.0, run_start + load.duration_s + load.drain_timeout_s - time.perf_counter())
    _, pending = await asyncio.wait(tasks, timeout=timeout)
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)


def result_row(r: RequestResult) -> dict[str, Any]:
    """One request as a JSON row (ms; inter-token latencies as a count, not the list)."""
    ms = lambda s: None if s is None else round(s * 1000.0, 3)  # noqa: E731
    return {"status": r.status, "start_s": round(r.start_s, 6), "ttft_ms": ms(r.ttft_s), "tpot_ms": ms(r.tpot_s),
            "e2e_ms": ms(r.e2e_s), "output_tokens": r.output_tokens, "prompt_tokens": r.prompt_tokens,
            "num_itl": len(r.itl_s), "retry_after_s": r.retry_after_s, "error": r.error,
            "server_timings_ms": r.server_timings_ms}


def write_results(run: BenchRun, config: BenchConfig, out: str | Path,
                  meta: dict[str, Any] | None = None, plot: bool = True) -> tuple[Path, Path | None]:
    """Write the JSON to `out` and the CDF PNG next to it (same name, .png); return both paths."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "config": {"url": config.url, "model": config.model, "load": _finite(asdict(config.load)),
                   "mode": config.load.mode, "slo": asdict(config.slo), "ignore_eos": config.ignore_eos,
                   **(meta or {})},
        "summary": run.summary.to_dict(),
        "requests": [result_row(r) for r in run.results],
    }
    out.write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n")
    png = None
    if plot:
        from splitserve.bench.plot import plot_cdfs

        png = plot_cdfs(run.results, out.with_suffix(".png"), title=f"{config.model} — {config.load.mode}")
    return out, png


def _finite(d: dict[str, Any]) -> dict[str, Any]:
    """JSON has no infinity: an infinite rate is written as the string "inf"."""
    return {k: "inf" if isinstance(v, float) and math.isinf(v) else v for k, v in d.items()}
