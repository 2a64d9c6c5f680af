"""A pipeline stage SIGKILLed under load (issue 35): an aggregated app of two decode workers,
each two pipeline stages (stage 0 the worker actor, stage 1 an actor it started), 16 greedy
streams at once. Stage 1 of the busier worker is killed mid-stream: the fault lands (its
worker's streams migrate), every stream still ends with the single engine's tokens, the
Controller marks the worker dead (its pipeline broken) and brings up a new two-stage worker, and
afterwards no live worker holds a block."""

import os
import signal

import pytest
import ray

from splitserve.orchestrator import Cluster
from splitserve.types import Role
from tests.chaos.harness import (Load, assert_nothing_held, assert_outcomes, migration_report, params, prompts,
                                 reference, replaced)

N, MAX_TOKENS = 16, 48
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


def test_sigkill_a_pipeline_stage_under_load(ray_session, model):
    ps, sps = prompts(N), params(N, False, MAX_TOKENS)
    ref = reference(model, ps, sps)
    with Cluster.start(model=model, name="chaos-kill-stage", prefill=0, decode=2, decode_pp=2, num_kv_blocks=256,
                       decode_inactivity_timeout_s=5.0) as c:
        before = {w.id for w in ray.get(c.controller.status.remote()).workers if w.state == "ready"}
        load = Load(c, ps, sps)
        load.wait_progress(3)
        running = {v.worker_id: v.num_running for v in c.directory.views(Role.DECODE)}
        rec = max((r for r in c.directory.records.values() if r.role is Role.DECODE),
                  key=lambda r: running.get(r.id, 0))
        stage1 = ray.get(rec.handle.describe.remote()).ranks[0].pid
        os.kill(stage1, signal.SIGKILL)
        outcomes = load.result()
        r = migration_report(c)
        print(f"\nchaos SIGKILL stage 1: {r['migrated']} streams migrated ({r['migrations']} moves), "
              f"added latency p50 {r['gap_p50_s']} s p99 {r['gap_p99_s']} s")
        assert r["migrated"] >= 1  # the fault landed: the killed stage's worker lost its streams
        assert_outcomes(outcomes, ref, min_exact=N)
        dead, fresh = replaced(c, before)
        assert "pipeline" in dead[0].reason, dead  # its step failed, or (seen first) stage 1 exited
        assert len(fresh[0].ranks) == 2  # a new two-stage worker
        assert_nothing_held(c, load)

