"""What the simulator replays: requests with an arrival time, prompt and output lengths and the
prompt's prefix identity, from a Mooncake trace (its `hash_ids`: equal ids are equal blocks of
`tokens_per_hash` tokens) or from a `splitserve bench` dataset.

A simulated prompt carries no real token ids — only its length and the chained block hashes of
its full blocks (`prompt_hashes`), derived from the trace's hash ids the way the engine's
hashing derives them from tokens: block k of a prompt is named by the hash ids up to its
position, so two prompts share exactly the blocks the trace says they share. `splitserve bench
--dataset mooncake` builds its token prompts from the same ids (bench/datasets.py), so the
simulator and a measured run see the same prefix sharing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from splitserve.bench.datasets import MOONCAKE_BLOCK_SIZE, BenchRequest, TraceRecord, read_mooncake_trace
from splitserve.hashing import DIGEST_SIZE, BlockHash, block_hashes
from splitserve.types import ConfigError


@dataclass(frozen=True, slots=True)
class SimRequestSpec:
    index: int
    arrival_s: float
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] = ()  # prefix identity at `tokens_per_hash` granularity (empty: unique)
    tokens: tuple[int, ...] | None = None  # real token ids (bench datasets): hashed as the engine does
    grammar: str | None = None  # a structured-output spec's key: requests with one key share its compile


@dataclass(frozen=True)
class Workload:
    requests: tuple[SimRequestSpec, ...]
    tokens_per_hash: int = MOONCAKE_BLOCK_SIZE
    name: str = ""

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s if self.requests else 0.0

    def scaled(self, rate_scale: float) -> "Workload":
        """Arrivals `rate_scale` times as dense (2: twice the request rate)."""
        if not rate_scale > 0:
            raise ConfigError(f"rate_scale must be > 0, got {rate_scale}")
        reqs = tuple(dataclasses.replace(r, arrival_s=r.arrival_s / rate_scale) for r in self.requests)
        return Workload(reqs, self.tokens_per_hash, self.name)

    def with_grammars(self, share: float, kinds: int, seed: int = 0) -> "Workload":
        """A random `share` of the requests constrained by a structured-output grammar, one of
        `kinds` distinct ones (each compiled once per worker, then cached)."""
        if not 0.0 <= share <= 1.0 or kinds < 1:
            raise ConfigError(f"grammar share must be in [0, 1] and kinds >= 1, got {share} and {kinds}")
        rng = random.Random(seed)
        reqs = tuple(dataclasses.replace(r, grammar=f"g{rng.randrange(kinds)}") if rng.random() < share else r
                     for r in self.requests)
        return Workload(reqs, self.tokens_per_hash, self.name)


def from_trace(path: str | Path, max_requests: int | None = None, tokens_per_hash: int = MOONCAKE_BLOCK_SIZE,
               length_scale: float = 1.0, max_output_len: int | None = None) -> Workload:
    """A Mooncake JSONL trace. `length_scale` shrinks prompts and hash blocks together (1/32:
    512-token blocks become 16-token ones, so a small model sees the trace's sharing)."""
    records = read_mooncake_trace(path, max_requests)
    return from_records(records, tokens_per_hash, length_scale, max_output_len, Path(path).stem)


def from_records(records: Sequence[TraceRecord], tokens_per_hash: int = MOONCAKE_BLOCK_SIZE,
                 length_scale: float = 1.0, max_output_len: int | None = None, name: str = "") -> Workload:
    if not 0 < length_scale <= 1:
        raise ConfigError(f"length_scale must be in (0, 1], got {length_scale}")
    tph = max(1, round(tokens_per_hash * length_scale))
    t0 = min((r.timestamp_ms for r in records), default=0.0)
    reqs = []
    for i, r in enumerate(records):
        out = r.output_length if max_output_len is None else min(r.output_length, max_output_len)
        reqs.append(SimRequestSpec(i, (r.timestamp_ms - t0) / 1e3, max(1, round(r.input_length * length_scale)),
                                   max(1, out), r.hash_ids))
    reqs.sort(key=lambda q: (q.arrival_s, q.index))
    return Workload(tuple(reqs), tph, name)


def from_bench(requests: Iterable[BenchRequest], rate: float | None = None, name: str = "bench") -> Workload:
    """Token-id prompts from a `splitserve bench` dataset; arrivals from the dataset (a trace's
    offsets) or evenly at `rate` per second."""
    reqs = []
    for i, b in enumerate(requests):
        if not isinstance(b.prompt, tuple):
            raise ConfigError("the simulator needs token-id prompts (the random, shared-prefix and mooncake datasets)")
        at = b.arrival_s if b.arrival_s is not None else (i / rate if rate else 0.0)
        reqs.append(SimRequestSpec(i, at, len(b.prompt), b.output_len, tokens=b.prompt))
    return Workload(tuple(reqs), MOONCAKE_BLOCK_SIZE, name)


class PrefixHasher:
    """Block hashes of simulated prompts. Those with hash ids: block k's digest chains the
    previous block's with (the hash id covering it, its offset in that id's tokens), memoised
    per (parent, hash id) so a shared prefix is hashed once; tokens past the ids are the
    request's own. Those with tokens: the engine's own hashing."""

    def __init__(self, block_size: int, tokens_per_hash: int) -> None:
        if tokens_per_hash % block_size:
            raise ConfigError(f"the trace's {tokens_per_hash}-token hash blocks must be whole engine blocks "
                              f"of {block_size}")
        self.block_size, self.per_hash = block_size, tokens_per_hash // block_size
        self._memo: dict[tuple[BlockHash | None, int], tuple[BlockHash, ...]] = {}

    def hashes(self, spec: SimRequestSpec) -> tuple[BlockHash, ...]:
        bs = self.block_size
        if spec.tokens is not None:
            return tuple(block_hashes(spec.tokens, bs))
        full = spec.input_len // bs
        out: list[BlockHash] = []
        parent: BlockHash | None = None
        for h in spec.hash_ids:
            if len(out) >= full:
                break
            key = (parent, h)
            sub = self._memo.get(key)
            if sub is None:
                sub = self._memo[key] = _chain(parent, struct.pack("<q", h), self.per_hash)
            out += sub
            parent = sub[-1]
        if len(out) < full:  # past the trace's blocks: this request's own
            out += _chain(out[-1] if out else None, b"tail" + struct.pack("<q", spec.index), full - len(out))
        return tuple(out[:full])


def _chain(parent: BlockHash | None, name: bytes, n: int) -> tuple[BlockHash, ...]:
    out = []
    for k in range(n):
        parent = hashlib.blake2b((parent or b"") + name + struct.pack("<i", k), digest_size=DIGEST_SIZE).digest()
        out.append(parent)
    return tuple(out)
