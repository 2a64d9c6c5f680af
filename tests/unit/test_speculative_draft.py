"""Speculative method `draft` (engine/speculative/draft.py): a draft head — an EAGLE head
directory, or DeepSeek-V3's multi-token-prediction layer — whose KV is one more layer of the
paged cache. Its forward against a reference built from transformers' own modules; greedy
output exactly the plain engine's and Hugging Face's, with proposals both accepted and rejected
(through chunked prefill, prefix hits, preemption), and so under tensor parallelism (two rank
processes, each running its shard of the head; every rank's proposals the one-process head's); a
PD handoff carries its KV, between TP groups of different sizes too; a seeded sampled request is
reproducible; and the refusals, by name."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from draft_heads import RefEagle, RefMTP, agree, predictable
from greedy_parity import assert_greedy_equal, drained, hf_greedy, make_prompts

from splitserve import LLM, SamplingParams
from splitserve.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.kv_transfer.base import TransferError
from splitserve.kv_transfer.regions import check_transfer
from splitserve.types import ConfigError, Request

MAX_NEW = 24
QUIET = 0.003  # the target's layers scaled by this: mostly a bigram model (draft_heads.predictable)


@pytest.fixture(scope="module")
def heads(tiny_checkpoint, tmp_path_factory):
    """kind -> (model dir, speculative config, hf target) for a constructed head that agrees
    with the target often ("eagle" on Llama, "mtp" on DeepSeek-V3), and "*_random" for a head of
    random weights on the same target."""
    from transformers import AutoModelForCausalLM

    out = {}
    for kind, shape, ref_cls in (("eagle", "llama", RefEagle), ("mtp", "deepseek_v3", RefMTP)):
        root = tmp_path_factory.mktemp(kind)
        target = predictable(tiny_checkpoint(shape), root / "target", QUIET)
        hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
        for name, make in ((kind, lambda: agree(ref_cls(hf), hf)), (f"{kind}_random", lambda: ref_cls(hf))):
            torch.manual_seed(1)
            ref = make()
            if kind == "eagle":
                path, spec = target, {"method": "draft", "k": 3, "draft_path": str(ref.save(root / name))}
            else:
                path, spec = ref.save_into(target, root / name), {"method": "draft", "k": 3}
            out[name] = (str(path), spec, hf, ref)
    return out


@pytest.fixture(scope="module")
def refs(heads):
    """kind -> (prompts, HF greedy continuations); fewer for the MoE target (transformers' MoE
    generation is the slow part)."""
    cache = {}

    def get(kind):
        if kind not in cache:
            prompts = make_prompts(seed=7)[:16 if kind == "eagle" else 6]
            cache[kind] = (prompts, hf_greedy(heads[kind][2], prompts, MAX_NEW))
        return cache[kind]

    return get


def greedy(llm, prompts):
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    return [list(o.outputs[0].token_ids) for o in outs]


def proposals_at_first_token(eng, prompt, k: int, max_tokens: int) -> list[int]:
    """The head's k proposals once `prompt` has its first token; the engine checked and closed."""
    eng.add_request(Request("r", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens)))
    while not eng.step():
        pass
    proposals = eng.draft.propose_batch([(eng.scheduler.running[0], k)])[0]
    eng.abort("r")
    eng.check_invariants()
    eng.close()
    return proposals


# -- the head's forward against transformers' modules -----------------------------------------------

