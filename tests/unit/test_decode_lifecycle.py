"""The decode worker's handoff, step by step, without Ray: a real prefill worker and a real
decode worker in this process, the KV moving over TCP through a gated transport the test
controls. An abort lands at every point of the handoff state machine (before allocate, while
the allocation is queued, during the pull, after the read before ready, during verify, after
ready); each test ends with both workers holding no blocks, no lease, no detached block and no
handoff. Also: a prefill cancelled after its blocks were detached frees them, and blocks
detached with no lease are an invariant violation."""

import asyncio
import dataclasses
import threading
import time

import pytest

from splitserve.config import EngineConfig
from splitserve.worker.decode import worker as decode_module
from splitserve.worker.decode.handoff import Handoff, HandoffState
from splitserve.worker.decode.worker import DecodeWorker
from splitserve.engine.engine import KV_LAYER_GROUPS
from splitserve.worker.prefill import worker as prefill_module
from splitserve.worker.prefill.worker import PrefillWorker
from splitserve.types import FinishReason, Request, SamplingParams
from tests.fakes.transports import CorruptLanding, Gated, SlowToStop

SP = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = tuple(range(5, 45))


class Local:
    """An in-process worker as the decode side calls its prefill peer: `peer.ack.remote(x)`."""

    def __init__(self, obj) -> None:
        self._obj = obj

    def __getattr__(self, name):
        fn = getattr(self._obj, name)
        return type("Method", (), {"remote": staticmethod(lambda *a: asyncio.ensure_future(fn(*a)))})


@pytest.fixture(scope="module")
def workers(tiny_checkpoint):
    cfg = EngineConfig(model=str(tiny_checkpoint("llama")), num_kv_blocks=64)
    pre, dec = PrefillWorker(cfg, ["tcp"]), DecodeWorker(cfg, ["tcp"])
    real = dec.transports["tcp"]
    yield pre, dec, real
    pre.close()
    dec.close()


@pytest.fixture
def gated(workers):
    pre, dec, real = workers
    dec.transports["tcp"] = g = Gated(real, dec)
    yield pre, dec, g
    dec.transports["tcp"] = real


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    """The tokens of one uninterrupted run on one engine."""
    return long_reference(tiny_checkpoint, PROMPT)


async def no_leaks(pre, dec) -> None:
    await asyncio.sleep(0.05)  # fire-and-forget acks and renewals settle
    p, d = await pre.check_invariants(), await dec.check_invariants()
    assert (p["in_use"], p["leases"], p["grants"], pre.engine.detached_requests()) == (0, 0, 0, []), p
    assert (d["in_use"], d["handoffs"], dec.loop.num_active) == (0, 0, 0), d


async def handed_off(pre, rid):
    result = await pre.prefill(Request(rid, PROMPT, SP), "tcp")
    assert result.handoff is not None
    return Request(rid, PROMPT, SP), result


async def collect(gen):
    return [c async for c in gen]


def landing(pre, dec, req, r):
    """The decode worker's whole stream for the prefill result `r`, collected."""
    return collect(dec.generate(req, r.handoff, Local(pre)))


async def wait_state(dec, rid, state):
    for _ in range(2000):
        ho = dec.handoffs.get(rid)
        if ho is not None and ho.state is state:
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"{rid} never reached {state}")


def finishes(chunks):
    return [c.finish_reason for c in chunks if c.finish_reason is not None]


def outcome_count(dec, state):
    return dec.handoff_outcomes[state]


def test_abort_before_allocate_the_stream_began(gated):
    """The abort reaches the worker before the request does (Ray does not order the calls)."""
    pre, dec, g = gated

    async def go():
        req, r = await handed_off(pre, "before-allocate")
        await dec.abort(req.request_id)
        chunks = await landing(pre, dec, req, r)
        assert finishes(chunks) == [FinishReason.ABORT]
        await no_leaks(pre, dec)

    asyncio.run(go())


def test_abort_while_the_allocation_is_queued_on_the_engine_thread(gated):
    pre, dec, g = gated

    async def go():
        req, r = await handed_off(pre, "allocating")
        busy = asyncio.ensure_future(dec.loop.call(time.sleep, 0.3))  # add_pulled waits behind this
        task = asyncio.ensure_future(landing(pre, dec, req, r))
        await wait_state(dec, req.request_id, HandoffState.ALLOCATING)
        await dec.abort(req.request_id)
        before = outcome_count(dec, HandoffState.ABORTED)
        assert finishes(await task) == [FinishReason.ABORT]
        await busy
        assert outcome_count(dec, HandoffState.ABORTED) == before + 1
        await no_leaks(pre, dec)

    asyncio.run(go())


