"""The prefill side of a streamed handoff (DESIGN.md §1 steps 5–6, streamed): while a prompt is
still being computed, its complete blocks are published as `StreamPiece`s — each with its own
checksum, readable under the stream's lease from the moment it is published — so the decode
worker pulls them behind the prefill instead of after it. The last step's blocks are the last
piece (`KVHandoff.streamed`: how many leading blocks the pieces, or the reader, covered; a
handoff carries the rest only when no reader had called yet).

A `KVStream` is one request's: the pieces so far, the epoch (a preempted prefill's blocks were
freed: its pieces are void, publishing starts again), and whether more will come. Its reader's
first call says how many leading blocks it holds already (its prefix cache): those are covered
without a piece, and publishing waits for that call. The blocks a step completes are published
layer group by layer group while its forward runs (the engine's `KVProgress.computing`): such
a run is covered once its last layer is. Readers wait
on it (`wait`) for what is new. Mechanism only: the worker computes checksums, grants and
revokes reads, and ends the stream with the lease.
"""

from __future__ import annotations

import asyncio
import dataclasses

from splitserve.kv_transfer.base import KVHandoff, StreamPiece, StreamUpdate
from splitserve.types import KVProgress


class KVStream:
    def __init__(self, opening: KVHandoff) -> None:
        self.opening = opening  # the handoff as a reader first sees it: lease, endpoint, header, no blocks
        self.blocks: tuple[int, ...] = ()  # source blocks covered, in context order: the reader's held ones, then the pieces'
        self.pieces: list[StreamPiece] = []
        self.epoch = 0
        # leading context blocks the reader holds already (its prefix cache), never sent: None
        # until its first call says; nothing is published before, so no piece overlaps them
        self.held: int | None = None
        self.run: tuple[int, ...] = ()  # blocks after those covered, published layer group by layer group
        self.run_layers = 0  # how many of their layers
        self.latest: KVProgress | None = None  # the prefill's progress, the newest
        self.publishing = asyncio.Lock()  # one publication at a time (the prefill's, the reader's first call)
        self.done = False
        self._changed = asyncio.Event()

    @property
    def request_id(self) -> str:
        return self.opening.request_id

    @property
    def lease_id(self) -> str:
        return self.opening.lease_id

    def restart(self, epoch: int) -> None:
        self.blocks, self.pieces, self.epoch = (), [], epoch
        self.run, self.run_layers = (), 0
        self._changed.set()

    def cover_held(self, block_ids: tuple[int, ...]) -> None:
        """Of these (the context's computed blocks), those the reader holds: covered, not sent."""
        if self.held and block_ids[:len(self.blocks)] == self.blocks:
            self.blocks += tuple(block_ids[len(self.blocks):self.held])

    def due(self, complete: tuple[int, ...], computing: tuple[int, ...], layers: int,
            num_layers: int) -> list[tuple[tuple[int, ...], range]]:
        """The pieces to publish, in order, now that the `complete` blocks are computed and the
        first `layers` layers of `computing`: the rest of a run that was streaming layer by
        layer, the complete blocks after it, then the new layers of the run in flight."""
        if complete[:len(self.blocks)] != self.blocks:
            return []
        out, rest, run, done = [], complete[len(self.blocks):], self.run, self.run_layers
        if run and rest[:len(run)] == run:  # the run in flight is complete: its other layers
            if done < num_layers:
                out.append((run, range(done, num_layers)))
            rest, run, done = rest[len(run):], (), 0
        if rest:
            out.append((rest, range(num_layers)))
        if computing and layers and len(complete) >= (self.held or 0):  # (a run the reader holds is not sent)
            if computing != run:  # a new run (the step after)
                done = 0
            if layers > done:
                out.append((computing, range(done, layers)))
        return out

    def add(self, block_ids: tuple[int, ...], layers: range, checksum: int, num_layers: int) -> None:
        """A published piece: `layers` of `block_ids`, the blocks after those covered. All
        layers (the last of them) cover the blocks; fewer leave them the run in flight."""
        whole = layers == range(num_layers)
        self.pieces.append(StreamPiece(len(self.blocks), tuple(block_ids), checksum, None if whole else layers))
        if layers.stop == num_layers:
            self.blocks += tuple(block_ids)
            self.run, self.run_layers = (), 0
        else:
            self.run, self.run_layers = tuple(block_ids), layers.stop
        self._changed.set()

    def close(self) -> None:
        self.done = True
        self._changed.set()

    def update(self, have: int, epoch: int) -> StreamUpdate:
        """What a reader holding `have` pieces of `epoch` has not seen yet."""
        start = have if epoch == self.epoch else 0
        blocks = self.blocks + self.run
        opening = dataclasses.replace(self.opening, block_ids=blocks,
                                      header=dataclasses.replace(self.opening.header, num_blocks=len(blocks)))
        return StreamUpdate(opening, tuple(self.pieces[start:]), self.epoch, self.done)

    async def wait(self, have: int, epoch: int, within_s: float) -> StreamUpdate:
        """The update once there is something new (or the stream ends), else after `within_s`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        while not self.done and epoch == self.epoch and len(self.pieces) <= have:
            self._changed.clear()
            left = deadline - loop.time()
            if left <= 0:
                break
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                break
        return self.update(have, epoch)
