"""A cancel at every phase of a request's life leaves nothing behind (issue 50, deliverable 5).

On a 1P+1D and a 1P+2D cluster (decode pool speculating with n-grams, every prompt through the
prefill worker, its KV streamed in pieces), the real HTTP server (uvicorn, SSE) and gRPC server
run on the router's loop, and clients on their own loop send requests under load (a dozen at
once, mixed with requests that run to their end). Each victim request is armed with a phase; the
probed workers (tests/fakes/phases.py) hold it when it gets there and say so; the client then
cancels it at a random moment of that hold — an HTTP client closes its connection mid-SSE, a gRPC
client cancels its call. The worker records the phase the request was held in when the cancel
reached it: the phase is observed, not assumed. Phases: queued at its prefill worker, during
prefill, while its KV pieces stream, between handoff and first decode step, mid-decode, during
speculative verify, under a grammar, and (1P+2D) during a migration — a decode worker SIGKILLed
under streams, the moved requests held at their new prefill and cancelled there.

Afterwards: every cancel that reached a hold landed in it (none timed out), each phase counted
>= 10 and all together >= 200; every worker holds no block, lease, TCP grant, handoff or staging;
the ingress holds no admission slot, outstanding load or tenant count; the router no pending
count; and every request not cancelled equals one engine's uninterrupted greedy run (tokens over
gRPC, text over HTTP). Run with -s for the counts."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import os
import random
import signal
import time

import pytest
import torch

from splitserve import LLM
from splitserve.orchestrator import Cluster
from splitserve.text.grammar import json_schema_spec
from splitserve.types import SamplingParams
from tests.chaos.harness import pid_of, prompts
from tests.fakes.phases import PHASES
from tests.loopback import ip

pytestmark = pytest.mark.timeout(400)

SPEC = {"method": "ngram", "k": 4, "min_n": 1}  # proposals wherever the last token was seen before
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["kind", "n"],
          "properties": {"kind": {"enum": ["cat", "dog", "bird"]}, "n": {"type": "integer", "minimum": 0,
                                                                         "maximum": 99999}}}
STEP_PHASES = [p for p in PHASES if p != "migration"]
CONCURRENT = 12
MIGRATING = 30  # streams running when a decode worker is killed (1P+2D); at most 2 moved ones finish
PER_PHASE = {"1p1d": 16, "1p2d": 13}  # victims per phase (migration: every moved stream but 2)
SURVIVORS = {"1p1d": 28, "1p2d": 20}


@dataclasses.dataclass
class Job:
    prompt: tuple[int, ...]
    client: str  # "http" | "grpc"
    max_tokens: int
    grammar: bool = False
    phase: str | None = None  # armed: cancelled once held there; None: runs to its end
    tokens: list = dataclasses.field(default_factory=list)  # gRPC: token ids received
    text: str = ""  # HTTP: the text received
    events: int = 0  # messages received
    cancelled: bool = False
    error: str | None = None

    @property
    def params(self) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=self.max_tokens, ignore_eos=not self.grammar,
                              grammar=json_schema_spec(SCHEMA) if self.grammar else None)


def repetitive(g: torch.Generator) -> tuple[int, ...]:
    """A short random pattern repeated: the n-gram proposer finds continuations to propose."""
    pattern = torch.randint(3, 384, (int(torch.randint(5, 9, (1,), generator=g)),), generator=g).tolist()
    return tuple(pattern * (40 // len(pattern)))


def jobs_for(name: str, seed: int) -> list[Job]:
    """Victims of every step phase and survivors of every kind, shuffled; prompts all distinct."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    n, s = PER_PHASE[name], SURVIVORS[name]
    plain = iter(prompts(len(STEP_PHASES) * n + s, seed=seed))
    out = []
    for phase in STEP_PHASES:
        for _ in range(n):
            grammar = phase == "grammar"
            p = repetitive(g) if phase == "spec_verify" else next(plain)
            out.append(Job(p, rng.choice(("http", "grpc")), 48 if grammar or phase == "spec_verify" else 24,
                           grammar, phase))
    for i in range(s):
        kind = i % 3  # plain, speculating, grammar
        p = repetitive(g) if kind == 1 else next(plain)
        out.append(Job(p, rng.choice(("http", "grpc")), 48 if kind == 2 else 16, kind == 2))
    rng.shuffle(out)
    assert len({j.prompt for j in out}) == len(out)
    return out