def test_abort_during_the_pull(gated):
    pre, dec, g = gated

    async def go():
        req, r = await handed_off(pre, "pulling")
        task = asyncio.ensure_future(landing(pre, dec, req, r))
        await wait_state(dec, req.request_id, HandoffState.PULLING)  # the gate holds the read
        await dec.abort(req.request_id)
        assert finishes(await task) == [FinishReason.ABORT]
        await no_leaks(pre, dec)

    asyncio.run(go())


def test_abort_after_the_read_before_ready(gated):
    pre, dec, g = gated

    async def go():
        req, r = await handed_off(pre, "read-not-ready")
        g.gate.set()
        g.on_done = lambda: asyncio.ensure_future(dec.abort(req.request_id))  # the bytes are in
        before = outcome_count(dec, HandoffState.ABORTED)
        chunks = await landing(pre, dec, req, r)
        assert finishes(chunks) == [FinishReason.ABORT] and not any(c.token_ids for c in chunks)
        assert outcome_count(dec, HandoffState.ABORTED) == before + 1
        await no_leaks(pre, dec)

    asyncio.run(go())


def test_abort_during_verify(gated, monkeypatch):
    pre, dec, g = gated
    verifying = threading.Event()

    def slow_verify(*args):
        verifying.set()
        time.sleep(0.3)
        return real_verify(*args)

    real_verify = decode_module.verify_landed
    monkeypatch.setattr(decode_module, "verify_landed", slow_verify)

    async def go():
        req, r = await handed_off(pre, "verifying")
        g.gate.set()
        task = asyncio.ensure_future(landing(pre, dec, req, r))
        while not verifying.is_set():
            await asyncio.sleep(0.001)
        assert dec.handoffs[req.request_id].state is HandoffState.VERIFYING
        await dec.abort(req.request_id)
        assert finishes(await task) == [FinishReason.ABORT]
        await no_leaks(pre, dec)

    asyncio.run(go())


def test_abort_after_ready(gated, reference):
    pre, dec, g = gated

    async def go():
        req, r = await handed_off(pre, "ready")
        g.gate.set()
        gen = dec.generate(req, r.handoff, Local(pre))
        first = await gen.__anext__()  # the first token after the handoff: it is in the batch
        assert first.token_ids == (reference[1],)
        await dec.abort(req.request_id)
        rest = [c async for c in gen]
        assert finishes(rest) == [FinishReason.ABORT]
        await no_leaks(pre, dec)

    asyncio.run(go())


def test_a_consumer_that_leaves_mid_pull_frees_everything(gated):
    """No abort call at all: the caller closes the stream while the read is held."""
    pre, dec, g = gated

    async def go():
        req, r = await handed_off(pre, "cancelled")
        task = asyncio.ensure_future(landing(pre, dec, req, r))
        await wait_state(dec, req.request_id, HandoffState.PULLING)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await no_leaks(pre, dec)

    asyncio.run(go())


def test_an_uninterrupted_handoff_and_a_corrupt_one_both_give_the_reference(workers, reference):
    pre, dec, real = workers

    async def go(rid):
        req, r = await handed_off(pre, rid)
        chunks = await landing(pre, dec, req, r)
        await no_leaks(pre, dec)
        return [r.handoff.first_token] + [t for c in chunks for t in c.token_ids]

    assert asyncio.run(go("clean")) == reference
    dec.transports["tcp"] = CorruptLanding(real, dec)
    try:
        before = outcome_count(dec, HandoffState.RECOMPUTE)
        assert asyncio.run(go("corrupt")) == reference  # verification caught it, recomputed here
        assert outcome_count(dec, HandoffState.RECOMPUTE) == before + 1
    finally:
        dec.transports["tcp"] = real


def test_a_migrated_request_continues_exactly(workers, reference):
    """Without a handoff, with the tokens another worker already streamed: the rest follows."""
    pre, dec, _ = workers

    async def go():
        chunks = await collect(dec.generate(Request("migrated", PROMPT, SP), outputs=tuple(reference[:3])))
        await no_leaks(pre, dec)
        return [t for c in chunks for t in c.token_ids]

    assert asyncio.run(go()) == reference[3:]


