"""The pieces a Controller restart and the pools' hygiene rest on (issue 30), without Ray: the
saved state round-trips without handles; a restored registry is past every version routers saw
and records the workers it lost; a restarted Controller waits for its owners only if it had
some; start failures back off exponentially and reset; pools are bounded; a gone worker's
metric series are dropped. The real restart under load is tests/chaos/test_controller_chaos.py."""

from __future__ import annotations

import pickle
import time

import pytest

from splitserve.control.deploy_config import DeployConfig
from splitserve.control.owners import ORPHAN_GRACE_S, Owners
from splitserve.control.persisted import ControllerState, worker_name
from splitserve.control.registry import Registry
from splitserve.control.start_backoff import MAX_S, StartBackoff
from splitserve.metrics import Metrics
from splitserve.types import ConfigError, Role, WorkerId, WorkerState as S
from splitserve.worker.info import WorkerInfo


def info() -> WorkerInfo:
    return WorkerInfo(node_id="n1", node_ip="127.0.0.2", pid=1, endpoints=())


@pytest.fixture
def model(tiny_checkpoint):
    return tiny_checkpoint("llama")


def test_the_saved_state_round_trips_without_handles(model):
    reg = Registry()
    a, b = WorkerId.new(Role.PREFILL), WorkerId.new(Role.DECODE)
    reg.add(a, handle=object())  # an unpicklable handle: never saved
    reg.add(b, handle=object())
    reg.move(b, S.READY, info=info())
    cfg = DeployConfig(model=str(model), prefill=1, decode=1)
    state = pickle.loads(pickle.dumps(ControllerState.of(cfg, {Role.PREFILL: 1, Role.DECODE: 2}, reg.version,
                                                          list(reg), owned=True)))
    assert state.cfg == cfg and dict(state.targets) == {Role.PREFILL: 1, Role.DECODE: 2} and state.owned
    assert {(w.id, w.state, w.handle) for w in state.workers} == {(a, S.STARTING, None), (b, S.READY, None)}
    assert worker_name(cfg, a) == f"splitserve:{a}"


def test_a_restored_registry_is_newer_than_any_snapshot_and_records_the_lost():
    old = Registry()
    kept, lost = WorkerId.new(Role.DECODE), WorkerId.new(Role.PREFILL)
    for w in (kept, lost):
        old.add(w, None)
        old.move(w, S.READY, info=info())
    reg = Registry()
    reg.restore([old[kept]], old.version)
    reg.record_lost(old[lost], "lost while the Controller restarted")
    assert reg.version > old.version and [r.id for r in reg] == [kept]
    (ended,) = reg.ended()
    assert ended.id == lost and ended.state is S.DEAD and "restarted" in ended.reason
    reg.check_invariants()
    reg.move(kept, S.DRAINING)  # a restored worker goes on through its state machine


def test_a_restarted_controller_waits_for_owners_only_if_it_had_some():
    owned = Owners()
    owned.expect(grace_s=0.05)
    assert owned.owned and not owned.orphaned()
    time.sleep(0.1)
    assert owned.orphaned()  # nobody came back: the app was deleted meanwhile
    owned.attach("replica", None)
    assert not owned.orphaned(0.0)
    back = Owners()
    back.expect(grace_s=30)
    back.attach("replica", None)  # came back in time
    back.detach("replica")
    assert not back.orphaned(ORPHAN_GRACE_S)  # and then the usual grace applies
    assert not Owners().owned  # the offline Cluster: never attached, never orphaned


def test_start_failures_back_off_exponentially_and_reset_when_one_starts():
    now = [100.0]
    b = StartBackoff(clock=lambda: now[0])
    assert b.may_spawn(Role.DECODE)
    waits = []
    for k in range(9):
        b.failed(Role.DECODE, f"failed to start: OSError {k}")
        assert not b.may_spawn(Role.DECODE) and b.may_spawn(Role.PREFILL)
        t0 = now[0]
        while not b.may_spawn(Role.DECODE):
            now[0] += 0.25
        waits.append(now[0] - t0)
    assert waits[:4] == [1.0, 2.0, 4.0, 8.0] and max(waits) == MAX_S
    assert "9 worker starts failed (last: failed to start: OSError 8)" in b.messages()["decode"]
    b.started(Role.DECODE)
    assert b.may_spawn(Role.DECODE) and b.messages() == {}


