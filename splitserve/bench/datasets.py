"""Request generators for `splitserve bench`.

A dataset is an iterator of `BenchRequest`: a prompt (token ids, so no tokenizer is needed — the
OpenAI API accepts `prompt: [int, ...]` — or text), the number of tokens to generate, and, for
traces, the arrival offset from the start of the run. The runner decides how requests arrive
(Poisson rate, closed loop, or these offsets); datasets only decide what is asked.

    random         input/output lengths drawn uniformly from ranges (endless)
    shared-prefix  groups x prompts per group; prompts of a group share one system prompt
    mooncake       a Mooncake JSONL trace: lengths, timestamps (ms), and `hash_ids` — equal hash ids
                   are equal 512-token blocks, so the trace's prefix sharing is reproduced exactly

Every generator is seeded: the same arguments give the same requests.
"""

from __future__ import annotations

import functools
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

MOONCAKE_BLOCK_SIZE = 512  # tokens per hash id in the Mooncake traces
DATASETS = ("random", "shared-prefix", "mooncake")


@dataclass(frozen=True)
class BenchRequest:
    """One request to send: prompt (token ids or text), tokens to generate, arrival offset (s)."""

    prompt: tuple[int, ...] | str
    output_len: int
    arrival_s: float | None = None  # offset from the run's start; None: the runner decides

    @property
    def prompt_len(self) -> int | None:
        return len(self.prompt) if isinstance(self.prompt, tuple) else None


@dataclass(frozen=True)
class TokenSpace:
    """Token ids are drawn from [low, vocab_size); low skips the special tokens at the start."""

    vocab_size: int = 32000

    def __post_init__(self) -> None:
        if self.vocab_size < 16:
            raise ValueError(f"vocab_size must be >= 16, got {self.vocab_size}")

    @property
    def low(self) -> int:
        return min(1000, self.vocab_size // 4)

    @property
    def span(self) -> int:
        return self.vocab_size - self.low

    def draw(self, rng: random.Random, n: int) -> list[int]:
        return [rng.randrange(self.low, self.vocab_size) for _ in range(n)]

    def distinct_firsts(self, rng: random.Random, n: int) -> list[int]:
        """n distinct token ids, so that n sequences starting with them differ at position 0."""
        if n > self.span:
            raise ValueError(f"need {n} distinct tokens but vocab_size {self.vocab_size} offers {self.span}")
        return rng.sample(range(self.low, self.vocab_size), n)


def _check_range(name: str, lo_hi: Sequence[int], minimum: int) -> tuple[int, int]:
    lo, hi = int(lo_hi[0]), int(lo_hi[1])
    if lo < minimum or hi < lo:
        raise ValueError(f"{name} must be a range LO HI with {minimum} <= LO <= HI, got {lo} {hi}")
    return lo, hi


def random_requests(input_len: Sequence[int] = (128, 512), output_len: Sequence[int] = (32, 128),
                    seed: int = 0, vocab_size: int = 32000) -> Iterator[BenchRequest]:
    """Endless requests with input and output lengths uniform in the given inclusive ranges."""
    in_lo, in_hi = _check_range("input_len", input_len, 1)
    out_lo, out_hi = _check_range("output_len", output_len, 1)
    space, rng = TokenSpace(vocab_size), random.Random(seed)
    while True:
        n_in = rng.randint(in_lo, in_hi)
        yield BenchRequest(tuple(space.draw(rng, n_in)), rng.randint(out_lo, out_hi))


def shared_prefix_requests(num_groups: int = 8, prompts_per_group: int = 8, system_len: int = 512,
                           question_len: int = 64, output_len: int = 64, seed: int = 0,
                           vocab_size: int = 32000, shuffle: bool = True) -> Iterator[BenchRequest]:
    """num_groups x prompts_per_group requests; a group's prompts share exactly its system prompt.

    System prompts of different groups differ at their first token, and questions within a group
    differ at theirs, so the shared prefix is exactly `system_len` tokens — what a prefix cache can
    reuse is known analytically. Shuffled (seeded) so that groups interleave.
    """
    for name, v in (("num_groups", num_groups), ("prompts_per_group", prompts_per_group),
                    ("question_len", question_len), ("output_len", output_len)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if system_len < 0:
        raise ValueError(f"system_len must be >= 0, got {system_len}")
    space, rng = TokenSpace(vocab_size), random.Random(seed)
    out: list[BenchRequest] = []
    for first in space.distinct_firsts(rng, num_groups):
        system = ([first] + space.draw(rng, system_len - 1)) if system_len else []
        for q_first in space.distinct_firsts(rng, prompts_per_group):
            question = [q_first] + space.draw(rng, question_len - 1)
            out.append(BenchRequest(tuple(system + question), output_len))
    if shuffle:
        rng.shuffle(out)
    yield from out


@dataclass(frozen=True)
class TraceRecord:
    """One line of a Mooncake trace."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_mooncake_trace(path: str | Path, max_requests: int | None = None) -> list[TraceRecord]:
    """Parse a Mooncake JSONL trace (fields: timestamp, input_length, output_length, hash_ids)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"trace file not found: {path}")
    records: list[TraceRecord] = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if max_requests is not None and len(records) >= max_requests:
                break
            if line.strip():
                records.append(_parse_trace_line(line, path, lineno))
    return records


def _parse_trace_line(line: str, path: Path, lineno: int) -> TraceRecord:
    try:
        d = json.loads(line)
        return TraceRecord(float(d["timestamp"]), int(d["input_length"]), int(d["output_length"]),
                           tuple(int(h) for h in d.get("hash_ids", ())))
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}:{lineno}: not a Mooncake trace record ({e!r})") from e


