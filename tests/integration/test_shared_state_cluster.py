"""Two ingress replicas of one app on the local Ray cluster, sharing a real Redis (rate limits
and in-flight load, `ingress/shared/`): while their streams run, Redis is killed, then started
again. Every stream completes with the single engine's tokens (no error reaches a client);
each replica counts the other's placements while Redis is there, goes on alone while it is
away, and counts them again once it is back — neither replica restarted."""

import asyncio
import time

import pytest

pytest.importorskip("redis")

from splitserve.orchestrator import Cluster  # noqa: E402
from splitserve.orchestrator.cluster_backend import ClusterBackend, ControllerSource  # noqa: E402
from splitserve.ingress.frontend import Frontend  # noqa: E402
from splitserve.ingress.shared import SharedRateLimiter  # noqa: E402
from tests.chaos.harness import Load, assert_nothing_held, assert_outcomes, params, prompts, reference  # noqa: E402

N, MAX_TOKENS = 24, 48
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


class Watch:
    """The most pending placements each replica has counted of the other's, per phase."""

    def __init__(self, backends) -> None:
        self.backends, self.phase, self.most = backends, "before", {}

    async def run(self) -> None:
        while True:
            seen = [sum(b.directory.shared.others.values()) for b in self.backends]
            best = self.most.setdefault(self.phase, [0] * len(seen))
            self.most[self.phase] = [max(a, b) for a, b in zip(best, seen)]
            await asyncio.sleep(0.005)


def until(cond, what: str, within_s: float = 10.0) -> None:
    deadline = time.time() + within_s
    while not cond():
        assert time.time() < deadline, what
        time.sleep(0.02)


def test_two_replicas_share_through_redis_and_outlive_it(ray_session, redis_server, model):
    ps, sps = prompts(N), params(N, False, MAX_TOKENS)
    ref = reference(model, ps, sps)
    with Cluster.start(model=model, name="shared-redis", prefill=1, decode=2, disagg_min_tokens=0,
                       num_kv_blocks=512, redis_url=redis_server.url) as c:
        second = ClusterBackend(c.cfg, ControllerSource(c.controller))
        c._loop.run(second.start())
        backends = [c.backend, second]
        fronts = [Frontend(b, limiter=SharedRateLimiter(b.redis)) for b in backends]
        watch = Watch(backends)
        watcher = asyncio.run_coroutine_threadsafe(watch.run(), c._loop.loop)
        links = [b.redis for b in backends]
        try:
            load = Load(c, ps, sps, fronts=fronts)
            load.wait_progress(2)
            redis_server.kill()
            try:
                until(lambda: not any(link.up for link in links), "a replica never noticed Redis gone")
                time.sleep(0.2)  # each replica's next exchange has failed: its view is its own
                watch.phase = "away"
                outcomes = load.result()
            finally:
                redis_server.start()
            until(lambda: all(link.up for link in links), "a replica never noticed Redis back")
            watch.phase = "back"
            again = Load(c, ps, sps, fronts=fronts)
            outcomes += again.result()
            print("most pending placements counted of the other replica:", watch.most)
            assert_outcomes(outcomes, ref + ref, min_exact=2 * N)
            assert all(watch.most["before"]) and all(watch.most["back"]), watch.most
            assert not any(watch.most["away"]), watch.most  # alone while Redis was away
            assert_nothing_held(c, again)
        finally:
            watcher.cancel()
            second.stop()
