"""Cluster: start (or join) a local Ray cluster with a prefill pool and a decode pool, and run
requests through them — the disaggregated path end to end, before the router exists.

Per request: if the prompt has at least `disagg_min_tokens` tokens, a prefill worker computes
it and returns the first token at once (delivered to the caller before any KV moves) plus a
`KVHandoff`; a decode worker pulls the KV and streams the rest. Shorter prompts are prefilled on
the decode worker (aggregated path). A prefill worker that fails before its handoff is retried
on the next one, and with none left the decode worker prefills locally. Workers are picked
round robin here; placement policy is the router's job.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Sequence

from splitserve.detokenizer import RequestText
from splitserve.hashing import block_hashes
from splitserve.kv_events import Snapshot
from splitserve.llm import RequestOutput, _as_params_list, _as_prompt_list, request_output
from splitserve.router import NoCapacity, RouteRequest, WorkerView, make_router
from splitserve.router.admission import Plan
from splitserve.tokenizer import Tokenizer
from splitserve.types import ConfigError, Request, SamplingParams, TokenChunk, WorkerStats

TRANSPORTS = ("auto", "shm", "tcp", "nixl")


class PrefillFailed(RuntimeError):
    """A prefill worker died or failed before handing the KV over; retry elsewhere."""


@dataclass
class Timing:
    request_id: str
    prefill_done_to_first_token_s: float | None = None  # prefill worker sampled → caller has it
    first_to_second_token_s: float | None = None


@dataclass
class ClusterConfig:
    model: str
    prefill: int = 1
    decode: int = 1
    transport: str = "auto"
    disagg_min_tokens: int = 32
    on_transfer_failure: str = "recompute"
    lease_s: float = 30.0
    engine: dict = field(default_factory=dict)
    policy: str = "cache_aware"  # router placement policy (splitserve.router.POLICIES)
    decode_fault: str | None = None  # test hooks, see DecodeWorker / the transports
    prefill_transport_options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"unknown transport {self.transport!r}; known: {', '.join(TRANSPORTS)}")
        if self.prefill < 0 or self.decode < 1:
            raise ConfigError("a cluster needs at least one decode worker (and zero or more prefill workers)")
        if self.disagg_min_tokens < 0:
            raise ConfigError("disagg_min_tokens must be >= 0")


def resolve_transports(name: str) -> list[str]:
    """The transports every worker offers. `auto`: all that work here; each handoff then takes
    the one that suits its pair (same host → shm, else nixl, else tcp)."""
    if name != "auto":
        return [name]
    try:
        import nixl  # noqa: F401

        return ["shm", "nixl", "tcp"]
    except ImportError:
        return ["shm", "tcp"]


class Cluster:
    SNAPSHOT_TIMEOUT_S = 5.0
    def __init__(self, cfg: ClusterConfig, prefills: list, decodes: list, started_ray: bool,
                 readers: list[tuple[str, list[str]]]) -> None:
        self.cfg = cfg
        self.prefills = prefills
        self.decodes = decodes
        self.readers = readers  # per decode worker: (host, transports), for endpoint choice
        self.tokenizer = Tokenizer(cfg.model)
        self._started_ray = started_ray
        self._rr_p = itertools.count()
        self._rr_d = itertools.count()
        self.router = make_router(cfg.policy, disagg_min_tokens=cfg.disagg_min_tokens)
        self.block_size = int(cfg.engine.get("block_size") or 16)
        self._views: dict[str, WorkerView] = {}
        self._stats: dict[str, WorkerStats] = {}
        self._refreshed = 0.0
        self._refreshing: asyncio.Future | None = None
        self._ids = itertools.count()
        # Recent requests only: the Serve ingress keeps one Cluster for as long as it serves.
        self.timings: collections.deque[Timing] = collections.deque(maxlen=4096)
        self.prefill_failures = 0
        self._acked: dict[str, int] = {}  # per worker: the last KV-event batch applied (kv_events.py)
        self._router_id = uuid.uuid4().hex  # each ingress replica acknowledges on its own

    @classmethod
    def start(cls, model: str | None = None, prefill: int = 1, decode: int = 1, transport: str = "auto",
              disagg_min_tokens: int = 32, dtype: str = "auto", address: str | None = None,
              on_transfer_failure: str = "recompute", lease_s: float = 30.0, **kwargs: Any) -> "Cluster":
        import ray

        from splitserve.cluster.actors import gpu_share, make_decode, make_prefill, worker_placement

        if model is None:
            from splitserve.demo import ensure_demo_model

            model = str(ensure_demo_model())
        on_ready = kwargs.pop("on_ready", None)  # on_ready(done, total) as each worker finishes loading
        fault = kwargs.pop("decode_fault", None)
        popts = kwargs.pop("prefill_transport_options", {})
        policy = kwargs.pop("policy", "cache_aware")
        cfg = ClusterConfig(str(model), prefill, decode, transport, disagg_min_tokens, on_transfer_failure, lease_s,
                            {"dtype": dtype, **kwargs}, policy, fault, popts)
        started = not ray.is_initialized()
        if started:
            # Logical CPUs: one per worker at least, so a small box still places every actor.
            ncpu = None if address else max(os.cpu_count() or 1, cfg.prefill + cfg.decode)
            ray.init(address=address, num_cpus=ncpu, include_dashboard=False, log_to_driver=False)
        kinds = resolve_transports(cfg.transport)
        try:
            share = gpu_share(str(cfg.engine.get("device", "auto")), ray.cluster_resources().get("GPU", 0.0),
                              cfg.prefill + cfg.decode, joined=address is not None or not started)
            worker_placement(cfg, kinds, share)  # refuse a bad combination before any actor starts
        except ConfigError:
            if started:
                ray.shutdown()
            raise
        prefills = [make_prefill(cfg, kinds, i, share) for i in range(cfg.prefill)]
        decodes = [make_decode(cfg, kinds, i, share) for i in range(cfg.decode)]
        try:
            _wait_loaded(prefills + decodes, on_ready)
        except ConfigError:
            for w in prefills + decodes:
                ray.kill(w)
            if started:
                ray.shutdown()
            raise
        readers = ray.get([d.reader_info.remote() for d in decodes])
        return cls(cfg, prefills, decodes, started, readers)

    # -- requests -------------------------------------------------------------------------------
    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        prompts = _as_prompt_list(prompts)
        plist = _as_params_list(params, len(prompts))
        return asyncio.run(self._generate_all(prompts, plist))

    async def _generate_all(self, prompts, plist) -> list[RequestOutput]:
        groups = []
        for p, sp in zip(prompts, plist):
            ids = tuple(self.tokenizer.encode(p)) if isinstance(p, str) else tuple(p)
            gid = str(next(self._ids))
            reqs = [Request(f"{gid}-{i}", ids, sp.for_choice(i)) for i in range(sp.n)]
            groups.append((gid, p if isinstance(p, str) else None, ids, reqs))
        tasks = [[asyncio.ensure_future(self.run_request(r)) for r in reqs] for *_, reqs in groups]
        outs = [request_output(gid, text, ids, [await t for t in ts]) for (gid, text, ids, _), ts in zip(groups, tasks)]
        if self._refreshing is not None:  # let it land rather than have asyncio.run cancel it
            await asyncio.wait({self._refreshing})
        return outs

    async def run_request(self, req: Request) -> RequestText:
        text = RequestText(self.tokenizer, req.params, req.prompt_token_ids)
        gen = self.stream(req)
        try:
            async for chunk in gen:
                if text.add(chunk) or text.finished:
                    break
        finally:
            await gen.aclose()  # a stop string ended it early: the workers free it now
        return text

    async def plan(self, req: Request) -> Plan:
        """Where the router would place `req` now, with both workers' load (for admission)."""
        p, d, cached = await self._place(req)
        first = f"prefill-{p}" if p is not None else f"decode-{d}"
        return Plan(first, self._stats.get(first), f"decode-{d}", self._stats.get(f"decode-{d}"), cached, (p, d))

    async def stream(self, req: Request, plan: Plan | None = None) -> AsyncIterator[TokenChunk]:
        """The request's chunks: the first token as soon as the prefill worker has it, then the
        decode worker's. Closing the iterator early releases the request on every worker.
        `plan` (from `plan()`) fixes the placement; without it the router places it now."""
        timing = Timing(req.request_id)
        self.timings.append(timing)
        p, d = plan.route if plan is not None else (await self._place(req))[:2]
        handoff, prefill, first_at = None, None, None
        if p is not None:
            result, prefill = await self._prefill(req, self.readers[d], p)
            if result is not None:
                timing.prefill_done_to_first_token_s = time.time() - result.done_at
                first_at = time.monotonic()
                handoff = result.handoff
                taken = False
                try:
                    yield result.chunk
                    taken = True
                finally:
                    if not taken and handoff is not None:  # the caller stopped at the first token
                        await prefill.ack.remote(handoff.lease_id)
                if handoff is None:
                    return
        async for chunk in self._decode(self.decodes[d], req, handoff, prefill, timing, first_at):
            yield chunk

    async def _decode(self, decode, req, handoff, prefill, timing: Timing, first_at) -> AsyncIterator[TokenChunk]:
        gen = decode.generate.options(num_returns="streaming").remote(req, handoff, prefill)
        finished = False
        try:
            async for ref in gen:
                chunk = await ref
                if first_at is not None and chunk.token_ids and timing.first_to_second_token_s is None:
                    timing.first_to_second_token_s = time.monotonic() - first_at
                finished = chunk.finished
                yield chunk
                if finished:
                    return
        finally:
            if not finished:
                await decode.abort.remote(req.request_id)

    async def _place(self, req: Request) -> tuple[int | None, int, int]:
        """(prefill index or None for the aggregated path, decode index, prompt tokens cached
        where it is prefilled), by the router policy over fresh worker views and the cluster
        KV index."""
        await self._refresh()
        route = RouteRequest(req.request_id, len(req.prompt_token_ids),
                             tuple(block_hashes(req.prompt_token_ids, self.block_size, req.cache_salt)), self.block_size)
        views = self._views
        pre = [views[f"prefill-{i}"] for i in range(len(self.prefills)) if f"prefill-{i}" in views]
        dec = [views[f"decode-{i}"] for i in range(len(self.decodes)) if f"decode-{i}" in views]
        try:
            pl = self.router.place(route, pre, dec)
        except NoCapacity:  # every decode worker looks full: its scheduler will queue the request
            d = next(self._rr_d) % len(self.decodes)
            use_p = self.prefills and len(req.prompt_token_ids) >= self.cfg.disagg_min_tokens
            return (next(self._rr_p) % len(self.prefills) if use_p else None), d, 0
        p = None if pl.prefill is None else int(pl.prefill.split("-")[1])
        return p, int(pl.decode.split("-")[1]), pl.cached_tokens

    async def _refresh(self, min_interval: float = 0.02, wait_s: float = 0.05) -> None:
        """Pull every worker's load and KV events (at most every `min_interval` seconds). A
        request waits at most `wait_s` for it (a worker busy in a long step answers late): past
        that it is placed on the views it has, and the refresh lands when the answers do."""
        task = self._refreshing
        if task is None or task.done():
            if time.monotonic() - self._refreshed < min_interval:
                return
            self._refreshed = time.monotonic()
            task = self._refreshing = asyncio.ensure_future(self._pull_snapshots())
        # A waiter that goes away must not cancel the refresh that others wait on too (events a
        # cancelled refresh missed would only come again, kv_events.py: this saves the round trip).
        if self._views:
            await asyncio.wait({task}, timeout=wait_s)
        else:
            await asyncio.shield(task)  # nothing to place on yet

    async def _pull_snapshots(self) -> None:
        named = [(f"prefill-{i}", "prefill", w) for i, w in enumerate(self.prefills)]
        named += [(f"decode-{i}", "decode", w) for i, w in enumerate(self.decodes)]
        snaps = await asyncio.gather(*[self._snapshot(wid, w) for wid, _, w in named], return_exceptions=True)
        for (wid, role, _), snap in zip(named, snaps):
            if snap is None:  # slow to answer: its view stays as it was, its events come next time
                continue
            if isinstance(snap, BaseException):  # dead or failing: out of placement, cache forgotten
                self._views[wid] = WorkerView(wid, role, local_host(), healthy=False)
                self._stats.pop(wid, None)
                self._acked.pop(wid, None)  # so its next answer is a full listing
                self.router.index.remove_worker(wid)
                continue
            stats = snap.stats
            self._stats[wid] = stats
            self._acked[wid] = snap.seq
            if snap.reset:
                self.router.index.remove_worker(wid)
            self.router.index.apply(wid, snap.events)
            self._views[wid] = WorkerView(wid, role, local_host(), stats.num_waiting, stats.num_running,
                                          stats.kv_usage, stats.kv_blocks_free + stats.kv_blocks_cached)

    async def _snapshot(self, wid: str, worker) -> Snapshot | None:
        """A worker's snapshot, or None when it takes longer than SNAPSHOT_TIMEOUT_S: one hung
        worker must not freeze every view (delivery is at least once, so giving up loses
        nothing)."""
        try:
            ref = worker.snapshot.remote(self._acked.get(wid), self._router_id)
            return await asyncio.wait_for(ref, self.SNAPSHOT_TIMEOUT_S)
        except asyncio.TimeoutError:
            return None

    async def _prefill(self, req: Request, reader: tuple[str, list[str]], first: int):
        """The chosen prefill worker, then the others in turn; (None, None) when all fail
        (local prefill instead)."""
        start = first
        for k in range(len(self.prefills)):
            worker = self.prefills[(start + k) % len(self.prefills)]
            ref = worker.prefill.remote(req, *reader)
            try:
                return await ref, worker
            except asyncio.CancelledError:  # the caller left: stop the prefill (and its lease) now
                _cancel(ref)
                raise
            except ConfigError as e:  # the request is at fault, not the worker: all would refuse it
                raise getattr(e, "cause", e) from None  # (Ray's wrapper carries the remote traceback)
            except Exception:  # the actor died or its engine failed: the next one, else locally
                self.prefill_failures += 1
        return None, None

    def worker_views(self) -> list[WorkerView]:
        """Every worker's load as of the last refresh."""
        return list(self._views.values())

    # -- lifecycle ------------------------------------------------------------------------------
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

    def shutdown(self) -> None:
        import ray

        for w in self.prefills + self.decodes:
            try:
                ray.get(w.close.remote(), timeout=10)
            except Exception:
                pass
            ray.kill(w)
        self.prefills, self.decodes = [], []
        if self._started_ray:
            ray.shutdown()

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _cancel(ref) -> None:
    import ray

    try:
        ray.cancel(ref)  # an async actor method gets CancelledError and aborts its engine request
    except Exception:  # not a Ray ref (tests), or already finished
        pass


def _wait_loaded(workers: list, on_ready=None) -> None:
    """Block until every worker has loaded its model; a worker that failed to load raises here
    (a ConfigError as itself, e.g. a backend the machine cannot run, not as Ray's traceback)."""
    import ray

    pending = [w.stats.remote() for w in workers]
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        try:
            ray.get(done)
        except ray.exceptions.RayActorError as e:
            refused = _config_error_in(e)
            if refused is None:
                raise
            raise refused from None
        if on_ready is not None:
            on_ready(len(workers) - len(pending), len(workers))


def _config_error_in(e: BaseException) -> ConfigError | None:
    """The ConfigError a worker's constructor raised, recovered from Ray's actor error (which
    keeps only its text)."""
    marker = f"{ConfigError.__module__}.ConfigError: "
    text = str(e)
    if not getattr(e, "actor_init_failed", False) or marker not in text:
        return None
    return ConfigError(text.rsplit(marker, 1)[1].strip().splitlines()[0])


def local_host() -> str:
    return socket.gethostname()
