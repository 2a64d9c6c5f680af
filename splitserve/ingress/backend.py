"""What the HTTP and gRPC ingresses generate with: a `Backend` plans where one engine request
would run (for admission) and then streams its TokenChunks. `LocalBackend` runs one engine in
this process (the aggregated path: a single worker that prefills and decodes);
`cluster.backend.ClusterBackend` places each request on Ray workers through the router.
"""

from __future__ import annotations

from typing import AsyncIterator, Protocol

from splitserve.config import EngineConfig
from splitserve.worker.engine_loop import EngineLoop
from splitserve.router.admission import Plan
from splitserve.router.policy import WorkerView
from splitserve.text.tokenizer import Tokenizer
from splitserve.types import Request, TokenChunk


class Backend(Protocol):
    model_name: str
    tokenizer: Tokenizer
    max_model_len: int
    vocab_size: int
    sampling_defaults: dict  # the model's recommended sampling parameters (generation_config.json)
    max_new_tokens: int | None  # and its default generation length

    def ready(self) -> bool: ...

    async def plan(self, req: Request) -> Plan: ...

    def generate(self, req: Request, plan: Plan | None = None) -> AsyncIterator[TokenChunk]: ...

    def abandon(self, plan: Plan) -> None:
        """A plan that will not run (admission refused it): forget what it reserved."""

    def worker_views(self) -> list[WorkerView]: ...

    def autoscale_report(self):
        """The autoscaler's last report (autoscale.AutoscaleReport); None: fixed pools."""


LOCAL = "local"


class LocalBackend:
    def __init__(self, config: EngineConfig, model_name: str | None = None) -> None:
        self.loop = EngineLoop.start(config)
        self.engine = self.loop.engine
        self.tokenizer = Tokenizer(config.model)
        self.model_name = model_name or config.model.rstrip("/").rsplit("/", 1)[-1]
        self.max_model_len = self.engine.max_model_len
        self.vocab_size = self.engine.model_config.vocab_size
        self.sampling_defaults = dict(self.engine.model_config.sampling_defaults)
        self.max_new_tokens = self.engine.model_config.max_new_tokens

    def ready(self) -> bool:
        return True

    async def plan(self, req: Request) -> Plan:
        stats = self.loop.latest_stats  # the snapshot after the last step: no waiting on the engine
        return Plan(LOCAL, stats, LOCAL, stats)

    def abandon(self, plan: Plan) -> None:
        pass

    def autoscale_report(self) -> None:
        return None

    def worker_views(self) -> list[WorkerView]:
        s = self.loop.latest_stats
        return [WorkerView(LOCAL, "decode", "localhost", s.num_waiting, s.num_running, s.kv_usage,
                           step_time_coeffs=s.step_time_coeffs, expert_tokens=s.expert_tokens_total)]

    async def generate(self, req: Request, plan: Plan | None = None) -> AsyncIterator[TokenChunk]:
        q = await self.loop.submit(req)
        done = False
        try:
            while not done:
                item = await q.get()
                if isinstance(item, Exception):
                    raise item
                done = item.finished
                yield item
        finally:
            if not done:  # the consumer went away (client disconnect, stop string): free it now
                await self.loop.abort(req.request_id)