def test_a_prefill_cancelled_after_its_blocks_were_detached_frees_them(workers, monkeypatch):
    pre, dec, _ = workers
    checksumming = threading.Event()
    real = prefill_module.kv_checksum

    def slow_checksum(*args):
        checksumming.set()
        time.sleep(0.3)
        return real(*args)

    monkeypatch.setattr(prefill_module, "kv_checksum", slow_checksum)

    async def go():
        task = asyncio.ensure_future(pre.prefill(Request("detached", PROMPT, SP), "tcp"))
        while not checksumming.is_set():
            await asyncio.sleep(0.001)
        task.cancel()  # the caller is gone while the handoff is being built
        with pytest.raises(asyncio.CancelledError):
            await task
        await no_leaks(pre, dec)

    asyncio.run(go())


def test_a_handoff_whose_caller_gave_up_is_freed_by_abandon(workers):
    """The caller's cancel raced the prefill's result (Ray then reports the call cancelled, the
    handoff with it): nobody will acknowledge the lease; `abandon` ends it and frees the blocks
    now — also for a prefill still running when it comes, as that prefill returns."""
    pre, dec, _ = workers

    async def go():
        _, r = await handed_off(pre, "gave-up")
        assert (await pre.check_invariants())["leases"] == 1
        await pre.abandon("gave-up")
        await no_leaks(pre, dec)
        assert await pre.ack(r.handoff.lease_id) is False  # a late reader learns its copy may be torn
        await pre.abandon("gave-up-early")  # before its prefill returned
        _, r = await handed_off(pre, "gave-up-early")
        await no_leaks(pre, dec)

    asyncio.run(go())


def test_blocks_detached_with_no_lease_are_a_violation(workers):
    pre, dec, _ = workers

    async def go():
        q = await pre.loop.submit(Request("orphan", PROMPT, SP), prefill_only=True)
        chunk = await q.get()
        assert chunk.kv_blocks
        with pytest.raises(AssertionError, match="no lease"):
            await pre.check_invariants()
        await pre.loop.call(pre.engine.release_detached, "orphan")
        await no_leaks(pre, dec)

    asyncio.run(go())


def test_the_handoff_state_machine_refuses_what_is_not_a_transition():
    ho = Handoff("r")
    with pytest.raises(AssertionError):
        ho.move(HandoffState.VERIFYING)  # ALLOCATING cannot skip the pull
    ho.move(HandoffState.PULLING)
    assert ho.request_abort() is False  # not in the engine yet: the state machine frees it
    ho.move(HandoffState.VERIFYING)

    class Engine:
        freed = []

        def abort(self, rid):
            self.freed.append(rid)

    ho.allocated = True
    assert ho.finish(Engine(), HandoffState.READY) is HandoffState.ABORTED  # the abort came first
    assert ho.finish(Engine(), HandoffState.READY) is HandoffState.ABORTED  # ended once: stays so
    assert Engine.freed == ["r"]  # freed once


def test_a_migrated_request_through_a_prefill_worker_continues_exactly(workers, reference):
    """The context (prompt + 3 delivered tokens) is prefilled there, its KV handed over, and the
    decode worker continues after the prefill worker's token: the uninterrupted output."""
    pre, dec, _ = workers

    async def go():
        req, outputs = Request("migrated-pd", PROMPT, SP), tuple(reference[:3])
        r = await pre.prefill(req, "tcp", outputs)
        assert r.chunk.token_ids == (reference[3],)
        chunks = await collect(dec.generate(req, r.handoff, Local(pre), outputs))
        await no_leaks(pre, dec)
        return [t for c in chunks for t in c.token_ids]

    assert asyncio.run(go()) == reference[4:]


def test_blocks_are_freed_only_after_a_released_transfer_stopped_even_when_cancelled(workers, monkeypatch):
    """An abort mid-transfer, then the caller's cancel while the released read is still moving
    bytes: the blocks go back only once the transport says the read stopped."""
    pre, dec, real = workers
    slow = SlowToStop(real, dec)
    freed = []
    real_abort = dec.engine.abort
    monkeypatch.setattr(dec.engine, "abort", lambda rid: (freed.append(time.monotonic()), real_abort(rid)))

    async def go():
        req, r = await handed_off(pre, "slow-stop")
        task = asyncio.ensure_future(landing(pre, dec, req, r))
        await wait_state(dec, req.request_id, HandoffState.PULLING)
        await asyncio.sleep(0.05)  # the bytes are in; the read is held open
        await dec.abort(req.request_id)
        await asyncio.sleep(0.05)  # released: the worker waits for the read to stop
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await no_leaks(pre, dec)

    dec.transports["tcp"] = slow
    try:
        asyncio.run(go())
    finally:
        dec.transports["tcp"] = real
    assert freed and slow.stopped_at is not None and min(freed) >= slow.stopped_at


