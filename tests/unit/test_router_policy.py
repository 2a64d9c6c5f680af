"""Router core: the KV index, the policies, the joint (prefill, decode) choice and the PD
decision — including a simulated shared-prefix workload where cache_aware must reach the
analytic maximum prefix-cache hit rate that round_robin cannot."""

import pytest

from splitserve.types import BlockRemoved, BlockStored
from splitserve.hashing import block_hashes
from splitserve.router import KVIndex, NoCapacity, RouteRequest, WorkerView, make_router
from splitserve.router.kv_index import Group
from splitserve.router.policy import WeightedPicker

BS = 16


def req(tokens, rid="r"):
    return RouteRequest(rid, len(tokens), tuple(block_hashes(tokens, BS)), BS)


def workers(role, n, host="h0", **kw):
    return [WorkerView(f"{role}{i}", role, host, **kw) for i in range(n)]


def test_index_leading_overlap_and_removal():
    idx = KVIndex()
    h = block_hashes(list(range(64)), BS)
    idx.apply("a", [BlockStored(tuple(h))])
    idx.apply("b", [BlockStored(tuple(h[:2]))])
    assert idx.overlap(h) == {"a": 4, "b": 2}
    idx.apply("a", [BlockRemoved((h[1],))])  # a hole ends a's prefix there
    assert idx.overlap(h) == {"a": 1, "b": 2}
    assert idx.overlap(h, ["a", "c"]) == {"a": 1, "c": 0}
    idx.remove_worker("b")
    assert idx.overlap(h) == {"a": 1}


def test_index_overlap_equals_a_naive_walk_per_worker():
    """Random stores, removals and workers leaving (their slots reused by new ones): every
    overlap equals the obvious per-worker walk over what each worker holds."""
    import random

    rng = random.Random(0)
    chain = block_hashes(list(range(40 * BS)), BS)
    idx, held = KVIndex(), {}
    for step in range(400):
        w = f"w{rng.randrange(12)}"
        op = rng.random()
        if op < 0.5:
            got = chain[: rng.randrange(len(chain) + 1)]
            idx.apply(w, [BlockStored(tuple(got))])
            held.setdefault(w, set()).update(got)
        elif op < 0.85:
            gone = tuple(rng.sample(chain, 3))
            idx.apply(w, [BlockRemoved(gone)])
            held.setdefault(w, set()).difference_update(gone)
        else:
            idx.remove_worker(w)
            held.pop(w, None)
        naive = {}
        for name, hs in held.items():
            run = next((i for i, h in enumerate(chain) if h not in hs), len(chain))
            if run:
                naive[name] = run
        assert idx.overlap(chain) == naive, step
        some = [f"w{i}" for i in range(0, 12, 3)]
        assert idx.overlap(chain, some) == {name: naive.get(name, 0) for name in some}


def test_native_kv_table_equals_the_python_one():
    """csrc/kv_table.c answers exactly as the OrderedDict table does under random stores,
    removals, workers leaving, evictions and touches: the same runs (holders changing,
    repeating, equal ints that are distinct objects, a missing hash early, late or never), the
    same holders, the same order of eviction; and both refuse what is not a digest or a bit."""
    import os
    import random
    import shutil

    from splitserve.router import kv_table

    if not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")) or os.environ.get("SPLITSERVE_NO_NATIVE"):
        pytest.skip("no C compiler (or native code turned off): the Python table is the only path")
    assert kv_table._native_type() is not None, "a C compiler is here: the native table must build"
    rng = random.Random(3)
    chain = block_hashes(list(range(300 * BS)), BS)  # 300 hashes: the native index grows past 64 slots
    fast, slow = kv_table.make_table(), kv_table.PythonKVTable()
    assert not isinstance(fast, kv_table.PythonKVTable)
    bits = [1, 2, 4, 1 << 40, 1 << 70]
    for step in range(3000):
        op, bit, n = rng.random(), rng.choice(bits), rng.randrange(40)
        hs = tuple(chain[rng.randrange(300):][: rng.randrange(1, 80)])
        gone = rng.sample(hs, min(3, len(hs)))
        for t in (fast, slow):
            b = int(str(bit))  # equal values, new objects
            if op < 0.4:
                t.store(hs, b)
            elif op < 0.7:
                t.discard(gone, b)
            elif op < 0.75:
                t.drop_bit(b)
            elif op < 0.8:
                t.evict(n)
            else:
                t.touch(hs)
        assert fast.runs(chain) == slow.runs(chain) and fast.runs(tuple(chain[5:])) == slow.runs(chain[5:]), step
        assert len(fast) == len(slow) and fast.keys() == slow.keys(), step
        assert [fast.get(h) for h in chain[:50]] == [slow.get(h) for h in chain[:50]], step
    assert fast.runs([]) == [] and (chain[0] in fast) == (chain[0] in slow)
    for t in (fast, slow):
        for bad in (b"short", "x" * 16, 7):
            with pytest.raises(TypeError):
                t.store([bad], 1)
            with pytest.raises(TypeError):
                t.runs([bad])
        with pytest.raises(TypeError):
            t.store(chain[:1], 0)
        with pytest.raises(TypeError):
            t.discard(chain[:1], "1")


