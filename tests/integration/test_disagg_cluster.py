"""Disaggregated prefill/decode on a local Ray cluster: 32 concurrent requests give exactly the
single-engine (and Hugging Face) greedy tokens over every transport, faults end in correct
output or a clear typed error, and afterwards no worker holds a block or a lease."""

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.orchestrator import Cluster
from splitserve.kv_transfer.base import TransferError

SP = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def prompts(n=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 384, (int(k),), generator=g).tolist() for k in torch.randint(1, 100, (n,), generator=g)]


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def expected(model):
    """The single-engine path; test_engine_parity.py ties it to Hugging Face token for token."""
    from transformers import AutoModelForCausalLM

    ps = prompts()
    toks = [o.outputs[0].token_ids for o in LLM(model, num_kv_blocks=256).generate(ps, SP)]
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    for p, t in list(zip(ps, toks))[:4]:  # and directly against HF for a few
        ids = torch.tensor([p])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=10,
                          min_new_tokens=10, pad_token_id=0)[0, len(p):].tolist()
        assert list(t) == ref
    return toks


def assert_drained(cluster):
    stats = cluster.check_invariants()
    assert stats, "no live worker to check"
    for s in stats:
        assert s["in_use"] == 0 and s["free"] + s["cached"] == s["total"], s
        assert s.get("leases", 0) == 0, s


def transports():
    out = ["shm", "tcp"]
    try:
        import nixl  # noqa: F401

        out.append("nixl")
    except ImportError:
        out.append(pytest.param("nixl", marks=pytest.mark.skip(reason="nixl not installed")))
    return out


@pytest.mark.parametrize("transport", transports())
def test_32_concurrent_requests_exact(ray_session, model, expected, transport):
    """Streamed (issue 32): every prompt, however short, streams its KV, and a 32-token step
    budget makes the longer ones span several chunks, so pieces land while they are computed
    — over each transport the tokens still equal the single engine's (which the off mode, the
    other tests here, equals too). Sent again, the prompts are prefix hits on both sides, and
    the tokens are the same. (The decode worker keeps the blocks it holds when its stage call
    reaches the prefill first — a race a one-step prefill often wins:
    test_decode_lifecycle.py::test_blocks_the_decode_worker_holds_are_not_moved.) The prefill
    worker is paced (tests/fakes/workers.py: each step also waits ~15 ms off the CPU), so the
    decode worker's stage calls reach it while it computes even on a loaded machine: unpaced,
    the whole batch could be prefilled before any stage call arrived, and nothing streamed."""
    with Cluster.start(model=model, transport=transport, disagg_min_tokens=0, num_kv_blocks=256,
                       kv_streaming_min_tokens=0, max_num_batched_tokens=32, **fakes(prefill="PacedPrefill")) as c:
        outs = c.generate(prompts(), SP)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert all(t.prefill_done_to_first_token_s is not None for t in c.timings)  # all disaggregated
        decode = c.check_invariants()[-1]
        assert decode["pieces_landed"] > 0 and decode["transfer_failures"] == {}, decode
        assert decode["staged"] == 0 and decode["prefix_blocks_kept"] == 0
        again = c.generate(prompts()[:8], SP)  # (whether the decode worker's held blocks stay
        assert [o.outputs[0].token_ids for o in again] == expected[:8]  # depends on a race: unit-tested)
        assert c.check_invariants()[-1]["transfer_failures"] == {}
        assert_drained(c)


def test_an_fp8_kv_cache_hands_over_on_a_cluster(ray_session, model):
    """kv_cache_dtype fp8 through the app's engine config: both pools' caches hold FP8 rows,
    the KV streams over tcp in pieces (a 32-token step budget) with its scales, and the tokens
    equal the in-process FP8 engine's (test_fp8_kv.py ties that to transformers)."""
    ps = prompts()[:12]
    want = [o.outputs[0].token_ids for o in LLM(model, num_kv_blocks=256, kv_cache_dtype="fp8").generate(ps, SP)]
    with Cluster.start(model=model, transport="tcp", disagg_min_tokens=0, num_kv_blocks=256, kv_cache_dtype="fp8",
                       kv_streaming_min_tokens=0, max_num_batched_tokens=32, **fakes(prefill="PacedPrefill")) as c:
        assert [o.outputs[0].token_ids for o in c.generate(ps, SP)] == want
        assert all(t.prefill_done_to_first_token_s is not None for t in c.timings)  # all disaggregated
        decode = c.check_invariants()[-1]
        assert decode["transfer_failures"] == {} and decode["pieces_landed"] > 0, decode
        assert_drained(c)


