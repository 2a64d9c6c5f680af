"""The worker registry's state machine, without Ray: STARTING → READY → DRAINING → STOPPED, DEAD
from any live state, nothing else; every change bumps the version, a probe's load does not."""

import pytest

from splitserve.control.registry import IllegalTransition, Registry
from splitserve.types import Role, WorkerId, WorkerLoad, WorkerState as S, WorkerStats
from splitserve.worker.info import WorkerInfo

INFO = WorkerInfo("node-a", "127.0.0.2", 1, ())


def test_a_worker_lives_and_ends_once():
    reg = Registry()
    wid = WorkerId.new(Role.PREFILL)
    assert str(wid).startswith("prefill-") and len(str(wid)) == len("prefill-") + 8
    reg.add(wid, handle="h")
    v = reg.version
    reg.move(wid, S.READY, info=INFO)
    assert reg.version == v + 1 and reg[wid].node_ip == "127.0.0.2"
    reg.observe(wid, WorkerLoad(WorkerStats(0, 1, 0, 8, 7, 0, 0, 0, 0)))
    assert reg.version == v + 1 and reg[wid].load.stats.num_running == 1  # load is not a registry change
    reg.move(wid, S.DRAINING)
    snap = reg.snapshot({Role.PREFILL: 0, Role.DECODE: 1})
    assert [w.state for w in snap.workers] == [S.DRAINING] and snap.version == reg.version
    reg.move(wid, S.STOPPED, reason="drained")
    assert wid not in reg and [r.reason for r in reg.ended()] == ["drained"]
    assert reg.ended()[0].handle is None  # an ended worker's handle is not kept
    reg.check_invariants()
    with pytest.raises(KeyError):
        reg.move(wid, S.READY)


@pytest.mark.parametrize("path", [
    [S.READY, S.READY], [S.DRAINING], [S.READY, S.STOPPED], [S.READY, S.DRAINING, S.READY],
])
def test_transitions_outside_the_state_machine_raise(path):
    reg = Registry()
    wid = WorkerId.new(Role.DECODE)
    reg.add(wid, None)
    with pytest.raises(IllegalTransition):
        for state in path:
            reg.move(wid, state, **({"info": INFO} if state is S.READY else {}))


def test_dead_from_every_live_state():
    for before in ([], [S.READY], [S.READY, S.DRAINING]):
        reg = Registry()
        wid = WorkerId.new(Role.DECODE)
        reg.add(wid, None)
        for state in before:
            reg.move(wid, state, **({"info": INFO} if state is S.READY else {}))
        reg.move(wid, S.DEAD, reason="its actor died")
        assert wid not in reg and reg.ended()[-1].state is S.DEAD


def test_ready_without_registration_info_breaks_the_invariant():
    reg = Registry()
    wid = WorkerId.new(Role.DECODE)
    reg.add(wid, None)
    reg.move(wid, S.READY)
    with pytest.raises(AssertionError, match="without registration info"):
        reg.check_invariants()


def test_an_unanswered_probe_is_a_registry_change_only_when_it_flips():
    reg = Registry()
    wid = WorkerId.new(Role.DECODE)
    reg.add(wid, None)
    reg.move(wid, S.READY, info=INFO)
    v = reg.version
    reg.set_silent(wid, None)
    assert reg.version == v  # no change
    reg.set_silent(wid, 100.0)
    reg.set_silent(wid, 101.0)  # still silent: when it began is kept, and routers need nothing new
    assert reg.version == v + 1 and reg[wid].slow and reg[wid].silent_since == 100.0
    assert reg[wid].state is S.READY  # slow is not a state: it stays READY (DEAD only past dead_after_s)
    reg.set_silent(wid, None)
    assert reg.version == v + 2 and not reg[wid].slow
