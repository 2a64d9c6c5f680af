"""The aggregated path: one engine in this process that prefills and decodes (`splitserve serve
--prefill 0 --decode 0`, and the tests' in-process servers), behind the edge's `Backend`
protocol (`ingress.backend`)."""

from __future__ import annotations

from typing import AsyncIterator

from splitserve.config import EngineConfig
from splitserve.router.admission import Plan
from splitserve.router.policy import WorkerView
from splitserve.text.tokenizer import Tokenizer
from splitserve.types import Request, TokenChunk
from splitserve.worker.engine_loop import EngineLoop

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

    def moves(self) -> tuple:
        return ()  # one engine here: nothing to move to

    def worker_views(self) -> list[WorkerView]:
        s = self.loop.latest_stats
        return [WorkerView(LOCAL, "decode", "localhost", s.num_waiting, s.num_running, s.kv_usage,
                           step_time_coeffs=s.step_time_coeffs, expert_tokens=s.expert_tokens_total,
                           expert_balance=s.expert_balance, spec_proposed_tokens=s.spec_proposed_tokens_total,
                           spec_accepted_tokens=s.spec_accepted_tokens_total,
                           spec_verify_steps=s.spec_verify_steps_total,
                           spec_verify_step_seconds=s.spec_verify_step_seconds_total,
                           spec_verify_step_plain_seconds=s.spec_verify_step_plain_seconds_total)]

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
