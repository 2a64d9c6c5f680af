"""Small typed values exchanged at every boundary: sampling parameters, requests, token chunks.

A request's life (DESIGN.md §1): the front end (offline `LLM`, later the router) builds a
`Request` from token ids and `SamplingParams`; `Engine.add_request` takes it; every
`Engine.step` returns `TokenChunk`s — new token ids (with logprobs when asked), and a
`FinishReason` on the last one. Text and stop strings are the front end's job (`detokenizer`).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import uuid
from dataclasses import dataclass, field
from typing import Sequence


class ConfigError(ValueError):
    """A configuration or parameter value is invalid; the message says which and why."""


class ServiceUnavailable(RuntimeError):
    """The service could not finish a request it had accepted (its workers were lost and no other
    could take it over). The message is ours and safe to show a client: it names no actor, process
    or address. HTTP 503 / an SSE `error` event; gRPC UNAVAILABLE."""


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"  # the caller aborted


class MoveKind(str, enum.Enum):
    """Why a request left a worker before it was done (a label of /metrics)."""

    MIGRATION = "migration"  # its decode worker stopped serving it mid-stream: it continues on another
    RETRY = "retry"  # its prefill worker failed it: placed again


class MoveReason(str, enum.Enum):
    DIED = "died"  # the worker's process is gone
    FAILED = "failed"  # its engine raised
    SILENT = "silent"  # sent nothing within the inactivity (decode) or prefill timeout
    ENDED = "ended"  # ended the stream unasked


@dataclass(frozen=True)
class MoveCount:
    """How many requests moved for one kind and reason, since the orchestrator started."""

    kind: MoveKind
    reason: MoveReason
    total: int


class Priority(enum.IntEnum):
    """Lower value runs first; FCFS within a class."""

    CRITICAL = 0
    STANDARD = 1
    SHEDDABLE = 2


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


class GrammarKind(str, enum.Enum):
    """What a grammar spec's text is."""

    JSON_SCHEMA = "json_schema"  # a JSON Schema, as JSON text
    JSON_OBJECT = "json_object"  # any JSON object (the text is empty)
    REGEX = "regex"
    CHOICE = "choice"  # one of several strings, as a JSON list
    GRAMMAR = "grammar"  # a Lark / EBNF grammar (llguidance's dialect)


