"""EngineLoop's health, without a model: a fake engine whose steps fail. One failed step is
delivered to the waiting requests and the loop goes on; `max_step_failures` in a row stop it —
it says why (`failure`, what the worker reports to health probes so the Controller replaces it)
and refuses new work. At most `max_requests` wait at once."""

import asyncio

import pytest

from splitserve.worker.engine_loop import EngineBusy, EngineFailed, EngineLoop
from splitserve.types import FinishReason, Request, SamplingParams, TokenChunk


class FakeEngine:
    def __init__(self, failures: int) -> None:
        self.failures, self.seqs, self.steps, self.pulling = failures, set(), 0, set()

    def is_pulling(self, rid):
        return rid in self.pulling

    def stats(self):
        return {"steps": self.steps}

    def check_request(self, req, outputs=()):
        return 1

    def add_request(self, req, **kw):
        self.seqs.add(req.request_id)

    def has_unfinished(self):
        return bool(self.seqs)

    def abort(self, rid):
        self.seqs.discard(rid)

    def step(self):
        self.steps += 1
        if self.failures:
            self.failures -= 1
            raise RuntimeError("a kernel failed")
        done, self.seqs = list(self.seqs), set()
        return [TokenChunk(r, (1,), finish_reason=FinishReason.LENGTH) for r in done]


def req(i):
    return Request(f"r{i}", (1, 2, 3), SamplingParams(max_tokens=1))


def test_a_failed_step_is_delivered_and_the_loop_goes_on():
    async def go():
        loop = EngineLoop(FakeEngine(failures=1), max_step_failures=3)
        q = await loop.submit(req(0))
        first, second = await q.get(), await q.get()
        return loop, first, second

    loop, first, second = asyncio.run(go())
    assert isinstance(first, RuntimeError) and second.finished
    assert loop.failure is None


def test_steps_that_keep_failing_stop_the_engine_and_say_why():
    async def go():
        loop = EngineLoop(FakeEngine(failures=10), max_step_failures=3)
        q = await loop.submit(req(0))
        items = [await q.get() for _ in range(3)]
        with pytest.raises(EngineFailed, match="stopped"):
            await loop.submit(req(1))
        return loop, items

    loop, items = asyncio.run(go())
    assert [type(i) for i in items] == [RuntimeError, RuntimeError, EngineFailed]
    assert loop.failure is not None and "3 engine steps in a row failed" in loop.failure
    assert loop.engine.steps == 3  # it stopped stepping


def test_at_most_max_requests_wait():
    async def go():
        loop = EngineLoop(FakeEngine(failures=0), max_requests=2)
        await loop.submit(req(0))
        await loop.submit(req(1))
        with pytest.raises(EngineBusy):
            await loop.submit(req(2))

    asyncio.run(go())


def test_a_failed_step_spares_a_request_whose_kv_is_still_arriving():
    """It was not in that step: failing it would migrate it for nothing."""
    async def go():
        loop = EngineLoop(FakeEngine(failures=1), max_step_failures=3)
        loop.engine.pulling.add("landing")
        landing = loop.watch("landing")
        q = await loop.submit(req(0))
        failed, done = await q.get(), await q.get()
        return landing.empty(), failed, done

    spared, failed, done = asyncio.run(go())
    assert spared and isinstance(failed, RuntimeError) and done.finished
