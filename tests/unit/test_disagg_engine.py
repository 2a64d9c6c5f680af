"""The engine's half of disaggregation, without Ray or a transport: a prefill engine hands its
blocks over, a decode engine takes the KV in (copied here directly) and continues. The output
must equal the single-engine path, also when the pull fails and the decode side recomputes."""

import pytest
import torch

from splitserve.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.kv_cache import OutOfBlocks
from splitserve.types import Request, SamplingParams


def engine(path, **kw):
    return Engine(EngineConfig(model=str(path), num_kv_blocks=kw.pop("num_kv_blocks", 128), **kw))


def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 384, (n,), generator=g).tolist() for n in (1, 15, 16, 17, 40, 90)]


def run(eng):
    out = {}
    while eng.has_unfinished():
        for c in eng.step():
            out.setdefault(c.request_id, []).extend(c.token_ids)
    return out


def assert_holds_nothing(*engines):
    for e in engines:
        e.check_invariants()
        assert e.pool.num_in_use == 0


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def expected(path):
    eng = engine(path)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for i, p in enumerate(prompts()):
        eng.add_request(Request(str(i), p, sp))
    return run(eng)


def prefill_all(pre, sp):
    firsts = {}
    for i, p in enumerate(prompts()):
        pre.add_request(Request(str(i), p, sp), prefill_only=True)
    while pre.has_unfinished():
        for c in pre.step():
            assert c.kv_blocks is not None and c.finish_reason is None
            firsts[c.request_id] = (c.token_ids[0], c.kv_blocks)
    return firsts


@pytest.mark.parametrize("pull_ok", [True, False])
def test_handoff_continues_exactly(path, expected, pull_ok):
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    pre, dec = engine(path), engine(path, num_kv_blocks=64)
    firsts = prefill_all(pre, sp)
    assert pre.pool.num_in_use > 0  # pinned for the handoff
    pre.check_invariants()
    for i, p in enumerate(prompts()):
        rid = str(i)
        first, src = firsts[rid]
        dst = dec.add_pulled(Request(rid, p, sp), first)
        assert len(dst) == len(src)
        if pull_ok:
            dec.kv.storage[:, :, dst] = pre.kv.storage[:, :, list(src)]
            dec.kv_ready(rid)
        else:
            dec.kv_failed(rid)
        assert pre.release_detached(rid)
    got = run(dec)
    for rid, toks in expected.items():
        assert [firsts[rid][0]] + got[rid] == toks
    assert_holds_nothing(pre, dec)


def test_abort_while_pulling_and_while_pinned(path):
    sp = SamplingParams(temperature=0, max_tokens=5)
    pre, dec = engine(path), engine(path)
    firsts = prefill_all(pre, sp)
    dec.add_pulled(Request("0", prompts()[0], sp), firsts["0"][0])
    dec.abort("0")
    for rid in firsts:
        pre.abort(rid)  # an abort also drops a pinned handoff
    assert_holds_nothing(pre, dec)


def test_pull_without_room_raises_and_leaks_nothing(path):
    dec = engine(path, num_kv_blocks=8)
    sp = SamplingParams(temperature=0, max_tokens=4)
    dec.add_pulled(Request("a", [5] * 100, sp), 7)  # 7 blocks
    with pytest.raises(OutOfBlocks):
        dec.add_pulled(Request("b", [5] * 40, sp), 7)
    dec.kv_failed("a")
    run(dec)
    dec.check_invariants()
    assert dec.pool.num_in_use == 0


