"""The KV-transfer contract: how a decode worker pulls a request's KV blocks from the prefill
worker that computed them (DESIGN.md §1 steps 5–6).

Life of a handoff:
  1. Each worker registers its paged KV memory with its transport once (`register`) and
     publishes the returned `TransportEndpoint` (address + metadata + the `KVLayout`).
  2. The prefill worker finishes a prompt, pins its blocks under a lease (whose token its
     transports `allow` to read those blocks), and returns a `KVHandoff`: first token, source
     block ids, endpoint, lease and its token, a `TransferHeader` and the checksum of the
     source blocks.
  3. The decode worker allocates local blocks and calls `read(handoff, dst_blocks)`; it polls the
     handle without blocking until DONE or FAILED (FAILED carries the reason).
  4. It verifies (`verify.check_handoff` + checksum of what landed) before using anything, then
     acknowledges the lease; the prefill side revokes its token and frees its blocks. Any
     mismatch is a TransferError and the data is never used.

Transports are data movers only: which transport a pair uses, leases and verification are
decided elsewhere. Byte offsets are relative to the start of the KV storage tensor
[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim].
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Protocol, Sequence

from splitserve.types import TokenLogprob


def layers_differ(source: int, local: int) -> str:
    """The words for two caches of different layer counts. One layer apart is what a draft head's
    KV makes (speculative method draft caches it as one more layer): the pools' speculative
    configs differ, not their models."""
    why = f"num_layers: source {source!r}, local {local!r}"
    if abs(source - local) == 1:
        why += (" — one side caches a draft head's layer (speculative method draft: its KV is the cache's last "
                "layer) and the other does not: give the prefill and decode pools the same speculative config")
    return why


class TransferError(RuntimeError):
    """A transfer failed or delivered data that must not be used. `kind` says why, for metrics
    and tests: corrupt | truncated | header | lease_expired | unreachable | aborted | internal."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.detail = message

    def __reduce__(self):  # crosses process boundaries (Ray) with its kind intact
        return (type(self), (self.kind, self.detail))


@dataclass(frozen=True)
class KVLayout:
    """What both sides must agree on before a single byte moves."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int  # a row's elements: fp8_e4m3's is head_dim + 1 bytes (values, then their scale)
    dtype: str  # "float32" | "bfloat16" | "float16" | "fp8_e4m3"
    element_size: int
    model_fingerprint: str  # hash of the model config + weights' identity

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer's K (or V)."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.element_size

    @property
    def storage_bytes(self) -> int:
        return self.num_layers * 2 * self.num_blocks * self.block_bytes

    def offset(self, layer: int, kv: int, block: int) -> int:
        return ((layer * 2 + kv) * self.num_blocks + block) * self.block_bytes


@dataclass(frozen=True)
class TransportEndpoint:
    transport: str  # "shm" | "tcp" | "nixl"
    host: str  # node identity, for locality (same host -> shm)
    address: str  # tcp: "ip:port"; shm: file path; nixl: agent name
    layout: KVLayout
    metadata: bytes = b""  # transport-specific (e.g. NIXL agent metadata)


@dataclass(frozen=True)
class TransferHeader:
    request_id: str
    model_fingerprint: str
    dtype: str
    block_size: int
    num_layers: int
    num_blocks: int  # blocks in this handoff
    lease_epoch: int


@dataclass(frozen=True)
class KVHandoff:
    """What the prefill worker returns: enough to continue the request anywhere."""

    request_id: str
    first_token: int
    first_logprob: TokenLogprob | None
    num_prompt_tokens: int
    num_cached_tokens: int  # prefix-cache hit on the prefill side
    block_ids: tuple[int, ...]  # source blocks covering the prompt, in order
    endpoint: TransportEndpoint
    lease_id: str
    lease_expires_at: float  # time.time() seconds
    header: TransferHeader
    checksum: int  # kv_checksum over block_ids, all layers (0 in a sliced handoff: its ranks' per-head ones)
    lease_token: bytes = b""  # what lets its reader read these blocks (and no others) where the transport checks
    # a tensor-parallel source (or a tensor-parallel reader): every source rank's endpoints and
    # per-head checksums (head_slices.RankSource); each reader rank pulls its heads from them
    ranks: tuple = ()
    computed_at: float = 0.0  # time.time() when the prefill's last forward pass ended (its first token sampled)
    # a streamed handoff: its leading blocks were published as `StreamPiece`s, each checked by
    # its own checksum as it landed; `checksum` covers block_ids[streamed:] only
    streamed: int = 0
    # a pipeline-parallel source (or reader): every source stage's endpoints, global layers and
    # per-layer checksums (stage_slices.StageSource; a single source is one stage of every layer);
    # each reader stage pulls its layers from them. `checksum` is 0 then, as in a sliced handoff
    stages: tuple = ()

    def piece(self, first: int, count: int, checksum: int) -> "KVHandoff":
        """This handoff narrowed to block_ids[first:first + count] (a streamed piece, or the
        tail after the pieces), with that run's checksum: what a transport reads."""
        ids = self.block_ids[first:first + count]
        header = dataclasses.replace(self.header, num_blocks=len(ids))
        return dataclasses.replace(self, block_ids=ids, header=header, checksum=checksum, streamed=0)