def test_routable_hashes_stop_after_the_first_checked_block_nobody_holds():
    toks = list(range(100 * BS))
    full = block_hashes(toks, BS, "t")
    idx = KVIndex()
    assert idx.routable_hashes(toks, BS, "t", check_every=16) == tuple(full[:16])  # empty index: one chunk
    idx.apply("a", [BlockStored(tuple(full[:40]))])
    assert idx.routable_hashes(toks, BS, "t", check_every=16) == tuple(full[:48])  # chunk 32..47 ends unheld
    idx.apply("b", [BlockStored(tuple(full))])
    assert idx.routable_hashes(toks, BS, "t", check_every=16) == tuple(full)  # all of it, and the tail's 4 tokens not
    assert idx.overlap(idx.routable_hashes(toks, BS, "t", check_every=16)) == idx.overlap(full)


def test_index_is_bounded():
    idx = KVIndex(max_hashes=10)
    for i in range(5):
        idx.apply("w", [BlockStored(tuple(block_hashes(list(range(i * 100, i * 100 + 64)), BS)))])
    assert len(idx) == 10


def test_filters_and_no_capacity():
    r = req(list(range(100)))
    down = [WorkerView("d0", "decode", "h", healthy=False), WorkerView("d1", "decode", "h", draining=True)]
    with pytest.raises(NoCapacity):
        make_router("least_loaded").place(r, [], down)
    full = down + [WorkerView("d2", "decode", "h", free_blocks=3)]
    # the only worker up is full: placed there all the same (its scheduler queues it), not refused
    assert make_router("least_loaded").place(r, [], full).decode == "d2"
    ok = full + [WorkerView("d3", "decode", "h", free_blocks=100, num_running=4)]
    assert make_router("least_loaded").place(r, [], ok).decode == "d3"  # room beats load


def test_round_robin_alternates_and_least_loaded_picks_min():
    r = req(list(range(100)))
    rr = make_router("round_robin", disagg_min_tokens=0)
    picks = [rr.place(r, workers("p", 2), workers("d", 1)).prefill for _ in range(4)]
    assert picks == ["p0", "p1", "p0", "p1"]
    busy = [WorkerView("p0", "prefill", "h", num_waiting=5), WorkerView("p1", "prefill", "h", num_waiting=1)]
    assert make_router("least_loaded", disagg_min_tokens=0).place(r, busy, workers("d", 1)).prefill == "p1"


def test_power_of_two_never_picks_the_most_loaded():
    r = req(list(range(100)))
    ws = [WorkerView(f"p{i}", "prefill", "h", num_running=i) for i in range(3)]
    router = make_router("power_of_two", disagg_min_tokens=0, seed=1)
    picks = {router.place(r, ws, workers("d", 1)).prefill for _ in range(50)}
    assert "p2" not in picks and picks == {"p0", "p1"}


def test_cache_aware_follows_the_prefix_unless_the_holder_is_swamped():
    tokens = list(range(320))
    r = req(tokens)
    router = make_router("cache_aware", disagg_min_tokens=0)
    router.index.apply("p1", [BlockStored(r.block_hashes)])
    pl = router.place(r, workers("p", 3), workers("d", 1))
    assert pl.prefill == "p1" and pl.cached_tokens == 304  # the last token is always recomputed
    swamped = [WorkerView("p0", "prefill", "h"), WorkerView("p1", "prefill", "h", num_waiting=50, kv_usage=1.0),
               WorkerView("p2", "prefill", "h", num_waiting=1)]
    assert router.place(r, swamped, workers("d", 1)).prefill == "p0"


