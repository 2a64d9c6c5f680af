"""A router replica's view of the cluster and the request orchestrator, without Ray (fake
workers and a fake registry): the KV index follows each worker's cache through lost replies,
failures and slow workers; a burst of simultaneous requests splits evenly over the decode pool
under every policy; a hung worker never makes a placement wait; a failed prefill worker leaves
placement and the request is placed again, while a request the engine refuses fails at once."""

import asyncio
import dataclasses
import subprocess
import sys

import pytest

from splitserve.router.policy import POLICIES
from splitserve.types import ConfigError, MoveCount, MoveKind, MoveReason, Request, Role, SamplingParams, WorkerState as S
from tests.fakes.cluster import Call, FakeSource, digest, directory, stats


def req(i, n=40):
    return Request(f"r{i}", tuple(range(i * 1000, i * 1000 + n)), SamplingParams(max_tokens=4))


async def settle(s=0.1):
    await asyncio.sleep(s)


async def until(cond, timeout_s: float = 30.0) -> None:
    """Until `cond()` holds: the background tasks' pace is the machine's, not a fixed sleep's."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "the directory's background tasks never got there"
        await asyncio.sleep(0.01)


def test_the_index_follows_the_cache_through_lost_replies_failures_and_slow_workers():
    async def go():
        src = FakeSource()
        wid = src.add(Role.DECODE)
        w = src.workers[wid]
        d = directory(src)
        await d.start()

        def held():
            return {h for h in range(10) if d.policy.index.overlap([digest(h)]).get(wid)}

        w.store(1, 2)
        await settle()
        assert held() == {1, 2}
        w.mode = "fail"  # out of placement, forgotten; its events since are not lost
        w.store(3)
        w.drop(1)
        await settle()
        assert held() == set() and not d.view(d.records[wid]).healthy
        w.mode = "ok"
        await settle()
        assert held() == {2, 3} and d.view(d.records[wid]).healthy
        w.mode = "hang"  # too slow: its view stays as it was, nothing is lost
        await settle()
        w.store(4)
        calls = w.calls
        await settle()
        assert held() == {2, 3} and w.calls == calls  # an unanswered call is never sent twice
        w.mode = "ok"
        d.stop()
        return held

    asyncio.run(go())


def test_workers_that_leave_the_registry_leave_placement_and_the_index():
    async def go():
        src = FakeSource()
        a, b = src.add(Role.DECODE), src.add(Role.DECODE)
        src.workers[a].store(b"x")
        d = directory(src)
        await d.start()
        await settle()
        assert d.policy.index.overlap([digest(b"x")]) == {a: 1}
        src.registry.move(a, S.DRAINING)
        await settle()
        assert {v.worker_id: v.draining for v in d.views()} == {a: True, b: False}
        assert all(d.place(req(i)).decode.id == b for i in range(4))  # a draining worker takes nothing new
        src.registry.set_silent(b, 1.0)  # a probe went unanswered: slow, and the last of its pool up
        await settle()
        assert d.view(d.records[b]).healthy and d.slow(b) and b in d.records
        src.registry.set_silent(b, None)
        await settle()
        assert d.view(d.records[b]).healthy and not d.slow(b)
        src.registry.move(a, S.DEAD, reason="gone")
        await settle()
        assert set(d.records) == {b} and d.policy.index.overlap([digest(b"x")]) == {}
        d.stop()

    asyncio.run(go())


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_burst_splits_evenly_over_the_decode_pool(policy):
    """16 simultaneous distinct requests between two snapshots: every worker still looks idle in
    its last report, so only the router's own count of what it placed spreads them."""
    async def go():
        src = FakeSource()
        ds = [src.add(Role.DECODE), src.add(Role.DECODE)]
        d = directory(src, policy, load_interval_s=60)  # no new snapshot during the burst
        await d.start()
        await settle(0.05)
        routes = [d.place(req(i)) for i in range(16)]
        split = {w: sum(r.decode.id == w for r in routes) for w in ds}
        print(f"{policy}: {sorted(split.values())}")
        for r in routes:
            r.close()
        assert all(d.pending.count(w, None) == 0 for w in ds)  # closed routes count no more
        d.stop()
        return split

    split = asyncio.run(go())
    assert all(6 <= n <= 10 for n in split.values()), split


def test_pending_counts_until_the_worker_reports_the_request():
    async def go():
        src = FakeSource()
        wid = src.add(Role.DECODE)
        d = directory(src, load_interval_s=0.01)
        await d.start()
        await settle(0.05)
        route = d.place(req(0))
        assert d.view(d.records[wid]).num_waiting == 1  # placed, not yet seen
        route.confirm(wid)  # the worker has it; its next report counts it
        src.workers[wid].load = stats(running=1)
        await settle(0.05)
        v = d.view(d.records[wid])
        assert (v.num_waiting, v.num_running) == (0, 1)  # counted once, by the worker's own report
        route.close()
        d.stop()

    asyncio.run(go())


