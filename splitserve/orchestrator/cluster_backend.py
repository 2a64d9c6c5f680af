"""`ClusterBackend`: what the HTTP and gRPC ingresses generate with on a Ray cluster — the
`ingress.backend.Backend` protocol over this replica's `Directory` (registry + worker views,
refreshed in the background) and the request `Orchestrator`."""

from __future__ import annotations

import asyncio
import gc
import logging
from typing import AsyncIterator

from splitserve.router.directory import Directory
from splitserve.orchestrator.orchestrator import Orchestrator
from splitserve.router.snapshot import RegistrySnapshot
from splitserve.control.controller import unreachable
from splitserve.control.deploy_config import DeployConfig
from splitserve.router.admission import Plan
from splitserve.router.pd_decider import make_decider
from splitserve.router.policy import NoCapacity, WorkerView, make_router
from splitserve.ingress.protocol import APIError
from splitserve.text.tokenizer import Tokenizer
from splitserve.types import Request, TokenChunk

log = logging.getLogger(__name__)
REPORT_INTERVAL_S = 1.0


class ControllerSource:
    """The registry, read from the app's Controller actor. `owner`: (id, actor handle) of the
    ingress replica reading it, attached again whenever the Controller is a new incarnation
    (it restarted, and knows its owners only as they come back)."""

    def __init__(self, controller, owner: tuple[str, object] | None = None) -> None:
        self.controller, self.owner = controller, owner
        self.epoch = ""

    async def fetch(self, known_version: int) -> RegistrySnapshot | None:
        snap = await self.controller.snapshot.remote(known_version)
        if snap is not None and snap.epoch != self.epoch:
            if self.owner is not None:
                await self.controller.attach.remote(*self.owner)
            self.epoch = snap.epoch
        return snap

    async def report(self, samples: list) -> None:
        """Finished requests' latencies, for the Controller's autoscaler."""
        await self.controller.report.remote(samples)


class ClusterBackend:
    def __init__(self, cfg: DeployConfig, source) -> None:
        from splitserve.engine.model.config import ModelConfig

        mc = ModelConfig.from_dir(cfg.model)
        self.tokenizer = Tokenizer(cfg.model)
        self.model_name = cfg.served_model_name or cfg.model.rstrip("/").rsplit("/", 1)[-1]
        self.max_model_len = cfg.engine.get("max_model_len") or mc.max_context
        self.vocab_size = mc.vocab_size
        self.sampling_defaults = dict(mc.sampling_defaults)
        self.max_new_tokens = mc.max_new_tokens
        slo_s = lambda ms: None if ms is None else ms / 1e3  # noqa: E731
        policy = make_router(cfg.policy, decider=make_decider(cfg.pd_decider, cfg.disagg_min_tokens,
                                                              slo_s(cfg.ttft_slo_ms), slo_s(cfg.tpot_slo_ms)))
        self.directory = Directory(source, policy, int(cfg.engine.get("block_size") or 16),
                                   slow_after_s=cfg.probe_timeout_s, unreachable=unreachable)
        self.redis = None  # ingress.shared.RedisLink, with cfg.redis_url: the replicas' shared load and limits
        if cfg.redis_url:
            from splitserve.ingress.shared import RedisLink, SharedLoad

            self.redis = RedisLink(cfg.redis_url, prefix=f"splitserve:{cfg.name}")
            self.directory.shared = SharedLoad(self.redis, self.directory.router_id)
        self.source = source
        self._reporter: asyncio.Task | None = None
        self.orchestrator = Orchestrator(self.directory, migration_limit=cfg.migration_limit,
                                         inactivity_timeout_s=cfg.decode_inactivity_timeout_s,
                                         prefill_timeout_s=cfg.prefill_timeout_s,
                                         kv_streaming_min_tokens=cfg.kv_streaming_min_tokens if cfg.kv_streaming else None)
        self.directory.caller = self.orchestrator.caller  # introduced to each decode worker before its streams

    async def start(self) -> None:
        await self.directory.start()
        # Everything built so far lives as long as the process (the KV index's tables among it,
        # which grow to a million hashes): out of the collector's sight, a full collection no
        # longer walks them (~60 ms with a full index, measured here: a stall of every request).
        gc.freeze()
        self._reporter = asyncio.get_running_loop().create_task(self._report_forever())

    def stop(self) -> None:
        self.directory.stop()
        if self._reporter is not None:
            self._reporter.cancel()

    async def _report_forever(self) -> None:
        """Send the Controller the latencies of the requests that ended since the last report
        (the TTFT / TPOT its autoscaler compares with the SLOs). Lost on a failed send: the
        autoscaler reads a window of them, a gap only narrows it."""
        samples = self.orchestrator.samples
        while True:
            await asyncio.sleep(REPORT_INTERVAL_S)
            if not samples:
                continue
            batch = list(samples)
            samples.clear()
            try:
                await self.source.report(batch)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("latency report to the Controller failed: %s", e)

    def autoscale_report(self):
        """The Controller's last autoscaler report, as of the last registry read (None: fixed pools)."""
        return self.directory.autoscale

    def moves(self) -> tuple:
        return self.orchestrator.moves()

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