def test_pd_decider_uses_the_uncached_part():
    tokens = list(range(200))
    r = req(tokens)
    router = make_router("cache_aware", disagg_min_tokens=64)
    assert router.place(r, workers("p", 1), workers("d", 1)).prefill == "p0"  # 200 uncached
    router.index.apply("d0", [BlockStored(r.block_hashes[:10])])  # 160 cached on the decode worker
    pl = router.place(r, workers("p", 1), workers("d", 1))
    assert pl.prefill is None and pl.cached_tokens == 160  # 40 uncached < 64: aggregated
    assert make_router("cache_aware", disagg_min_tokens=64).place(req(tokens[:30]), workers("p", 1),
                                                                  workers("d", 1)).prefill is None


def test_same_host_pair_preferred_within_margin():
    r = req(list(range(100)))
    pre = [WorkerView("far", "prefill", "h1"), WorkerView("near", "prefill", "h0", num_waiting=1)]
    dec = [WorkerView("d0", "decode", "h0")]
    router = make_router("least_loaded", disagg_min_tokens=0, same_host_margin=0.6)
    assert router.place(r, pre, dec).prefill == "near"
    router = make_router("least_loaded", disagg_min_tokens=0, same_host_margin=0.0)
    assert router.place(r, pre, dec).prefill == "far"


def test_scores_outside_unit_interval_are_refused():
    class BadLoad:
        def score(self, worker):
            return 2.0

    class BadBonus:
        def score(self, req, hits):
            return [Group(-0.5, members) for _, members in hits]

    with pytest.raises(ValueError, match="outside"):
        WeightedPicker(load=[(BadLoad(), 1.0)]).load_score(workers("p", 1)[0])
    with pytest.raises(ValueError, match="outside"):
        WeightedPicker(request=[(BadBonus(), 1.0)]).bonus(req([1] * 20), [Group(1, ("p0",))])


def test_unknown_policy_lists_known():
    with pytest.raises(ValueError, match="cache_aware"):
        make_router("random_walk")


@pytest.mark.parametrize("policy,min_fraction", [("cache_aware", 0.95), ("round_robin", 0.0)])
def test_shared_prefix_hit_rate(policy, min_fraction):
    """8 groups × 8 prompts (512-token system prompt + 64-token question), 2 prefill workers.
    Each worker's cache is simulated from the router's own placements (BlockStored events)."""
    router = make_router(policy, disagg_min_tokens=0)
    pre, dec = workers("p", 2), workers("d", 1)
    hit = best = 0
    for g in range(8):
        system = [10_000 + g * 1000 + i for i in range(512)]
        for q in range(8):
            tokens = system + [(g * 8 + q) * 100 + i for i in range(64)]
            r = req(tokens, f"{g}-{q}")
            pl = router.place(r, pre, dec)
            hit += pl.cached_tokens
            best += 0 if q == 0 else 512  # analytic max: only a group's first prompt misses
            router.index.apply(pl.prefill, [BlockStored(r.block_hashes)])
    frac = hit / best
    if policy == "cache_aware":
        assert frac >= min_fraction, frac
    else:
        assert frac < 0.95, f"round robin should split groups across workers, got {frac}"


def naive_place(router, r, prefills, decodes):
    """The placement written the obvious way: every eligible worker scored in full."""
    from splitserve.router.policy import _order

    def eligible(ws):
        up = [w for w in ws if w.healthy and not w.draining]
        return [w for w in up if w.free_blocks >= r.blocks_needed] or up

    blocks, hits = router._hits(r)
    blocks = {w: v for v, members in blocks for w in members}
    bonus = {w: v for v, members in router.picker.bonus(r, hits) for w in members}

    def best(ws):
        total = {w.worker_id: router.load_score(w) + bonus.get(w.worker_id, 0.0) for w in ws}
        w = min(ws, key=lambda w: (-total[w.worker_id], _order(w.worker_id), w.worker_id))
        return w, total[w.worker_id]

    d, _ = best(eligible(decodes))
    d_cached = router._cached_tokens(r, blocks.get(d.worker_id, 0))
    ps = eligible(prefills)
    if not ps or r.num_tokens - d_cached < router.disagg_min_tokens:
        return None, d.worker_id
    p, top = best(ps)
    near = [w for w in ps if w.host == d.host]
    if near and p.host != d.host:
        n, score = best(near)
        p = n if score >= top - router.same_host_margin else p
    return p.worker_id, d.worker_id


