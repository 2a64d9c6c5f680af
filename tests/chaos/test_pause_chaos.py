"""Pauses (issue 50, DESIGN.md §4 "Liveness": slow is not dead), on the three-node local Ray
cluster, 16 greedy streams through the ingress's own Frontend + RequestLease, a decode worker
SIGSTOPped mid-way:

  * for 3 s, then SIGCONT, the pool's only decode worker: it is seen slow and its streams stand
    still while stopped (the pause landed), 4 more requests sent during the pause are placed on
    it and wait rather than being refused; every stream finishes exactly, nothing migrates;
  * past the streams' inactivity timeout, then resumed: its streams move on to the other decode
    worker and finish exactly; the resumed worker gets their aborts and frees what it held;
  * past the dead bound (`dead_after_s`, short here): the Controller declares it DEAD and kills
    it while its streams are mid-flight; they migrate and finish exactly.

Afterwards every live worker holds no block, lease or handoff and admission is back to zero."""

import os
import signal
import time

import pytest

from splitserve.types import Role
from tests.chaos.harness import (Load, assert_nothing_held, assert_outcomes, busiest_record, migration_report, params,
                                 pid_of, prompts, reference)
from tests.chaos.harness import streamed_cluster as cluster

N, MORE, MAX_TOKENS, PAUSE_S = 16, 4, 64, 3.0
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def work(model):
    ps = prompts(N + MORE, seed=23)
    sps = params(N + MORE, False, MAX_TOKENS)
    return ps, sps, reference(model, ps, sps)


def report(name, c, outcomes, started):
    r = migration_report(c)
    errors = sum(o.error is not None for o in outcomes)
    print(f"\npause {name}: {len(outcomes)} streams, {errors} errors, {r['migrated']} migrated "
          f"({r['migrations']} moves), added latency p50 {r['gap_p50_s']} s, {time.time() - started:.1f} s")
    return r


def wait_until(cond, timeout: float, what: str):
    deadline = time.time() + timeout
    while not (got := cond()):
        assert time.time() < deadline, what
        time.sleep(0.02)
    return got


def test_a_decode_worker_paused_for_3_s_is_waited_for(ray_session, model, work):
    ps, sps, ref = work
    started = time.time()
    # the defaults: a probe timeout of 1 s, the dead bound and the inactivity timeout far above 3 s
    with cluster(model, "pause-short", decode=1) as c:
        (rec,) = [r for r in c.directory.records.values() if r.role is Role.DECODE]
        load = Load(c, ps[:N], sps[:N])
        load.wait_progress(3)
        pid = pid_of(rec.handle)
        os.kill(pid, signal.SIGSTOP)
        stopped = time.time()
        try:
            wait_until(lambda: c.directory.slow(rec.id), PAUSE_S, "the paused worker was never seen slow")
            still = list(load.progress)
            # sent while it is paused, to the pool's only decode worker: placed there, not refused
            more = Load(c, ps[N:], sps[N:])
            time.sleep(max(0.0, stopped + PAUSE_S - time.time()))
            paused_progress = list(load.progress)
            ready_while_paused = c.backend.ready()
            status = [w for w in c.status().workers if w.id == str(rec.id)]
        finally:
            os.kill(pid, signal.SIGCONT)
        # the pause landed: streams mid-flight stood still while it was stopped, and it was slow, not dead
        assert all(3 <= p < MAX_TOKENS for p in still), still
        assert paused_progress == still, (still, paused_progress)
        assert ready_while_paused
        assert status and status[0].state == "ready" and status[0].slow, status
        outcomes = load.result() + more.result()
        r = report("3 s", c, outcomes, started)
        assert all(o.error is None for o in outcomes), [o.error for o in outcomes]  # none refused
        assert_outcomes(outcomes, ref, min_exact=N + MORE)
        assert r["migrated"] == 0
        assert wait_until(lambda: not c.directory.slow(rec.id), 10, "it never answered again")
        assert [w.state for w in c.status().workers if w.id == str(rec.id)] == ["ready"]
        assert_nothing_held(c, load)
        assert_nothing_held(c, more)


def test_a_decode_worker_paused_past_the_inactivity_timeout(ray_session, model, work):
    ps, sps, ref = work
    ps, sps, ref = ps[:N], sps[:N], ref[:N]
    started = time.time()
    with cluster(model, "pause-inactive", decode_inactivity_timeout_s=1.5) as c:
        load = Load(c, ps, sps)
        load.wait_progress(3)
        # the busiest decode worker, asked itself (the directory's view may be a poll old, and it
        # once named an idle one: nothing to move): placement may have put every stream on one
        pid = pid_of(busiest_record(c).handle)
        os.kill(pid, signal.SIGSTOP)
        try:
            # its streams move on once silent for the inactivity timeout: resumed only after every
            # stream has delivered past where it stood at the stop (the stopped worker's, elsewhere)
            load.wait_progress_past(list(load.progress))
        finally:
            os.kill(pid, signal.SIGCONT)
        outcomes = load.result()
        r = report("past the inactivity timeout", c, outcomes, started)
        assert r["migrated"] >= 1  # the pause landed: streams moved
        assert_outcomes(outcomes, ref, min_exact=N)
        assert_nothing_held(c, load)  # the resumed worker got its aborts and freed


def test_a_decode_worker_paused_past_the_dead_bound(ray_session, model, work):
    ps, sps, ref = work
    ps, sps, ref = ps[:N], sps[:N], ref[:N]
    started = time.time()
    with cluster(model, "pause-dead", dead_after_s=4.0) as c:
        load = Load(c, ps, sps)
        load.wait_progress(3)
        victim = busiest_record(c)
        pid, wid = pid_of(victim.handle), victim.id
        os.kill(pid, signal.SIGSTOP)
        try:
            dead = wait_until(lambda: [w for w in c.status().workers if w.id == str(wid) and w.state == "dead"], 30,
                              "the paused worker was never declared dead")
            at_death = list(load.progress)
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:  # killed by the Controller, as it should be
                pass
        assert "no answer to health probes" in dead[0].reason, dead
        assert any(p < MAX_TOKENS for p in at_death), at_death  # streams were mid-flight when it died
        outcomes = load.result()
        r = report("past the dead bound", c, outcomes, started)
        assert r["migrated"] >= 1
        assert all(o.error is None for o in outcomes), [o.error for o in outcomes]
        assert_outcomes(outcomes, ref, min_exact=N)
        assert_nothing_held(c, load)