def test_a_replica_introduces_itself_once_to_each_decode_worker_it_learns_of():
    """Its handle reaches a decode worker's process before any stream does (the first handle of
    an actor class to arrive loads that class there); a prefill worker is sent none (no stream
    names a caller there), and a driver (no caller) introduces itself nowhere."""
    async def go(caller):
        src = FakeSource()
        first, prefill = src.add(Role.DECODE), src.add(Role.PREFILL)
        d = directory(src)
        d.caller = caller
        await d.start()
        await until(lambda: first in d._pollers and prefill in d._pollers)
        await until(lambda: caller is None or src.workers[first].met)
        later = src.add(Role.DECODE)  # a worker that joins later is introduced to as it appears
        await until(lambda: later in d._pollers and (caller is None or src.workers[later].met))
        await settle()  # (a second introduction would come now)
        d.stop()
        return [src.workers[w].met for w in (first, prefill, later)]

    replica = object()
    assert asyncio.run(go(replica)) == [[replica], [], [replica]]
    assert asyncio.run(go(None)) == [[], [], []]


def test_a_hung_worker_never_makes_a_placement_wait():
    async def go():
        src = FakeSource()
        hung = src.add(Role.DECODE)
        src.add(Role.DECODE)
        src.workers[hung].mode = "hang"
        d = directory(src, load_interval_s=0.001)
        await d.start()
        placed = 0
        for i in range(200):  # place() is synchronous: it cannot wait on a worker
            r = d.place(req(i))
            placed += 1
            r.close()
            if i % 20 == 0:
                await asyncio.sleep(0.001)  # the pollers run in between
        d.stop()
        return placed

    assert asyncio.run(go()) == 200


def test_transport_by_locality():
    async def go():
        src = FakeSource()
        p = src.add(Role.PREFILL, "127.0.0.2", ("shm", "nixl", "tcp"))
        near = src.add(Role.DECODE, "127.0.0.2", ("shm", "nixl", "tcp"))
        d = directory(src)
        await d.start()
        assert d.place(req(0)).transport == "shm"
        src.registry.move(near, S.DEAD)
        src.add(Role.DECODE, "127.0.0.3", ("shm", "tcp"))
        await settle()
        r = d.place(req(1))
        assert (r.prefill.id, r.transport) == (p, "tcp")  # another node: never shm
        d.stop()

    asyncio.run(go())


class FakePrefill:
    def __init__(self, outcome):
        self.outcome, self.calls = outcome, 0
        self.prefill = Call(self._prefill)

    async def _prefill(self, req, transport, outputs=(), reader_ranks=1, stream=False):
        self.calls += 1
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome


def test_a_failed_prefill_worker_leaves_placement_a_refused_request_is_not_retried():
    from splitserve.orchestrator.orchestrator import Orchestrator
    from splitserve.orchestrator.request_run import RequestRun
    from splitserve.orchestrator.trace import RequestTrace

    async def go(first_outcome):
        src = FakeSource()
        p1, p2 = src.add(Role.PREFILL), src.add(Role.PREFILL)
        src.add(Role.DECODE)
        d = directory(src, "round_robin")
        await d.start()
        fakes = {p1: FakePrefill(first_outcome), p2: FakePrefill(first_outcome)}
        for wid, f in fakes.items():
            src.registry._live[wid] = src.registry[wid].__class__(**{**src.registry[wid].__dict__, "handle": f})
        d.records = {w: src.registry[w] for w in d.records}
        o = Orchestrator(d)
        route = d.place(req(0))
        first = route.prefill.id
        try:
            return await RequestRun(o, req(0), route, RequestTrace("0"))._prefill(route.prefill), fakes, first, d, o
        finally:
            d.stop()

    result, fakes, first, d, o = asyncio.run(go(RuntimeError("actor died")))
    assert result is None and o.prefill_failures == 1
    assert o.moves() == (MoveCount(MoveKind.RETRY, MoveReason.FAILED, 1),)  # its engine raised
    assert not d.view(d.records[first]).healthy  # out of placement at once
    with pytest.raises(ConfigError, match="prompt too long"):
        asyncio.run(go(ConfigError("prompt too long")))