@pytest.mark.parametrize("size, spread", [(12, 1), (40, 4)])
def test_ranked_pools_place_as_scoring_every_worker_would(size, spread):
    """A router keeps its pools ranked between decisions and scores only a request's prefix
    holders, a group at a time; over random loads, hosts, room, health, pools that change one
    view at a time or shrink, and shared prefixes, it places exactly as scoring every worker
    does — for small holder groups and for big ones (`spread` workers a step store the system
    prompt: groups of 16+, which a pool walks in rank order)."""
    import random

    rng = random.Random(7)
    biggest = 0
    router = make_router("cache_aware", disagg_min_tokens=40, same_host_margin=0.15)
    systems = [[rng.randrange(1000) for _ in range(64)] for _ in range(4)]

    def view(role, i):
        return WorkerView(f"{role}{i}", role, f"h{rng.randrange(3)}", num_waiting=rng.randrange(4),
                          num_running=rng.randrange(4), kv_usage=rng.choice([0.0, 0.5, 1.0]),
                          free_blocks=rng.choice([2, 8, 100]), healthy=rng.random() > 0.1,
                          draining=rng.random() < 0.1)

    pools = {role: tuple(view(role, i) for i in range(size)) for role in ("prefill", "decode")}
    for step in range(300):
        for role, ws in pools.items():  # one worker's facts change, or the pool shrinks or regrows
            ws = list(ws)
            if rng.random() < 0.1 and len(ws) > 3:
                ws.pop(rng.randrange(len(ws)))
            else:
                i = rng.randrange(size)
                ws = [w for w in ws if w.worker_id != f"{role}{i}"] + [view(role, i)]
            pools[role] = tuple(ws)
        tokens = rng.choice(systems) + [rng.randrange(1000) for _ in range(rng.randrange(0, 96))]
        r = req(tokens, f"r{step}")
        if not any(w.healthy and not w.draining for w in pools["decode"]):
            continue
        pl = router.place(r, pools["prefill"], pools["decode"])
        assert (pl.prefill, pl.decode) == naive_place(router, r, pools["prefill"], pools["decode"]), step
        biggest = max([biggest] + [len(g.members) for g in router._hits(r)[1]])
        holder = rng.choice(pools[rng.choice(("prefill", "decode"))]).worker_id
        router.index.apply(holder, [BlockStored(r.block_hashes[: rng.randrange(len(r.block_hashes) + 1)])])
        for _ in range(spread - 1):
            holder = rng.choice(pools[rng.choice(("prefill", "decode"))]).worker_id
            router.index.apply(holder, [BlockStored(r.block_hashes[:4])])  # the system prompt's 4 blocks
    assert biggest >= (16 if spread > 1 else 2)


def test_a_bounded_index_keeps_the_prefix_decisions_keep_matching():
    """Past its bound the index forgets the least recently stored or matched hashes: a system
    prompt that routing keeps matching survives one-off prompts churning through many times
    the index's size; one nobody asks for is forgotten."""
    idx = KVIndex(max_hashes=400)
    hot = block_hashes(list(range(10_000, 10_000 + 20 * BS)), BS)
    cold = block_hashes(list(range(20_000, 20_000 + 20 * BS)), BS)
    idx.apply("a", [BlockStored(tuple(hot)), BlockStored(tuple(cold))])
    for i in range(200):  # 4,000 one-off blocks: 10x the bound
        idx.apply("b", [BlockStored(tuple(block_hashes(list(range(i * 320, (i + 1) * 320)), BS)))])
        assert idx.overlap(hot) == {"a": 20}, i
    assert len(idx) == 400 and idx.overlap(cold) == {}


def test_a_scorer_that_raises_keeps_raising():
    """A view whose load cannot be scored is refused on every decision, not dropped silently
    after the first (the pool changes only once the score is known)."""
    class Flaky:
        def score(self, worker):
            return 2.0 if worker.num_waiting else 0.5

    router = make_router("least_loaded", disagg_min_tokens=0)
    router.picker = WeightedPicker(load=[(Flaky(), 1.0)])
    bad = (WorkerView("d0", "decode", "h", num_waiting=1),)
    for _ in range(2):
        with pytest.raises(ValueError, match="outside"):
            router.place(req(list(range(40))), (), bad)
