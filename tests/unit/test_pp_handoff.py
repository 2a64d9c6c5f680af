"""The KV handoff by pipeline stage, without Ray (kv_transfer/stage_slices.py): real prefill and
decode workers in this process, pipeline-parallel ones with a local process for their stage 1
(the tiny model's two layers: one a stage). Each source stage serves its own layer over tcp and
shm, the handoff carries every stage's endpoints and per-layer checksums under one lease, and
the destination — one engine, or each of its stages — pulls the layers it holds and checks them.
PP2 → TP1 and TP1 → PP2 give Hugging Face's greedy tokens (tie rule as in test_engine_parity;
PP2 → PP2 runs on Ray, tests/integration/test_pp_cluster.py: a process holds one
torch.distributed group, so one pipeline-parallel engine at a time here), chunked on the PP prefill side (32 tokens a step), with prefix hits on
the prefill side (a second pass) and on the decode side (a request computed there after the
handoff finds the pulled blocks in its prefix cache), and for a migrated request; a stage's
layer corrupted after its checksum is caught (recompute, same tokens). Afterwards nothing is
held on any worker: no block in use, no lease, no grant on any stage's transports."""

import asyncio

import pytest

from splitserve.config import EngineConfig
from splitserve.engine.parallel.pipeline import on_all_stages
from splitserve.kv_transfer.base import TransferError
from splitserve.kv_transfer.stage_slices import plan
from splitserve.types import ConfigError, Request, SamplingParams
from splitserve.worker import rank_kv
from splitserve.worker.decode.handoff import HandoffState
from splitserve.worker.decode.worker import DecodeWorker
from splitserve.worker.prefill.worker import PrefillWorker
from tests.fakes.stages import corrupt_last_stage, corrupt_layer
from tests.greedy_parity import assert_greedy_equal, hf_greedy, make_prompts
from tests.unit.test_decode_lifecycle import Local, collect
from tests.unit.test_engine_parity import MAX_NEW, reference  # noqa: F401  (a fixture)

SP = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
PICK = (5, 8, 11, 13)  # prompts of 17, 48, 97 and 23 tokens
KINDS = ("tcp", "shm")


def _config(tiny_checkpoint, pp: int = 1, **kw) -> EngineConfig:
    return EngineConfig(model=str(tiny_checkpoint("llama")), num_kv_blocks=64, kv_shared_memory=True,
                        pipeline_parallel_size=pp, **kw)


@pytest.fixture(scope="module", params=["pp_pre->dec", "pre->pp_dec"])
def pair(request, tiny_checkpoint):
    """(prefill worker, decode worker, name): a PP2 prefill (chunked: 32 tokens a step) and a TP1
    decode worker, or a TP1 prefill whose readers are PP2 and a PP2 decode worker. One
    pipeline-parallel engine per process at a time: torch.distributed has one default group."""
    made = []
    try:
        if request.param == "pp_pre->dec":
            made.append(PrefillWorker(_config(tiny_checkpoint, 2, max_num_batched_tokens=32), list(KINDS)))
            made.append(DecodeWorker(_config(tiny_checkpoint), list(KINDS)))
        else:
            made.append(PrefillWorker(_config(tiny_checkpoint), list(KINDS), reader_stages=2))
            made.append(DecodeWorker(_config(tiny_checkpoint, 2), list(KINDS)))
        yield (*made, request.param)
    finally:
        for w in made:
            w.close()


async def no_leaks(pre, dec) -> None:
    """Nothing held: no block in use, no lease, no grant on any stage's transports, no handoff."""
    await asyncio.sleep(0.05)  # fire-and-forget acks settle
    p, d = await pre.check_invariants(), await dec.check_invariants()
    assert (p["in_use"], p["leases"], p["grants"], pre.engine.detached_requests()) == (0, 0, 0, []), p
    assert (d["in_use"], d["handoffs"], dec.loop.num_active) == (0, 0, 0), d
    if pre.engine.pp is not None:
        assert await pre.loop.call(on_all_stages, pre.engine, rank_kv.granted) == [0, 0]


async def pd(pre, dec, rid: str, prompt, kind: str, outputs=()) -> tuple[list[int], object]:
    """Prefill on `pre`, land and decode on `dec`: the tokens after `outputs`, and the handoff."""
    req = Request(rid, list(prompt), SP)
    r = await pre.prefill(req, kind, tuple(outputs))
    assert r.handoff is not None and r.handoff.stages
    chunks = await collect(dec.generate(req, r.handoff, Local(pre), tuple(outputs)))
    return [r.handoff.first_token] + [t for c in chunks for t in c.token_ids], r.handoff


