"""`Cluster`: the offline Python API over a Ray cluster (`Cluster.start(...).generate(...)`) — the
same Controller, Directory and Orchestrator the Serve ingress uses, driven from this process.

`start` joins or starts Ray, creates the app's Controller (which creates the pools) and waits
for every worker; the router runs on an event loop of its own in a background thread, so its
views refresh in the background as they do in an ingress replica.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import socket
import threading
import uuid
from typing import Any, Sequence

from splitserve import tracing
from splitserve.orchestrator.cluster_backend import ClusterBackend, ControllerSource
from splitserve.control.deploy_config import DeployConfig
from splitserve.text.detokenizer import RequestText
from splitserve.llm import RequestOutput, _as_params_list, _as_prompt_list, request_output
from splitserve.types import ConfigError, Request, Role, SamplingParams, WorkerState


class _LoopThread:
    """An asyncio loop in a daemon thread; `run` waits for a coroutine on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="splitserve-router", daemon=True)
        self._thread.start()

    def run(self, coro, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


class Cluster:
    def __init__(self, cfg: DeployConfig, controller, started_ray: bool) -> None:
        import ray

        self.cfg, self.controller, self._started_ray = cfg, controller, started_ray
        self._loop = _LoopThread()
        self.backend = ClusterBackend(cfg, ControllerSource(controller))
        self.tokenizer = self.backend.tokenizer
        self.directory, self.orchestrator = self.backend.directory, self.backend.orchestrator
        self._loop.run(self.backend.start())
        self.wait_routable(ray.get(controller.status.remote()).targets)
        self._ids = 0
        atexit.register(self._at_exit)  # a script that never shut it down: its router stops before Ray does

    @classmethod
    def start(cls, model: str | None = None, prefill: int = 1, decode: int = 1, transport: str = "auto",
              disagg_min_tokens: int = 32, address: str | None = None, on_ready=None,
              unplaced_s: float | None = 10.0, **options: Any) -> "Cluster":
        """Options: any DeployConfig key (policy, prefill_resources, lease_s, ...) and any engine
        setting (dtype, num_kv_blocks, ...). A worker Ray cannot place for `unplaced_s` (one no
        node could ever hold: at once) fails the start with the reason (launch.wait_ready); None
        waits for it (a cluster whose autoscaler adds nodes)."""
        import ray

        from splitserve.control import controller as controller_mod
        from splitserve.control.launch import check_files, connect_ray, local_cpus, precheck, stop_local_ray, wait_ready

        deploy_keys = set(DeployConfig.__dataclass_fields__) - {"engine"}
        engine = {k: options.pop(k) for k in list(options) if k not in deploy_keys}
        cfg = DeployConfig.from_options({"model": model, "prefill": prefill, "decode": decode, "transport": transport,
                                         "disagg_min_tokens": disagg_min_tokens, "engine": engine,
                                         "name": options.pop("name", f"cluster-{uuid.uuid4().hex[:8]}"), **options})
        tracing.setup(cfg.trace, "splitserve-ingress", f"{socket.gethostname()}:{os.getpid()}")
        check_files(cfg)
        started = connect_ray(address, local_cpus(cfg))
        controller = None
        try:
            precheck(cfg, joined=not started)
            controller = controller_mod.get_or_create(cfg, joined=not started)
            ray.get(controller.start.remote())
            wait_ready(controller, on_ready, unplaced_s=unplaced_s)
            return cls(cfg, controller, started)
        except BaseException:  # refused, unplaceable, interrupted: nothing stays behind, the Ray we started neither
            if controller is not None:
                _stop_controller(controller, cfg)
            if started:
                stop_local_ray()
            raise

    # -- requests -------------------------------------------------------------------------------
    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        prompts = _as_prompt_list(prompts)
        return self._loop.run(self._generate_all(prompts, _as_params_list(params, len(prompts))))

    async def _generate_all(self, prompts, plist) -> list[RequestOutput]:
        groups = []
        for p, sp in zip(prompts, plist):
            ids = tuple(self.tokenizer.encode(p)) if isinstance(p, str) else tuple(p)
            self._ids += 1
            gid = f"{self.cfg.name}-{self._ids}"
            reqs = [Request(f"{gid}-{i}", ids, sp.for_choice(i)) for i in range(sp.n)]
            groups.append((gid, p if isinstance(p, str) else None, ids, reqs))
        tasks = [[asyncio.ensure_future(self.run_request(r)) for r in reqs] for *_, reqs in groups]
        return [request_output(gid, text, ids, [await t for t in ts]) for (gid, text, ids, _), ts in zip(groups, tasks)]

    async def run_request(self, req: Request) -> RequestText:
        text = RequestText(self.tokenizer, req.params, req.prompt_token_ids)
        gen = self.orchestrator.stream(req)
        try:
            async for chunk in gen:
                if text.add(chunk) or text.finished:
                    break
        finally:
            await gen.aclose()  # a stop string ended it early: the workers free it now
        return text

    def run(self, coro, timeout: float | None = None) -> Any:
        """Run a coroutine on the router's loop (tests drive the orchestrator directly)."""
        return self._loop.run(coro, timeout)

    # -- the pools --------------------------------------------------------------------------------
    @property
    def timings(self):
        return self.orchestrator.traces

    def workers(self, role: Role | str) -> list:
        """The handles of the pool's READY workers, as this router sees them."""
        return [r.handle for r in self.directory.records.values()
                if r.role is Role(role) and r.state is WorkerState.READY]

    @property
    def prefills(self) -> list:
        return self.workers(Role.PREFILL)

    @property
    def decodes(self) -> list:
        return self.workers(Role.DECODE)

    def scale(self, prefill: int | None = None, decode: int | None = None) -> dict:
        import ray

        out = {}
        for role, n in ((Role.PREFILL, prefill), (Role.DECODE, decode)):
            if n is not None:
                out = ray.get(self.controller.scale.remote(role.value, n))
        return out

    def status(self):
        import ray

        return ray.get(self.controller.status.remote())

    def wait_routable(self, targets: dict, timeout_s: float = 60.0) -> None:
        """Until this router sees each pool's target of READY workers."""
        import time

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            seen = {r.value: len(self.workers(r)) for r in Role}
            if all(seen[k] == v for k, v in targets.items()):
                return
            time.sleep(0.05)
        raise TimeoutError(f"the router sees {seen}, not {targets}")

    def check_invariants(self) -> list[dict]:
        """Every live worker's block counts (raises if a worker's invariant is broken)."""
        import ray

        out = []
        for w in self.prefills + self.decodes:
            try:
                out.append(ray.get(w.check_invariants.remote()))
            except ray.exceptions.RayActorError:
                continue  # a worker a test killed
        return out

    # -- lifecycle ------------------------------------------------------------------------------
    def shutdown(self) -> None:
        from splitserve.control.launch import stop_local_ray

        if self.controller is None:
            return
        atexit.unregister(self._at_exit)
        self._loop.run(_stopped(self.backend))
        self._loop.close()
        _stop_controller(self.controller, self.cfg)
        self.controller = None
        if self._started_ray:
            stop_local_ray()  # and its note: the next start here must not look for it

    def _at_exit(self) -> None:
        import ray

        if ray.is_initialized():  # else a Ray call would start a new cluster in a process that is exiting
            self.shutdown()
        else:
            self._loop.close()

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


async def _stopped(backend) -> None:
    backend.stop()


def _stop_controller(controller, cfg: DeployConfig) -> None:
    """Every worker stopped, then the Controller itself (for good: no restart); whatever worker
    it failed to stop is killed here (workers are detached: nothing else takes them)."""
    import ray

    from splitserve.control.persisted import kill_leftovers

    try:
        ray.get(controller.shutdown.remote(), timeout=30)
    except Exception:  # it exits inside the call: Ray reports the actor gone
        pass
    try:
        ray.kill(controller, no_restart=True)
    except Exception:
        pass
    kill_leftovers(cfg)