def test_an_ack_is_answered_while_the_prefill_engine_is_busy(workers):
    """The reader's acknowledgment does not wait for the prefill engine's thread (a long prefill
    step would hold back the request's first decode step); the blocks are freed once that
    thread is free, and the worker counts them as held until then."""
    pre, dec, _ = workers

    async def go():
        _, r = await handed_off(pre, "ack-while-busy")
        busy = threading.Event()
        blocker = asyncio.ensure_future(pre.loop.call(busy.wait))  # the engine thread, occupied
        try:
            assert await asyncio.wait_for(pre.ack(r.handoff.lease_id), 10) is True
            assert pre.engine.detached_requests() == ["ack-while-busy"] and pre.held() == 1
        finally:
            busy.set()
        await blocker
        await no_leaks(pre, dec)
        assert pre.held() == 0

    asyncio.run(go())


def test_the_exposed_transfer_is_from_the_prefills_last_pass_to_the_kv_verified(workers):
    """The handoff carries when the prefill's last forward pass ended; the first chunk after the
    landing reports the time from then to the KV verified here (`exposed_transfer_s`), which
    holds the whole pull and, with the gap before the pull began, is at least its transfer_s."""
    pre, dec, _ = workers

    async def go():
        req, r = await handed_off(pre, "exposed")
        assert r.handoff.computed_at == r.done_at
        await asyncio.sleep(0.2)  # the hand-over waits: that wait is on the critical path too
        began = time.time()
        chunks = await landing(pre, dec, req, r)
        await no_leaks(pre, dec)
        return r, began, chunks

    r, began, chunks = asyncio.run(go())
    (phases,) = [c.phases for c in chunks if c.phases is not None and c.phases.transfer_s is not None]
    # (wall clock against the monotonic one transfer_s is taken on: a millisecond's slack)
    assert phases.exposed_transfer_s >= (began - r.handoff.computed_at) + phases.transfer_s - 1e-3
    assert phases.exposed_transfer_s >= 0.2 and phases.transfer_bytes > 0


@pytest.fixture(scope="module")
def chunked(tiny_checkpoint):
    """Workers whose prefill takes 16 tokens a step: a 90-token prompt is six steps, five
    pieces streamed and a tail."""
    cfg = EngineConfig(model=str(tiny_checkpoint("llama")), num_kv_blocks=64)
    pre = PrefillWorker(dataclasses.replace(cfg, max_num_batched_tokens=16), ["tcp"])
    dec = DecodeWorker(cfg, ["tcp"])
    yield pre, dec
    pre.close()
    dec.close()


LONG = tuple(range(7, 97))


def long_reference(tiny_checkpoint, prompt=LONG):
    """The tokens of one uninterrupted run of `prompt` on one engine."""
    from splitserve.engine.engine import Engine

    eng = Engine(EngineConfig(model=str(tiny_checkpoint("llama")), num_kv_blocks=64))
    eng.add_request(Request("ref", prompt, SP))
    out = []
    while eng.has_unfinished():
        out += [t for c in eng.step() for t in c.token_ids]
    return out


@pytest.mark.parametrize("staged", [True, False])
def test_a_streamed_handoff_lands_its_pieces_during_the_prefill(chunked, tiny_checkpoint, staged, monkeypatch):
    """The decode worker stages the stream as the prefill starts: every piece lands and is
    checked while the prompt is computed (each prefill step made to take 0.1 s here, a
    long prompt's chunk), and the last step's blocks are the last piece, which its staging
    pulls while the handoff travels: the handoff carries nothing left to pull. The output
    equals the single engine's. Without stage() (its call lost or late) nothing is published — the
    prefill waits for its reader's first call — and the handoff is pulled whole. Nothing is
    held afterwards on either side."""
    pre, dec = chunked
    step = pre.engine.step
    monkeypatch.setattr(pre.engine, "step", lambda: (time.sleep(0.1), step())[1])
    rid = f"streamed-{staged}"
    prompt = LONG if staged else tuple(range(3, 93))[::-1]  # each its own: no prefix cached before
    req = Request(rid, prompt, SP)

    async def go():
        staging = asyncio.ensure_future(dec.stage(req, Local(pre))) if staged else None
        result = await pre.prefill(req, "tcp", (), 1, True)
        landed_before = dec.staged[rid].landed if staged else 0
        chunks = await collect(dec.generate(req, result.handoff, Local(pre)))
        if staging is not None:
            await staging
        await no_leaks(pre, dec)
        return result, landed_before, chunks

    result, landed_before, chunks = asyncio.run(go())
    h = result.handoff
    assert (h.streamed, len(h.block_ids)) == ((6, 6) if staged else (0, 6))  # five pieces and the last
    if staged:
        assert landed_before >= 5  # the five landed before the prefill's handoff came back
    assert [h.first_token] + [t for c in chunks for t in c.token_ids] == long_reference(tiny_checkpoint, prompt)
    assert not pre.streams and not dec.staged