@pytest.mark.parametrize("kind", ["eagle_random", "mtp_random"])
def test_head_forward_and_chain_match_a_transformers_reference(heads, kind):
    """Per-position draft logits over a prompt prefilled in chunks (the update's positions: the
    target's hidden state at i, token i+1 — the sampled one at the end), then the k-step chain's
    proposals, against the same head built from transformers' modules, run without cache."""
    path, spec, hf, ref = heads[kind]
    eng = Engine(EngineConfig(path, num_kv_blocks=64, max_num_batched_tokens=16, speculative=spec))
    outs = []
    forward = eng.draft.head.forward
    eng.draft.head.forward = lambda *a: outs.append(forward(*a)) or outs[-1]
    prompt = make_prompts(seed=3, lengths=(37,))[0]
    eng.add_request(Request("r", prompt, SamplingParams(temperature=0.0, max_tokens=8)))
    first = None
    while first is None:
        chunks = eng.step()
        first = chunks[0].token_ids[0] if chunks else None
    assert len(outs) == -(-len(prompt) // 16) > 1  # one update per chunk of 16
    seq = eng.scheduler.running[0]
    with torch.inference_mode():
        ours = eng.draft.head.logits(torch.cat(outs))
    proposals = eng.draft.propose_batch([(seq, 4)])[0]
    ids = torch.tensor([prompt + [first]])
    with torch.no_grad():
        h = hf.model(ids).last_hidden_state
        feats, toks = h[:, :-1], ids[:, 1:]
        want = ref.logits(ref(toks, feats))[0]
        chain = [int(want[-1].argmax())]
        out = ref(toks, feats)
        for _ in range(3):  # the chain: the head's own output and guess at the next position
            feats = torch.cat((feats, out[:, -1:]), dim=1)
            toks = torch.cat((toks, torch.tensor([[chain[-1]]])), dim=1)
            out = ref(toks, feats)
            chain.append(int(ref.logits(out)[0, -1].argmax()))
    assert torch.allclose(ours, want, atol=1e-4, rtol=1e-4), float((ours - want).abs().max())
    assert proposals == chain
    eng.abort("r")
    eng.check_invariants()
    eng.close()


# -- greedy exactness -----------------------------------------------------------------------------

@pytest.mark.parametrize("kind,case", [("eagle", "plain"), ("eagle", "chunked_prefill"), ("eagle", "prefix_hits"),
                                       ("eagle", "preemption"), ("mtp", "plain"), ("mtp", "chunked_prefill"),
                                       ("mtp", "preemption")])
def test_greedy_with_a_draft_head_equals_plain_engine_and_hf(heads, refs, kind, case):
    path, spec, hf, _ = heads[kind]
    prompts, want = refs(kind)
    kw = {"chunked_prefill": dict(max_num_batched_tokens=24),
          "preemption": dict(num_kv_blocks=24 if kind == "eagle" else 10,  # fewer prompts for the MoE target
                             max_num_batched_tokens=64)}.get(case, {})
    plain = greedy(LLM(path, num_kv_blocks=256), prompts)
    llm = LLM(path, **{"num_kv_blocks": 256, **kw}, speculative=dict(spec, adaptive=False))
    if case == "prefix_hits":
        greedy(llm, prompts)
        hits = llm.engine.stats().prefix_hit_tokens_total
    outs = greedy(llm, prompts)
    assert outs == plain
    for p, o, r in zip(prompts, outs, want):
        assert_greedy_equal(hf, p, o, r)
    s = llm.engine.stats()
    assert s.spec_proposed_tokens_total > s.spec_accepted_tokens_total > 0
    if case == "prefix_hits":
        assert s.prefix_hit_tokens_total > hits
    if case == "preemption":
        assert s.num_preempted_total > 0, "the pool was meant to be too small for the batch"
    if case == "plain":  # a head of random weights on the same target is accepted far less
        rnd = LLM(heads[f"{kind}_random"][0], num_kv_blocks=256,
                  speculative=dict(heads[f"{kind}_random"][1], adaptive=False))
        assert greedy(rnd, prompts) == plain
        r = rnd.engine.stats()
        assert r.spec_proposed_tokens_total > 0
        rate, random_rate = (x.spec_accepted_tokens_total / x.spec_proposed_tokens_total for x in (s, r))
        print(f"{kind}: acceptance {rate:.2f}, a random head's {random_rate:.2f}")
        assert rate > random_rate + 0.2
        drained(rnd)
    drained(llm)


def test_a_grammar_request_with_a_draft_head_equals_the_plain_engine(heads):
    from splitserve.types import GrammarKind, GrammarSpec

    path, spec, _, _ = heads["eagle"]
    params = [SamplingParams(temperature=0.0, max_tokens=16, grammar=GrammarSpec(GrammarKind.REGEX, "[a-z ]{4,40}")),
              SamplingParams(temperature=0.0, max_tokens=16)]
    prompts = ["the cat sat on", "the cat sat on"]
    plain = [o.outputs[0].token_ids for o in LLM(path, num_kv_blocks=64).generate(prompts, params)]
    llm = LLM(path, num_kv_blocks=64, speculative=dict(spec, adaptive=False))
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain
    assert llm.engine.stats().spec_proposed_tokens_total > 0
    drained(llm)


# -- under tensor parallelism ---------------------------------------------------------------------

@pytest.mark.parametrize("kind,case", [("eagle", "plain"), ("eagle", "chunked_prefill_and_preemption"),
                                       ("mtp", "plain"), ("mtp", "chunked_prefill_and_preemption")])
def test_greedy_with_a_draft_head_under_tensor_parallelism_equals_one_process_and_hf(heads, refs, kind, case):
    """Two rank processes, each holding half of the head as of a target layer (query/KV heads,
    MLP or expert columns; the MTP layer's own LM head by vocab rows): the output is the plain
    one-process engine's and Hugging Face's, with proposals both accepted and rejected."""
    path, spec, hf, _ = heads[kind]
    prompts, want = refs(kind)
    kw = dict(num_kv_blocks=14 if kind == "eagle" else 10, max_num_batched_tokens=24) if case != "plain" else {}
    plain = greedy(LLM(path, num_kv_blocks=256), prompts)
    with LLM(path, **{"num_kv_blocks": 256, **kw}, tensor_parallel_size=2,
             speculative=dict(spec, adaptive=False)) as llm:
        layer = llm.engine.draft.head.layer
        assert llm.engine.tp.size == 2 and layer.tp is llm.engine.tp
        # its half of the heads, as a target layer's on this rank
        target = llm.engine.runner.model.layers[0].self_attn.o_proj
        assert layer.self_attn.o_proj.weight.shape == target.weight.shape != (target.out_features, target.out_features)
        outs = greedy(llm, prompts)
        assert outs == plain
        for p, o, r in zip(prompts, outs, want):
            assert_greedy_equal(hf, p, o, r)
        s = llm.engine.stats()
        assert s.spec_proposed_tokens_total > s.spec_accepted_tokens_total > 0
        if case != "plain":
            assert s.num_preempted_total > 0, "the pool was meant to be too small for the batch"
        drained(llm)


def own_vocab_head(heads, out):
    """The EAGLE head shipping its own embed_tokens and lm_head (copies of the target's): under
    tensor parallelism held by vocab rows and gathered, as the target's are."""
    from safetensors.torch import load_file, save_file

    path, spec, _, _ = heads["eagle"]
    shutil.copytree(spec["draft_path"], out)
    target = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        target.update(load_file(f))
    weights = load_file(out / "model.safetensors")
    weights.update({"embed_tokens.weight": target["model.embed_tokens.weight"],
                    "lm_head.weight": target["lm_head.weight"]})
    save_file(weights, out / "model.safetensors")
    return path, {**spec, "draft_path": str(out)}


@pytest.mark.parametrize("kind", ["eagle", "mtp", "eagle_own_vocab"])
def test_every_rank_runs_the_head_and_proposes_what_one_process_does(heads, kind, tmp_path):
    """Each update and chain runs on both ranks (the answers gathered from each: a follower that
    did not run the head answers nothing, and rank 0's collectives would wait for it), every
    rank computes the same tokens, and they are what the one-process head proposes."""
    path, spec = heads[kind][:2] if kind in heads else own_vocab_head(heads, tmp_path / "own")
    prompt = make_prompts(seed=3, lengths=(37,))[0]
    proposals, answers = [], []
    for tp in (1, 2):
        eng = Engine(EngineConfig(path, num_kv_blocks=64, max_num_batched_tokens=16, speculative=spec,
                                  tensor_parallel_size=tp))
        if kind == "eagle_own_vocab":  # its own rows: half of them on each rank
            assert eng.draft.head.embed_tokens.weight.shape[0] == eng.draft.head.lm_head.out_features == 384 // tp
        if tp == 2:  # a recorder around rank 0's way to the ranks
            run = eng.draft.everywhere
            eng.draft.everywhere = lambda fn, *a: answers.append((fn.__name__, run(fn, *a))) or answers[-1][1]
        else:
            assert eng.draft.everywhere is None  # one process: no rank calls
        proposals.append(proposals_at_first_token(eng, prompt, 4, max_tokens=8))
    assert len(proposals[0]) == 4 and proposals[1] == proposals[0]
    chunks = -(-len(prompt) // 16)  # one update per prefill chunk
    assert [name for name, _ in answers] == ["update_on_rank"] * chunks + ["chain_on_rank"]
    for _, per_rank in answers:
        assert len(per_rank) == 2 and per_rank[1] == per_rank[0]
    assert answers[-2][1][1] == proposals[0][:1]  # the last chunk's tail, on rank 1 too
    assert answers[-1][1][1] == [[t] for t in proposals[0][1:]]  # the chain's 3 steps, on rank 1 too


# -- across a PD handoff ---------------------------------------------------------------------------

def test_the_handoff_carries_the_draft_layer_and_decode_proposes_from_it(heads, refs):
    """A prefill engine computes the prompt's draft KV (the cache's last layer) and hands it over
    with the rest; it equals what an aggregated engine computes; the decode side's proposals
    attend over it and the output is the aggregated run's."""
    path, spec, _, _ = heads["eagle"]
    prompts, _ = refs("eagle")
    prompts = prompts[:6]
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    spec = dict(spec, adaptive=False)
    agg = Engine(EngineConfig(path, num_kv_blocks=128, speculative=spec))
    pre = Engine(EngineConfig(path, num_kv_blocks=128, speculative=spec))
    dec = Engine(EngineConfig(path, num_kv_blocks=128, speculative=spec))
    L = agg.model_config.num_layers
    assert agg.kv.storage.shape[0] == L + 1 and agg.cache_layers == L + 1
    expected, agg_draft = {}, {}
    for i, p in enumerate(prompts):
        agg.add_request(Request(str(i), p, sp))
        for c in agg.step():  # each prompt prefilled alone, as the prefill engine does below
            expected.setdefault(c.request_id, []).extend(c.token_ids)
        seq = agg._seqs[str(i)]
        full = len(p) // agg.block_size
        agg_draft[str(i)] = agg.kv.storage[L, :, seq.block_ids[:full]].clone()
    while agg.has_unfinished():
        for c in agg.step():
            expected.setdefault(c.request_id, []).extend(c.token_ids)
    firsts = {}
    for i, p in enumerate(prompts):
        pre.add_request(Request(str(i), p, sp), prefill_only=True)
        for c in pre.step():
            firsts[c.request_id] = (c.token_ids[0], c.kv_blocks)
    got = {}
    for i, p in enumerate(prompts):
        rid = str(i)
        first, src = firsts[rid]
        got[rid] = [first]
        dst = dec.add_pulled(Request(rid, p, sp), first)
        dec.kv.storage[:, :, dst] = pre.kv.storage[:, :, list(src)]
        full = len(p) // dec.block_size
        assert torch.allclose(dec.kv.storage[L, :, dst[:full]], agg_draft[rid], atol=1e-5)
        dec.kv_ready(rid)
        assert pre.release_detached(rid)
    while dec.has_unfinished():
        for c in dec.step():
            got[c.request_id].extend(c.token_ids)
    assert got == {k: [*v] for k, v in expected.items()}
    s = dec.stats()
    assert s.spec_proposed_tokens_total > s.spec_accepted_tokens_total > 0
    for e in (agg, pre, dec):
        e.check_invariants()
        assert e.pool.num_in_use == 0
        e.close()


@pytest.mark.parametrize("kind", ["eagle", "mtp"])
def test_a_handoff_between_tensor_parallel_groups_carries_the_draft_layer(heads, kind):
    """P(TP 2) -> D(TP 1) and P(TP 1) -> D(TP 2), each decode rank pulling its KV heads of every
    cache layer (the draft layer's too) from the prefill ranks that hold them, as a decode
    worker's ranks do (worker/rank_kv.py): the decode side proposes from the carried draft KV,
    accepts some, and its output is the one-process engine's."""
    from tests.unit.test_head_slices import hand_over, run_to_end

    path, spec, _, _ = heads[kind]
    prompts = make_prompts(seed=11, lengths=(1, 17, 40, 90))
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    spec = dict(spec, adaptive=False)
    # no prefix cache: each side computes every prompt's KV itself
    one, two = (Engine(EngineConfig(path, num_kv_blocks=96, tensor_parallel_size=t, kv_shared_memory=True,
                                    enable_prefix_caching=False, speculative=spec)) for t in (1, 2))
    try:
        for i, p in enumerate(prompts):
            one.add_request(Request(str(i), p, sp))
        want = run_to_end(one)
        for pre, dec in ((two, one), (one, two)):
            before = dec.stats()
            assert hand_over(pre, dec, prompts, sp) == want
            after = dec.stats()
            proposed = after.spec_proposed_tokens_total - before.spec_proposed_tokens_total
            accepted = after.spec_accepted_tokens_total - before.spec_accepted_tokens_total
            assert proposed > accepted > 0, (pre.tp.size, dec.tp.size)
        for e in (one, two):
            e.check_invariants()
            assert e.pool.num_in_use == 0
    finally:
        one.close()
        two.close()


def test_a_streamed_prefill_reports_the_draft_layer_last(heads):
    """A streamed prefill's blocks go out layer group by layer group as the forward runs; the
    draft layer is the cache's last, written after the target's: its report comes after the
    head ran (the tiny model: 2 layers + the draft's, each its own group)."""
    path, spec, _, _ = heads["eagle"]
    pre = Engine(EngineConfig(path, num_kv_blocks=64, max_num_batched_tokens=16, speculative=spec))
    seen = []

    def sink(p):
        if p.computing:
            seen.append((pre._steps, p.layers, pre.kv.storage[:, :, list(p.computing)].clone(), p.computing))

    pre.kv_progress = sink
    prompt = make_prompts(seed=3, lengths=(50,))[0][:48]  # three steps of 16, a block each
    pre.add_request(Request("s", prompt, SamplingParams(temperature=0.0, max_tokens=2)), prefill_only=True,
                    stream_kv=True)
    while pre.has_unfinished():
        pre.step()
    assert [(step, k) for step, k, _, _ in seen] == [(s, k) for s in range(3) for k in (1, 2, 3)]
    for _, k, snap, blocks in seen:
        final = pre.kv.storage[:, :, list(blocks)]
        assert torch.equal(snap[:k], final[:k])  # done layers: as they stay
        if k < 3:  # the draft layer (index 2): not written yet
            assert not snap[2:].any() and final[2:].any()
    pre.release_detached("s")
    pre.check_invariants()
    assert pre.pool.num_in_use == 0
    pre.close()


@pytest.mark.parametrize("kind", ["tcp", "shm"])
def test_a_prefill_and_a_decode_worker_hand_the_draft_layer_over_a_transport(heads, kind):
    """Real workers in this process: the handoff's checksum covers every layer, the draft
    layer's included, so the decode side proposes from exactly the bytes the prefill side made."""
    import asyncio

    from splitserve.worker.decode.handoff import HandoffState
    from splitserve.worker.decode.worker import DecodeWorker
    from splitserve.worker.prefill.worker import PrefillWorker
    from tests.unit.test_decode_lifecycle import Local, collect

    path, spec, _, _ = heads["eagle"]
    prompts = make_prompts(seed=7)[:4]
    want = greedy(LLM(path, num_kv_blocks=64), prompts)
    cfg = EngineConfig(path, num_kv_blocks=64, kv_shared_memory=kind == "shm", speculative=dict(spec, adaptive=False))
    pre, dec = PrefillWorker(cfg, [kind]), DecodeWorker(cfg, [kind])
    try:
        async def go():
            got = []
            for i, p in enumerate(prompts):
                req = Request(f"{kind}-{i}", p, SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
                r = await pre.prefill(req, kind)
                assert r.handoff.header.num_layers == pre.engine.model_config.num_layers + 1
                chunks = await collect(dec.generate(req, r.handoff, Local(pre)))
                got.append([r.handoff.first_token] + [t for c in chunks for t in c.token_ids])
            await asyncio.sleep(0.05)  # fire-and-forget acks settle
            assert (await pre.check_invariants())["in_use"] == 0 and (await dec.check_invariants())["in_use"] == 0
            return got

        assert asyncio.run(go()) == want
        assert dec.handoff_outcomes[HandoffState.READY] == len(prompts) and not dec.transfer_failures
        s = dec.engine.stats()
        assert s.spec_proposed_tokens_total > s.spec_accepted_tokens_total > 0
    finally:
        pre.close()
        dec.close()


def test_a_handoff_between_pools_of_different_speculative_configs_names_the_draft_layer(heads):
    from splitserve.worker.kv_layout import layout_of, model_fingerprint

    eng = Engine(EngineConfig(heads["eagle"][0], num_kv_blocks=8, speculative=heads["eagle"][1]))
    with_draft = layout_of(eng)
    without = dataclasses.replace(with_draft, num_layers=with_draft.num_layers - 1)
    with pytest.raises(TransferError, match="draft head's layer"):
        check_transfer(with_draft, without, [0], [0])
    # and two pools with different EAGLE heads (equal geometry) do not take each other's KV
    assert with_draft.model_fingerprint != model_fingerprint(heads["eagle"][0], with_draft.dtype)
    eng.close()


# -- sampling ------------------------------------------------------------------------------------

def test_a_seeded_sampled_request_is_reproducible(heads):
    path, spec, _, _ = heads["eagle"]
    prompts = make_prompts(seed=5)[:4]
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=MAX_NEW, seed=3)
    runs = []
    for _ in range(2):
        llm = LLM(path, num_kv_blocks=128, speculative=dict(spec, adaptive=False))
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        assert llm.engine.stats().spec_proposed_tokens_total > 0
        drained(llm)
    assert runs[0] == runs[1]


# -- refusals, by name ----------------------------------------------------------------------------

def test_an_eagle_head_shipped_as_pytorch_model_bin_loads_as_its_safetensors_twin(heads, tmp_path):
    """EAGLE's releases ship `pytorch_model.bin`, some names under `model.`: the same head saved
    that way loads the same weights and proposes the same tokens."""
    from safetensors.torch import load_file

    path, spec, _, _ = heads["eagle"]
    twin = tmp_path / "bin_head"
    twin.mkdir()
    shutil.copy(f"{spec['draft_path']}/config.json", twin)
    sd = load_file(f"{spec['draft_path']}/model.safetensors")
    torch.save({(f"model.{n}" if n.startswith("layers.") else n): t for n, t in sd.items()}, twin / "pytorch_model.bin")
    engines = [Engine(EngineConfig(path, num_kv_blocks=64, speculative={**spec, "draft_path": str(d)}))
               for d in (spec["draft_path"], twin)]
    ours, theirs = (dict(e.draft.head.named_parameters()) for e in engines)
    assert ours.keys() == theirs.keys() and len(ours) > 5
    assert all(torch.equal(ours[n], theirs[n]) for n in ours)
    prompt = make_prompts(seed=5, lengths=(20,))[0]
    proposed = []
    for e in engines:
        proposed.append(proposals_at_first_token(e, prompt, 3, max_tokens=4))
    assert len(proposed[0]) == 3 and proposed[0] == proposed[1]


def test_a_draft_head_that_is_missing_or_does_not_fit_is_refused_by_name(heads, tiny_checkpoint, tmp_path):
    llama = str(tiny_checkpoint("llama"))
    with pytest.raises(ConfigError, match="num_nextn_predict_layers is 0"):
        LLM(llama, num_kv_blocks=8, speculative={"method": "draft"})
    with pytest.raises(ConfigError, match="holds no model.layers.2"):  # the config says 1, no weights
        LLM(str(tiny_checkpoint("deepseek_v3")), num_kv_blocks=8, speculative={"method": "draft"})
    eagle_dir = heads["eagle"][1]["draft_path"]
    with pytest.raises(ConfigError, match="num_key_value_heads"):  # Qwen3's cache has one KV head of 32
        LLM(str(tiny_checkpoint("qwen3")), num_kv_blocks=8, speculative={"method": "draft", "draft_path": eagle_dir})
    with pytest.raises(ConfigError, match="caches one latent per token"):
        LLM(str(tiny_checkpoint("deepseek_v3")), num_kv_blocks=8,
            speculative={"method": "draft", "draft_path": eagle_dir})
    with pytest.raises(ConfigError, match="draft_path is for method draft"):
        EngineConfig(llama, speculative={"method": "ngram", "draft_path": eagle_dir})
    with pytest.raises(ConfigError, match="not a directory"):
        EngineConfig(llama, speculative={"method": "draft", "draft_path": str(tmp_path / "nowhere")})
    with pytest.raises(ConfigError, match="pipeline_parallel_size"):
        EngineConfig(llama, speculative={"method": "draft"}, pipeline_parallel_size=2)
    EngineConfig(llama, speculative={"method": "draft"}, tensor_parallel_size=2)  # a head runs sharded
    two = tmp_path / "two_layers"
    shutil.copytree(eagle_dir, two)
    (two / "config.json").write_text((two / "config.json").read_text().replace('"num_hidden_layers": 1',
                                                                               '"num_hidden_layers": 2'))
    with pytest.raises(ConfigError, match="an EAGLE head has one"):
        LLM(llama, num_kv_blocks=8, speculative={"method": "draft", "draft_path": str(two)})
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="holds no EAGLE head: no config.json"):
        LLM(llama, num_kv_blocks=8, speculative={"method": "draft", "draft_path": str(empty)})


def test_a_driver_refuses_a_head_that_cannot_fit_from_its_config_alone(heads, tiny_checkpoint, tmp_path):
    """`check_draft_head` (what a driver checks before Ray starts, control/launch.py
    `check_files`): the loaders' refusals that need no weights read."""
    from splitserve.config import SpeculativeConfig
    from splitserve.engine.speculative.draft import check_draft_head

    llama, eagle_dir = heads["eagle"][0], heads["eagle"][1]["draft_path"]
    check_draft_head(SpeculativeConfig("draft", draft_path=eagle_dir), llama)
    empty, unweighted = tmp_path / "empty", tmp_path / "unweighted"
    empty.mkdir()
    unweighted.mkdir()
    shutil.copy(f"{eagle_dir}/config.json", unweighted)
    for head, why in ((empty, "holds no EAGLE head: no config.json"), (unweighted, "has no weights")):
        with pytest.raises(ConfigError, match=why):
            check_draft_head(SpeculativeConfig("draft", draft_path=str(head)), llama)
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        check_draft_head(SpeculativeConfig("draft", draft_path=eagle_dir), str(tiny_checkpoint("qwen3")))
    with pytest.raises(ConfigError, match="num_nextn_predict_layers is 0"):
        check_draft_head(SpeculativeConfig("draft"), llama)
    # under tensor parallelism its heads must split (the target's 8 do over 4 ranks, its 6 not)
    six = tmp_path / "six_heads"
    shutil.copytree(eagle_dir, six)
    cfg = json.loads((six / "config.json").read_text())
    (six / "config.json").write_text(json.dumps({**cfg, "num_attention_heads": 6, "head_dim": 8}))
    check_draft_head(SpeculativeConfig("draft", draft_path=str(six)), llama, tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="six_heads: tensor_parallel_size 4 does not divide num_attention_heads 6"):
        check_draft_head(SpeculativeConfig("draft", draft_path=str(six)), llama, tensor_parallel_size=4)
