"""One request's landing on the decode side: the handoff state machine (DESIGN.md §1 step 6).

    ALLOCATING ──► PULLING ──► VERIFYING ──► READY       (joins the decode batch)
        │             │            │
        └─────────────┴────────────┴───────► RECOMPUTE   (computes the prompt here instead)
                                     └─────► ABORTED     (blocks freed, nothing more happens)

An abort may arrive at any moment, from the event loop; the landing itself moves on the event
loop too, but its last step (admit to the batch, recompute, or free) runs on the engine thread.
`finish` takes that decision there, in one call, under a lock shared with `request_abort`: so
either the abort is seen and the blocks are freed (once, after every transfer into them has
stopped), or the request is already in the engine and the abort is sent there, ordered after it
on the engine's one thread. Never both, never neither.
"""

from __future__ import annotations

import enum
import threading

from splitserve.engine.core import Reservation
from splitserve.engine.engine import Engine


class HandoffState(str, enum.Enum):
    ALLOCATING = "allocating"  # waiting for destination blocks
    PULLING = "pulling"  # a transfer may be writing the blocks
    VERIFYING = "verifying"  # the bytes are in; checking header and checksum
    READY = "ready"  # in the decode batch
    RECOMPUTE = "recompute"  # the pull failed: the engine computes the prompt itself
    ABORTED = "aborted"  # freed; the request ends here

    def __str__(self) -> str:
        return self.value


S = HandoffState
_NEXT = {
    S.ALLOCATING: {S.PULLING, S.RECOMPUTE, S.ABORTED},
    S.PULLING: {S.VERIFYING, S.RECOMPUTE, S.ABORTED},
    S.VERIFYING: {S.READY, S.RECOMPUTE, S.ABORTED},
    S.READY: set(), S.RECOMPUTE: set(), S.ABORTED: set(),
}
FINAL = frozenset({S.READY, S.RECOMPUTE, S.ABORTED})


class Handoff:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.state = S.ALLOCATING
        self.allocated = False  # the engine holds destination blocks for it (set on the engine thread)
        self._abort_requested = False
        self._lock = threading.Lock()  # request_abort (event loop) vs finish (engine thread)

    @property
    def abort_requested(self) -> bool:
        return self._abort_requested

    def move(self, to: HandoffState) -> None:
        with self._lock:
            self._move(to)

    def _move(self, to: HandoffState) -> None:
        if to not in _NEXT[self.state]:
            raise AssertionError(f"handoff {self.request_id}: {self.state} -> {to} is not a transition")
        self.state = to

    def request_abort(self) -> bool:
        """Note the abort. True when the request has already left the handoff for the engine
        (READY or RECOMPUTE): the caller must abort it there."""
        with self._lock:
            self._abort_requested = True
            return self.state in (S.READY, S.RECOMPUTE)

    def reserve(self, engine: Engine, req, outputs: tuple[int, ...]) -> Reservation:
        """On the engine thread: destination blocks for a context the peer is still computing
        (a streamed handoff; `adopt` makes them the request's once its token is known)."""
        r = engine.reserve_pulled(req, outputs)
        self.allocated = True
        return r

    def adopt(self, engine: Engine, req, outputs: tuple[int, ...]) -> list[int]:
        """On the engine thread: the reserved blocks become the request's, `outputs` ending
        with the peer's token (as `allocate` would have made them)."""
        return engine.add_pulled(req, outputs[-1], outputs[:-1])

    def allocate(self, engine: Engine, req, outputs: tuple[int, ...]) -> list[int]:
        """On the engine thread: destination blocks for the context (prompt + `outputs`, the last
        of which is the peer's token). Raises OutOfBlocks."""
        dst = engine.add_pulled(req, outputs[-1], outputs[:-1])
        self.allocated = True
        return dst

    def finish(self, engine: Engine, outcome: HandoffState) -> HandoffState:
        """On the engine thread: end the handoff with `outcome` (READY or RECOMPUTE), or ABORTED if
        an abort came first (or the landing failed). Frees or hands over the blocks exactly once:
        a handoff that has ended already stays as it ended."""
        with self._lock:
            if self.state in FINAL:
                return self.state
            if self._abort_requested:
                outcome = S.ABORTED
            self._move(outcome)
        if self.allocated:
            if outcome is S.READY:
                engine.kv_ready(self.request_id)  # joins the decode batch
            elif outcome is S.RECOMPUTE:
                engine.kv_failed(self.request_id)  # blocks freed, the prompt computed here
            else:
                engine.abort(self.request_id)  # blocks freed
        return outcome
