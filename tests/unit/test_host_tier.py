"""The host-memory KV tier below the device pool: blocks the device pool evicts are kept in host
memory and brought back for a later prefix instead of recomputed — with the same greedy output
as recomputing them, both tiers' invariants after every step, KV events that leave a router's
index agreeing with the worker's own listing of both tiers, and a router that prefers a device
hit to an equal host hit."""

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.config import EngineConfig
from splitserve.router import KVIndex, RouteRequest, WorkerView, make_router
from splitserve.router.kv_index import Group
from splitserve.router.policy import PrefixScorer
from splitserve.hashing import block_hashes
from splitserve.types import BlockStored, ConfigError, Request, Tier


def workload(groups=6, per_group=3, prefix=96, tail=12, seed=0):
    """`groups` shared prefixes, each asked `per_group` times, round robin over the groups: with
    6 × 96-token prefixes (36 blocks) and a 24-block device pool, a group's blocks are evicted
    before it comes round again."""
    g = torch.Generator().manual_seed(seed)
    heads = [torch.randint(3, 384, (prefix,), generator=g).tolist() for _ in range(groups)]
    return [heads[i % groups] + torch.randint(3, 384, (tail,), generator=g).tolist()
            for i in range(groups * per_group)]


def run(llm, prompts, index=None):
    eng, outs = llm.engine, []
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i, p in enumerate(prompts):  # one at a time: each request sees what the last left behind
        eng.add_request(Request(f"r{i}", p, sp))
        toks = []
        while eng.has_unfinished():
            for c in eng.step():
                toks += c.token_ids
            eng.check_invariants()
            if index is not None:
                index.apply("w", eng.drain_kv_events())
        outs.append(toks)
    return outs


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


def test_host_hits_replace_recompute_with_the_same_tokens(path):
    prompts = workload()
    plain = LLM(path, num_kv_blocks=24)
    tiered = LLM(path, num_kv_blocks=24, host_kv_blocks=64)
    assert run(tiered, prompts) == run(plain, prompts)  # promoted KV is the KV recomputing gives
    s0, s1 = plain.engine.stats(), tiered.engine.stats()
    assert s0.host_hit_tokens_total == 0 and s1.host_hit_tokens_total > 0
    assert s1.prefix_hit_tokens_total >= 2 * max(1, s0.prefix_hit_tokens_total)
    assert tiered.engine.host.saved_total > 0 and tiered.engine.host.promoted_total > 0
    pool = tiered.engine.pool
    assert pool.num_in_use == 0 and pool.num_free + pool.num_cached == pool.num_blocks


def test_a_full_host_tier_evicts_its_oldest_and_stays_consistent(path):
    llm = LLM(path, num_kv_blocks=24, host_kv_blocks=8)  # far smaller than the working set
    index = KVIndex()
    run(llm, workload(groups=8), index)
    host = llm.engine.host
    assert len(host) == 8 and host.saved_total > 8
    host.check_invariants()
    # the router's index, fed only the events, equals the worker's own listing of both tiers
    listing = KVIndex()
    listing.apply("w", llm.engine.kv_listing())
    assert index._holders.keys() == listing._holders.keys() and index._host.keys() == listing._host.keys()
    assert set(index._host.keys()) == set(host.held_hashes()) and not set(index._host.keys()) & set(index._holders.keys())


def test_config_checks():
    with pytest.raises(ConfigError, match="host_kv_blocks"):
        EngineConfig(model=".", host_kv_blocks=-1)
    with pytest.raises(ConfigError, match="prefix_caching"):
        EngineConfig(model=".", host_kv_blocks=8, enable_prefix_caching=False)


def test_router_counts_host_blocks_as_cached_but_weighs_them_lower():
    toks = list(range(16 * 10))
    hashes = tuple(block_hashes(toks, 16))
    router = make_router("cache_aware", disagg_min_tokens=0)
    router.index.apply("dev", [BlockStored(hashes[:6])])
    router.index.apply("host", [BlockStored(hashes[:2]), BlockStored(hashes[2:6], Tier.HOST)])
    device = router.index.holders(hashes)
    assert router.index.overlap(hashes) == {"dev": 6, "host": 2}
    assert router.index.host_holders(hashes, device) == (Group(4, frozenset({"host"})),)
    ws = [WorkerView("dev", "prefill", "h"), WorkerView("host", "prefill", "h")]
    req = RouteRequest("r", len(toks), hashes)
    pl = router.place(req, ws, [WorkerView("d0", "decode", "h")])
    assert pl.prefill == "dev" and pl.cached_tokens == 96
    hits = [Group(6, ("dev",)), Group(2 + router.host_hit_weight * 4, ("host",))]
    scores = {w: v for v, members in PrefixScorer().score(req, hits) for w in members}
    assert 0 < scores["host"] < scores["dev"]
    only_host = [ws[1], WorkerView("cold", "prefill", "h")]
    pl = router.place(req, only_host, [WorkerView("d0", "decode", "h")])
    assert pl.prefill == "host" and pl.cached_tokens == 96  # loaded back counts as cached for the PD decision