def test_pools_are_bounded(model):
    assert DeployConfig(model=str(model), decode=64).max_pool_size == 64
    with pytest.raises(ConfigError, match="above max_pool_size"):
        DeployConfig(model=str(model), decode=65)
    with pytest.raises(ConfigError, match="max_pool_size"):
        DeployConfig(model=str(model), max_pool_size=0)


def test_a_gone_workers_metric_series_are_dropped():
    m = Metrics()
    for w in ("decode-a", "decode-b"):
        m.kv_usage.labels(role="decode", worker=w).set(0.5)
        m.step_time.labels(role="decode", worker=w, term="c0").set(0.01)
        m.expert_tokens.labels(role="decode", worker=w, expert="0").set(3)
    m.forget_workers({"decode-a"})
    text = m.exposition().decode() if isinstance(m.exposition(), bytes) else m.exposition()
    assert 'worker="decode-a"' in text and 'worker="decode-b"' not in text


def test_the_app_keeps_its_kv_secret_across_rebuilds(model, monkeypatch):
    """Every ingress replica start (a rebuild, a config change) makes a new DeployConfig: without a
    kv_secret of its own it takes the app's, which the Controller made once (and persists), so
    workers it keeps and workers it starts still accept each other's KV readers — and a replica
    restart is no config change. A kv_secret given explicitly (a rotation) replaces every worker."""
    import asyncio

    from splitserve.control import controller as controller_mod

    monkeypatch.setattr(controller_mod.persisted, "load", lambda cfg: None)  # a first start, no Ray
    opts = {"model": str(model), "prefill": 1, "decode": 1}
    ctl = controller_mod.Controller(DeployConfig.from_options(opts))
    secret = ctl.cfg.kv_secret
    assert len(bytes.fromhex(secret)) == 32
    reconciled: list = []
    monkeypatch.setattr(ctl, "_reconcile", lambda: reconciled.append(1))  # no pools to start here
    wid = WorkerId.new(Role.DECODE)
    ctl.registry.add(wid, handle=None)
    ctl.registry.move(wid, S.READY, info=info())

    rebuilt = DeployConfig.from_options(opts)  # what a restarted ingress replica sends
    assert rebuilt.kv_secret is None
    asyncio.run(ctl.configure(rebuilt))
    assert ctl.cfg.kv_secret == secret and not reconciled and ctl.registry[wid].state is S.READY
    asyncio.run(ctl.configure(DeployConfig.from_options({**opts, "kv_secret": "ab" * 32})))
    assert ctl.cfg.kv_secret == "ab" * 32 and reconciled and ctl.registry[wid].state is S.DRAINING


def test_kv_secret_from_a_file(model, tmp_path):
    """kv_secret_file (the chart's mounted Secret): read once where the config is made, then
    carried as kv_secret (a copy made on another node does not look for the file); unreadable,
    too short, or given twice: a ConfigError that names the file, never its content."""
    import dataclasses

    path = tmp_path / "kv_secret"
    path.write_text("cd" * 32 + "\n")
    cfg = DeployConfig.from_options({"model": str(model), "kv_secret_file": str(path)})
    assert cfg.kv_secret == "cd" * 32 and cfg.kv_secret_file is None
    path.unlink()
    assert dataclasses.replace(cfg, decode=2).kv_secret == "cd" * 32  # no second read
    with pytest.raises(ConfigError, match="kv_secret_file .*cannot be read"):
        DeployConfig.from_options({"model": str(model), "kv_secret_file": str(path)})
    path.write_text("short-and-not-hex")
    with pytest.raises(ConfigError, match="at least 32 hex digits") as refused:
        DeployConfig.from_options({"model": str(model), "kv_secret_file": str(path)})
    assert "short-and-not-hex" not in str(refused.value)
    with pytest.raises(ConfigError, match="not both"):
        DeployConfig.from_options({"model": str(model), "kv_secret_file": str(path), "kv_secret": "ab" * 32})