def test_a_handoff_gives_its_stream_lease_a_whole_term(chunked, tiny_checkpoint, monkeypatch):
    """A stream no reader followed (its stage() lost or late) kept the lease it opened with,
    which its long prefill nearly used up; its handoff renews it, so the reader — to whom the
    handoff travels for a while on a loaded machine — gets a whole term for the pull, as a
    fresh lease would give (CI: lease_expired, then a recompute, on a 32-request run)."""
    pre, dec = chunked
    monkeypatch.setattr(pre.leases, "ttl_s", 1.0)
    step = pre.engine.step
    monkeypatch.setattr(pre.engine, "step", lambda: (time.sleep(0.15), step())[1])  # 6 steps: 0.9 s
    prompt = tuple(range(5, 95))[::-1]
    req = Request("stale-lease", prompt, SP)
    failures = dict(dec.transfer_failures)

    async def go():
        result = await pre.prefill(req, "tcp", (), 1, True)
        await asyncio.sleep(0.5)  # on its way prefill -> orchestrator -> decode
        chunks = await collect(dec.generate(req, result.handoff, Local(pre)))
        await no_leaks(pre, dec)
        return result, chunks

    result, chunks = asyncio.run(go())
    assert result.handoff.streamed == 0 and dec.transfer_failures == failures
    assert [result.handoff.first_token] + [t for c in chunks for t in c.token_ids] == long_reference(tiny_checkpoint, prompt)


async def streamed_run(pre, dec, req, stage_peer):
    """One streamed handoff end to end: staged through `stage_peer` (the prefill worker as the
    decode worker's staging sees it), prefilled, landed, decoded; nothing held afterwards."""
    staging = asyncio.ensure_future(dec.stage(req, stage_peer))
    result = await pre.prefill(req, "tcp", (), 1, True)
    chunks = await collect(dec.generate(req, result.handoff, Local(pre)))
    await staging
    await no_leaks(pre, dec)
    return result, chunks


def test_blocks_the_decode_worker_holds_are_not_moved(chunked, tiny_checkpoint, monkeypatch):
    """Prefix hits on either side. The decode worker computed `base` itself (an aggregated
    request): a streamed request sharing it reserves base's five blocks from its own prefix
    cache, and the prefill — which computes everything — publishes pieces only after them.
    Then both hold `base`: the prefill's cached blocks are covered at once, the decode worker's
    are kept. Each output equals the single engine's; nothing is held afterwards."""
    pre, dec = chunked
    step = pre.engine.step
    monkeypatch.setattr(pre.engine, "step", lambda: (time.sleep(0.05), step())[1])
    base = tuple(range(250, 170, -1))  # 80 tokens, five blocks: its own, cached by no other test

    async def go():
        chunks = await collect(dec.generate(Request("warm", base + (9, 8, 7), SP)))  # aggregated, here
        assert len([t for c in chunks for t in c.token_ids]) == SP.max_tokens
        out = []
        for rid, tail in (("decode-holds", tuple(range(60, 100))), ("both-hold", tuple(range(20, 60)))):
            req = Request(rid, base + tail, SP)
            kept, pieces = dec.prefix_blocks_kept, dec.pieces_landed
            result, chunks = await streamed_run(pre, dec, req, Local(pre))
            moved = next(c.phases.transfer_bytes for c in chunks if c.phases is not None)
            assert moved == 3 * dec.layout.num_layers * 2 * dec.layout.block_bytes  # what moved: not base's blocks
            assert not dec._kept
            out.append((req.prompt_token_ids, result, chunks, dec.prefix_blocks_kept - kept,
                        dec.pieces_landed - pieces))
        return out

    for prompt, result, chunks, kept, pieces in asyncio.run(go()):
        h = result.handoff
        assert kept == 5  # base's blocks: not moved
        assert (h.streamed, len(h.block_ids)) == (8, 8)  # 120 tokens: held 5, then three pieces
        assert pieces == 3 * min(KV_LAYER_GROUPS, dec.layout.num_layers)  # its three steps' blocks, by layer group
        assert [h.first_token] + [t for c in chunks for t in c.token_ids] == long_reference(tiny_checkpoint, prompt)
    assert not pre.streams and not dec.staged


