"""Router state shared through a real Redis (tests/redis_server.py): two ingress replicas'
rate limiters charge one set of buckets, and a replica's placements show in the other's view
of the workers, and a /v1/responses answer stored on one continues on the other. Redis killed:
nothing raises, each replica goes on with its own view; Redis back: shared again, with no
restart of either replica."""

import asyncio
import uuid

import pytest

pytest.importorskip("redis")

from splitserve.router.policy import make_router  # noqa: E402
from splitserve.router.directory import Directory  # noqa: E402
import httpx  # noqa: E402

from splitserve.config import EngineConfig  # noqa: E402
from splitserve.ingress.http import OpenAIServer  # noqa: E402
from splitserve.ingress.shared import RedisLink, SharedLoad, SharedRateLimiter, SharedResponseStore  # noqa: E402
from splitserve.orchestrator.local_backend import LocalBackend  # noqa: E402
from splitserve.tenancy import KeyRing, RateLimiter, Tenant  # noqa: E402
from splitserve.types import Request, Role, SamplingParams  # noqa: E402
from tests.fakes.cluster import FakeSource  # noqa: E402


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


async def until(cond, what: str, within_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while not cond():
        assert loop.time() < deadline, what
        await asyncio.sleep(0.02)


def replicas(url: str, n: int, clock):
    """n replicas' limiters over one app's keys in Redis, each with its own local buckets."""
    prefix = f"test:{uuid.uuid4().hex}"
    links = [RedisLink(url, prefix, retry_s=0.1) for _ in range(n)]
    return links, [SharedRateLimiter(link, RateLimiter(clock), clock) for link in links]


def test_two_replicas_limit_a_tenant_as_one(redis_server):
    """R = 4 requests/s offered at 3R for 30 (simulated) seconds, alternately to two replicas:
    R ± 10% admitted in all, where two local limiters admit 2R; another tenant's bucket is its
    own; a refund gives back to the shared bucket."""
    async def go():
        clock = Clock()
        links, (a, b) = replicas(redis_server.url, 2, clock)
        local = [RateLimiter(clock), RateLimiter(clock)]
        t, other = Tenant("t", requests_per_s=4.0), Tenant("o", requests_per_s=2.0)
        shared = alone = spare = 0
        for step in range(30 * 12):
            clock.t += 1 / 12
            shared += await (a if step % 2 else b).charge(t, 1, 10) == 0
            alone += local[step % 2].charge_now(t, 1, 10) == 0
            spare += await (b if step % 2 else a).charge(other, 1, 10) == 0
        assert abs(shared / 30 - 4) <= 0.4 and abs(alone / 30 - 8) <= 0.8 and abs(spare / 30 - 2) <= 0.2
        assert await a.charge(t, 1, 10) > 0
        a.refund(t, 1, 10)
        await asyncio.sleep(0.1)  # refunds go in the background
        assert await b.charge(t, 1, 10) == 0
        for link in links:
            await link.close()

    asyncio.run(go())


def test_a_charge_in_two_parts_fits_exactly_when_the_whole_would(redis_server):
    """The ingress charges a token per choice before tokenizing and the rest after
    (`Frontend.prepay`, `admit`): in Redis as in the local buckets, the rest fits exactly when
    the whole charge would have, an oversize one too (alone in a full bucket), and a charge of
    no requests leaves the request bucket alone."""
    async def go():
        clock = Clock()
        (link,), (shared,) = replicas(redis_server.url, 1, clock)
        local = RateLimiter(clock)

        async def local_charge(*args):
            return local.charge_now(*args)

        t = Tenant("t", tokens_per_min=60, requests_per_s=1.0)  # a token a second, 60 at most
        for charge in (shared.charge, local_charge):
            assert await charge(t, 1, 1) == 0 and await charge(t, 0, 99, 1) == 0  # 100 > 60: alone, in debt
            assert await charge(t, 0, 1) > 0  # the bucket is 40 below empty
            clock.t += 100.0  # full again
            assert await charge(t, 1, 1) == 0 and await charge(t, 0, 59, 1) == 0  # exactly the bucket
            clock.t += 30.0  # 30 tokens back
            assert await charge(t, 1, 1) == 0 and await charge(t, 0, 30, 1) > 0  # 31 of 30: the rest waits
            assert await charge(t, 0, 28, 1) == 0  # 29 of 30 fit
            clock.t += 100.0
        await link.close()

    asyncio.run(go())


def test_losing_redis_falls_back_to_local_limits_and_recovers(redis_server):
    async def go():
        clock = Clock()
        (link,), (lim,) = replicas(redis_server.url, 1, clock)
        t = Tenant("t", requests_per_s=1.0)
        assert await lim.charge(t, 1, 1) == 0 and await lim.charge(t, 1, 1) > 0  # shared bucket: empty now
        redis_server.kill()
        try:
            assert await lim.charge(t, 1, 1) == 0  # Redis away: the local bucket (full) decides, no error
            assert not link.up and await lim.charge(t, 1, 1) > 0
        finally:
            redis_server.start()
        await until(lambda: link.up, "the link never noticed Redis back")
        clock.t += 1.0
        assert await lim.charge(t, 1, 1) == 0
        assert await link.client.exists(link.key("limit", "t", "requests")) == 1  # charged in Redis again
        await link.close()

    asyncio.run(go())


def test_a_replica_sees_what_another_placed_and_degrades_without_redis(redis_server):
    """Replica A places three requests (held open) over two idle decode workers; replica B's view
    of each worker counts A's pending ones, so B places on the one A loaded less. Redis killed:
    B's view is its own again, placing still works; Redis back: A's counts show again."""
    async def go():
        src = FakeSource()
        w1, w2 = src.add(Role.DECODE), src.add(Role.DECODE)
        prefix = f"test:{uuid.uuid4().hex}"
        frozen = lambda: 0.0  # noqa: E731 - A's pending entries never lapse by themselves here
        dirs = []
        for clock in (frozen, None):
            link = RedisLink(redis_server.url, prefix, retry_s=0.1)
            d = Directory(src, make_router("least_loaded"), 16, registry_interval_s=0.01, load_interval_s=0.01,
                          **({"clock": clock} if clock else {}))
            d.shared = SharedLoad(link, d.router_id, interval_s=0.02)
            dirs.append(d)
        a, b = dirs
        for d in dirs:
            await d.start()
        req = Request("r", tuple(range(40)), SamplingParams(max_tokens=4))
        routes = [a.place(req) for _ in range(3)]
        placed = {w: sum(r.decode.id == w for r in routes) for w in (w1, w2)}
        assert sorted(placed.values()) == [1, 2]

        def b_sees(counts):
            return {w: b.view(b.records[w]).num_waiting for w in (w1, w2)} == counts

        await until(lambda: b_sees(placed), "B never saw A's placements")
        lighter = min(placed, key=placed.get)
        route = b.place(req)
        assert route.decode.id == lighter
        route.close()
        redis_server.kill()
        try:
            await until(lambda: b_sees({w1: 0, w2: 0}), "B kept counting A's load with Redis gone")
            b.place(req).close()  # still places, on its own view
        finally:
            redis_server.start()
        await until(lambda: b_sees(placed), "A's placements never showed again after Redis came back")
        for r in routes:
            r.close()
        await until(lambda: b_sees({w1: 0, w2: 0}), "A's closed routes still count at B")
        for d in dirs:
            d.stop()
            await d.shared.leave()
            await d.shared.link.close()

    asyncio.run(go())


def test_a_response_stored_on_one_replica_continues_on_another(redis_server, tiny_checkpoint):
    """Two ingress replicas (one engine behind both), each with its own SharedResponseStore on one
    Redis: a response made on A is continued on B with previous_response_id (B's prompt holds A's
    conversation), but not by another tenant. Redis killed: A still continues its own responses,
    B answers 404 for A's new ones; nothing raises."""
    keys = KeyRing.from_options({"keys": [{"key": "sk-alpha-0123456789", "tenant": "alpha"},
                                          {"key": "sk-beta-01234567890", "tenant": "beta"}]})
    backend = LocalBackend(EngineConfig(model=str(tiny_checkpoint("llama")), num_kv_blocks=256), model_name="tiny")

    async def go():
        prefix = f"test:{uuid.uuid4().hex}"
        links = [RedisLink(redis_server.url, prefix, retry_s=0.1) for _ in range(2)]
        a, b = (OpenAIServer(backend, keys=keys, responses=SharedResponseStore(link)) for link in links)

        async def ask(srv, key="sk-alpha-0123456789", **body):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=srv.app), base_url="http://t") as h:
                r = await h.post("/v1/responses", headers={"Authorization": f"Bearer {key}"},
                                 json={"model": "tiny", "max_output_tokens": 3, "temperature": 0, **body})
                return r.status_code, r.json()

        code, first = await ask(a, input="The capital of France is")
        assert code == 200, first
        code, there = await ask(b, input="and of Spain?", previous_response_id=first["id"])
        assert code == 200 and there["usage"]["input_tokens"] > first["usage"]["input_tokens"], there
        code, err = await ask(b, key="sk-beta-01234567890", input="hi", previous_response_id=first["id"])
        assert code == 404 and err["error"]["param"] == "previous_response_id", err
        assert await links[0].client.exists(links[0].key("responses", "alpha", first["id"])) == 1
        redis_server.kill()
        try:
            code, mine = await ask(a, input="Hello")
            assert code == 200 and not links[0].up  # stored in A's memory only
            assert (await ask(a, input="again", previous_response_id=mine["id"]))[0] == 200
            assert (await ask(b, input="again", previous_response_id=mine["id"]))[0] == 404
        finally:
            redis_server.start()
        for link in links:
            await link.close()

    try:
        asyncio.run(go())
    finally:
        backend.loop.close()


