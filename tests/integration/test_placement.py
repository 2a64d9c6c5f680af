"""A pool Ray cannot place says so, in our words, instead of leaving its caller waiting: a
worker no node of the cluster could hold fails `Cluster.start` at once with what it needs; one
that the cluster could hold but not with what other workers left free fails it once it has
waited `unplaced_s`. Either way nothing stays behind (tests/leaks.py checks)."""

from __future__ import annotations

import re

import pytest

from splitserve.orchestrator import Cluster
from splitserve.types import ConfigError

pytestmark = pytest.mark.timeout(120)  # a hang guard; the errors come within seconds


def test_a_worker_no_node_can_hold_is_refused_with_what_it_needs(ray_session, tiny_checkpoint):
    with pytest.raises(ConfigError) as e:
        Cluster.start(model=str(tiny_checkpoint("llama")), prefill=0, decode=1, transport="tcp", num_kv_blocks=64,
                      decode_resources={"gpu_island": 1})
    assert str(e.value) == ("cannot place a decode worker: it needs 1 CPU + 1 gpu_island on one node, and no node "
                            "of the cluster has that much")


def test_a_worker_the_busy_cluster_cannot_hold_says_what_is_free(ray_session, tiny_checkpoint):
    """The decode node has 3 CPUs: a pool of two 2-rank workers fits one, not both."""
    with pytest.raises(ConfigError) as e:
        Cluster.start(model=str(tiny_checkpoint("llama")), prefill=0, decode=2, decode_tp=2, transport="tcp",
                      num_kv_blocks=64, decode_resources={"decode_node": 1}, unplaced_s=1.0)
    assert re.fullmatch(r"cannot place a decode worker: it needs 2 CPUs \+ 1 decode_node on one node; no node has "
                        r"that free now \(the cluster has \d+ CPUs \+ 2 decode_node free in all\)", str(e.value)), e.value


def test_scale_and_status_say_at_once_why_a_new_worker_waits(ray_session, tiny_checkpoint):
    """The decode node has 3 decode_node: a second worker asking 2 cannot join the first. `scale`
    answers with why it waits and what would place it, and `status` shows that in its table."""
    from splitserve.control import admin

    with Cluster.start(model=str(tiny_checkpoint("llama")), prefill=0, decode=1, transport="tcp", num_kv_blocks=64,
                       decode_resources={"decode_node": 2}) as c:
        said = admin.scale("auto", c.cfg.name, c.cfg.namespace, None, 2).splitlines()
        why = (r"cannot place a decode worker: it needs 1 CPU \+ 2 decode_node on one node; no node has that free "
               r"now \(the cluster has \d+ CPUs \+ 1 decode_node free in all\) — it starts when that much is freed "
               r"\(scale a pool down\) or a node with it joins the cluster")
        assert said[0] == "targets: prefill 0, decode 2" and len(said) == 2, said
        waiting = said[1].split()[0]
        assert re.fullmatch(rf"{waiting} waits: {why}", said[1]), said
        (row,) = [line for line in admin.status_table(c.status()).splitlines() if line.startswith(waiting)]
        assert row.split()[1:4] == ["decode", "starting", "-"] and re.search(rf"  {why}$", row), row
        assert admin.scale("auto", c.cfg.name, c.cfg.namespace, None, 1) == "targets: prefill 0, decode 1"
