"""Losing an ingress replica (issue 30), on the three-node local Ray cluster: two replicas over
one 1P+1D app — this process's, and one in a process of its own (tests/fakes/ingress.py: the
replica's real ClusterBackend, Frontend and RequestLease) — each running 8 streams. SIGKILL the
second one mid-stream: this replica's streams all finish with the uninterrupted run's tokens,
and the killed one's requests are stopped on the workers — no block in use, no lease, no
handoff, no running sequence anywhere — long before they would have finished by themselves."""

import os
import signal
import time

import pytest
import ray

from splitserve.orchestrator import Cluster
from splitserve.types import SamplingParams
from tests.chaos.harness import Load, assert_nothing_held, assert_outcomes, params, prompts, reference
from tests.fakes.ingress import IngressReplica

N, MAX_TOKENS = 8, 48
LONG = 900  # the killed replica's streams: far longer than this test, if nobody stopped them
pytestmark = pytest.mark.timeout(300)


def test_sigkill_one_of_two_ingress_replicas(ray_session, tiny_checkpoint):
    model = str(tiny_checkpoint("llama"))
    ps = prompts(2 * N, seed=41)
    sps = params(N, False, MAX_TOKENS)
    ref = reference(model, ps[:N], sps)
    with Cluster.start(model=model, name="chaos-ingress", prefill=1, decode=1, transport="auto",
                       disagg_min_tokens=0, num_kv_blocks=512) as c:
        other = IngressReplica.remote(c.cfg, c.controller)
        pid = ray.get(other.start.remote())
        ray.get(other.run.remote(ps[N:], [SamplingParams(temperature=0, max_tokens=LONG, ignore_eos=True)] * N))
        load = Load(c, ps[:N], sps)
        deadline = time.time() + 60
        while min(ray.get(other.report.remote())) < 3:  # its streams are running on the workers
            assert time.time() < deadline
            time.sleep(0.05)
        load.wait_progress(3)
        os.kill(pid, signal.SIGKILL)
        killed = time.time()
        with pytest.raises(ray.exceptions.RayActorError):  # the fault landed: that replica is gone
            ray.get(other.report.remote(), timeout=30)
        outcomes = load.result()
        assert_outcomes(outcomes, ref, min_exact=N)
        assert all(o.error is None for o in outcomes)
        assert_nothing_held(c, load, timeout=60)
        freed_s = time.time() - killed
        # the decode worker found that replica gone and aborted its streams (not run to LONG)
        assert ray.get(c.decodes[0].__ray_call__.remote(lambda w: w.callers.gone)) == 1
        print(f"\ningress loss: the killed replica's {N} streams freed on the workers {freed_s:.1f} s after the kill")