@pytest.mark.parametrize("refusal", ["OutOfMemoryError", "ReadOnlyError"])
def test_redis_answering_errors_degrades_to_local_limits_never_a_500(redis_server, tiny_checkpoint, refusal):
    """Redis there but refusing writes — out of memory (`maxmemory 1`, noeviction) or a replica
    (READONLY) — under rate-limited traffic: each call falls back to the local buckets, so the
    limits still hold (429s) and no request gets a 5xx; Redis taking writes again, shared again."""
    import redis

    keys = KeyRing.from_options({"keys": [{"key": "sk-alpha-0123456789", "tenant": "alpha", "requests_per_s": 2}]})
    backend = LocalBackend(EngineConfig(model=str(tiny_checkpoint("llama")), num_kv_blocks=256), model_name="tiny")
    admin = redis.Redis(port=redis_server.port)

    async def go():
        link = RedisLink(redis_server.url, f"test:{uuid.uuid4().hex}", retry_s=0.1)
        srv = OpenAIServer(backend, keys=keys, limiter=SharedRateLimiter(link))

        async def ask():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=srv.app), base_url="http://t") as h:
                r = await h.post("/v1/completions", headers={"Authorization": "Bearer sk-alpha-0123456789"},
                                 json={"model": "tiny", "prompt": "x", "max_tokens": 1})
                return r.status_code

        if refusal == "OutOfMemoryError":
            admin.config_set("maxmemory-policy", "noeviction")
            admin.config_set("maxmemory", 1)
        else:
            admin.replicaof("127.0.0.1", 1)  # a replica of a master that is not there: writes are refused
        try:
            codes = [await ask() for _ in range(12)]
        finally:
            admin.config_set("maxmemory", 0)
            admin.replicaof("NO", "ONE")
        assert link.refusals.get(refusal, 0) >= 1, link.refusals  # the fault landed: Redis refused
        assert link.up and all(c < 500 for c in codes), codes
        assert 200 in codes and 429 in codes, codes  # the local bucket (2/s, burst 2) still limits
        await asyncio.sleep(1.0)
        assert await ask() == 200
        assert await link.client.exists(link.key("limit", "alpha", "requests")) == 1  # shared again
        await link.close()

    asyncio.run(go())
