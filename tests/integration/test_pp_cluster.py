"""Pipeline-parallel workers on the local Ray cluster. A decode worker of 2 stages on the
aggregated path (prefill 0) is one placement group (PACK: its stages may sit on different
nodes), the actor as stage 0 and stage 1 an actor it starts running the engine's stage main; the
router and the Controller see one worker. Its greedy tokens equal the single engine's,
`describe` shows the stage's place, and killing the stage process takes the worker down naming
the stage and brings up a new one. A prefill worker of 2 stages spread over two nodes
(pp_placement spread: STRICT_SPREAD) hands its KV off by stage to a single decode worker: each
stage serves its own layer from its own node, the decode worker pulls and checks both."""

import os
import signal
import time

import pytest
import ray

from splitserve.orchestrator import Cluster
from splitserve.router.policy import NoCapacity
from tests.chaos.harness import params, prompts, reference, replaced
from tests.conftest import PREFILL_IP

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


def test_a_pipeline_parallel_decode_worker_serves_exactly_and_is_replaced_when_a_stage_dies(ray_session, model):
    ps, sps = prompts(12), params(12, False, 16)
    ref = reference(model, ps, sps)
    with Cluster.start(model=model, name="pp-decode", prefill=0, decode=1, decode_pp=2, num_kv_blocks=256) as c:
        st = ray.get(c.controller.status.remote())
        ready = [w for w in st.workers if w.state == "ready"]
        assert [w.role for w in ready] == ["decode"] and len(ready[0].ranks) == 2, ready  # both stages' nodes
        info = ray.get(c.decodes[0].describe.remote())
        assert len(info.ranks) == 1 and info.ranks[0].pid != info.pid
        outs = c.generate([list(p) for p in ps], sps)
        assert [tuple(o.outputs[0].token_ids) for o in outs] == ref
        for s in c.check_invariants():
            assert s["in_use"] == 0 and s["free"] + s["cached"] == s["total"], s

        before = {w.id for w in ready}
        os.kill(info.ranks[0].pid, signal.SIGKILL)  # stage 1, idle: found by the health probes
        dead, fresh = replaced(c, before)
        deadline = time.time() + 60
        assert "pipeline stage 1 exited" in dead[0].reason, dead
        assert len(fresh[0].ranks) == 2
        removed = [g for g in ray.util.placement_group_table().values() if g["state"] == "REMOVED"]
        assert removed, "the broken worker's placement group was not removed"
        while True:  # the new worker serves exactly too, once the router has seen it
            try:
                outs = c.generate([list(p) for p in ps[:4]], sps[:4])
                break
            except NoCapacity:
                assert time.time() < deadline, "the router never saw the new worker"
                time.sleep(0.1)
        assert [tuple(o.outputs[0].token_ids) for o in outs] == ref[:4]


def test_a_pp_prefill_worker_spread_over_two_nodes_hands_off_by_stage_exactly(ray_session, model):
    ps, sps = prompts(12), params(12, False, 10)
    ref = reference(model, ps, sps)
    with Cluster.start(model=model, name="pp-prefill-spread", prefill=1, decode=1, prefill_pp=2, pp_placement="spread",
                       disagg_min_tokens=0, num_kv_blocks=256, prefill_resources={"prefill_node": 1},
                       decode_resources={"decode_node": 1}) as c:
        ready = [w for w in ray.get(c.controller.status.remote()).workers if w.state == "ready"]
        assert sorted(w.role for w in ready) == ["decode", "prefill"], ready
        prefill = next(w for w in ready if w.role == "prefill")
        assert prefill.ranks[0] == PREFILL_IP and len(set(prefill.ranks)) == 2, prefill  # one stage a node
        outs = c.generate([list(p) for p in ps], sps)
        assert [tuple(o.outputs[0].token_ids) for o in outs] == ref
        assert all(t.prefill_done_to_first_token_s is not None for t in c.timings)  # every one handed over
        counts = c.check_invariants()
        decode = counts[-1]
        assert decode["transfer_failures"] == {} and decode["transfers_by_transport"] == {"tcp": 12}, decode
        for s in counts:  # both sides drained: no block, lease or grant left (on either stage)
            assert s["in_use"] == 0 and s["free"] + s["cached"] == s["total"], s
            assert s.get("leases", 0) == 0 and s.get("grants", 0) == 0 and s.get("handoffs", 0) == 0, s


@pytest.mark.parametrize("prefill_pp", [1, 2])
def test_a_pp_decode_worker_beside_a_prefill_pool_lands_each_stage_exactly(ray_session, model, prefill_pp):
    """decode_pp 2 with a single prefill worker (told its readers' stages), or one of 2 stages
    too, all on the head node: the handoff goes by stage; each decode stage pulls its layer
    over shm between steps, from the source stage holding it, and checks it. Tokens equal the
    single engine's; nothing held on any stage."""
    ps, sps = prompts(12, seed=12), params(12, False, 10)
    ref = reference(model, ps, sps)
    with Cluster.start(model=model, name=f"pp-decode-pd-{prefill_pp}", prefill=1, decode=1, prefill_pp=prefill_pp,
                       decode_pp=2, disagg_min_tokens=0, num_kv_blocks=256, prefill_resources={"head_node": 1},
                       decode_resources={"head_node": 1}) as c:
        outs = c.generate([list(p) for p in ps], sps)
        assert [tuple(o.outputs[0].token_ids) for o in outs] == ref
        assert all(t.prefill_done_to_first_token_s is not None for t in c.timings)  # every one handed over
        counts = c.check_invariants()
        decode = counts[-1]
        assert decode["transfer_failures"] == {} and decode["transfers_by_transport"] == {"shm": 12}, decode
        for s in counts:
            assert s["in_use"] == 0 and s["free"] + s["cached"] == s["total"], s
            assert s.get("leases", 0) == 0 and s.get("grants", 0) == 0 and s.get("handoffs", 0) == 0, s