def test_a_reservation_gives_up_held_blocks_for_fresh_ones(tiny_checkpoint):
    """unshare_reserved: a handoff that carries the held blocks after all gets fresh ones to
    land them in; the shared blocks stay cached, and the counts hold."""
    from splitserve.engine.engine import Engine
    from splitserve.hashing import block_hashes

    eng = Engine(EngineConfig(model=str(tiny_checkpoint("llama")), num_kv_blocks=16))
    prompt = tuple(range(5, 45))
    eng.add_request(Request("a", prompt, SP))
    while eng.has_unfinished():
        eng.step()
    r = eng.reserve_pulled(Request("b", prompt, SP))
    assert r.held == 2 and len(r.blocks) == 3  # 40 tokens: two full blocks cached
    u = eng.unshare_reserved("b")
    assert u.held == 0 and len(u.blocks) == 3 and not set(u.blocks[:2]) & set(r.blocks[:2])
    assert u.blocks[2] == r.blocks[2]
    eng.check_invariants()
    eng.abort("b")
    assert eng.holds_nothing() and eng.pool.num_in_use == 0
    assert eng.pool.match_prefix(block_hashes(prompt, eng.block_size)).block_ids == r.blocks[:2]  # still cached
    eng.check_invariants()


def test_a_corrupt_piece_mid_stream_recomputes_exactly(chunked, tiny_checkpoint, monkeypatch):
    """The third of five pieces lands corrupt: its own check catches it as it lands, the
    request is recomputed here, the output still equals the reference, nothing is held."""
    from tests.fakes.transports import CorruptNthLanding

    pre, dec = chunked
    real = dec.transports["tcp"]
    monkeypatch.setitem(dec.transports, "tcp", CorruptNthLanding(real, dec, n=2))
    step = pre.engine.step
    monkeypatch.setattr(pre.engine, "step", lambda: (time.sleep(0.05), step())[1])
    prompt = tuple(range(101, 191))  # its own: no prefix of it cached by earlier tests
    req = Request("corrupt-piece", prompt, SP)
    before = (dec.transfer_failures.get("corrupt", 0), outcome_count(dec, HandoffState.RECOMPUTE))

    result, chunks = asyncio.run(streamed_run(pre, dec, req, Local(pre)))
    assert dec.transports["tcp"].reads == 3  # it stopped at the corrupt piece: no tail read
    assert (dec.transfer_failures["corrupt"], outcome_count(dec, HandoffState.RECOMPUTE)) == (before[0] + 1,
                                                                                                before[1] + 1)
    assert [result.handoff.first_token] + [t for c in chunks for t in c.token_ids] == long_reference(tiny_checkpoint,
                                                                                                      prompt)


def test_a_stream_whose_prefill_dies_mid_way_leaves_nothing_held(chunked, monkeypatch):
    """The prefill stops after three of its six steps (cancelled, as a dead worker's call
    ends): its stream and lease end, the decode worker's staging finds the stream gone, and —
    no generate() coming — gives its reserved blocks back after claim_s."""
    pre, dec = chunked
    monkeypatch.setattr(dec, "claim_s", 0.2)
    step, steps = pre.engine.step, []
    monkeypatch.setattr(pre.engine, "step", lambda: (steps.append(1), time.sleep(0.1), step())[2])
    req = Request("prefill-dies", tuple(range(201, 291)), SP)

    async def go():
        staging = asyncio.ensure_future(dec.stage(req, Local(pre)))
        prefill = asyncio.ensure_future(pre.prefill(req, "tcp", (), 1, True))
        while len(steps) < 3:
            await asyncio.sleep(0.005)
        prefill.cancel()
        await asyncio.gather(prefill, return_exceptions=True)
        await asyncio.wait_for(staging, 10)
        await no_leaks(pre, dec)

    before = outcome_count(dec, HandoffState.ABORTED)
    asyncio.run(go())
    assert outcome_count(dec, HandoffState.ABORTED) == before + 1 and not dec.staged and not pre.streams


