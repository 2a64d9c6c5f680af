"""Tensor-parallel workers on the local Ray cluster: a worker of T ranks is one placement group
(STRICT_PACK) on its pool's node, the actor as rank 0 and ranks 1..T-1 as actors it starts;
the router and the Controller see one worker. Its greedy tokens equal the single engine's,
`status` shows the ranks' nodes, and killing one rank process under load takes the group out
of placement (its streams migrate, or end with our explicit error), removes its placement
group and brings up a new group."""

import os
import signal

import pytest
import ray

from splitserve.orchestrator import Cluster
from splitserve.control.admin import status_table
from tests.chaos.harness import (Load, assert_nothing_held, assert_outcomes, migration_report, params, prompts,
                                 reference, replaced)
from tests.conftest import DECODE_IP, HEAD_IP, PREFILL_IP

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


def groups_of(c):
    return ray.get(c.controller.status.remote())


def tp_decode_cluster(model, name, decode=1, **kw):
    return Cluster.start(model=model, name=name, prefill=0, decode=decode, decode_tp=2, num_kv_blocks=256, **kw)


def assert_drained(c):
    for s in c.check_invariants():
        assert s["in_use"] == 0 and s["free"] + s["cached"] == s["total"], s


def rank_pids(worker) -> list[int]:
    return [p.pid for p in ray.get(worker.describe.remote()).ranks]


def test_killing_one_rank_under_load_replaces_the_group(ray_session, model):
    n = 24
    ps, sps = prompts(n), params(n, False, 48)
    ref = reference(model, ps, sps)
    # two groups of two ranks: more CPUs than one test node has, so wherever they fit
    with tp_decode_cluster(model, "tp-chaos", decode=2, decode_inactivity_timeout_s=1.5) as c:
        before = {w.id for w in groups_of(c).workers if w.state == "ready"}
        load = Load(c, ps, sps)
        load.wait_progress(2)
        busiest = max(c.decodes, key=lambda w: ray.get(w.load.remote()).stats.num_running)
        os.kill(rank_pids(busiest)[0], signal.SIGKILL)  # rank 1 of the group serving the most streams
        outcomes = load.result()
        r = migration_report(c)
        print(f"\nTP rank killed: {sum(o.error is not None for o in outcomes)} of {n} streams ended with the "
              f"explicit error, {r['migrated']} migrated")
        assert r["migrated"] >= 1  # the fault landed: the killed group's streams moved
        assert_outcomes(outcomes, ref, min_exact=n // 2)
        dead, fresh = replaced(c, before)  # the broken group is dead, a new one READY with both ranks
        assert len(dead) == 1 and "tensor-parallel" in dead[0].reason, dead
        assert len(fresh[0].ranks) == 2 and len(set(fresh[0].ranks)) == 1  # both ranks on one node
        removed = [g for g in ray.util.placement_group_table().values() if g["state"] == "REMOVED"]
        assert removed, "the broken group's placement group was not removed"
        assert_nothing_held(c, load)


# each direction once, each transport once (the whole 2 x 2 took 80 s of the suite's time; the
# slicing is the same code on either transport, each transport's read the same in either direction)
@pytest.mark.parametrize("prefill_tp,decode_tp,transport", [(2, 1, "shm"), (1, 2, "tcp")])
def test_a_handoff_between_groups_of_different_sizes_continues_exactly(ray_session, model, prefill_tp, decode_tp,
                                                                       transport):
    """Each decode rank pulls the KV heads it holds from the prefill ranks holding them, every
    head checked against its source's checksum; one lease covers all source ranks. shm: both
    groups on the head node (one host); tcp: each on its pool's node. A group is one worker to
    the Controller and the router, and `status` shows its ranks' nodes."""
    ps, sps = prompts(16), params(16, False, 10)
    ref = reference(model, ps, sps)
    nodes = ({"prefill_resources": {"head_node": 1}, "decode_resources": {"head_node": 1}} if transport == "shm" else
             {"prefill_resources": {"prefill_node": 1}, "decode_resources": {"decode_node": 1}})
    with Cluster.start(model=model, name=f"tp-pd-{prefill_tp}{decode_tp}-{transport}", prefill=1, decode=1,
                       prefill_tp=prefill_tp, decode_tp=decode_tp, transport=transport, disagg_min_tokens=0,
                       num_kv_blocks=256, **nodes) as c:
        st = groups_of(c)
        ready = [w for w in st.workers if w.state == "ready"]
        ip = {"prefill": HEAD_IP, "decode": HEAD_IP} if transport == "shm" else {"prefill": PREFILL_IP,
                                                                                 "decode": DECODE_IP}
        tps = {"prefill": prefill_tp, "decode": decode_tp}
        assert sorted(w.role for w in ready) == ["decode", "prefill"], ready  # one worker per group
        for w in ready:
            assert w.ranks == ((ip[w.role],) * 2 if tps[w.role] == 2 else ()), w
        grouped = "prefill" if prefill_tp == 2 else "decode"
        assert f"2: {ip[grouped]} ×2" in status_table(st)
        # each worker registered what its engine holds; the table says it for pool sizing
        assert all("KV cache" in w.memory and " tokens" in w.memory for w in ready), ready
        assert status_table(st).count(" memory: weights ") == len(ready)
        outs = c.generate([list(p) for p in ps], sps)
        assert [tuple(o.outputs[0].token_ids) for o in outs] == ref
        assert all(t.prefill_done_to_first_token_s is not None for t in c.timings)  # every one handed over
        counts = c.check_invariants()
        decode = counts[-1]
        assert decode["transfer_failures"] == {} and decode["transfers_by_transport"] == {transport: 16}, decode
        for s in counts:  # both sides drained: no block, lease or token left
            assert s["in_use"] == 0 and s["free"] + s["cached"] == s["total"], s
            assert s.get("leases", 0) == 0 and s.get("grants", 0) == 0 and s.get("handoffs", 0) == 0, s


def test_killing_a_prefill_rank_under_load_replaces_its_group(ray_session, model):
    """A P(TP 2) -> D(TP 1) pair: rank 1 of the prefill group is killed while handoffs are in
    flight. Its requests are placed again (or end with our explicit error), every handoff that
    lands is checked head by head, a new prefill group becomes READY, and nothing stays held."""
    n = 24
    ps, sps = prompts(n), params(n, False, 24)
    ref = reference(model, ps, sps)
    with Cluster.start(model=model, name="tp-chaos-prefill", prefill=1, decode=1, prefill_tp=2, transport="tcp",
                       disagg_min_tokens=0, num_kv_blocks=256) as c:
        before = {w.id for w in groups_of(c).workers if w.state == "ready"}
        load = Load(c, ps, sps)
        load.wait_progress(1, of=max)  # the first handoffs are done, the rest in flight or queued
        os.kill(rank_pids(c.prefills[0])[0], signal.SIGKILL)
        outcomes = load.result()
        errors = [o.error for o in outcomes if o.error is not None]
        print(f"\nprefill TP rank killed: {len(errors)} of {n} streams ended with the explicit error")
        dead, fresh = replaced(c, before, role="prefill")  # the fault landed: the group is dead (and replaced)
        assert "tensor-parallel" in dead[0].reason, dead
        assert_outcomes(outcomes, ref, min_exact=n // 2)
        assert len(fresh[0].ranks) == 2
        assert c.check_invariants()[-1]["transfer_failures"].get("corrupt", 0) == 0  # nothing landed wrong
        assert_nothing_held(c, load)
