"""The Controller's health probe tells slow from dead (DESIGN.md §4 "Liveness"), without a Ray
cluster: a Controller over fake worker handles whose `load` answers late, is refused as
unreachable for a while (Ray's ActorUnavailableError), never answers, dies, or reports its
engine stopped. Late and unreachable are slow — `silent_since` while it lasts, READY
throughout —; DEAD only for a death, a stopped engine, or silence past `dead_after_s`."""

from __future__ import annotations

import asyncio

import pytest
import ray

from splitserve.control import controller as controller_mod
from splitserve.control.deploy_config import DeployConfig
from splitserve.types import Role, WorkerId, WorkerLoad, WorkerState as S
from tests.fakes.cluster import Call, stats
from splitserve.worker.info import WorkerInfo


class FakeHandle:
    """`load` answers each call by the next step of `script`: ("ok", _) answers, ("late", s)
    answers after s seconds, ("unreachable", s) is refused after s seconds, ("silent",) never
    answers, ("dies",) raises a death, ("stopped",) reports its engine stopped; the last step
    repeats."""

    def __init__(self, script):
        self.script, self.load = list(script), Call(self._load)
        self.answered = 0

    async def _load(self):
        step = self.script[0] if len(self.script) == 1 else self.script.pop(0)
        kind = step[0]
        if kind == "late":
            await asyncio.sleep(step[1])
        elif kind == "unreachable":
            await asyncio.sleep(step[1])
            raise ray.exceptions.ActorUnavailableError("cannot reach the actor for now", None)
        elif kind == "silent":
            await asyncio.Event().wait()
        elif kind == "dies":
            raise ray.exceptions.ActorDiedError()
        elif kind == "stopped":
            return WorkerLoad(stats(), failure="3 engine steps in a row failed")
        self.answered += 1
        return WorkerLoad(stats())


@pytest.fixture
def controller(tiny_checkpoint, monkeypatch):
    monkeypatch.setattr(controller_mod.persisted, "load", lambda cfg: None)
    monkeypatch.setattr(controller_mod.persisted, "save", lambda state: None)
    monkeypatch.setattr(controller_mod.ray, "kill", lambda handle, no_restart=True: None)
    cfg = DeployConfig(model=str(tiny_checkpoint("llama")), prefill=0, decode=1, probe_interval_s=0.01,
                       probe_timeout_s=0.05, dead_after_s=1.5)
    return controller_mod.Controller(cfg)


def probe(c, script, watch_s: float):
    """Register one READY decode worker, probe it for `watch_s`; every registry record of it
    seen meanwhile (its state and silent_since), and how it ended (None: still live)."""
    async def go():
        wid = WorkerId.new(Role.DECODE)
        handle = FakeHandle(script)
        c.registry.add(wid, handle)
        c.registry.move(wid, S.READY, info=WorkerInfo("n", "127.0.0.2", 1, ()))
        task = asyncio.ensure_future(c._probe(wid))
        seen = []
        for _ in range(int(watch_s / 0.01)):
            if wid in c.registry:
                seen.append((c.registry[wid].state, c.registry[wid].slow))
            await asyncio.sleep(0.01)
        task.cancel()
        ended = next((r for r in c.registry.ended() if r.id == wid), None)
        return seen, ended, handle

    return asyncio.run(go())


@pytest.mark.parametrize("steps", [[("late", 0.3)], [("unreachable", 0.0)] * 10], ids=["late", "unreachable"])
def test_a_worker_late_or_unreachable_for_a_while_is_slow_then_well_never_dead(controller, steps):
    seen, ended, handle = probe(controller, [("ok", 1), *steps, ("ok", 1)], 1.0)
    assert ended is None, ended.reason
    assert (S.READY, True) in seen  # slow while it lasted, READY throughout
    assert {state for state, _ in seen} == {S.READY}
    assert seen[-1] == (S.READY, False) and handle.answered > 2  # it answers again: not slow


def test_a_worker_silent_past_the_dead_bound_is_dead(controller):
    seen, ended, _ = probe(controller, [("ok", 1), ("silent",)], 2.5)
    assert (S.READY, True) in seen  # slow first
    assert ended is not None and ended.state is S.DEAD and "no answer to health probes for 1.5 s" in ended.reason


@pytest.mark.parametrize("kind, why", [("dies", "its actor died"), ("stopped", "its engine stopped")])
def test_a_worker_whose_actor_died_or_engine_stopped_is_dead_at_once(controller, kind, why):
    seen, ended, _ = probe(controller, [("ok", 1), (kind,)], 0.3)
    assert ended is not None and ended.state is S.DEAD and why in ended.reason, ended
    assert (S.READY, True) not in seen  # never taken for slow on the way


def test_status_and_metrics_show_a_slow_worker_apart_from_a_dead_one():
    """`splitserve status` (its JSON and its table) and /metrics say slow for a worker whose probes
    go unanswered; it stays `ready` there, and a dead one is `dead`, never slow."""
    import time

    from splitserve.control.admin import status_table
    from splitserve.control.registry import Registry
    from splitserve.control.status import ClusterStatus, status_row
    from splitserve.router.policy import WorkerView
    from tests.fake_backend import exported

    reg = Registry()
    slow, dead = WorkerId.new(Role.DECODE), WorkerId.new(Role.DECODE)
    for w in (slow, dead):
        reg.add(w, None)
        reg.move(w, S.READY, info=WorkerInfo("n", "127.0.0.2", 1, ()))
    reg.set_silent(slow, time.time() - 3.0)
    reg.move(dead, S.DEAD, reason="no answer to health probes for 60 s")
    rows = tuple(status_row(r) for r in [*reg, *reg.ended()])
    st = ClusterStatus({"prefill": 0, "decode": 2}, rows, {}, reg.version)
    by_id = {w["id"]: w for w in st.to_json()["workers"]}
    assert by_id[str(slow)]["state"] == "ready" and by_id[str(slow)]["slow"] and by_id[str(slow)]["silent_s"] >= 3.0
    assert by_id[str(dead)]["state"] == "dead" and not by_id[str(dead)]["slow"]
    table = status_table(st)
    assert f"{slow}  decode  ready, slow" in table and "dead" in table, table
    m = exported([WorkerView(str(slow), "decode", "h", slow=True), WorkerView("decode-b", "decode", "h")])
    assert m.slow.labels(role="decode", worker=str(slow))._value.get() == 1
    assert m.slow.labels(role="decode", worker="decode-b")._value.get() == 0
