"""The `splitserve bench` handler: parsed arguments -> dataset and config -> run -> JSON + PNG.

The arguments themselves are declared in `splitserve/cli/main.py` (`_add_bench`); this module turns
them into typed values, with a clear error for every bad combination.
"""

from __future__ import annotations

import argparse
import sys
from typing import Iterator

from splitserve.bench.datasets import (
    MOONCAKE_BLOCK_SIZE, BenchRequest, random_requests, read_mooncake_trace, scale_lengths, shared_prefix_requests,
    trace_requests,
)
from splitserve.bench.metrics import Slo, format_summary
from splitserve.bench.runner import BenchConfig, LoadConfig, run_bench, write_results

DEFAULT_RANDOM_REQUESTS = 100  # the random dataset is endless; without bounds it sends this many


def dataset_from_args(args: argparse.Namespace) -> tuple[Iterator[BenchRequest], int | None]:
    """The request iterator and its length when known."""
    if args.dataset == "random":
        return random_requests(_range("--input-len", args.input_len), _range("--output-len", args.output_len),
                               args.seed, args.vocab_size), None
    if args.dataset == "shared-prefix":
        lo, hi = _range("--output-len", args.output_len)
        if lo != hi:
            raise ValueError("--dataset shared-prefix takes one --output-len N, not a range")
        n = args.num_groups * args.prompts_per_group
        return shared_prefix_requests(args.num_groups, args.prompts_per_group, args.system_prompt_len,
                                      args.question_len, lo, args.seed, args.vocab_size), n
    if args.dataset == "mooncake":
        if not args.trace:
            raise ValueError("--dataset mooncake needs --trace FILE.jsonl")
        if args.max_requests is not None and args.max_requests < 1:
            raise ValueError(f"--max-requests must be >= 1, got {args.max_requests}")
        records = read_mooncake_trace(args.trace, args.max_requests)
        if args.length_scale != 1.0:
            records = scale_lengths(records, args.length_scale)
        block = max(1, round(MOONCAKE_BLOCK_SIZE * args.length_scale))
        return trace_requests(records, args.time_scale, args.seed, args.vocab_size, block_size=block,
                              max_output_len=args.max_output_len), len(records)
    raise ValueError(f"unknown dataset {args.dataset!r}")


def _range(flag: str, values: list[int]) -> tuple[int, int]:
    """`N` -> (N, N); `LO HI` -> (LO, HI)."""
    if len(values) not in (1, 2):
        raise ValueError(f"{flag} takes N or LO HI, got {len(values)} values")
    return values[0], values[-1]


def load_from_args(args: argparse.Namespace) -> LoadConfig:
    if args.rate is not None and args.concurrency is not None:
        raise ValueError("give either --rate (open loop) or --concurrency (closed loop), not both")
    trace = args.dataset == "mooncake" and args.rate is None and args.concurrency is None
    if args.rate is None and args.concurrency is None and not trace:
        raise ValueError(f"--dataset {args.dataset} needs a load: --rate R (req/s, 'inf' for all at once) "
                         "or --concurrency N")
    num = args.num_requests
    if args.dataset == "random" and num is None and args.duration is None:
        num = DEFAULT_RANDOM_REQUESTS
    return LoadConfig(rate=args.rate, concurrency=args.concurrency, trace_timestamps=trace, num_requests=num,
                      duration_s=args.duration, drain_timeout_s=args.drain_timeout, seed=args.seed)


def run_from_args(args: argparse.Namespace) -> int:
    load = load_from_args(args)
    config = BenchConfig(args.url, args.model, load, Slo(args.ttft_slo_ms, args.tpot_slo_ms),
                         request_timeout_s=args.request_timeout, ignore_eos=not args.no_ignore_eos,
                         progress=not args.quiet)
    requests, total = dataset_from_args(args)
    print(f"splitserve bench: {args.dataset} -> {config.endpoint} ({load.mode})", file=sys.stderr)
    run = run_bench(config, requests, total)
    meta = {"dataset": args.dataset, "dataset_args": _dataset_args(args)}
    out, png = write_results(run, config, args.out, meta=meta, plot=not args.no_plot)
    print(format_summary(run.summary))
    print(f"wrote {out}" + (f" and {png}" if png else ""))
    return 0


def _dataset_args(args: argparse.Namespace) -> dict:
    keys = {"random": ("input_len", "output_len", "vocab_size", "seed"),
            "shared-prefix": ("num_groups", "prompts_per_group", "system_prompt_len", "question_len", "output_len",
                              "vocab_size", "seed"),
            "mooncake": ("trace", "time_scale", "length_scale", "max_requests", "max_output_len", "vocab_size", "seed")}
    return {k: getattr(args, k) for k in keys[args.dataset]}