def migration_jobs(seed: int) -> list[Job]:
    rng = random.Random(seed)
    return [Job(p, rng.choice(("http", "grpc")), 128, phase="migration") for p in prompts(MIGRATING, seed=seed)]


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


def with_reference(model: str, jobs: list[Job]) -> dict:
    """Every job's uninterrupted greedy run on one engine here: prompt -> (tokens, text)."""
    outs = LLM(model, num_kv_blocks=1024).generate([list(j.prompt) for j in jobs], [j.params for j in jobs])
    return {j.prompt: (tuple(o.outputs[0].token_ids), o.outputs[0].text) for j, o in zip(jobs, outs)}


def start(model: str, name: str, decode: int) -> Cluster:
    return Cluster.start(model=model, name=f"cancel-{name}", prefill=1, decode=decode, transport="auto",
                         disagg_min_tokens=0, kv_streaming_min_tokens=0, num_kv_blocks=512, speculative=SPEC,
                         decode_inactivity_timeout_s=10.0,
                         worker_classes={"prefill": "tests.fakes.phases:PhasePrefill",
                                         "decode": "tests.fakes.phases:PhaseDecode"})


# -- the servers, on the router's loop --------------------------------------------------------
class Servers:
    """The OpenAI HTTP server under uvicorn and the gRPC server, over the cluster's backend and
    one Frontend, as an ingress replica runs them."""

    def __init__(self, c: Cluster) -> None:
        self.c = c
        self.front = None
        c.run(self._start())

    async def _start(self) -> None:
        import uvicorn

        from splitserve.ingress import grpc_service
        from splitserve.ingress.http import OpenAIServer

        http = OpenAIServer(self.c.backend)
        self.front = http.front
        self.uvicorn = uvicorn.Server(uvicorn.Config(http.app, host=ip(10), port=0, log_level="warning",
                                                     lifespan="off"))
        self._serving = asyncio.ensure_future(self.uvicorn.serve())
        while not self.uvicorn.started:
            assert not self._serving.done(), self._serving.exception()
            await asyncio.sleep(0.01)
        self.http_url = f"http://{ip(10)}:{self.uvicorn.servers[0].sockets[0].getsockname()[1]}"
        self.grpc, port = await grpc_service.serve(grpc_service.GenerationService(self.front), ip(10), 0)
        self.grpc_target = f"{ip(10)}:{port}"

    def stop(self) -> None:
        async def stop():
            self.uvicorn.should_exit = True
            await self._serving
            await self.grpc.stop(0)

        self.c.run(stop(), timeout=30)


# -- the clients, on a loop of their own ------------------------------------------------------
class Clients:
    def __init__(self, servers: Servers, model_name: str) -> None:
        import grpc
        import httpx

        from splitserve.v1 import generation_pb2_grpc as pb_grpc

        self.model_name = model_name
        self.http = httpx.AsyncClient(base_url=servers.http_url, timeout=120,
                                      limits=httpx.Limits(max_connections=4 * CONCURRENT))
        self.channel = grpc.aio.insecure_channel(servers.grpc_target)
        self.stub = pb_grpc.GenerationStub(self.channel)

    async def close(self) -> None:
        await self.http.aclose()
        await self.channel.close()

    def start(self, job: Job):
        """The job's call, running: (its task, how to cancel it as its client would)."""
        if job.client == "http":
            task = asyncio.ensure_future(self._http(job))
            return task, task.cancel  # the connection closes under the open SSE body
        from splitserve.v1 import generation_pb2 as pb

        sampling = pb.SamplingParams(temperature=0, max_tokens=job.max_tokens, ignore_eos=not job.grammar)
        if job.grammar:
            sampling.json_schema = json.dumps(SCHEMA)
        call = self.stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=job.prompt), sampling=sampling))
        return asyncio.ensure_future(self._grpc(job, call)), call.cancel

    async def _http(self, job: Job) -> None:
        body = {"model": self.model_name, "prompt": list(job.prompt), "max_tokens": job.max_tokens,
                "temperature": 0, "ignore_eos": not job.grammar, "stream": True}
        if job.grammar:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}
        async with self.http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                job.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        job.error = str(ev["error"])
                    else:
                        job.text += ev["choices"][0]["text"]
                        job.events += 1

    async def _grpc(self, job: Job, call) -> None:
        import grpc

        try:
            async for msg in call:
                job.tokens += list(msg.token_ids)
                job.events += 1
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                job.error = f"gRPC {e.code()}: {e.details()}"


