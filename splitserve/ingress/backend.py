"""What the HTTP and gRPC ingresses generate with: a `Backend` plans where one engine request
would run (for admission) and then streams its TokenChunks. The edge knows only this protocol;
the backends are the orchestrator's (`orchestrator.cluster_backend.ClusterBackend` places each
request on Ray workers through the router, `orchestrator.local_backend.LocalBackend` runs one
engine in this process), so an ingress replica never loads the engine.
"""

from __future__ import annotations

from typing import AsyncIterator, Protocol

from splitserve.router.admission import Plan
from splitserve.router.policy import WorkerView
from splitserve.text.tokenizer import Tokenizer
from splitserve.types import MoveCount, Request, TokenChunk


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

    def moves(self) -> tuple[MoveCount, ...]:
        """Requests moved off a worker so far (migrations, prefill retries), by reason."""

    def autoscale_report(self):
        """The autoscaler's last report (autoscale.AutoscaleReport); None: fixed pools."""