@dataclass(frozen=True)
class StreamPiece:
    """Blocks of a streamed handoff, published by the prefill worker as its prefill computed
    them: context blocks [first, first + len(block_ids)) — `block_ids` the source's — and
    their checksum over `layers` (None: all). A run of blocks the prefill was still computing
    comes as pieces of consecutive layer groups, the same blocks each time."""

    first: int
    block_ids: tuple[int, ...]
    checksum: int
    layers: range | None = None


@dataclass(frozen=True)
class StreamUpdate:
    """What a reader of a streamed handoff learns per call (`PrefillWorker.kv_stream`): the
    handoff so far (lease, endpoint, header; its block_ids the published ones, first_token
    unset), the pieces after those it had, and whether more will come. A new `epoch` (the
    prefill was preempted) voids every earlier piece."""

    handoff: "KVHandoff | None"  # None: no such stream (over, or never started)
    pieces: tuple[StreamPiece, ...]
    epoch: int
    done: bool


class TransferState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class TransferStatus:
    state: TransferState
    reason: TransferError | None = None


@dataclass
class TransferHandle:
    """Opaque per-transfer state; transports may subclass it."""

    request_id: str
    src: KVHandoff
    dst_blocks: tuple[int, ...]
    layers: range
    nbytes: int = 0


class UngatedReads:
    """For a transport whose reads are not gated per lease (shm: a file only this host's
    processes of the same user open; nixl: memory readable by the agents given this worker's
    metadata): `allow` and `revoke` accept and ignore."""

    def allow(self, token: bytes, blocks: Sequence[int]) -> None:
        pass

    def revoke(self, token: bytes) -> None:
        pass

    def granted(self) -> int:
        return 0


class KVTransport(Protocol):
    name: str

    def register(self, storage, layout: KVLayout, host: str, serve: bool = True) -> TransportEndpoint:
        """This worker's KV storage (a torch tensor), once per worker: readable by peers when
        `serve` (a prefill worker), else only a destination to read into (a decode worker)."""

    def allow(self, token: bytes, blocks: Sequence[int]) -> None:
        """Let the holder of `token` (a lease's) read `blocks` from this worker until `revoke`
        (a transport whose reads are not gated per lease ignores it: `UngatedReads`)."""

    def revoke(self, token: bytes) -> None:
        """The lease ended: its token reads nothing more."""

    def granted(self) -> int:
        """Tokens allowed and not yet revoked (0 where reads are not gated): a check's count."""

    def read(self, src: KVHandoff, dst_blocks: Sequence[int], layers: range | None = None) -> TransferHandle:
        """Start pulling src.block_ids (layers `layers`, default all) into local dst_blocks."""

    def poll(self, handle: TransferHandle) -> TransferStatus:
        """Never blocks. FAILED carries a TransferError."""

    def release(self, handle: TransferHandle) -> None:
        """Drop per-transfer resources (after DONE / FAILED, or to abort a pending one). An aborted
        transfer may still be writing: the destination blocks may be reused only once `poll`
        no longer answers PENDING."""

    def close(self) -> None:
        """Unregister memory, stop servers, close connections."""
