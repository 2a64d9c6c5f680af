"""A request inside the engine: its tokens, its blocks, and how far its KV has been computed.

`num_computed_tokens` only grows while the sequence runs; preemption (recompute) resets it to 0
and drops the blocks, keeping the generated tokens so nothing is lost. `token_ids` holds only
accepted tokens: speculative proposals (`spec_tokens`) join it once the model has verified them.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from splitserve.hashing import BlockHash, block_hashes
from splitserve.types import FinishReason, Request

if TYPE_CHECKING:  # the sampler needs torch; the simulator's sequences carry a plain stand-in
    from splitserve.engine.sampler import SamplingState


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request: Request
    order: int  # arrival order: FCFS within a priority class
    sampling: SamplingState
    max_tokens: int  # effective limit: the caller's, capped by the context length
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)  # of every full block of token_ids
    num_computed_tokens: int = 0
    num_cached_blocks: int = 0  # leading blocks already handed to the prefix cache
    num_cached_tokens: int = -1  # prefix-cache hit at first scheduling; -1 until then
    num_preemptions: int = 0
    prefill_only: bool = False  # stop after the first token and hand the KV blocks over
    stream_kv: bool = False  # report its complete blocks as they are computed (KVProgress)
    published: int = 0  # leading blocks reported so far (this epoch)
    # speculative decoding: tokens proposed to follow token_ids, verified by the coming step (the
    # scheduler may shorten them; every step consumes them), and the proposer's state for it
    spec_tokens: list[int] = field(default_factory=list)
    spec_state: object = None
    # a draft head's output at the last computed position (speculative/draft.py), or None
    draft_tail: object = None
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    added_at: float = field(default_factory=time.monotonic)
    scheduled_at: float | None = None  # first scheduling: ends its queueing, starts its prefill
    group: int = 0  # the scheduler's group whose steps carry it (several with pipeline steps in flight)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.request.prompt_token_ids)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.sampling.output_token_ids

    @property
    def sort_key(self) -> tuple[int, int]:
        return (int(self.request.priority), self.order)

    def update_hashes(self, block_size: int) -> None:
        """Extend `block_hashes` to every full block of `token_ids` (the prompt's from the
        request when the ingress computed them for this block size)."""
        done = len(self.block_hashes)
        ph = self.request.prompt_hashes
        if not done and ph is not None and ph.block_size == block_size:
            self.block_hashes = list(ph.hashes)
            done = len(self.block_hashes)
        if done < self.num_tokens // block_size:
            parent = self.block_hashes[-1] if done else None
            self.block_hashes += block_hashes(
                self.token_ids, block_size, self.request.cache_salt, start=done, parent=parent
            )

    def append_token(self, token: int, block_size: int) -> None:
        self.token_ids.append(token)
        self.sampling.output_token_ids.append(token)
        if self.num_tokens % block_size == 0:
            self.update_hashes(block_size)
