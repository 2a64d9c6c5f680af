"""Cluster._prefill retries a failed prefill on the next worker, but a request the engine
refuses (ConfigError) fails at once: every worker would refuse it the same way."""

import asyncio

import pytest

from splitserve.types import ConfigError

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
