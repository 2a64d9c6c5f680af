"""A fake cluster for router-side tests without Ray: workers that answer `snapshot` from a
fake cache (or fail, or hang) and a registry source the Directory reads."""

import asyncio

from splitserve.router.directory import Directory
from splitserve.control.registry import Registry
from splitserve.router.policy import make_router
from splitserve.types import BlockRemoved, BlockStored, WorkerId, WorkerState as S, WorkerStats
from splitserve.worker.info import WorkerInfo
from splitserve.worker.kv_events import RouterOutboxes, Snapshot


def stats(waiting=0, running=0):
    return WorkerStats(waiting, running, 0, 64, 64, 0, 0, 0, 0)


def digest(h: int | bytes) -> bytes:
    """A test's short name for a block (1, b"x") as the 16-byte digest the KV index keys on."""
    return h.to_bytes(16, "little") if isinstance(h, int) else h.ljust(16, b"\0")


class Call:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


class Unreachable(Exception):
    """The fakes' stand-in for Ray's ActorUnavailableError."""


class FakeWorker:
    """A worker's snapshot over a fake cache; `mode`: "ok", "fail" (the call raises), "hang"."""

    def __init__(self):
        self._answer = asyncio.Event()  # set while not hanging: a hung call answers once it is
        self.outboxes, self.cached, self.new, self.mode, self.load = RouterOutboxes(), set(), [], "ok", stats()
        self.snapshot = Call(self._snapshot)
        self.meet = Call(self._meet)
        self.calls = 0
        self.met = []  # the router replicas that introduced themselves (their `caller`), in order

    @property
    def mode(self):
        return self._mode

    @mode.setter
    def mode(self, mode):
        self._mode = mode
        if mode != "hang":
            self._answer.set()

    def store(self, *names):
        hs = tuple(map(digest, names))
        self.cached |= set(hs)
        self.new.append(BlockStored(hs))

    def drop(self, *names):
        hs = tuple(map(digest, names))
        self.cached -= set(hs)
        self.new.append(BlockRemoved(hs))

    async def _meet(self, caller):
        self.met.append(caller)

    async def _snapshot(self, ack, router):
        self.calls += 1
        if self.mode == "hang":  # answered when the mode changes (as a paused process resumes)
            self._answer.clear()
            await self._answer.wait()
        new, self.new = self.new, []
        out = self.outboxes.take(router, ack, new, lambda: [BlockStored(tuple(sorted(self.cached)))])
        if self.mode == "fail":  # the worker moved on, the reply is lost
            raise RuntimeError("reply lost")
        if self.mode == "unreachable":
            raise Unreachable("cannot reach the worker for the moment")
        return Snapshot(self.load, *out)


class FakeSource:
    def __init__(self):
        self.registry = Registry()
        self.workers = {}

    def add(self, role, ip="127.0.0.2", transports=("shm", "tcp"), worker=None):
        wid = WorkerId.new(role)
        w = worker or FakeWorker()
        self.workers[wid] = w
        self.registry.add(wid, w)
        endpoints = tuple(type("E", (), {"transport": t})() for t in transports)
        self.registry.move(wid, S.READY, info=WorkerInfo("node-" + ip, ip, 1, endpoints))
        return wid

    async def fetch(self, known):
        return self.registry.snapshot({}) if known != self.registry.version else None


def directory(source, policy="cache_aware", **kw):
    kw = {"registry_interval_s": 0.01, "load_interval_s": 0.01, "answer_timeout_s": 0.05, "slow_after_s": 0.05, **kw}
    return Directory(source, make_router(policy, disagg_min_tokens=0), 16,
                     unreachable=lambda e: isinstance(e, Unreachable), **kw)
