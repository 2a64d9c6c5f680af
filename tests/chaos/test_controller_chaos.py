"""The Controller is not a single point of failure (issue 30), on the three-node local Ray
cluster: SIGKILL of the app's Controller process while 16 greedy streams run on 1P+1D — Ray
restarts it, the new incarnation re-adopts the running workers (same processes), every stream
finishes with the uninterrupted run's tokens, a new request is served, and `status` and
`scale` answer again. And the same kill while a scale-up is in progress: the restarted
Controller finds the worker that was starting and does not start the pool twice."""

import os
import signal
import time

import pytest

from splitserve.orchestrator import Cluster
from splitserve.types import Role
from tests.chaos.harness import Load, assert_nothing_held, assert_outcomes, params, pid_of, prompts, reference

N, MAX_TOKENS = 16, 48
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


def controller_pid(c) -> int:
    import ray

    return ray.get(c.controller.__ray_call__.remote(lambda self: os.getpid()))


def kill_controller(c) -> int:
    """SIGKILL the Controller's process; returns the new incarnation's pid once Ray restarted it."""
    old = controller_pid(c)
    os.kill(old, signal.SIGKILL)
    return restarted(c, old)


def restarted(c, old: int) -> int:
    """The new Controller's pid, once Ray restarted the one whose pid was `old`."""
    import ray

    deadline = time.time() + 60
    while True:
        try:
            new = controller_pid(c)
            if new != old:
                return new
        except ray.exceptions.RayActorError:  # restarting
            pass
        assert time.time() < deadline, "Ray never restarted the Controller"
        time.sleep(0.2)


def live_workers(c, role: Role) -> list[str]:
    """The app's worker actors alive on the cluster (not only the ones its registry lists)."""
    import ray

    prefix = f"{c.cfg.name}:{role.value}-"
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == c.cfg.namespace and a["name"].startswith(prefix)]


def test_sigkill_the_controller_under_load(ray_session, model):
    ps = prompts(N, seed=31)
    sps = params(N, False, MAX_TOKENS)
    ref = reference(model, ps, sps)
    with Cluster.start(model=model, name="chaos-controller", prefill=1, decode=1, transport="auto",
                       disagg_min_tokens=0, num_kv_blocks=512) as c:
        workers = {pid_of(w) for w in c.prefills + c.decodes}
        old_pid = controller_pid(c)
        load = Load(c, ps, sps)
        load.wait_progress(3)
        os.kill(old_pid, signal.SIGKILL)
        at_kill = list(load.progress)  # every stream had 3 tokens before the kill, and not all after it
        new_pid = restarted(c, old_pid)
        # the fault landed: the Controller died while every stream was mid-flight, and a new one runs
        assert sum(p < MAX_TOKENS for p in at_kill) == N, at_kill
        assert new_pid != old_pid
        outcomes = load.result()
        assert_outcomes(outcomes, ref, min_exact=N)
        assert all(o.error is None for o in outcomes)
        assert {pid_of(w) for w in c.prefills + c.decodes} == workers  # the same processes, re-adopted
        st = c.status()
        assert [w.state for w in st.workers] == ["ready", "ready"] and controller_pid(c) == new_pid
        one = Load(c, ps[:1], sps[:1])  # a new request, through the restarted Controller's registry
        assert one.result(timeout=30)[0].tokens == ref[0]
        assert c.scale(decode=2) == {"prefill": 1, "decode": 2}
        c.wait_routable({"prefill": 1, "decode": 2})
        assert_nothing_held(c, load)


def test_sigkill_the_controller_during_a_scale_up(ray_session, model):
    with Cluster.start(model=model, name="chaos-controller-scale", prefill=1, decode=1, transport="auto",
                       disagg_min_tokens=0, num_kv_blocks=256) as c:
        c.scale(decode=2)
        deadline = time.time() + 30
        while len(live_workers(c, Role.DECODE)) < 2:  # the new worker exists (starting) before the kill
            assert time.time() < deadline
            time.sleep(0.05)
        starting = [w.id for w in c.status().workers if w.state == "starting"]
        kill_controller(c)
        assert len(starting) == 1, c.status().workers  # the fault landed mid-scale-up: one worker was starting
        c.wait_routable({"prefill": 1, "decode": 2}, timeout_s=90)
        time.sleep(2 * c.cfg.probe_interval_s)  # a few reconciles of the restarted Controller
        assert len(live_workers(c, Role.DECODE)) == 2 and len(live_workers(c, Role.PREFILL)) == 1
        st = c.status()
        assert sorted(w.state for w in st.workers) == ["ready"] * 3 and st.targets == {"prefill": 1, "decode": 2}
        assert c.generate([[5, 6, 7]], None)[0].outputs[0].token_ids