class Watch:
    """Which armed requests the workers hold now: each worker's `reached` list, followed."""

    def __init__(self, workers: list) -> None:
        self.workers = list(workers)
        self.seen: dict[int, int] = {}
        self.reached: dict[tuple, tuple[str, object]] = {}  # prompt -> (phase, the worker holding it)
        self.changed = asyncio.Event()
        self._task = asyncio.ensure_future(self._follow())

    async def _follow(self) -> None:
        import ray

        while True:
            for w in list(self.workers):
                try:
                    new = await w.reached_since.remote(self.seen.get(id(w), 0))
                except ray.exceptions.RayActorError:  # killed
                    self.workers.remove(w)
                    continue
                self.seen[id(w)] = self.seen.get(id(w), 0) + len(new)
                for key, _rid, phase in new:
                    self.reached[tuple(key)] = (phase, w)
                if new:
                    self.changed.set()
            await asyncio.sleep(0.01)

    async def held(self, job: Job, task: asyncio.Task) -> bool:
        """Until the job's request is held in its phase (True) or its call ended first (False)."""
        while job.prompt not in self.reached:
            if task.done():
                return False
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), 0.05)
            except asyncio.TimeoutError:
                pass
        assert self.reached[job.prompt][0] == job.phase, (self.reached[job.prompt], job.phase)
        return True

    def close(self) -> None:
        self._task.cancel()


async def run_job(job: Job, clients: Clients, watch: Watch, rng: random.Random) -> None:
    task, cancel = clients.start(job)
    if job.phase is not None and await watch.held(job, task):
        await cancel_in_hold(job, cancel, rng)
    await ended(job, task)


async def cancel_in_hold(job: Job, cancel, rng: random.Random) -> None:
    await asyncio.sleep(rng.uniform(0, 0.02))  # a random moment of the hold
    job.cancelled = True
    cancel()


async def ended(job: Job, task: asyncio.Task) -> None:
    """Its client's end: cancelled only where the test cancelled it."""
    try:
        await task
    except asyncio.CancelledError:
        if not job.cancelled:
            raise


async def arm(workers: list, jobs: list[Job]) -> None:
    armed = {j.prompt: j.phase for j in jobs if j.phase is not None}
    await asyncio.gather(*[w.arm.remote(armed) for w in workers])


async def run_load(c: Cluster, servers: Servers, jobs: list[Job], seed: int, migrate: bool = False) -> None:
    """The jobs, CONCURRENT at a time; `migrate`: the jobs all at once, a decode worker killed under them."""
    rng = random.Random(seed)
    clients = Clients(servers, c.backend.model_name)
    watch = Watch(c.prefills + c.decodes)
    await arm(watch.workers, jobs)
    try:
        if migrate:
            await kill_under_streams(c, clients, watch, jobs, rng)
            return
        gate = asyncio.Semaphore(CONCURRENT)

        async def one(job: Job) -> None:
            async with gate:
                await run_job(job, clients, watch, rng)

        await asyncio.gather(*[one(j) for j in jobs])
    finally:
        watch.close()
        await clients.close()


