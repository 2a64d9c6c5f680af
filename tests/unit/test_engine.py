"""Engine behaviour beyond parity: aborts at any point, priorities, stop rules, bad input,
seeds, logprobs, stop strings and the vLLM-shaped offline API. Every test ends drained."""

import dataclasses

import pytest

from tests.engine_checks import assert_engine_drained
import torch
import torch.nn.functional as F

from splitserve import LLM, SamplingParams
from splitserve.types import ConfigError, FinishReason, Priority, Request


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(str(tiny_checkpoint("llama")), num_kv_blocks=64, max_num_batched_tokens=32)


@pytest.fixture(autouse=True)
def drained_after(llm):
    yield
    assert_engine_drained(llm.engine)


def prompt(n, seed=0):
    return torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_all(eng):
    chunks = []
    while eng.has_unfinished():
        chunks += eng.step()
    return chunks


@pytest.mark.parametrize("abort_after_steps", [0, 1, 2, 5])
def test_abort_at_any_point_leaks_nothing(llm, abort_after_steps):
    eng = llm.engine
    # 100-token prompt with a 32-token budget: steps 1-3 are prefill chunks, then decode.
    eng.add_request(Request("victim", prompt(100), SamplingParams(temperature=0, max_tokens=50)))
    eng.add_request(Request("other", prompt(20, 1), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)))
    for _ in range(abort_after_steps):
        eng.step()
    eng.abort("victim")
    eng.abort("no-such-request")  # unknown ids are ignored
    chunks = run_all(eng)
    assert not [c for c in chunks if c.request_id == "victim"], "no chunk after an abort"
    other = [c for c in chunks if c.request_id == "other"]
    assert other and other[-1].finish_reason is FinishReason.LENGTH


def test_critical_request_preempts_sheddable(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("llama")), num_kv_blocks=12, max_num_batched_tokens=256)
    eng = llm.engine
    for i in range(3):
        eng.add_request(Request(f"s{i}", prompt(60, i), SamplingParams(temperature=0, max_tokens=10),
                                priority=Priority.SHEDDABLE))
    eng.step()  # the three sheddable prompts take 12 blocks: the pool is full
    eng.add_request(Request("c", prompt(40, 9), SamplingParams(temperature=0, max_tokens=4),
                            priority=Priority.CRITICAL))
    order = [c.request_id for c in run_all(eng) if c.finished]
    assert order[0] == "c", f"the critical request should finish first, got {order}"
    assert eng.stats().num_preempted_total >= 1
    assert sorted(order) == ["c", "s0", "s1", "s2"]  # nobody lost
    eng.check_invariants()


def test_stop_rules(llm):
    eng = llm.engine
    p = prompt(10, 3)
    base = llm.generate([p], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    assert len(base.token_ids) == 12 and base.finish_reason == "length"
    stop_tok = base.token_ids[4]
    first = base.token_ids.index(stop_tok)
    o = llm.generate([p], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_tok]))[0].outputs[0]
    assert o.token_ids == base.token_ids[: first + 1] and o.finish_reason == "stop" and o.stop_reason == stop_tok
    o = llm.generate([p], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_tok],
                                         min_tokens=first + 2))[0].outputs[0]
    assert stop_tok not in o.token_ids[: first + 2]
    assert eng.stats().num_running == 0


def test_eos_stops_and_ignore_eos_continues(tiny_checkpoint, tmp_path):
    import json
    import shutil

    src = tiny_checkpoint("qwen2")
    p = prompt(8, 4)
    base = LLM(str(src), num_kv_blocks=64).generate(
        [p], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].outputs[0]
    # A copy of the checkpoint whose generation config names one of those tokens as EOS.
    eos = base.token_ids[3]
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    gen = json.loads((dst / "generation_config.json").read_text())
    (dst / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [eos]}))
    llm = LLM(str(dst), num_kv_blocks=64)
    o = llm.generate([p], SamplingParams(temperature=0, max_tokens=10))[0].outputs[0]
    k = base.token_ids.index(eos)
    assert o.token_ids == base.token_ids[: k + 1] and o.finish_reason == "stop" and o.stop_reason == eos
    o = llm.generate([p], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].outputs[0]
    assert o.token_ids == base.token_ids