def test_a_stream_missing_a_piece_recomputes_exactly(chunked, tiny_checkpoint, monkeypatch):
    """The stream as its reader sees it loses its second piece (a truncated stream): the next
    piece does not start where the landed ones end, so the landing stops there ("truncated")
    and the request is recomputed here, exactly; nothing is held."""
    import dataclasses as dc

    pre, dec = chunked
    step = pre.engine.step
    monkeypatch.setattr(pre.engine, "step", lambda: (time.sleep(0.05), step())[1])
    prompt = tuple(range(11, 101))[::-1]
    req = Request("truncated-stream", prompt, SP)

    class Lossy(Local):
        def __getattr__(self, name):
            if name != "kv_stream":
                return super().__getattr__(name)

            async def kv_stream(*a):
                upd = await pre.kv_stream(*a)
                return dc.replace(upd, pieces=tuple(p for p in upd.pieces if p.first != 1))

            return type("Method", (), {"remote": staticmethod(lambda *a: asyncio.ensure_future(kv_stream(*a)))})

    before = dec.transfer_failures.get("truncated", 0)

    result, chunks = asyncio.run(streamed_run(pre, dec, req, Lossy(pre)))
    assert dec.transfer_failures["truncated"] == before + 1
    assert [result.handoff.first_token] + [t for c in chunks for t in c.token_ids] == long_reference(tiny_checkpoint,
                                                                                                      prompt)


def test_a_fully_streamed_landing_does_not_wait_for_its_ack(chunked, tiny_checkpoint, monkeypatch):
    """Every block came in a piece, each checked as it landed, so the request starts decoding
    without waiting for the ack's answer (a round trip to the prefill worker, here made to take
    1 s): its first decoded token comes before the ack is answered. Its last chunk comes after
    it, so a finished request has freed its source blocks as before."""
    pre, dec = chunked
    step = pre.engine.step
    monkeypatch.setattr(pre.engine, "step", lambda: (time.sleep(0.05), step())[1])
    prompt = tuple(range(13, 103))[::-1]
    req = Request("ack-later", prompt, SP)
    answered: list[float] = []

    async def slow_ack(lease_id):
        await asyncio.sleep(1.0)
        answered.append(time.monotonic())
        return await pre.ack(lease_id)

    class SlowAck(Local):
        def __getattr__(self, name):
            if name != "ack":
                return super().__getattr__(name)
            return type("Method", (), {"remote": staticmethod(lambda *a: asyncio.ensure_future(slow_ack(*a)))})

    async def go():
        staging = asyncio.ensure_future(dec.stage(req, Local(pre)))
        result = await pre.prefill(req, "tcp", (), 1, True)
        chunks = []
        async for c in dec.generate(req, result.handoff, SlowAck(pre)):
            chunks.append((time.monotonic(), c))
        await staging
        await no_leaks(pre, dec)
        return result, chunks

    result, chunks = asyncio.run(go())
    assert result.handoff.streamed == len(result.handoff.block_ids)  # nothing left to pull
    assert len(answered) == 1 and chunks[0][0] < answered[0] <= chunks[-1][0]
    tokens = [result.handoff.first_token] + [t for _, c in chunks for t in c.token_ids]
    assert tokens == long_reference(tiny_checkpoint, prompt)


def test_a_live_streams_grant_is_replaced_never_withdrawn(chunked, monkeypatch):
    """Each piece widens the stream's grant. The prefill replaces the grant in one step: were it
    revoked and granted again, a read served meanwhile by the transport's own thread found no
    grant and failed as `lease_expired` (seen under load in the 32-request cluster test)."""
    pre, dec = chunked
    tcp, withdrawn, live = pre.transports["tcp"], [], set()
    allow, revoke = tcp.allow, tcp.revoke

    def allowing(token, blocks):
        live.add(bytes(token))
        allow(token, blocks)

    def revoking(token):
        if bytes(token) in live and any(le.token == bytes(token) for le in pre.leases._leases.values()):
            withdrawn.append(token)  # its lease still runs
        revoke(token)

    monkeypatch.setattr(tcp, "allow", allowing)
    monkeypatch.setattr(tcp, "revoke", revoking)
    req = Request("regranted", LONG, SP)

    async def go():
        staging = asyncio.ensure_future(dec.stage(req, Local(pre)))
        result = await pre.prefill(req, "tcp", (), 1, True)
        await collect(dec.generate(req, result.handoff, Local(pre)))
        await asyncio.wait_for(staging, 10)
        await no_leaks(pre, dec)

    asyncio.run(go())
    assert live and not withdrawn


