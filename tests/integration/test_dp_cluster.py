"""Data-parallel attention + expert parallelism on the local Ray cluster. A decode worker with
`engine: {data_parallel_size: 2}` on the aggregated path (prefill 0) is one placement group of
2 bundles (STRICT_PACK), the actor replica 0 (the front) and replica 1 an actor it starts
running the replica main; the router and the Controller see one worker, with both replicas'
load summed. Its greedy tokens equal the single engine's for concurrent prompts, `describe` shows
replica 1's place, and killing replica 1's process takes the worker down naming the replica and
brings up a new one that serves exactly."""

import os
import signal
import time

import pytest
import ray

from splitserve.orchestrator import Cluster
from splitserve.router.policy import NoCapacity
from tests.chaos.harness import params, prompts, reference, replaced

pytestmark = pytest.mark.timeout(300)

BLOCKS = 128


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return str(tiny_checkpoint("qwen3_moe"))


def test_a_data_parallel_decode_worker_serves_exactly_and_is_replaced_when_a_replica_dies(ray_session, model):
    ps, sps = prompts(8), params(8, False, 12)
    ref = reference(model, ps, sps)
    with Cluster.start(model=model, name="dp-decode", prefill=0, decode=1, num_kv_blocks=BLOCKS,
                       data_parallel_size=2) as c:
        st = ray.get(c.controller.status.remote())
        ready = [w for w in st.workers if w.state == "ready"]
        assert [w.role for w in ready] == ["decode"] and len(ready[0].ranks) == 2, ready  # both replicas' nodes
        info = ray.get(c.decodes[0].describe.remote())
        assert len(info.ranks) == 1 and info.ranks[0].pid != info.pid
        warm = ray.get(c.decodes[0].stats.remote())
        outs = c.generate([list(p) for p in ps], sps)
        assert [tuple(o.outputs[0].token_ids) for o in outs] == ref
        stats = ray.get(c.decodes[0].stats.remote())  # what the router reads: both replicas', summed
        assert stats.kv_blocks_total == 2 * BLOCKS
        assert stats.prefill_tokens_total - warm.prefill_tokens_total == sum(map(len, ps))
        for s in c.check_invariants():
            assert s["in_use"] == 0 and s["free"] + s["cached"] == s["total"] == 2 * BLOCKS, s

        before = {w.id for w in ready}
        os.kill(info.ranks[0].pid, signal.SIGKILL)  # replica 1, idle: found by the health probes
        dead, fresh = replaced(c, before)
        deadline = time.time() + 60
        assert "data-parallel replica 1 exited" in dead[0].reason, dead
        assert len(fresh[0].ranks) == 2
        while True:  # the new worker serves exactly too, once the router has seen it
            try:
                outs = c.generate([list(p) for p in ps], sps)
                break
            except NoCapacity:
                assert time.time() < deadline, "the router never saw the new worker"
                time.sleep(0.1)
        assert [tuple(o.outputs[0].token_ids) for o in outs] == ref
