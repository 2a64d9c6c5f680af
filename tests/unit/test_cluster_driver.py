"""The Cluster driver's bookkeeping, without Ray (fake workers): a failed prefill is retried on
the next worker but a request the engine refuses (ConfigError) fails at once; the router's KV
index follows each worker's cache through lost replies, failures and slow workers."""

import asyncio
import types

import pytest

from splitserve.engine.kv_cache.block_pool import BlockRemoved, BlockStored
from splitserve.kv_events import RouterOutboxes, Snapshot
from splitserve.router.kv_index import KVIndex
from splitserve.types import ConfigError, WorkerStats

cluster_mod = pytest.importorskip("splitserve.cluster.cluster")


class _Worker:
    def __init__(self, outcome):
        self.calls = 0
        self.outcome = outcome
        self.prefill = self

    def remote(self, req, *reader):
        self.calls += 1

        async def run():
            if isinstance(self.outcome, BaseException):
                raise self.outcome
            return self.outcome

        return run()


def _cluster(workers):
    c = object.__new__(cluster_mod.Cluster)  # no Ray: only the retry loop is under test
    c.prefills, c.prefill_failures = workers, 0
    return c


def test_a_dead_worker_is_skipped_a_bad_request_is_not_retried():
    dead, ok = _Worker(RuntimeError("actor died")), _Worker("handoff")
    c = _cluster([dead, ok])
    assert asyncio.run(c._prefill("req", ("host", ["tcp"]), 0)) == ("handoff", ok)
    assert c.prefill_failures == 1
    bad, other = _Worker(ConfigError("prompt too long")), _Worker("handoff")
    c = _cluster([bad, other])
    with pytest.raises(ConfigError, match="prompt too long"):
        asyncio.run(c._prefill("req", ("host", ["tcp"]), 0))
    assert other.calls == 0 and c.prefill_failures == 0


class _SnapWorker:
    """A worker's outbox over a fake cache; `mode`: "ok", "fail" (the call raises), "slow"."""

    def __init__(self):
        self.outboxes, self.cached, self.pending, self.mode = RouterOutboxes(), set(), [], "ok"
        self.snapshot = self

    def store(self, *hs):
        self.cached |= set(hs)
        self.pending.append(BlockStored(hs))

    def drop(self, *hs):
        self.cached -= set(hs)
        self.pending.append(BlockRemoved(hs))

    def remote(self, ack, router):
        async def run():
            if self.mode == "slow":
                await asyncio.sleep(10)
            new, self.pending = self.pending, []
            out = self.outboxes.take(router, ack, new, lambda: [BlockStored(tuple(sorted(self.cached)))])
            if self.mode == "fail":  # the worker moved on, the reply is lost
                raise RuntimeError("reply lost")
            return Snapshot(WorkerStats(0, 0, 0, 16, 16, 0, 0, 0, 0), *out)

        return run()


def test_the_index_follows_the_cache_through_lost_replies_failures_and_slow_workers(monkeypatch):
    monkeypatch.setattr(cluster_mod.Cluster, "SNAPSHOT_TIMEOUT_S", 0.2)
    w = _SnapWorker()
    c = object.__new__(cluster_mod.Cluster)
    c.prefills, c.decodes = [], [w]
    c._acked, c._views, c._stats, c._router_id = {}, {}, {}, "router-1"
    c.router = types.SimpleNamespace(index=KVIndex())

    def held():
        return {h for h in range(10) if c.router.index.overlap([h]).get("decode-0")}

    w.store(1, 2)
    asyncio.run(c._pull_snapshots())
    assert held() == {1, 2}
    w.mode = "fail"  # the worker is marked unhealthy and forgotten; its events since are not lost
    w.store(3)
    w.drop(1)
    asyncio.run(c._pull_snapshots())
    assert held() == set() and not c._views["decode-0"].healthy
    w.mode = "ok"
    asyncio.run(c._pull_snapshots())
    assert held() == {2, 3} and c._views["decode-0"].healthy
    w.mode = "slow"  # too slow: skipped, nothing changes, nothing is lost
    w.store(4)
    asyncio.run(c._pull_snapshots())
    assert held() == {2, 3} and c._views["decode-0"].healthy
    w.mode = "ok"
    w.drop(2)
    asyncio.run(c._pull_snapshots())
    assert held() == {3, 4} == w.cached