def test_a_dropped_staging_and_a_late_stage_give_their_blocks_back(chunked, monkeypatch):
    """drop_staging mid-stream (the orchestrator will not claim it) stops the staging, which
    frees its blocks once its read has stopped; a stage() that arrives after its request's
    generate() has come and gone (Ray orders neither) finds the stream over and frees at once,
    not after claim_s."""
    pre, dec = chunked
    step, steps = pre.engine.step, []
    monkeypatch.setattr(pre.engine, "step", lambda: (steps.append(1), time.sleep(0.05), step())[2])
    dropped, late = Request("dropped", tuple(range(21, 111)), SP), Request("late", tuple(range(31, 121)), SP)

    async def go():
        staging = asyncio.ensure_future(dec.stage(dropped, Local(pre)))
        prefill = asyncio.ensure_future(pre.prefill(dropped, "tcp", (), 1, True))
        while len(steps) < 3:
            await asyncio.sleep(0.005)
        await dec.drop_staging(dropped.request_id)
        result = await prefill
        await pre.ack(result.handoff.lease_id)  # what the orchestrator does with a result it drops
        await asyncio.wait_for(staging, 10)
        await no_leaks(pre, dec)

        result = await pre.prefill(late, "tcp", (), 1, True)
        await collect(dec.generate(late, result.handoff, Local(pre)))
        await asyncio.wait_for(dec.stage(late, Local(pre)), 5)  # claim_s is 30 s
        await no_leaks(pre, dec)

    before = outcome_count(dec, HandoffState.ABORTED)
    asyncio.run(go())
    assert outcome_count(dec, HandoffState.ABORTED) == before + 2 and not dec.staged


def test_a_staging_with_no_room_is_freed_when_nobody_claims_it(chunked, monkeypatch):
    """No free blocks to stage into: the staging keeps that as its failure and, unclaimed,
    still leaves the handoff table once its stream ends (it held no block)."""
    from splitserve.engine.kv_cache import OutOfBlocks

    pre, dec = chunked
    monkeypatch.setattr(dec, "claim_s", 0.2)

    def full(*a, **kw):
        raise OutOfBlocks("no room")

    monkeypatch.setattr(dec.engine, "reserve_pulled", full)
    req = Request("no-room", tuple(range(41, 131)), SP)

    async def go():
        staging = asyncio.ensure_future(dec.stage(req, Local(pre)))
        result = await pre.prefill(req, "tcp", (), 1, True)
        await pre.ack(result.handoff.lease_id)  # the orchestrator's, for a result it drops
        await asyncio.wait_for(staging, 10)
        await no_leaks(pre, dec)

    asyncio.run(go())
    assert not dec.staged and not dec.handoffs


def test_an_abort_that_reaches_only_the_staging_ends_the_generate_that_comes_after(chunked):
    """The caller left as the first token came: its abort reached the decode worker while only
    the staging was there (Ray orders neither call), and the staging gave its blocks back. The
    generate() that arrives after it ends at once, acknowledging the lease — it does not stage
    again and run the request to its end for nobody."""
    pre, dec = chunked
    req = Request("abort-staged", tuple(range(9, 99)), SP)

    async def go():
        staging = asyncio.ensure_future(dec.stage(req, Local(pre)))
        result = await pre.prefill(req, "tcp", (), 1, True)
        await dec.abort(req.request_id)
        await asyncio.wait_for(staging, 5)
        chunks = await collect(dec.generate(req, result.handoff, Local(pre)))
        assert finishes(chunks) == [FinishReason.ABORT] and not any(c.token_ids for c in chunks)
        await no_leaks(pre, dec)

    asyncio.run(go())


def test_a_stage_that_arrives_after_its_drop_reserves_nothing(chunked, tiny_checkpoint):
    """The prefill failed: the orchestrator dropped the staging and placed the request again,
    aggregated, on this same worker — and Ray delivered the first attempt's stage() last (it
    orders neither call). That stage() returns at once: it reserves no blocks under the id,
    so the engine admits the aggregated request (it refused it as "already running" before)."""
    pre, dec = chunked
    req = Request("stage-after-drop", LONG, SP)

    async def go():
        await dec.drop_staging(req.request_id)  # before the stage() it drops
        chunks = dec.generate(req)  # placed again without a prefill worker
        first = await chunks.__anext__()
        await asyncio.wait_for(dec.stage(req, Local(pre)), 1)  # the late one: claim_s is 30 s
        assert req.request_id not in dec.staged and req.request_id not in dec.handoffs
        rest = await collect(chunks)
        await no_leaks(pre, dec)
        return [t for c in (first, *rest) for t in c.token_ids]

    assert asyncio.run(go()) == long_reference(tiny_checkpoint)[:SP.max_tokens]