@pytest.mark.parametrize("bad", [
    dict(prompt_token_ids=[]),
    dict(prompt_token_ids=[5, 384]),
    dict(prompt_token_ids=[5, -1]),
    dict(prompt_token_ids=[1] * 1024),
])
def test_bad_requests_are_rejected_cleanly(llm, bad):
    with pytest.raises(ConfigError):
        llm.engine.add_request(Request("bad", **bad))


def test_request_that_can_never_fit_is_rejected(tiny_checkpoint):
    small = LLM(str(tiny_checkpoint("llama")), num_kv_blocks=8)
    with pytest.raises(ConfigError, match="KV blocks"):
        small.engine.add_request(Request("huge", prompt(100), SamplingParams(max_tokens=100)))
    small.engine.check_invariants()


def test_duplicate_request_id(llm):
    llm.engine.add_request(Request("dup", prompt(5), SamplingParams(max_tokens=2)))
    with pytest.raises(ConfigError):
        llm.engine.add_request(Request("dup", prompt(5), SamplingParams(max_tokens=2)))
    run_all(llm.engine)


def test_seed_reproducible_whatever_the_batch(llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12)
    alone = llm.generate([prompt(9, 5)], sp)[0].outputs[0].token_ids
    crowd = llm.generate([prompt(30, 6), prompt(9, 5), prompt(50, 7)],
                         [SamplingParams(temperature=1.0, max_tokens=20), sp, SamplingParams(temperature=0.7)])
    assert crowd[1].outputs[0].token_ids == alone
    other = llm.generate([prompt(9, 5)], SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=12))
    assert other[0].outputs[0].token_ids != alone


def test_logprobs_match_reference(llm, tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("llama"), dtype=torch.float32).eval()
    p = prompt(12, 8)
    o = llm.generate([p], SamplingParams(temperature=0, max_tokens=4, logprobs=3))[0].outputs[0]
    assert len(o.logprobs) == 4
    with torch.no_grad():
        ref = F.log_softmax(hf(torch.tensor([p + list(o.token_ids)])).logits[0].float(), -1)
    for i, lp in enumerate(o.logprobs):
        row = ref[len(p) - 1 + i]
        assert lp.token_id == o.token_ids[i]
        assert lp.logprob == pytest.approx(float(row[lp.token_id]), abs=1e-4)
        assert lp.rank == 1  # greedy picks the best
        top_ids = row.topk(3).indices.tolist()
        assert [t for t, _ in lp.top] == top_ids
    assert o.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in o.logprobs))


def test_stop_string_cuts_text(llm):
    p = prompt(10, 10)
    base = llm.generate([p], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0]
    text = base.text
    assert len(text) > 6
    stop = text[3:6]
    at = text.find(stop)
    o = llm.generate([p], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert o.text == text[:at] and o.finish_reason == "stop" and o.stop_reason == stop
    o = llm.generate([p], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop],
                                         include_stop_str_in_output=True))[0].outputs[0]
    assert o.text == text[: at + len(stop)]


def test_text_equals_full_decode(llm):
    outs = llm.generate([prompt(7, s) for s in range(4)], SamplingParams(temperature=0.8, seed=3, max_tokens=24))
    for o in outs:
        assert o.outputs[0].text == llm.tokenizer.decode(o.outputs[0].token_ids)


def test_offline_api_shapes(llm):
    outs = llm.generate(["hello world", "Paris is"], SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=5))
    assert len(outs) == 2 and all(len(o.outputs) == 2 for o in outs)
    assert outs[0].prompt == "hello world" and outs[0].prompt_token_ids == tuple(llm.tokenizer.encode("hello world"))
    assert [c.index for c in outs[0].outputs] == [0, 1]
    chat = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=3))
    assert chat[0].prompt.endswith("<|assistant|>")
    assert len(chat[0].outputs[0].token_ids) == 3