def test_auto_picks_shared_memory_on_one_host(ray_session, model, expected):
    both_on_the_head = {"head_node": 1}
    with Cluster.start(model=model, transport="auto", disagg_min_tokens=0, num_kv_blocks=256,
                       prefill_resources=both_on_the_head, decode_resources=both_on_the_head) as c:
        outs = c.generate(prompts()[:8], SP)
        assert [o.outputs[0].token_ids for o in outs] == expected[:8]
        assert c.check_invariants()[-1]["transfers_by_transport"] == {"shm": 8}
        assert_drained(c)


def test_cache_aware_placement_reuses_prefixes(ray_session, model):
    """2 prefill workers, 6 groups × 4 prompts sharing a 64-token system prompt, one at a time.
    Analytic maximum: every prompt but a group's first reuses its 64 prefix tokens. A policy
    blind to the caches cannot pass: round robin sends a group's prompts to the workers in turn,
    so each worker misses the group's first prompt it sees: 2 of 3 possible hits, 0.67 of the
    maximum (test_router_policy.py::test_shared_prefix_hit_rate compares the policies on the router alone)."""
    g = torch.Generator().manual_seed(7)
    groups = [torch.randint(3, 384, (64,), generator=g).tolist() for _ in range(6)]
    with Cluster.start(model=model, prefill=2, transport="tcp", disagg_min_tokens=0, num_kv_blocks=256,
                       policy="cache_aware") as c:
        for system in groups:
            for q in range(4):
                c.generate([system + torch.randint(3, 384, (20,), generator=g).tolist()], SP)
        import ray

        hits = sum(ray.get(p.stats.remote()).prefix_hit_tokens_total for p in c.prefills)
        assert_drained(c)
    best = 6 * 3 * 64
    assert hits >= 0.8 * best, hits


def test_pools_on_their_own_nodes_move_kv_between_nodes(ray_session, model, expected):
    """Prefill on the "prefill" node, decode on the "decode" node: the registry knows where each
    runs, and every transfer crosses the node boundary over tcp or nixl, never shm. (tcp alone
    between the nodes: test_latent_attention_kv_is_handed_over_as_latents.)"""
    from conftest import DECODE_IP, PREFILL_IP

    with Cluster.start(model=model, prefill=2, transport="auto", disagg_min_tokens=0, num_kv_blocks=256,
                       prefill_resources={"prefill_node": 1}, decode_resources={"decode_node": 1}) as c:
        nodes = {(w.role, w.node_ip) for w in c.status().workers}
        assert nodes == {("prefill", PREFILL_IP), ("decode", DECODE_IP)}, nodes
        outs = c.generate(prompts(), SP)
        assert [o.outputs[0].token_ids for o in outs] == expected
        decode = c.check_invariants()[-1]
        assert decode["transfer_failures"] == {}  # no local recompute
        moved = decode["transfers_by_transport"]
        assert sum(moved.values()) == 32 and set(moved) <= {"tcp", "nixl"}, moved
        assert_drained(c)


def test_aggregated_path_below_threshold(ray_session, model, expected):
    with Cluster.start(model=model, transport="tcp", disagg_min_tokens=50, num_kv_blocks=256) as c:
        ps = prompts()
        outs = c.generate(ps, SP)
        assert [o.outputs[0].token_ids for o in outs] == expected
        local = sum(t.prefill_done_to_first_token_s is None for t in c.timings)
        assert local == sum(len(p) < 50 for p in ps) > 0
        assert_drained(c)


def fakes(**pools):
    """worker_classes naming the fault-injecting fakes in tests/fakes/workers.py."""
    return {"worker_classes": {role: f"tests.fakes.workers:{name}" for role, name in pools.items()}}


@pytest.mark.parametrize("kind,extra", [
    ("corrupt", fakes(decode="CorruptingDecode")),
    ("lease_expired", {"lease_s": 0.3, **fakes(decode="LateDecode")}),
    ("truncated", fakes(prefill="TruncatingPrefill")),
])
def test_faults_recompute_to_the_right_answer(ray_session, model, expected, kind, extra):
    n = 4
    with Cluster.start(model=model, transport="tcp", disagg_min_tokens=0, num_kv_blocks=256, **extra) as c:
        outs = c.generate(prompts()[:n], SP)
        assert [o.outputs[0].token_ids for o in outs] == expected[:n]
        stats = c.check_invariants()
        assert stats[-1]["transfer_failures"].get(kind, 0) == n, stats[-1]
        assert_drained(c)