# The FP8 KV cache's dtype name (engine/kv_cache/fp8.py): its storage is bytes, each head's row
# head_dim e4m3 values and one scale exponent; layouts and handoffs name it so, never "uint8".
KV_FP8 = "fp8_e4m3"
MAX_GRAMMAR_BYTES = 64 * 1024  # a schema, regex or grammar's text: bounded, documented
GRAMMAR_CACHE_SIZE = 128  # compiled grammars an engine keeps (an LRU: a new spec evicts the oldest)
MAX_LOGIT_BIAS = 300  # token ids one request may bias (OpenAI's bound)


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint on a request's output (structured output, a forced tool call): what travels
    with the request to every worker that samples for it — the prefill worker's first token, the
    decode worker's rest, a migration's new worker — each of which builds its matcher from this
    and the tokens already accepted. `text/grammar.py` checks and translates it."""

    kind: GrammarKind
    text: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", GrammarKind(self.kind))
        _check(isinstance(self.text, str), "a grammar's text must be a string")
        _check(len(self.text.encode()) <= MAX_GRAMMAR_BYTES,
               f"the {self.kind.value} is {len(self.text.encode())} bytes; at most {MAX_GRAMMAR_BYTES} are accepted")

    @property
    def key(self) -> str:
        """Equal specs share one compiled grammar."""
        return f"{self.kind.value}:{self.text}"


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens; names and defaults follow vLLM / the OpenAI API."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # number of top alternatives; 0 = only the chosen token's
    skip_special_tokens: bool = True
    grammar: GrammarSpec | None = None  # structured output: every token is one the grammar allows
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, -100..100) added to its logit

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(self.logit_bias.items()))
        object.__setattr__(self, "logit_bias", tuple(tuple(kv) for kv in self.logit_bias))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _validate(self) -> None:
        def finite(name: str) -> float:
            v = getattr(self, name)
            _check(isinstance(v, (int, float)) and not isinstance(v, bool), f"{name} must be a number, got {v!r}")
            _check(math.isfinite(v), f"{name} must be finite, got {v!r}")
            return float(v)

        _check(isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        _check(0.0 <= finite("temperature") <= 100.0, f"temperature must be in [0, 100], got {self.temperature}")
        _check(0.0 < finite("top_p") <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, f"top_k must be -1, 0 or a positive integer, got {self.top_k!r}")
        _check(0.0 <= finite("min_p") <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        _check(-2.0 <= finite("presence_penalty") <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        _check(-2.0 <= finite("frequency_penalty") <= 2.0, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        _check(0.0 < finite("repetition_penalty") <= 2.0, f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        _check(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)
                                     and -(1 << 63) <= self.seed <= (1 << 63) - self.n),
               f"seed must be a 64-bit signed integer (with n samples, seed + n - 1 too), got {self.seed!r}")
        _check(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            f"max_tokens must be an integer >= 1, got {self.max_tokens!r}",
        )
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens!r}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids must be non-negative integers")
        _check(
            self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
            f"logprobs must be an integer in [0, 20], got {self.logprobs!r}",
        )
        _check(self.grammar is None or isinstance(self.grammar, GrammarSpec), "grammar must be a GrammarSpec")
        self._validate_logit_bias()

    def _validate_logit_bias(self) -> None:
        _check(len(self.logit_bias) <= MAX_LOGIT_BIAS,
               f"logit_bias may bias at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}")
        for kv in self.logit_bias:
            _check(len(kv) == 2, "logit_bias must map token ids to numbers")
            tok, bias = kv
            _check(isinstance(tok, int) and not isinstance(tok, bool) and tok >= 0,
                   f"logit_bias: {tok!r} is not a token id")
            _check(isinstance(bias, (int, float)) and not isinstance(bias, bool) and -100 <= bias <= 100,
                   f"logit_bias: the bias of token {tok} must be a number in [-100, 100], got {bias!r}")
        _check(len({t for t, _ in self.logit_bias}) == len(self.logit_bias), "logit_bias names a token twice")

    def for_choice(self, i: int) -> "SamplingParams":
        """The params of the i-th of n samples: seeded samples must differ from each other and
        still be reproducible, so sample i > 0 takes seed + i (one sample: n is the fan-out's)."""
        if self.seed is None or i == 0:
            return self
        return dataclasses.replace(self, seed=self.seed + i, n=1)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


@dataclass(frozen=True)
class PromptHashes:
    """A prompt's leading chained block hashes (splitserve.hashing) as the ingress computed them
    to place it — as far as some worker may hold the prefix, maybe not every full block —
    carried to the engines so that they continue the chain instead of hashing the prompt
    again. Set by our ingress only, never from a client's input."""

    block_size: int
    hashes: tuple[bytes, ...]


@dataclass(frozen=True)
class Request:
    """One sequence to generate. `n > 1` is expanded by the front end into n requests."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    priority: Priority = Priority.STANDARD
    cache_salt: str | None = None  # keeps one tenant's prefix-cache blocks apart from another's
    arrival_time: float = 0.0
    prompt_hashes: PromptHashes | None = None
    traceparent: str | None = None  # W3C trace context of the span the callee's span is a child of (tracing.py)

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))
        _check(len(self.prompt_token_ids) > 0, f"request {self.request_id}: the prompt is empty")
        ph = self.prompt_hashes
        _check(ph is None or (ph.block_size > 0 and len(ph.hashes) <= len(self.prompt_token_ids) // ph.block_size),
               f"request {self.request_id}: more prompt hashes than the prompt has full blocks")


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's logprob and the top alternatives (token id -> logprob), best first."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class PhaseTimes:
    """Seconds one request spent in each phase (and the KV bytes its transfer moved), as far as
    the reporting worker saw it; unset phases are None (an aggregated request has no
    transfer). The ingress merges what each worker reports."""

    queue_s: float | None = None  # added to the engine → first scheduled
    prefill_s: float | None = None  # first scheduled → first token sampled
    transfer_s: float | None = None  # KV pull + verify + ack on the decode worker
    transfer_bytes: int | None = None  # what that pull moved
    # the prefill's last forward pass ended → its KV landed and verified on the decode worker:
    # the part of the hand-over on the request's critical path (wall clocks of both workers)
    exposed_transfer_s: float | None = None
    transport: str | None = None  # the transport the KV came over (its registered name)

    def merged(self, other: "PhaseTimes | None") -> "PhaseTimes":
        if other is None:
            return self
        return PhaseTimes(*(b if b is not None else a for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


@dataclass(frozen=True)
class TokenChunk:
    """New tokens of one request from one engine step; `finish_reason` set on the last chunk."""

    request_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None  # the EOS / stop token that ended it, not in token_ids
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    kv_blocks: tuple[int, ...] | None = None  # prefill-only: the blocks now pinned for handoff
    phases: PhaseTimes | None = None  # on the chunk where a worker learned them

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class KVProgress:
    """A streamed prefill's progress (the engine → its prefill worker, `add_request(stream_kv=
    True)`): the leading blocks of the request's context whose KV is computed — full blocks,
    which nothing rewrites while the request holds them. `epoch` counts the request's
    preemptions: blocks reported under an earlier epoch are void (they were freed). Mid-forward
    (layer by layer): `computing`, the blocks the running step completes (the last step: up to
    the context's end), of which the first `layers` layers are written and stay as they are."""

    request_id: str
    block_ids: tuple[int, ...]
    epoch: int
    computing: tuple[int, ...] = ()
    layers: int = 0


# The terms of an engine's fitted step time (engine/step_model.py), in the order of
# WorkerStats.step_time_coeffs: what the router's admission and /metrics name them by.
STEP_TERMS = ("const", "prefill_tokens", "decode_seqs", "decode_ctx_tokens", "prefill_attention_pairs")


@dataclass(frozen=True)
class ExpertBalance:
    """A mixture-of-experts worker's expert placement and the load it gives its expert-parallel
    ranks (engine/expert_balance.py; one rank without expert parallelism), summed over layers.
    Imbalance: the sum over layers of the busiest rank's tokens / the sum of the mean's — how much
    longer the MoE layers take than with an even spread (1.0)."""

    ranks: int
    slots_per_rank: int  # physical expert slots per rank (logical experts / ranks + redundant ones)
    replicas: tuple[int, ...]  # per logical expert: the slots holding it, over all layers
    rank_tokens: tuple[int, ...]  # tokens each rank's slots took since the last rebalance
    imbalance: float  # of rank_tokens' window (0.0: nothing counted yet)
    imbalance_before: float = 0.0  # of the window the last rebalance was planned from (0.0: none yet)
    rebalances_total: int = 0  # placements applied


@dataclass(frozen=True)
class WorkerStats:
    """A snapshot of an engine's load, for the router and the admission cost models."""

    num_waiting: int
    num_running: int
    num_preempted_total: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_blocks_cached: int
    prefix_query_tokens_total: int
    prefix_hit_tokens_total: int
    steps_total: int
    # Fitted step time (engine/step_model.py): seconds ≈ c0 + c1·prefill tokens + c2·decode seqs
    # + c3·decode context tokens + c4·prefill attention pairs
    step_time_coeffs: tuple[float, ...] = (0.0,) * len(STEP_TERMS)
    pending_prefill_tokens: int = 0  # prompt tokens admitted or queued but not yet computed
    decode_context_tokens: int = 0  # context the running decodes read each step
    token_budget: int = 2048  # max_num_batched_tokens
    prefill_tokens_total: int = 0  # prompt tokens computed (prefill chunks), ever
    host_hit_tokens_total: int = 0  # of the prefix hits, tokens loaded back from the host KV tier
    kv_host_blocks_cached: int = 0  # blocks the host tier holds now
    expert_tokens_total: tuple[int, ...] = ()  # a mixture of experts: tokens each expert took, over all layers
    expert_balance: ExpertBalance | None = None  # where its experts sit and the rank load (None: not tracked)
    grammar_compile_s: float = 0.0  # a structured-output grammar's compile time on a cache miss (0: none yet)
    # speculative decoding (engine/speculative/): tokens proposed and verified, of which the model
    # accepted (each step also emits one token of its own per row), and verifications: one per
    # sequence per step that verified its proposals (accepted / verifications: per sequence)
    spec_proposed_tokens_total: int = 0
    spec_accepted_tokens_total: int = 0
    spec_verify_steps_total: int = 0
    # ... and what verification costs: the seconds of the engine steps that verified proposals, and
    # the step-time fit's seconds for those same steps without their proposals (each verifying row
    # a one-token decode); both from the fit's 32nd step on (engine/core.py `_verify_cost`)
    spec_verify_step_seconds_total: float = 0.0
    spec_verify_step_plain_seconds_total: float = 0.0

    @property
    def kv_usage(self) -> float:
        used = self.kv_blocks_total - self.kv_blocks_free - self.kv_blocks_cached
        return used / self.kv_blocks_total if self.kv_blocks_total else 0.0


@dataclass(frozen=True)
class WorkerLoad:
    """What a worker reports to health probes: its engine's load, and what it holds for others
    (a prefill worker's granted leases, a decode worker's pulls in flight). A draining worker
    stops once both are zero."""

    stats: WorkerStats
    held: int = 0
    failure: str | None = None  # set when its engine has stopped: the worker must be replaced

    @property
    def idle(self) -> bool:
        return self.stats.num_waiting == 0 and self.stats.num_running == 0 and self.held == 0


# -- KV events: a BlockPool's cache changes, for the router's cluster KV index -----------------

class Tier(str, enum.Enum):
    """Where a worker holds a cached block: its device pool, or the host-memory tier below it
    (loaded back instead of recomputed, but a load is not free: routers weigh it lower)."""

    DEVICE = "device"
    HOST = "host"


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[bytes, ...]
    tier: Tier = Tier.DEVICE


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[bytes, ...]
    tier: Tier = Tier.DEVICE


KVEvent = BlockStored | BlockRemoved


# -- workers: who they are and where they stand (the Controller's registry) ----------------------

class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"

    def __str__(self) -> str:  # metric labels, messages: the bare name
        return self.value


@dataclass(frozen=True)
class RankPlace:
    """Where one rank of a tensor-parallel worker runs (rank 0 is the worker itself)."""

    rank: int
    node_id: str
    node_ip: str
    pid: int


class WorkerId(str):
    """A worker's stable id: its role and a random suffix, e.g. `prefill-3f9a1c2e`. Never
    reused, so a replacement is a new worker to every router (its cache starts empty).

    The id is its own string: the routers' dicts and the KV index hash and compare it at C speed
    on every decision (a dataclass's generated `__hash__` is several Python calls)."""

    __slots__ = ()

    def __new__(cls, role: Role, uid: str) -> "WorkerId":
        return super().__new__(cls, f"{Role(role).value}-{uid}")

    @classmethod
    def new(cls, role: Role) -> "WorkerId":
        return cls(Role(role), uuid.uuid4().hex[:8])

    @property
    def role(self) -> Role:
        return Role(self.partition("-")[0])

    @property
    def uid(self) -> str:
        return self.partition("-")[2]

    def __getnewargs__(self) -> tuple[Role, str]:  # pickling (Ray) rebuilds it through __new__
        return self.role, self.uid

    def __repr__(self) -> str:
        return f"WorkerId({self.role.value!r}, {self.uid!r})"


class WorkerState(str, enum.Enum):
    """STARTING → READY → DRAINING → STOPPED, and DEAD from any live state."""

    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"
    DEAD = "dead"

    def __str__(self) -> str:
        return self.value

    @property
    def live(self) -> bool:
        return self in (WorkerState.STARTING, WorkerState.READY, WorkerState.DRAINING)


def as_token_ids(ids: Sequence[int], vocab_size: int) -> tuple[int, ...]:
    """Validate a caller's token ids against the vocabulary (a bad id would index out of range)."""
    out = tuple(ids)
    for t in out:
        _check(isinstance(t, int) and not isinstance(t, bool), f"token ids must be integers, got {t!r}")
        _check(0 <= t < vocab_size, f"token id {t} is outside the vocabulary [0, {vocab_size})")
    return out


_GIB = float(1 << 30)


def _size(n: int) -> str:
    return f"{n / _GIB:.2f} GiB" if n >= _GIB else f"{n / (1 << 20):.1f} MiB"


@dataclass(frozen=True)
class MemoryReport:
    """What one engine (one tensor-parallel rank) holds, said at start (engine/memory_report.py
    computes it; a worker registers it, `splitserve status` shows it) so an operator can size pools."""

    weights_bytes: int  # as held, in the serving dtype
    weights_dtype: str
    stored_bytes: int  # the checkpoint's safetensors files (all ranks' together)
    stored_format: str  # "plain" or the quantized format's label
    kv_bytes: int
    kv_tokens: int
    kv_dtype: str
    activation_bytes: int  # an estimate: the largest step's live intermediates and logits
    held: str = "dequantized at load"  # how a quantized checkpoint's weights are held

    def describe(self) -> str:
        stored = ("" if self.stored_format == "plain" else
                  f" (checkpoint {self.stored_format}: {_size(self.stored_bytes)} stored, {self.held})")
        return (f"weights {_size(self.weights_bytes)} {self.weights_dtype}{stored}; "
                f"KV cache {_size(self.kv_bytes)} {self.kv_dtype} = {self.kv_tokens} tokens; "
                f"activations ~{_size(self.activation_bytes)} per step")