def test_cache_salt_keeps_tenants_apart(llm):
    eng = llm.engine
    p = prompt(40, 11)
    sp = SamplingParams(temperature=0, max_tokens=2)
    for rid, salt in (("a1", "tenant-a"), ("a2", "tenant-a"), ("b1", "tenant-b")):
        eng.add_request(Request(rid, p, sp, cache_salt=salt))
        cached = [c.num_cached_tokens for c in run_all(eng) if c.request_id == rid][0]
        assert cached == (32 if rid == "a2" else 0), (rid, cached)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_and_agrees_where_decisive(tiny_checkpoint, dtype):
    """Half precision changes low bits, so only compare where fp32's choice is decisive."""
    from transformers import AutoModelForCausalLM

    path = str(tiny_checkpoint("qwen3"))
    prompts = [prompt(n, n) for n in (5, 20, 33, 60, 7, 12, 45, 70)]
    half = LLM(path, dtype=dtype, num_kv_blocks=64, max_num_batched_tokens=32)
    assert half.engine.kv.storage.dtype == getattr(torch, dtype)
    outs = half.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    decisive = 0
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            logits = hf(torch.tensor([p])).logits[0, -1]
        top = logits.topk(2)
        if float(top.values[0] - top.values[1]) > 0.2:  # logits ~N(0, 2.4): half-precision error ~0.05
            decisive += 1
            assert o.outputs[0].token_ids[0] == int(top.indices[0])
    assert decisive >= 2, "the test needs decisive cases to mean anything"
    half.engine.check_invariants()
    assert half.engine.pool.num_in_use == 0


def test_the_ingress_hashes_reach_the_engine_and_its_kv_events(tiny_checkpoint, monkeypatch):
    """The hashes a router computes to place a request (Directory.route_request) are the ones the
    engine caches the prompt under and announces in its KV events: carried in the Request, not
    computed again for the prompt (only the generated tokens' blocks are hashed on the engine)."""
    from splitserve.router.directory import Directory
    from splitserve.engine import sequence
    from splitserve.router import make_router
    from splitserve.types import BlockStored, PromptHashes

    llm = LLM(str(tiny_checkpoint("llama")), num_kv_blocks=64)
    eng = llm.engine
    bs = eng.config.block_size
    ids = prompt(5 * bs + 3, seed=7)
    route = Directory(None, make_router(), block_size=bs).route_request(Request("r", ids, cache_salt="t"))
    hashed = []
    real = sequence.block_hashes
    monkeypatch.setattr(sequence, "block_hashes", lambda t, *a, **k: hashed.append(len(t)) or real(t, *a, **k))
    eng.drain_kv_events()
    req = Request("r", ids, SamplingParams(temperature=0, max_tokens=bs, ignore_eos=True), cache_salt="t",
                  prompt_hashes=PromptHashes(bs, route.block_hashes))
    eng.add_request(req)
    outputs = [t for c in run_all(eng) for t in c.token_ids]
    stored = [h for ev in eng.drain_kv_events() if isinstance(ev, BlockStored) for h in ev.block_hashes]
    assert len(route.block_hashes) == 5 and stored[:5] == list(route.block_hashes)
    assert len(stored) == 6 and stored == real(ids + outputs, bs, "t")[:6]  # + the first generated block
    assert hashed and min(hashed) > len(ids), "the prompt's blocks were hashed again on the engine"
    # hashes that stop short (KVIndex.routable_hashes): the engine continues the same chain
    eng.pool.reset_prefix_cache()
    eng.drain_kv_events()
    eng.add_request(dataclasses.replace(req, request_id="r2", prompt_hashes=PromptHashes(bs, route.block_hashes[:2])))
    run_all(eng)
    stored = [h for ev in eng.drain_kv_events() if isinstance(ev, BlockStored) for h in ev.block_hashes]
    assert stored[:5] == list(route.block_hashes)
    with pytest.raises(ConfigError, match="prompt hashes"):
        Request("x", ids, prompt_hashes=PromptHashes(bs, route.block_hashes + route.block_hashes[:1]))