async def kill_under_streams(c: Cluster, clients: Clients, watch: Watch, jobs: list[Job], rng) -> None:
    """Every job streaming, the busiest decode worker SIGKILLed: the streams it held move, each
    held at its new prefill; all but two of them are cancelled there, those two released."""
    started = [(j, *clients.start(j)) for j in jobs]
    deadline = time.monotonic() + 60
    while any(j.events < 2 and not t.done() for j, t, _ in started):  # (one may have finished: a survivor)
        assert time.monotonic() < deadline, [j.events for j in jobs]
        await asyncio.sleep(0.01)
    assert not any(j.error for j in jobs), [j.error for j in jobs]
    loads = await asyncio.gather(*[w.load.remote() for w in c.decodes])
    victim = max(zip(c.decodes, loads), key=lambda wl: wl[1].stats.num_running)[0]
    os.kill(await asyncio.to_thread(pid_of, victim), signal.SIGKILL)
    kept = 0

    async def follow(job: Job, task: asyncio.Task, cancel) -> None:
        nonlocal kept
        if await watch.held(job, task):
            if kept < 2:  # moved, and let go on: it must finish exactly
                kept += 1
                job.phase = None
                _, worker = watch.reached[job.prompt]
                assert await worker.release.remote(job.prompt)
            else:
                await cancel_in_hold(job, cancel, rng)
        await ended(job, task)
    try:
        await asyncio.gather(*[follow(*s) for s in started])
    finally:
        for j, t, cancel in started:
            if not t.done():
                cancel()


# -- the checks -------------------------------------------------------------------------------
def landings(c: Cluster, landed: dict, job_of: dict, timeout: float = 20.0) -> None:
    """Into `landed`, prompt -> (the phase its cancel landed in, the engine id), over every live
    worker, once no hold is open any more (a client's cancel reaches the workers after its call
    has ended for the client); no hold may have ended unreached."""
    import ray

    deadline = time.time() + timeout
    while True:
        reports = []
        for w in c.prefills + c.decodes:
            try:
                reports.append(ray.get(w.probe_report.remote()))
            except ray.exceptions.RayActorError:
                continue
        holding = [h for r in reports for h in r["holding"]]
        if not holding:
            break
        assert time.time() < deadline, f"holds no cancel reached: {holding}"
        time.sleep(0.1)
    expired = [e for r in reports for e in r["expired"]]
    assert not expired, f"holds no cancel reached: {[(phase, job_of.get(tuple(k))) for k, phase in expired]}"
    for r in reports:
        for key, rid, phase in r["landed"]:
            assert landed.setdefault(tuple(key), (phase, rid)) == (phase, rid), ("landed twice", key, rid)


def leased_by(c: Cluster, landed: dict) -> list:
    """The requests whose blocks a prefill worker still leases, with where their cancel landed."""
    import ray

    phase_of = {rid: phase for phase, rid in landed.values()}
    rids = [rid for w in c.prefills for rid in ray.get(w.probe_report.remote())["leased"]]
    t0 = time.monotonic()
    trails = {rid: sorted((round(t[2] - t0, 3), t[0], t[1]) for w in c.prefills + c.decodes
                          for t in ray.get(w.trail_of.remote(rid))) for rid in rids}
    for rid in rids:
        print("still leased:", rid, "cancel landed in", phase_of.get(rid, "no hold"))
        for t in trails[rid]:
            print("   ", t)
    return [(rid, phase_of.get(rid, "not cancelled"), trails[rid]) for rid in rids]


