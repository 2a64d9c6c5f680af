"""NixlTransport's release ordering, with a scripted fake agent (tests/fakes/nixl_agent.py): runs
without NIXL. The decode worker's contract is "release, poll until not PENDING, then free the
blocks", so a released handle must stay PENDING while the poster is inside transfer() or a posted
READ is in flight, and NIXL's request is freed only once nothing of it can write."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
from tests.fakes.nixl_agent import install

import splitserve.kv_transfer.nixl as nixl_transport
from splitserve.kv_transfer.base import KVHandoff, KVLayout, TransferHeader, TransferState
from splitserve.kv_transfer.nixl import NixlTransport

pytestmark = pytest.mark.timeout(30)

LAYOUT = KVLayout(2, 8, 4, 1, 4, "float32", 4, "fp-test")


def storage() -> torch.Tensor:
    return torch.zeros(LAYOUT.storage_bytes // 4)


def handoff(endpoint, blocks) -> KVHandoff:
    header = TransferHeader("req", "fp-test", "float32", 4, 2, len(blocks), 1)
    return KVHandoff("req", 0, None, 4 * len(blocks), 0, tuple(blocks), endpoint, "lease", time.time() + 60, header, 0)


@pytest.fixture()
def nixl(monkeypatch):
    """(decode transport, its fake agent, the peer's endpoint)."""
    agents = install(monkeypatch)
    peer = NixlTransport(agent_name="peer")
    endpoint = peer.register(storage(), LAYOUT, "host-a")
    decode = NixlTransport(agent_name="decode")
    decode.register(storage(), LAYOUT, "host-b")
    yield decode, agents["decode"], endpoint
    decode.close()
    peer.close()


def stays_pending(transport, handle, seconds: float = 0.05) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if transport.poll(handle).state is not TransferState.PENDING:
            return False
    return True


def test_release_during_the_post_waits_for_the_poster_and_the_read(nixl):
    transport, agent, ep = nixl
    agent.post_gate.clear()
    handle = transport.read(handoff(ep, [0, 1]), [2, 3])
    assert agent.posting.wait(5)  # the poster is inside transfer()
    transport.release(handle)
    assert stays_pending(transport, handle)  # a READ may be going out
    agent.post_gate.set()
    handle.started.result(timeout=5)  # the poster has left transfer(): the READ is in flight
    assert stays_pending(transport, handle)
    (xfer,) = agent.posted
    xfer.finish()
    status = transport.poll(handle)
    assert status.state is TransferState.FAILED and status.reason.kind == "aborted", status
    assert xfer.released and agent.unsafe_releases == []


def test_release_of_a_queued_read_never_posts_it(nixl):
    transport, agent, ep = nixl
    agent.post_gate.clear()
    first = transport.read(handoff(ep, [0]), [0])
    assert agent.posting.wait(5)
    queued = transport.read(handoff(ep, [1]), [1])  # behind the first on the one poster thread
    transport.release(queued)
    status = transport.poll(queued)
    assert status.state is TransferState.FAILED and status.reason.kind == "aborted", status
    agent.post_gate.set()
    first.started.result(timeout=5)
    agent.posted[0].finish()
    assert transport.poll(first).state is TransferState.DONE
    transport.release(first)
    assert len(agent.posted) == 1 and agent.unsafe_releases == []


def test_release_during_the_connect_never_posts(nixl):
    transport, agent, ep = nixl
    agent.connect_gate.clear()
    handle = transport.read(handoff(ep, [0, 1]), [0, 1])
    assert agent.connecting.wait(5)
    transport.release(handle)
    assert stays_pending(transport, handle)  # the poster still runs for it
    agent.connect_gate.set()
    handle.started.result(timeout=5)
    status = transport.poll(handle)
    assert status.state is TransferState.FAILED and status.reason.kind == "aborted", status
    assert agent.posted == [] and all(x.released for x in agent.xfers)


def test_a_finished_read_is_done_and_freed_at_release(nixl):
    transport, agent, ep = nixl
    handle = transport.read(handoff(ep, [0, 1]), [0, 1])
    handle.started.result(timeout=5)
    assert transport.poll(handle).state is TransferState.PENDING
    agent.posted[0].finish()
    assert transport.poll(handle).state is TransferState.DONE
    transport.release(handle)
    assert transport.poll(handle).state is TransferState.DONE
    assert agent.posted[0].released and agent.unsafe_releases == []


def test_read_and_poll_return_while_the_peer_holds_the_connect_and_the_post(nixl):
    """read() and poll() never wait on the peer: the fake holds the connect, then the post,
    until the test lets go, and both calls return meanwhile (were either to wait, the fake's
    gate would time out and fail the READ: poll would say FAILED, not PENDING)."""
    transport, agent, ep = nixl
    agent.connect_gate.clear()
    agent.post_gate.clear()
    handle = transport.read(handoff(ep, [0, 1]), [0, 1])
    assert agent.connecting.wait(5) and not handle.started.done()  # read() returned mid-connect
    assert transport.poll(handle).state is TransferState.PENDING
    agent.connect_gate.set()
    assert agent.posting.wait(5)
    assert transport.poll(handle).state is TransferState.PENDING
    assert not handle.started.done()  # the poster is still inside transfer(): poll did not wait for it
    agent.post_gate.set()
    handle.started.result(timeout=5)
    agent.posted[0].finish()
    assert transport.poll(handle).state is TransferState.DONE
    transport.release(handle)


def test_close_waits_for_a_released_read_in_flight(nixl, monkeypatch):
    """The READ ends only once close() has looked at it and found it in flight, on another
    thread, as NIXL's progress thread ends one: close() must have waited for it. A close that
    did not wait returns first (`finished` unset) and deregisters a READ in flight."""
    transport, agent, ep = nixl
    monkeypatch.setattr(nixl_transport, "_CLOSE_DRAIN_S", 600.0)  # only the READ's end may end the wait
    handle = transport.read(handoff(ep, [0, 1]), [0, 1])
    handle.started.result(timeout=5)
    (xfer,) = agent.posted
    checked, finished = xfer.checks, threading.Event()

    def finish_once_close_waits() -> None:
        deadline = time.monotonic() + 10  # a close that never looks fails below, not here
        while xfer.checks < checked + 2 and time.monotonic() < deadline:  # release, then the drain
            time.sleep(0.001)
        finished.set()
        xfer.finish()

    finisher = threading.Thread(target=finish_once_close_waits, daemon=True)
    finisher.start()
    transport.close()
    assert finished.is_set(), "close() returned before the READ in flight ended"
    finisher.join(10)
    assert agent.in_flight_at_deregister == [] and agent.unsafe_releases == []
    assert transport.poll(handle).state is TransferState.FAILED


def test_close_gives_up_on_a_stuck_read_after_the_drain_timeout(nixl, monkeypatch, caplog):
    transport, agent, ep = nixl
    monkeypatch.setattr(nixl_transport, "_CLOSE_DRAIN_S", 0.1)
    handle = transport.read(handoff(ep, [0, 1]), [0, 1])
    handle.started.result(timeout=5)
    with caplog.at_level(logging.WARNING, logger=nixl_transport.__name__):
        transport.close()
    assert "still in flight at close" in caplog.text
    assert agent.posted[0].released  # NIXL is left to cancel it: the last resort of a shutdown