def scale_lengths(records: Sequence[TraceRecord], length_scale: float) -> list[TraceRecord]:
    """The trace for a smaller model: prompts x `length_scale`, with hash blocks shrunk alike
    (pass `block_size` = 512 x length_scale to `trace_requests`), so the same blocks are shared;
    outputs keep their length (cap them with max_output_len). `splitserve simulate
    --length-scale` reads a trace the same way."""
    if not 0 < length_scale <= 1:
        raise ValueError(f"length_scale must be in (0, 1], got {length_scale}")
    return [TraceRecord(r.timestamp_ms, max(1, round(r.input_length * length_scale)), r.output_length, r.hash_ids)
            for r in records]


@functools.lru_cache(maxsize=4096)
def mooncake_block(hash_id: int, seed: int, vocab_size: int, block_size: int) -> tuple[int, ...]:
    """The tokens of hash id `hash_id`: a deterministic function of (seed, hash id)."""
    return tuple(TokenSpace(vocab_size).draw(random.Random(f"mooncake:{seed}:{hash_id}"), block_size))


def mooncake_requests(path: str | Path, time_scale: float = 1.0, max_requests: int | None = None,
                      seed: int = 0, vocab_size: int = 32000, block_size: int = MOONCAKE_BLOCK_SIZE,
                      max_output_len: int | None = None) -> Iterator[BenchRequest]:
    """Requests replaying a Mooncake trace file; see `trace_requests`."""
    if max_requests is not None and max_requests < 1:
        raise ValueError(f"max_requests must be >= 1, got {max_requests}")
    records = read_mooncake_trace(path, max_requests)
    return trace_requests(records, time_scale, seed, vocab_size, block_size, max_output_len)


def trace_requests(records: Sequence[TraceRecord], time_scale: float = 1.0, seed: int = 0,
                   vocab_size: int = 32000, block_size: int = MOONCAKE_BLOCK_SIZE,
                   max_output_len: int | None = None) -> Iterator[BenchRequest]:
    """Requests replaying trace records, built lazily (a trace's prompts are too big to hold at once).

    The prompt is the concatenation of the blocks named by `hash_ids`, cut to `input_length`
    (the last block is partial); if `input_length` runs past the blocks, request-unique tokens
    fill the rest. Arrival offsets are the timestamps (ms, relative to the first) x `time_scale`.
    """
    if time_scale < 0:
        raise ValueError(f"time_scale must be >= 0, got {time_scale}")
    if max_output_len is not None and max_output_len < 1:
        raise ValueError(f"max_output_len must be >= 1, got {max_output_len}")
    space = TokenSpace(vocab_size)
    t0 = min((r.timestamp_ms for r in records), default=0.0)
    return (_trace_request(i, rec, (rec.timestamp_ms - t0) / 1000.0 * time_scale, seed, space, block_size,
                           max_output_len) for i, rec in enumerate(records))


def _trace_request(i: int, rec: TraceRecord, arrival_s: float, seed: int, space: TokenSpace, block_size: int,
                   max_output_len: int | None) -> BenchRequest:
    tokens: list[int] = []
    for h in rec.hash_ids:
        if len(tokens) >= rec.input_length:
            break
        tokens += mooncake_block(h, seed, space.vocab_size, block_size)
    if len(tokens) < rec.input_length:
        tokens += space.draw(random.Random(f"mooncake-tail:{seed}:{i}"), rec.input_length - len(tokens))
    out_len = rec.output_length if max_output_len is None else min(rec.output_length, max_output_len)
    return BenchRequest(tuple(tokens[: max(1, rec.input_length)]), max(1, out_len), arrival_s)