def test_the_router_policy_registry_and_autoscaler_import_without_ray_or_torch():
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, *a):\n"
            "        if name.split('.')[0] in ('torch', 'ray'):\n"
            "            raise ImportError('blocked: ' + name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "import splitserve.router.policy, splitserve.control.registry, splitserve.control.autoscale\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_a_request_placed_again_after_a_failed_prefill_leaves_no_pending_count():
    """The first prefill call fails, the request is placed again and finishes on the other
    prefill worker: every route it held is closed once it ends (none lingers until a TTL)."""
    from splitserve.orchestrator.orchestrator import Orchestrator
    from splitserve.worker.prefill.worker import PrefillResult
    from splitserve.types import FinishReason, TokenChunk

    calls = []

    class OnceFailing:
        def __init__(self):
            self.prefill = Call(self._prefill)

        async def _prefill(self, req, transport, outputs=(), reader_ranks=1, stream=False):
            calls.append(self)
            if len(calls) == 1:
                raise RuntimeError("actor died")
            chunk = TokenChunk(req.request_id, (7,), finish_reason=FinishReason.LENGTH)
            return PrefillResult(chunk, None, 0.0)

    async def go():
        src = FakeSource()
        for _ in range(2):
            wid = src.add(Role.PREFILL)
            src.registry._live[wid] = src.registry[wid].__class__(**{**src.registry[wid].__dict__,
                                                                     "handle": OnceFailing()})
        src.add(Role.DECODE)
        d = directory(src, "round_robin", load_interval_s=60)
        await d.start()
        chunks = [c async for c in Orchestrator(d).stream(req(0))]
        counts = {w: d.pending.count(w, None) for w in d.records}
        d.stop()
        return chunks, counts

    chunks, counts = asyncio.run(go())
    assert len(calls) == 2 and calls[0] is not calls[1]
    assert [c.token_ids for c in chunks] == [(7,)]
    assert set(counts.values()) == {0}, counts


def test_views_are_the_same_objects_until_a_workers_facts_change():
    """The policy re-scores only the views that are new objects, so the Directory must hand a
    new view exactly when a worker's facts change: a placement (its pending count), its route
    closing, its own report, a failure, and a pending count lapsing with time; every other view
    stays the object it was, and each cached view equals one built afresh."""
    async def go():
        now = [0.0]
        src = FakeSource()
        a, b = src.add(Role.DECODE), src.add(Role.DECODE)
        d = directory(src, load_interval_s=3600, clock=lambda: now[0])
        await d.start()
        await settle(0.05)

        def check():
            views = d.views(Role.DECODE)
            assert views == tuple(d.view(d.records[w]) for w in (a, b))  # cached, yet as fresh
            assert d.views(Role.DECODE) is views  # nothing changed: the very same tuple
            return dict(zip((a, b), views))

        before = check()
        route = d.place(req(0))
        placed, other = route.decode.id, ({a, b} - {route.decode.id}).pop()
        after = check()
        assert after[other] is before[other] and after[placed] is not before[placed]
        assert after[placed].num_waiting == 1
        route.close()  # the request ended: its count goes, in a new view
        closed = check()
        assert closed[placed] is not after[placed] and closed[placed].num_waiting == 0
        assert closed[other] is before[other]
        route = d.place(req(1))
        placed = route.decode.id
        now[0] += d.pending.ttl_s + 0.1  # never confirmed: the count lapses, and the view shows it
        lapsed = check()
        assert lapsed[placed].num_waiting == 0
        other = ({a, b} - {placed}).pop()
        src.workers[other].load = stats(running=3)  # its own report: a new view of it alone
        answer = asyncio.get_running_loop().create_future()
        answer.set_result(await src.workers[other].snapshot.remote(None, d.router_id))
        d._apply_snapshot(other, answer, now[0])
        reported = check()
        assert reported[other].num_running == 3 and reported[placed] is lapsed[placed]
        d.mark_failed(other)
        failed = check()
        assert not failed[other].healthy and failed[placed] is lapsed[placed]
        d.stop()

    asyncio.run(go())


