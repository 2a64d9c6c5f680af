"""A worker answers a router's load poll while its engine thread is busy (DESIGN.md §4
"Liveness": a long step is not silence), without Ray: a real decode worker in this process whose
engine thread is held by a call the test releases. The answer meanwhile is the last step's load
and no events, acknowledging nothing; the one take already asked of the engine thread is waited
on again, never a second one queued; once the thread is free, every event arrives."""

import asyncio
import threading

from splitserve.config import EngineConfig
from splitserve.types import BlockStored, Request, SamplingParams
from splitserve.worker.decode.worker import DecodeWorker


def test_a_snapshot_answers_while_the_engine_thread_is_busy_and_loses_no_event(tiny_checkpoint):
    dec = DecodeWorker(EngineConfig(model=str(tiny_checkpoint("llama")), num_kv_blocks=64), ["tcp"])

    def run(req):  # on the engine thread: the request to its end, its blocks cached (events)
        dec.engine.add_request(req)
        while dec.engine.has_unfinished():
            dec.engine.step()

    async def go():
        first = await dec.snapshot(None, "r")  # first contact: a listing
        await dec.loop.call(run, Request("a", tuple(range(5, 45)), SamplingParams(max_tokens=2)))
        gate = threading.Event()
        held = asyncio.ensure_future(dec.loop.call(gate.wait))  # the engine thread is busy until released
        try:
            during, asked = [], []
            for _ in range(3):
                during.append(await dec.snapshot(first.seq, "r"))
                asked.append(dec._taking["r"][1])  # the take asked of the engine thread
            asked_once = all(t is asked[0] for t in asked) and not asked[0].done()
        finally:
            gate.set()
            await held
        after = await dec.snapshot(first.seq, "r")
        return first, during, asked_once, after

    try:
        first, during, asked_once, after = asyncio.run(go())
    finally:
        dec.close()
    assert first.reset
    assert all(s.events == [] and s.seq == first.seq and not s.reset for s in during), during
    assert asked_once
    stored = [h for ev in after.events if isinstance(ev, BlockStored) for h in ev.block_hashes]
    assert after.seq > first.seq and len(stored) >= 2, after  # the prompt's two full blocks
    dec.engine.check_invariants()
