"""What both worker roles are (DESIGN.md §1 steps 5–6): an Engine on its own thread inside the
actor's event loop, warmed up before it serves, with its KV cache registered with every
transport the worker offers. `PrefillWorker` adds handoffs and leases, `DecodeWorker` pulls.
"""

from __future__ import annotations

import socket
from typing import Sequence

from splitserve.config import EngineConfig
from splitserve.engine_loop import EngineLoop
from splitserve.kv_events import RouterOutboxes, Snapshot
from splitserve.kv_transfer import make_transport
from splitserve.kv_transfer.base import TransportEndpoint
from splitserve.kv_transfer.layout import layout_of
from splitserve.types import WorkerStats


class KVWorker:
    def __init__(self, config: EngineConfig, transports: Sequence[str], transport_options: dict | None = None,
                 host: str | None = None) -> None:
        self.loop = EngineLoop.start(config)
        self.engine = self.loop.engine
        self.layout = layout_of(self.engine)
        self.host = host or socket.gethostname()
        self.transports = {t: make_transport(t, **(transport_options or {}).get(t, {})) for t in transports}
        self.endpoints: dict[str, TransportEndpoint] = {
            t: tr.register(self.engine.kv.storage, self.layout, self.host) for t, tr in self.transports.items()}
        self.outboxes = RouterOutboxes()  # touched on the engine thread only

    async def stats(self) -> WorkerStats:
        return await self.loop.call(self.engine.stats)

    async def snapshot(self, ack: int | None = None, router: str = "") -> Snapshot:
        """Load and the KV events `router` has not acknowledged (`ack`: the last `seq` it
        applied; None: it knows nothing of this worker yet), in one round trip."""
        def take() -> Snapshot:
            e = self.engine
            return Snapshot(e.stats(), *self.outboxes.take(router, ack, e.drain_kv_events(), e.kv_listing))

        return await self.loop.call(take)

    def close(self) -> None:
        self.loop.close()
        for tr in self.transports.values():
            tr.close()
        self.engine.close()