@pytest.mark.parametrize("kind", KINDS)
def test_handoff_by_stage_gives_the_reference_plain_and_with_prefix_hits(pair, reference, kind):
    pre, dec, name = pair
    hf, prompts, refs = reference("llama")
    before, failures = dict(dec.handoff_outcomes), dict(dec.transfer_failures)

    async def go():
        for rnd in range(2):  # the second pass hits the prefill side's prefix cache
            for i in PICK:
                got, h = await pd(pre, dec, f"{name}-{kind}-{rnd}-{i}", prompts[i], kind)
                assert_greedy_equal(hf, prompts[i], got, refs[i])
                assert [s.layers for s in h.stages] == ([range(0, 1), range(1, 2)] if pre.engine.pp else [range(0, 2)])
                if rnd == 1 and len(prompts[i]) > 16:
                    assert h.num_cached_tokens > 0
        await no_leaks(pre, dec)
        # the pulled blocks are the decode side's prefix cache: computed there, the prompt hits it
        i = PICK[2]
        hits = dec.engine.stats().prefix_hit_tokens_total
        chunks = await collect(dec.generate(Request(f"{name}-{kind}-here", list(prompts[i]), SP)))
        assert_greedy_equal(hf, prompts[i], [t for c in chunks for t in c.token_ids], refs[i])
        assert dec.engine.stats().prefix_hit_tokens_total > hits
        await no_leaks(pre, dec)

    asyncio.run(go())
    assert dec.handoff_outcomes[HandoffState.READY] == before.get(HandoffState.READY, 0) + 2 * len(PICK)
    assert dec.transfer_failures == failures


def test_a_migrated_request_through_stages_continues_exactly(pair, reference):
    """The context (prompt + 3 delivered tokens) prefilled by stage, handed over, continued."""
    pre, dec, name = pair
    hf, prompts, refs = reference("llama")
    i = PICK[1]

    async def go():
        got, _ = await pd(pre, dec, f"migrated-{name}", prompts[i], "tcp", refs[i][:3])
        await no_leaks(pre, dec)
        return got

    assert_greedy_equal(hf, prompts[i], list(refs[i][:3]) + asyncio.run(go()), refs[i])


def test_a_stage_whose_layer_changed_after_its_checksum_is_recomputed(pair, reference):
    """Stage 1's layer of the handoff's first block changes after the checksums were taken (on
    the PP prefill's stage 1, or the TP1 prefill's one cache): the pull catches it, the decode
    worker recomputes, the tokens are the reference's, nothing is held."""
    pre, dec, name = pair
    hf, prompts, refs = reference("llama")
    prompt = list(range(300, 340))  # its own blocks: no other test's prefix is corrupted
    recomputed = dec.handoff_outcomes[HandoffState.RECOMPUTE]

    async def go():
        req = Request(f"corrupt-{name}", prompt, SP)
        r = await pre.prefill(req, "tcp")
        if pre.engine.pp is not None:
            changed = await pre.loop.call(on_all_stages, pre.engine, corrupt_last_stage, r.handoff.block_ids[0])
            assert changed == [False, True]
        else:
            await pre.loop.call(corrupt_layer, pre.engine, 1, r.handoff.block_ids[0])
        chunks = await collect(dec.generate(req, r.handoff, Local(pre)))
        await no_leaks(pre, dec)
        return [r.handoff.first_token] + [t for c in chunks for t in c.token_ids]

    assert_greedy_equal(hf, prompt, asyncio.run(go()), hf_greedy(hf, [prompt], MAX_NEW)[0])
    assert dec.handoff_outcomes[HandoffState.RECOMPUTE] == recomputed + 1
    assert dec.transfer_failures.get("corrupt", 0) >= 1


@pytest.mark.parametrize("pair", ["pre->pp_dec"], indirect=True)
def test_a_pp_decode_worker_refuses_a_handoff_not_by_stage(pair, reference):
    """A plain handoff (one rank to one rank) cannot be split by stage: recomputed, exactly."""
    src, dec, name = pair
    hf, prompts, refs = reference("llama")
    i = PICK[0]
    before = dict(dec.transfer_failures)

    async def go():
        src.reader_stages = 1  # as if told its readers are single: it hands off one rank to one rank
        try:
            req = Request("plain-into-stages", list(prompts[i]), SP)
            r = await src.prefill(req, "tcp")
            assert not r.handoff.stages
            chunks = await collect(dec.generate(req, r.handoff, Local(src)))
        finally:
            src.reader_stages = 2
        await no_leaks(src, dec)
        return [r.handoff.first_token] + [t for c in chunks for t in c.token_ids]

    assert_greedy_equal(hf, prompts[i], asyncio.run(go()), refs[i])
    assert dec.transfer_failures.get("header", 0) == before.get("header", 0) + 1