def test_a_slow_worker_is_placed_on_only_while_no_worker_of_its_pool_answers():
    """Slow is not dead (DESIGN.md §4 "Liveness"): the last decode worker, unanswered, stays in
    placement (requests wait for it) and /ready says so; once another answers, the slow one
    takes nothing new until it answers again; a worker whose calls fail is out either way."""
    async def go():
        src = FakeSource()
        a = src.add(Role.DECODE)
        d = directory(src, "round_robin")
        await d.start()
        await settle()
        src.workers[a].mode = "hang"  # its poll goes unanswered past slow_after_s
        while not d.slow(a):
            await settle(0.02)
        alone = (d.ready(), {d.place(req(i)).decode.id for i in range(4)}, d.wait_s(a) > 0)
        b = src.add(Role.DECODE)
        while b not in d.records or not d.view(d.records[b]).healthy:
            await settle(0.02)
        beside = (d.ready(), {d.place(req(i)).decode.id for i in range(4)}, d.view(d.records[a]).healthy)
        src.workers[a].mode = "ok"  # it answers again: placed on again
        await settle()
        back = (d.slow(a), {d.place(req(i)).decode.id for i in range(4)}, d.wait_s(a))
        src.workers[b].mode = "fail"  # its calls fail: out of placement, even as the only brisk one
        src.workers[a].mode = "hang"
        while not (d.slow(a) and not d.view(d.records[b]).healthy):
            await settle(0.02)
        failing = (d.ready(), {d.place(req(i)).decode.id for i in range(4)})
        d.stop()
        return a, b, alone, beside, back, failing

    a, b, alone, beside, back, failing = asyncio.run(go())
    assert alone == (True, {a}, True)  # the last one: placed on, the wait counted
    assert beside == (True, {b}, False)  # another answers: the slow one takes nothing new
    assert back == (False, {a, b}, 0.0)
    assert failing == (True, {a})  # slow and alive beats failing


def test_ready_says_exactly_whether_place_would_place():
    """/ready's answer is `place`'s: no decode worker in placement (none READY, all failing,
    all draining) is a 503 and NoCapacity; a slow one alone is a 200 and a placement."""
    from splitserve.router.policy import NoCapacity

    async def go():
        src = FakeSource()
        a, b = src.add(Role.DECODE), src.add(Role.DECODE)
        src.add(Role.PREFILL)
        d = directory(src)
        await d.start()
        await settle()
        seen = []

        def look(name):
            try:
                placed = d.place(req(len(seen))).decode.id is not None
            except NoCapacity:
                placed = False
            seen.append((name, d.ready(), placed))

        look("both up")
        src.registry.set_silent(a, 1.0)
        src.registry.set_silent(b, 1.0)
        await settle()
        look("both slow")
        src.registry.move(a, S.DRAINING)
        await settle()
        look("one slow, one draining")
        src.workers[b].mode = "fail"
        while d.view(d.records[b]).healthy:
            await settle(0.02)
        look("one failing, one draining")
        src.registry.move(b, S.DEAD)
        await settle()
        look("one draining")
        d.stop()
        return seen

    seen = asyncio.run(go())
    assert all(ready == placed for _, ready, placed in seen), seen
    assert [ready for _, ready, _ in seen] == [True, True, True, False, False], seen


def test_a_worker_ray_cannot_reach_for_the_moment_is_slow_not_failed():
    """A transient 'cannot reach' (Ray's ActorUnavailableError) keeps the worker, its load and
    its KV index: slow, and still the pool's one worker in placement."""
    async def go():
        src = FakeSource()
        wid = src.add(Role.DECODE)
        src.workers[wid].store(1)
        d = directory(src)
        await d.start()
        await settle()
        src.workers[wid].mode = "unreachable"
        while not d.slow(wid):
            await settle(0.02)
        kept = (d.view(d.records[wid]).healthy, d.policy.index.overlap([digest(1)]).get(wid))
        d.stop()
        return kept

    assert asyncio.run(go()) == (True, 1)


def test_admission_counts_a_slow_workers_silence_in_the_ttft():
    """A request placed on a slow worker waits for it: the plan carries the silence so far and
    admission adds it to the predicted TTFT, so a TTFT target it cannot meet refuses it."""
    from splitserve.orchestrator.orchestrator import Orchestrator
    from splitserve.router.admission import Admission, AdmissionConfig
    from splitserve.types import Priority

    async def go():
        src = FakeSource()
        wid = src.add(Role.DECODE)
        src.workers[wid].load = dataclasses.replace(stats(), step_time_coeffs=(0.001, 1e-5, 0.0, 0.0, 0.0))
        d = directory(src)
        await d.start()
        await settle()
        o = Orchestrator(d)
        brisk = o.plan(req(0))
        brisk.route.close()
        src.workers[wid].mode = "hang"
        while d.wait_s(wid) < 0.3:
            await settle(0.05)
        slow = o.plan(req(1))
        slow.route.close()
        d.stop()
        return brisk, slow

    brisk, slow = asyncio.run(go())
    assert brisk.wait_s == 0.0 and slow.wait_s >= 0.3
    adm = Admission(AdmissionConfig(ttft_slo_ms=250, calibration_prior=1.0))
    assert adm.decide(brisk, Priority.STANDARD, 40).admit
    refused = adm.decide(slow, Priority.STANDARD, 40)
    assert not refused.admit and refused.reason == "ttft_slo" and refused.predicted_ttft_s >= 0.3
