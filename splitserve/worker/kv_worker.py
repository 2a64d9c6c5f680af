"""What both worker roles are (DESIGN.md §1 steps 5–6): an Engine on its own thread inside the
actor's event loop, warmed up before it serves, with its KV cache registered with every
transport the worker offers. `PrefillWorker` adds handoffs and leases, `DecodeWorker` pulls.

A worker knows where it runs (`node_id`, `node_ip`: the Ray shell reads them inside the actor
process and passes them in) and says so once, at registration (`describe`); its TCP KV server
listens on the node's IP, so a peer on another node can reach it. Health probes call `load`.
"""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Sequence

from splitserve import tracing
from splitserve.config import EngineConfig
from splitserve.worker.engine_loop import EngineLoop
from splitserve.kv_transfer import make_transport
from splitserve.kv_transfer.base import TransportEndpoint
from splitserve.worker.kv_layout import layout_of
from splitserve.types import ConfigError, WorkerLoad, WorkerStats
from splitserve.engine.parallel.rank_calls import on_all_ranks
from splitserve.engine.parallel.pipeline import on_all_stages
from splitserve.worker import rank_kv, stage_kv
from splitserve.worker.info import WorkerInfo
from splitserve.worker.kv_events import RouterOutboxes, Snapshot

# a snapshot the engine thread has not taken by then is answered with the last step's load:
# well within a router's probe timeout (1 s), so a long step is not taken for a silent worker
SNAPSHOT_WITHIN_S = 0.25


class KVWorker:
    serves_kv = False  # a prefill worker's peers read its cache; a decode worker only receives

    def __init__(self, config: EngineConfig, transports: Sequence[str], transport_options: dict | None = None,
                 host: str | None = None, node_id: str = "", start_ranks=None) -> None:
        # start_ranks: how a tensor-parallel engine starts its other ranks (engine/parallel/launch.py)
        if self.serves_kv and config.pipeline_parallel_size > 1 and config.tensor_parallel_size > 1:
            raise ConfigError("a pipeline-parallel worker of tensor-parallel stages does not hand its KV off: the "
                              "handoff by stage moves whole layers of one-rank stages (PP x TP is not built for it)")
        self.loop = EngineLoop.start(config, start_ranks=start_ranks)
        self.engine = self.loop.engine
        self.layout = layout_of(self.engine)
        self.host = host or socket.gethostname()
        self.node_id = node_id or self.host
        options = dict(transport_options or {})
        if host and "tcp" in transports:  # listen where peers on other nodes can reach us
            options["tcp"] = {"bind_host": host, **options.get("tcp", {})}
        self.transports = {t: make_transport(t, **options.get(t, {})) for t in transports}
        self.endpoints: dict[str, TransportEndpoint] = {
            t: tr.register(self.engine.kv, self.layout, self.host, serve=self.serves_kv)
            for t, tr in self.transports.items()}
        self.outboxes = RouterOutboxes()  # touched on the engine thread only
        self._taking: dict[str, tuple] = {}  # per router, (its ack, the snapshot asked of the engine thread)
        self.kv_secret = options.get("tcp", {}).get("secret")  # what a sliced TCP pull answers challenges with
        # every rank's endpoints, rank 0's first (a tensor-parallel prefill worker's other ranks
        # serve their own caches: the KV heads they hold)
        self.rank_endpoints = (tuple(self.endpoints.values()),)
        # likewise every pipeline stage's, stage 0's first (its other stages serve their layers)
        self.stage_endpoints = (tuple(self.endpoints.values()),)
        if self.serves_kv and self.engine.pp is not None:
            others = on_all_stages(self.engine, stage_kv.serve_kv, list(transports), options, self._process_hosts())
            self.stage_endpoints += tuple(others[1:])
        elif self.serves_kv and self.engine.tp.size > 1:
            others = on_all_ranks(self.engine, rank_kv.serve_kv, list(transports), options, self.host)
            self.rank_endpoints += tuple(others[1:])

    def _process_hosts(self) -> tuple[str, ...]:
        """Where each of this engine's processes serves its cache: this worker's host, or for a
        process on another node (a pipeline stage placed apart), that node's IP."""
        places = self.engine.ranks.places() if self.engine.ranks is not None else ()
        return (self.host, *(self.host if p.node_id == self.node_id else p.node_ip for p in places))

    def describe(self) -> WorkerInfo:
        ranks = self.engine.ranks.places() if self.engine.ranks is not None else ()
        return WorkerInfo(self.node_id, self.host, os.getpid(), tuple(self.endpoints.values()), ranks,
                          self.engine.memory)

    async def stats(self) -> WorkerStats:
        return await self.loop.call(self.engine.stats)

    def held(self) -> int:
        """Requests in flight here, plus what the role holds for others (a prefill worker's
        leases)."""
        return self.loop.num_active

    async def load(self) -> WorkerLoad:
        # The stats the engine thread left after its last step: a probe never waits on a step.
        return WorkerLoad(self.loop.latest_stats, self.held(), self.loop.stopped())

    async def snapshot(self, ack: int | None = None, router: str = "") -> Snapshot:
        """Load and the KV events `router` has not acknowledged (`ack`: the last `seq` it
        applied; None: it knows nothing of this worker yet), in one round trip. A worker whose
        engine has stopped answers with EngineFailed: routers keep it out of placement.

        The events are taken on the engine thread, after the step in progress. A step can be
        long (a long prompt's chunk on a busy CPU), and a router takes an answer that late for
        a slow worker: past SNAPSHOT_WITHIN_S the answer is the load the last step left and no
        events (`ack` handed back: nothing is acknowledged, the events wait in the outbox); the
        take already asked for (for that ack) is the one the next call waits on, never a second
        one queued behind the step."""
        self.loop.check_running()
        asked, taking = self._taking.get(router, (None, None))
        if taking is None or taking.done() or asked != ack:
            def take() -> Snapshot:
                e = self.engine
                return Snapshot(e.stats(), *self.outboxes.take(router, ack, e.drain_kv_events(), e.kv_listing))

            self._taking = {r: a_t for r, a_t in self._taking.items() if not a_t[1].done()}
            taking = asyncio.ensure_future(self.loop.call(take))
            self._taking[router] = (ack, taking)
        try:
            return await asyncio.wait_for(asyncio.shield(taking), SNAPSHOT_WITHIN_S)
        except asyncio.TimeoutError:
            return Snapshot(self.loop.latest_stats, ack, [], False)

    def close(self) -> None:
        self.loop.close()
        for tr in self.transports.values():
            tr.close()
        self.engine.close()
        tracing.flush()  # its last spans, before the process is stopped