def test_the_layer_plan_covers_each_layer_once():
    assert [(s.src_stage, s.src_layers, s.dst_layers) for s in plan([range(0, 3), range(3, 6)], range(2, 5))] == \
        [(0, range(2, 3), range(0, 1)), (1, range(0, 2), range(1, 3))]
    with pytest.raises(TransferError, match="header"):
        plan([range(0, 2)], range(0, 3))
    with pytest.raises(TransferError, match="header"):
        plan([range(0, 2), range(1, 3)], range(0, 3))


def test_a_pp_prefill_worker_of_tensor_parallel_stages_is_refused(tiny_checkpoint):
    cfg = EngineConfig(model=str(tiny_checkpoint("llama")), num_kv_blocks=8, pipeline_parallel_size=2,
                       tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="PP x TP"):
        PrefillWorker(cfg, ["tcp"])


@pytest.mark.parametrize("pair", ["pp_pre->dec"], indirect=True)
def test_pp_prefill_preempted_under_held_leases_hands_off_exactly(pair, reference):
    """Four handoffs left unlanded hold 54 of the PP prefill worker's 64 blocks under their
    leases. Two more prompts are prefilled, 32 tokens a step: the short one fits, the long one
    (13 blocks) cannot grow past what is left and is preempted — until the four are landed and
    their blocks freed, when it is computed again and handed off. All six, landed, give
    Hugging Face's tokens; nothing is held afterwards."""
    pre, dec, _ = pair
    hf = reference("llama")[0]
    prompts = make_prompts(seed=99, lengths=(200, 200, 200, 200, 50, 200))  # 0 and 3: 40 shared tokens first
    refs = hf_greedy(hf, prompts, MAX_NEW)
    req = [Request(f"squeezed-{i}", list(p), SP) for i, p in enumerate(prompts)]

    async def land(i, r):
        chunks = await collect(dec.generate(req[i], r.handoff, Local(pre)))
        return [r.handoff.first_token] + [t for c in chunks for t in c.token_ids]

    async def preemptions() -> int:
        return await pre.loop.call(lambda: pre.engine.stats().num_preempted_total)

    async def go():
        before = await preemptions()
        held = [await pre.prefill(req[i], "tcp") for i in range(4)]
        squeezed = [asyncio.ensure_future(pre.prefill(req[i], "tcp")) for i in (4, 5)]
        for _ in range(3000):  # the long one runs out of blocks as it grows (bounded: no hang)
            if await preemptions() > before:
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the pool was meant to be too small for the long prompt")
        out = [await land(i, r) for i, r in enumerate(held)]  # their blocks free: the long one goes on
        out += [await land(i, await t) for i, t in zip((4, 5), squeezed)]
        await no_leaks(pre, dec)
        return out

    for p, got, want in zip(prompts, asyncio.run(go()), refs):
        assert_greedy_equal(hf, p, got, want)


@pytest.mark.parametrize("pair", ["pp_pre->dec"], indirect=True)
def test_a_lapsed_lease_ends_on_every_stage_and_its_late_reader_recomputes(pair, reference):
    """A handoff nobody reads within its lease: both stages let its token read its blocks, then
    the reaper ends the lease — every stage forgets the token, the blocks are free. A reader
    that comes late is refused by the source stages and computes the prompt itself, exactly."""
    pre, dec, _ = pair
    hf, prompts, refs = reference("llama")
    i = PICK[1]
    ttl, pre.leases.ttl_s = pre.leases.ttl_s, 0.3

    async def go():
        req = Request("lapsed", list(prompts[i]), SP)
        r = await pre.prefill(req, "tcp")
        assert await pre.loop.call(on_all_stages, pre.engine, rank_kv.granted) == [0, 1]  # stage 1's own server
        for _ in range(500):  # the reaper runs every ttl / 4 (bounded: no hang)
            if not pre.leases.request_ids():
                break
            await asyncio.sleep(0.01)
        assert await pre.loop.call(on_all_stages, pre.engine, rank_kv.granted) == [0, 0]
        chunks = await collect(dec.generate(req, r.handoff, Local(pre)))
        await no_leaks(pre, dec)
        return [r.handoff.first_token] + [t for c in chunks for t in c.token_ids]

    try:
        recomputed = dec.handoff_outcomes[HandoffState.RECOMPUTE]
        assert_greedy_equal(hf, prompts[i], asyncio.run(go()), refs[i])
        assert dec.handoff_outcomes[HandoffState.RECOMPUTE] == recomputed + 1
    finally:
        pre.leases.ttl_s = ttl