def assert_nothing_held(c: Cluster, front, landed: dict, timeout: float = 20.0) -> None:
    """Workers: no block in use, no lease, no TCP grant, no handoff, no staging. Ingress: no
    admission slot, outstanding load or tenant count. Router: no pending count."""
    deadline = time.time() + timeout
    while True:
        counts = c.check_invariants()
        held = [s for s in counts if s["in_use"] or s.get("leases", 0) or s.get("grants", 0) or s.get("handoffs", 0)
                or s.get("staged", 0)]
        pending = {str(w): len(e) for w, e in c.directory.pending._entries.items() if e}
        ingress = (front.admission.inflight, dict(front.tenant_inflight))
        if not held and not pending and ingress == (0, {}):
            break
        assert time.time() < deadline, (held, pending, ingress, leased_by(c, landed))
        time.sleep(0.1)
    assert counts, "no live worker to check"
    outstanding = front.admission.outstanding
    assert all(outstanding[w] == (0, 0) for w in list(outstanding._by_worker)), outstanding._by_worker


def assert_survivors_exact(jobs: list[Job], ref: dict) -> int:
    n = 0
    for j in jobs:
        if j.cancelled:
            continue
        assert j.error is None, (j.phase, j.client, j.error)
        tokens, text = ref[j.prompt]
        if j.client == "grpc":
            assert tuple(j.tokens) == tokens, (j.phase, j.tokens, tokens)
        else:
            assert j.text == text, (j.phase, j.text, text)
        n += 1
    return n


def check(name: str, c: Cluster, servers: Servers, jobs: list[Job], ref: dict, landed: dict, started: float):
    cancelled = [j for j in jobs if j.cancelled]
    for j in cancelled:  # each cancel sent during a hold reached the worker holding it, in that hold
        assert j.prompt in landed, (j.phase, j.client)
        assert landed[j.prompt][0] == j.phase, (landed[j.prompt], j.phase)
    assert len(landed) == len(cancelled), "a cancel landed in a hold nobody cancelled"
    per_phase = collections.Counter(landed[j.prompt][0] for j in cancelled)
    by_client = collections.Counter(j.client for j in cancelled)
    assert_nothing_held(c, servers.front, landed)
    exact = assert_survivors_exact(jobs, ref)
    missed = sum(j.phase is not None and not j.cancelled for j in jobs)
    print(f"\ncancel phases {name}: {len(cancelled)} cancels ({dict(by_client)}) landed per phase {dict(per_phase)}; "
          f"{exact} survivors exact ({missed} armed but ended first); {time.time() - started:.1f} s")
    return per_phase


def run_cluster(model: str, name: str, decode: int, seed: int, migrate: bool) -> collections.Counter:
    started = time.time()
    jobs, moving = jobs_for(name, seed), migration_jobs(seed + 1) if migrate else []
    ref = with_reference(model, jobs + moving)
    landed: dict = {}
    job_of = {j.prompt: j for j in jobs + moving}
    with start(model, name, decode) as c:
        servers = Servers(c)
        try:
            asyncio.run(run_load(c, servers, jobs, seed))
            landings(c, landed, job_of)  # before the kill: one of these workers is about to go
            if migrate:
                asyncio.run(run_load(c, servers, moving, seed + 1, migrate=True))
                landings(c, landed, job_of)
                # the kill landed under streams; each cancel counted "migration" was of a moved request
                moved = {t.request_id for t in list(c.timings) if t.migrations}
                assert len(moved) >= 10, f"only {len(moved)} streams moved"
                assert all(rid.split("~")[0] in moved for phase, rid in landed.values() if phase == "migration")
            per_phase = check(name, c, servers, jobs + moving, ref, landed, started)
        finally:
            servers.stop()
    return per_phase


def test_cancels_at_every_phase_leave_nothing_behind(ray_session, model):
    """1P+1D, then 1P+2D with a decode worker killed under streams: >= 200 cancels, >= 10 landed
    in each phase."""
    totals = run_cluster(model, "1p1d", decode=1, seed=101, migrate=False)
    totals += run_cluster(model, "1p2d", decode=2, seed=202, migrate=True)
    print(f"cancel phases, both clusters: {sum(totals.values())} cancels; per phase {dict(totals)}")
    assert sum(totals.values()) >= 200, totals
    assert all(totals[p] >= 10 for p in PHASES), totals
