"""An ingress replica in a process of its own, for tests that kill one (issue 30): a Ray actor
with the replica's real parts — a ClusterBackend over the app's Controller, the Frontend and
a RequestLease per stream, exactly as the Serve replica drives them — that runs a load of
streams and reports each one's progress. Its death is a real process's (SIGKILL); nothing in
it fakes a fault."""

from __future__ import annotations

import asyncio
import os

import ray


@ray.remote(num_cpus=0, max_concurrency=64)
class IngressReplica:
    def __init__(self, cfg, controller) -> None:
        from splitserve.orchestrator.cluster_backend import ClusterBackend, ControllerSource

        self.backend = ClusterBackend(cfg, ControllerSource(controller))
        self.progress: list[int] = []
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> int:
        await self.backend.start()
        return os.getpid()

    async def run(self, prompts, params) -> None:
        """Start one stream per prompt (returns at once; `progress` follows them)."""
        from splitserve.ingress.frontend import Frontend

        front = Frontend(self.backend)
        self.progress = [0] * len(prompts)
        self._tasks = [asyncio.get_running_loop().create_task(self._one(front, i, p, sp))
                       for i, (p, sp) in enumerate(zip(prompts, params))]

    async def _one(self, front, i, prompt, sp) -> None:
        from splitserve.ingress.lease import RequestLease
        from splitserve.ingress.protocol import RequestOptions
        from splitserve.types import Priority

        opts = RequestOptions("m", sp, True, False, None, Priority.STANDARD, None, None)
        _, choices, reqs = front.requests(opts, [prompt])
        async with RequestLease(front, opts, reqs, choices, await front.prepay(opts.tenant, len(reqs))) as lease:
            async for _ in lease.streams[0]:
                self.progress[i] = len(choices[0].text.token_ids)

    async def report(self) -> list[int]:
        return list(self.progress)