def test_fail_policy_raises_typed_error(ray_session, model):
    with Cluster.start(model=model, transport="tcp", disagg_min_tokens=0, num_kv_blocks=256,
                       on_transfer_failure="fail", **fakes(decode="CorruptingDecode")) as c:
        with pytest.raises(TransferError) as e:
            c.generate(prompts()[:1], SP)
        assert e.value.kind == "corrupt"
        assert_drained(c)


def test_prefill_killed_during_transfer(ray_session, model, expected):
    import time

    with Cluster.start(model=model, transport="tcp", disagg_min_tokens=0, num_kv_blocks=256,
                       **fakes(decode="PrefillKillingDecode")) as c:
        first = c.status().workers[0].id
        outs = c.generate(prompts()[:3], SP)  # each pull finds its source gone: recomputed, or prefilled locally
        failures = c.check_invariants()[-1]["transfer_failures"]
        assert 1 <= sum(failures.values()) <= 3, failures  # the fault landed: a pull found its source gone
        assert [o.outputs[0].token_ids for o in outs] == expected[:3]
        deadline = time.time() + 60  # the Controller replaces the dead prefill worker
        while time.time() < deadline:
            ready = [w.id for w in c.status().workers if w.role == "prefill" and w.state == "ready"]
            if ready and first not in ready:
                break
            time.sleep(0.2)
        assert ready and first not in ready
        assert any(w.id == first and w.state == "dead" for w in c.status().workers)
        outs = c.generate(prompts()[3:5], SP)
        assert [o.outputs[0].token_ids for o in outs] == expected[3:5]
        assert_drained(c)


def test_abort_on_decode_side_mid_transfer(ray_session, model):
    import asyncio

    from splitserve.types import Request

    with Cluster.start(model=model, transport="tcp", disagg_min_tokens=0, num_kv_blocks=256,
                       **fakes(decode="HoldingDecode")) as c:
        decode, prefill = c.decodes[0], c.prefills[0]

        async def scenario():
            req = Request("abort-me", tuple(prompts()[5]), SP)
            result = await prefill.prefill.remote(req)
            gen = decode.generate.options(num_returns="streaming").remote(req, result.handoff, prefill)
            await asyncio.sleep(0.3)  # the pull is held in flight
            await decode.abort.remote("abort-me")
            return [await ref async for ref in gen]

        chunks = asyncio.run(scenario())
        assert [ch.finish_reason.value for ch in chunks] == ["abort"]
        assert_drained(c)


def test_a_worker_refusing_its_configuration_is_a_clean_config_error(ray_session, model):
    """A backend this machine cannot run: the worker's constructor raises ConfigError; the
    driver gets that ConfigError (its message, not Ray's traceback) and no worker is left."""
    from splitserve.types import ConfigError

    import time

    cpus = ray_session.available_resources().get("CPU", 0)
    with pytest.raises(ConfigError, match=r"^attention backend 'flash_attn' cannot run here: flash-attn runs only on CUDA"):
        Cluster.start(model=model, prefill=1, decode=1, attention_backend="flash_attn", num_kv_blocks=64)
    assert ray_session.is_initialized()  # a cluster it joined stays up
    deadline = time.time() + 20  # the workers' CPUs come back once they are gone
    while ray_session.available_resources().get("CPU", 0) < cpus and time.time() < deadline:
        time.sleep(0.2)
    assert ray_session.available_resources().get("CPU", 0) >= cpus


def test_latent_attention_kv_is_handed_over_as_latents(ray_session, tiny_checkpoint):
    """DeepSeek-V3-shaped (MLA): the cache and the transport layout hold one latent per token
    (kv_lora_rank + qk_rope_head_dim, one "head"), moved over tcp between the nodes; the tokens
    equal the single engine's (test_engine_parity ties those to Hugging Face)."""
    import ray

    model = str(tiny_checkpoint("deepseek_v3"))
    ps = prompts(12, seed=3)
    want = [o.outputs[0].token_ids for o in LLM(model, num_kv_blocks=256).generate(ps, SP)]
    with Cluster.start(model=model, transport="tcp", disagg_min_tokens=0, num_kv_blocks=256,
                       prefill_resources={"prefill_node": 1}, decode_resources={"decode_node": 1}) as c:
        assert [o.outputs[0].token_ids for o in c.generate(ps, SP)] == want
        layout = ray.get(c.prefills[0].describe.remote()).endpoints[0].layout
        assert (layout.num_kv_heads, layout.head_dim) == (1, 32 + 8)  # the latent, not 4 heads' K and V
        decode = c.check_invariants()[-1]
        assert decode["transfer_failures"] == {} and decode["transfers_by_transport"] == {"tcp": 12}, decode
        assert_drained(c)