def test_a_streamed_prefill_reports_its_blocks_as_they_are_computed(path, expected):
    """stream_kv with a 16-token budget, so a 90-token prompt takes six steps: the engine
    reports growing prefixes of the prompt's blocks, each as its step completes it and none the
    last step completes (the final chunk hands those over); a block, once reported, never
    changes; a decode engine that took the reported blocks early (into blocks it reserved) and
    the rest at the end continues exactly. A second request with the same prompt reports its
    cached blocks when it is first scheduled, before any of its compute."""
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    pre, dec = engine(path, max_num_batched_tokens=16), engine(path, num_kv_blocks=64)
    prompt = prompts()[5]
    seen: list[tuple[int, object]] = []  # (step it came in, progress)
    snaps = {}

    def sink(p):
        seen.append((pre._steps, p))
        for b in p.block_ids:
            snaps.setdefault(b, pre.kv.storage[:, :, b].clone())

    pre.kv_progress = sink
    pre.add_request(Request("5", prompt, sp), prefill_only=True, stream_kv=True)
    dst = list(dec.reserve_pulled(Request("5", prompt, sp)).blocks)
    first = blocks = None
    while pre.has_unfinished():
        for c in pre.step():
            first, blocks = c.token_ids[0], c.kv_blocks
    reported = [p.block_ids for _, p in seen if not p.computing]  # (layer by layer: test_layer_progress...)
    assert [len(b) for b in reported] == [1, 2, 3, 4, 5]  # 90 tokens: 5 full blocks, one per 16-token step
    assert all(b == blocks[:len(b)] for b in reported) and len(blocks) == 6
    for b, before in snaps.items():
        assert torch.equal(pre.kv.storage[:, :, b], before)  # reported, then never rewritten
    dec.kv.storage[:, :, dst[:5]] = pre.kv.storage[:, :, list(reported[-1])]  # what streamed
    dec.kv.storage[:, :, dst[5:]] = pre.kv.storage[:, :, list(blocks[5:])]  # the rest, at the end
    assert dec.add_pulled(Request("5", prompt, sp), first) == dst
    dec.kv_ready("5")
    assert [first] + run(dec)["5"] == expected["5"]
    assert pre.release_detached("5")

    seen.clear()
    step = pre._steps
    pre.add_request(Request("again", prompt, sp), prefill_only=True, stream_kv=True)
    pre.step()
    assert seen and seen[0][0] == step and len(seen[0][1].block_ids) == 5  # cached: before its compute
    pre.abort("again")
    assert_holds_nothing(pre, dec)


def test_a_streamed_prefill_reports_each_steps_blocks_layer_by_layer(path):
    """During each step's forward, after every layer group (the tiny model's 2 layers: each
    layer), the blocks the step completes — the last step: up to the prompt's end — are
    reported with how many layers are done: those layers hold their final KV already, the
    later ones are not written yet (a fresh cache is zeros)."""
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    pre = engine(path, max_num_batched_tokens=16)
    prompt = prompts()[5]  # 90 tokens: six steps, the last completes blocks 5 (partly filled)
    seen = []

    def sink(p):
        if p.computing:
            seen.append((pre._steps, p.layers, p.computing, pre.kv.storage[:, :, list(p.computing)].clone()))

    pre.kv_progress = sink
    pre.add_request(Request("layers", prompt, sp), prefill_only=True, stream_kv=True)
    blocks = None
    while pre.has_unfinished():
        for c in pre.step():
            blocks = c.kv_blocks
    assert [(step, k) for step, k, _, _ in seen] == [(s, k) for s in range(6) for k in (1, 2)]
    assert [b for _, k, b, _ in seen if k == 1] == [(blocks[i],) for i in range(6)]  # one block a step
    for _, k, b, snap in seen:
        final = pre.kv.storage[:, :, list(b)]
        assert torch.equal(snap[:k], final[:k])  # done layers: as they stay
        if k < 2:  # later ones: not written yet
            assert not snap[k:].any() and final[k:].any()
    pre.release_detached("layers")
    assert_holds_nothing(pre)


def test_reserved_blocks_are_freed_by_an_abort(path):
    dec = engine(path, num_kv_blocks=16)
    sp = SamplingParams(temperature=0, max_tokens=4)
    assert len(dec.reserve_pulled(Request("a", [5] * 40, sp)).blocks) == 3
    assert not dec.holds_nothing() and dec.pool.num_in_use == 3
    dec.check_invariants()
    dec.abort("a")
    assert dec.holds_nothing() and dec.pool.num_in_use == 0
