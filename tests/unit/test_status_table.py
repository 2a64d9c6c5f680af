"""What `splitserve status` and `splitserve scale` show when a worker does not run as asked (issue
50): a worker Ray has not placed says why and what would place it in the table's NOTE column,
as a dead one says why it died; CPU workers beyond a local machine's cores are said to share
them. The Controller's side on a real cluster: tests/integration/test_placement.py."""

from __future__ import annotations

import pytest

from splitserve.control.admin import status_table
from splitserve.control.deploy_config import DeployConfig
from splitserve.control.registry import Registry
from splitserve.control.status import ClusterStatus, cores_shared, status_row
from splitserve.control.unplaced import diagnose
from splitserve.types import Role, WorkerId, WorkerState as S
from splitserve.worker.info import WorkerInfo


@pytest.fixture
def cfg(tiny_checkpoint):
    return DeployConfig(str(tiny_checkpoint("llama")), prefill=1, decode=1)


def test_an_unplaced_worker_says_in_the_table_why_it_waits_and_what_would_place_it():
    reg = Registry()
    ready, waiting, dead = WorkerId.new(Role.DECODE), WorkerId.new(Role.PREFILL), WorkerId.new(Role.PREFILL)
    for w in (ready, waiting, dead):
        reg.add(w, None)
    reg.move(ready, S.READY, info=WorkerInfo(node_id="n1", node_ip="127.0.0.2", pid=1, endpoints=()))
    reg.move(dead, S.DEAD, reason="its actor died (RayActorError)")
    why = diagnose(Role.PREFILL, {"CPU": 1}, [{"CPU": 2}], {"CPU": 0}, joined=True)
    rows = [status_row(reg[ready]), status_row(reg[waiting], why), *map(status_row, reg.ended())]
    table = status_table(ClusterStatus({"prefill": 2, "decode": 1}, tuple(rows), {}, reg.version)).splitlines()
    assert table[1].split() == ["ID", "ROLE", "STATE", "NODE", "WAITING", "RUNNING", "KV", "USAGE", "TP", "RANKS",
                                "NOTE"]
    (line,) = [x for x in table if x.startswith(str(waiting))]
    assert line.split()[:4] == [str(waiting), "prefill", "starting", "-"]
    assert line.endswith("cannot place a prefill worker: it needs 1 CPU on one node; no node has that free now (the "
                         "cluster has 0 CPUs free in all) — it starts when that much is freed (scale a pool down) "
                         "or a node with it joins the cluster")
    (line,) = [x for x in table if x.startswith(str(dead))]
    assert line.endswith("its actor died (RayActorError)")
    (line,) = [x for x in table if x.startswith(str(ready))]
    assert line.split()[3] == "127.0.0.2" and line.endswith("-")  # nothing to note: the TP RANKS column ends it


def test_what_would_place_a_worker_depends_on_whether_the_cluster_can_grow():
    local = diagnose(Role.DECODE, {"CPU": 1, "GPU": 0.5}, [{"CPU": 2, "GPU": 1}], {"CPU": 1}, joined=False)
    assert not local.infeasible and local.remedy == "it starts when that much is freed: scale a pool down"
    never = diagnose(Role.DECODE, {"CPU": 1, "GPU": 1}, [{"CPU": 2}], {"CPU": 1}, joined=False)
    assert never.infeasible and never.remedy.startswith("this machine never has that much")
    joined = diagnose(Role.DECODE, {"CPU": 1, "GPU": 1}, [{"CPU": 2}], {"CPU": 1}, joined=True)
    assert joined.remedy == "it starts when a node that has that much joins the cluster"
    assert joined.describe() == f"{joined.message} — {joined.remedy}"


def test_cpu_workers_beyond_a_local_machines_cores_are_said_to_share_them(cfg):
    note = cores_shared(cfg, {"prefill": 2, "decode": 1}, cluster_gpus=0, cores=2)
    assert note.startswith("3 CPU worker processes share this machine's 2 cores: each runs slower")
    table = status_table(ClusterStatus({"prefill": 2, "decode": 1}, (), {}, 0, sharing=note))
    assert f"sharing: {note}" in table.splitlines()
    assert cores_shared(cfg, {"prefill": 1, "decode": 1}, cluster_gpus=0, cores=2) == ""
    assert cores_shared(cfg, {"prefill": 2, "decode": 1}, cluster_gpus=1, cores=2) == ""  # GPU workers
