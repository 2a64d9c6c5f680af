"""`ClusterBackend`: what the HTTP and gRPC ingresses generate with on a Ray cluster — the
`router.backend.Backend` protocol over this replica's `Directory` (registry + worker views,
refreshed in the background) and the request `Orchestrator`."""

from __future__ import annotations

from typing import AsyncIterator

from splitserve.cluster.directory import Directory
from splitserve.cluster.orchestrator import Orchestrator
from splitserve.cluster.registry import RegistrySnapshot
from splitserve.config import DeployConfig
from splitserve.router.admission import Plan
from splitserve.router.policy import NoCapacity, WorkerView, make_router
from splitserve.router.protocol import APIError
from splitserve.tokenizer import Tokenizer
from splitserve.types import Request, TokenChunk


class ControllerSource:
    """The registry, read from the app's Controller actor."""

    def __init__(self, controller) -> None:
        self.controller = controller

    async def fetch(self, known_version: int) -> RegistrySnapshot | None:
        return await self.controller.snapshot.remote(known_version)


class ClusterBackend:
    def __init__(self, cfg: DeployConfig, source) -> None:
        from splitserve.engine.model.config import ModelConfig

        mc = ModelConfig.from_dir(cfg.model)
        self.tokenizer = Tokenizer(cfg.model)
        self.model_name = cfg.served_model_name or cfg.model.rstrip("/").rsplit("/", 1)[-1]
        self.max_model_len = cfg.engine.get("max_model_len") or mc.max_context
        self.vocab_size = mc.vocab_size
        policy = make_router(cfg.policy, disagg_min_tokens=cfg.disagg_min_tokens)
        self.directory = Directory(source, policy, int(cfg.engine.get("block_size") or 16))
        self.orchestrator = Orchestrator(self.directory, migration_limit=cfg.migration_limit,
                                         inactivity_timeout_s=cfg.decode_inactivity_timeout_s,
                                         prefill_timeout_s=cfg.prefill_timeout_s)

    async def start(self) -> None:
        await self.directory.start()

    def stop(self) -> None:
        self.directory.stop()

    def ready(self) -> bool:
        return self.directory.ready()

    async def plan(self, req: Request) -> Plan:
        try:
            return self.orchestrator.plan(req)
        except NoCapacity as e:
            raise APIError(503, f"not ready: {e}; retry shortly", retry_after=1.0) from None

    def abandon(self, plan: Plan) -> None:
        if plan is not None and plan.route is not None:
            plan.route.close()

    def generate(self, req: Request, plan: Plan | None = None) -> AsyncIterator[TokenChunk]:
        return self.orchestrator.stream(req, plan)

    def worker_views(self) -> list[WorkerView]:
        return self.directory.views()
