"""The prefill side of a streamed handoff (DESIGN.md §1 steps 5–6, streamed): while a prompt is
still being computed, its complete blocks are published as `StreamPiece`s — each with its own
checksum, readable under the stream's lease from the moment it is published — so the decode
worker pulls them behind the prefill instead of after it. The last step's blocks go with the
final handoff (`KVHandoff.streamed`: how many leading blocks the pieces covered).

A `KVStream` is one request's: the pieces so far, the epoch (a preempted prefill's blocks were
freed: its pieces are void, publishing starts again), and whether more will come. Readers wait
on it (`wait`) for what is new. Mechanism only: the worker computes checksums, grants and
revokes reads, and ends the stream with the lease.
"""

from __future__ import annotations

import asyncio
import dataclasses

from splitserve.kv_transfer.base import KVHandoff, StreamPiece, StreamUpdate


class KVStream:
    def __init__(self, opening: KVHandoff) -> None:
        self.opening = opening  # the handoff as a reader first sees it: lease, endpoint, header, no blocks
        self.pieces: list[StreamPiece] = []
        self.epoch = 0
        self.done = False
        self._changed = asyncio.Event()

    @property
    def request_id(self) -> str:
        return self.opening.request_id

    @property
    def lease_id(self) -> str:
        return self.opening.lease_id

    @property
    def blocks(self) -> tuple[int, ...]:
        """The published source blocks, in context order (this epoch's)."""
        return tuple(b for p in self.pieces for b in p.block_ids)

    def restart(self, epoch: int) -> None:
        self.pieces, self.epoch = [], epoch
        self._changed.set()

    def add(self, block_ids: tuple[int, ...], checksum: int) -> None:
        self.pieces.append(StreamPiece(len(self.blocks), tuple(block_ids), checksum))
        self._changed.set()

    def close(self) -> None:
        self.done = True
        self._changed.set()

    def update(self, have: int, epoch: int) -> StreamUpdate:
        """What a reader holding `have` pieces of `epoch` has not seen yet."""
        start = have if epoch == self.epoch else 0
        blocks = self.blocks
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
