"""What this machine notes for a Ray cluster we start (issue 50): RAY_TMPDIR's
ray/ray_current_cluster, where `ray start` notes its own, so that `status` and `scale` find it.
A note is trusted only while its cluster lives: ours goes when the cluster ends, and one a
killed cluster left (SIGKILL runs no cleanup) is dropped with a one-line notice when its GCS
does not answer — unless the user named the address (RAY_ADDRESS, --address): then the clear
error stays. No Ray is started here; tests/integration/test_cluster_record.py runs the real
thing: `Cluster.start` twice in one process, then after a killed one."""

from __future__ import annotations

import socket

import pytest

from splitserve.control import launch
from splitserve.control.deploy_config import DeployConfig
from splitserve.types import ConfigError
from tests.loopback import ip

HOST = ip(77)  # not 127.0.0.1, which Ray reads as this node's own IP


@pytest.fixture
def ray_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    (tmp_path / "ray").mkdir()
    yield tmp_path / "ray" / "ray_current_cluster"
    launch.forget_local_address()


def a_port_nothing_listens_on() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def test_a_note_whose_cluster_is_gone_is_dropped_with_a_notice(ray_tmp, capsys):
    dead = f"{HOST}:{a_port_nothing_listens_on()}"
    ray_tmp.write_text(dead)
    assert launch._running_here(None) is None  # nothing runs here: the caller starts a fresh cluster
    assert not ray_tmp.exists()
    notice = capsys.readouterr().err.strip().splitlines()
    assert notice == [f"splitserve: ignoring the Ray cluster noted at {dead} (Connection refused): it ended "
                      f"without removing its note"]


def test_a_note_whose_cluster_answers_is_the_one_joined(ray_tmp, capsys):
    with socket.socket() as gcs:
        gcs.bind((HOST, 0))
        gcs.listen()
        live = f"{HOST}:{gcs.getsockname()[1]}"
        ray_tmp.write_text(live)
        assert launch._running_here(None) == live
    assert ray_tmp.read_text() == live and capsys.readouterr().err == ""


def test_an_address_the_user_named_keeps_the_clear_error(ray_tmp, monkeypatch):
    dead = f"{HOST}:{a_port_nothing_listens_on()}"
    ray_tmp.write_text(dead)
    monkeypatch.setenv("RAY_ADDRESS", dead)
    assert launch._running_here(None) == dead  # named: not second-guessed, the note stays
    assert ray_tmp.read_text() == dead
    with pytest.raises(ConfigError, match=rf"^cannot reach a Ray cluster at {dead} \(Connection refused\): start one "):
        launch._check_answers(HOST, int(dead.rpartition(":")[2]))


def test_our_note_goes_when_our_cluster_ends_and_another_ones_stays(ray_tmp):
    launch._note_address("127.0.0.1:6379")
    assert ray_tmp.read_text() == "127.0.0.1:6379"
    launch.forget_local_address()
    assert not ray_tmp.exists()
    launch._note_address("127.0.0.1:6379")
    ray_tmp.write_text("127.0.0.1:6380")  # `ray start` noted a cluster of its own since
    launch.forget_local_address()
    assert ray_tmp.read_text() == "127.0.0.1:6380"


def test_a_local_cluster_counts_a_cpu_for_every_rank_the_pools_may_take(tiny_checkpoint):
    cfg = DeployConfig(str(tiny_checkpoint("llama")), prefill=1, decode=1, max_pool_size=8, decode_tp=2)
    assert launch.local_cpus(cfg) == 8 * 1 + 8 * 2
