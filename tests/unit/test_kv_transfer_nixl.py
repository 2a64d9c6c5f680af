"""NixlTransport between two real processes: a spawned "prefill" child owns KV storage with known
random data and publishes its endpoint over a Pipe; this process ("decode") pulls blocks with
one-sided NIXL READs and checks every byte. Skipped where nixl is not installed."""

from __future__ import annotations

import multiprocessing as mp
import time
import uuid

import pytest

pytest.importorskip("nixl")

import torch  # noqa: E402

from splitserve.kv_transfer.base import (  # noqa: E402
    KVHandoff,
    KVLayout,
    TransferError,
    TransferHeader,
    TransferState,
)
from splitserve.kv_transfer.nixl import NixlTransport  # noqa: E402
from splitserve.kv_transfer.regions import kv_checksum  # noqa: E402

pytestmark = pytest.mark.timeout(60)

SEED = 1234
# The two sides deliberately differ in num_blocks: layer strides differ, block geometry does not.
SRC_LAYOUT = KVLayout(4, 32, 16, 2, 8, "float32", 4, "fp-test")
DST_LAYOUT = KVLayout(4, 24, 16, 2, 8, "float32", 4, "fp-test")
SENTINEL = -7.0


def make_storage(layout: KVLayout, seed: int | None) -> torch.Tensor:
    shape = (layout.num_layers, 2, layout.num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    if seed is None:
        return torch.full(shape, SENTINEL)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def prefill_child(conn, agent_name: str, layout: KVLayout, seed: int | None) -> None:
    """The remote side: register, publish the endpoint, answer checksum requests until told to stop."""
    storage = make_storage(layout, seed)
    transport = NixlTransport(agent_name=agent_name)
    conn.send(transport.register(storage, layout, "localhost"))
    while True:
        msg = conn.recv()
        if msg[0] == "checksum":
            conn.send(kv_checksum(storage, layout, msg[1], msg[2]))
        else:
            break
    transport.close()


class Peer:
    def __init__(self, layout: KVLayout = SRC_LAYOUT, seed: int | None = SEED) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        name = f"prefill-{uuid.uuid4().hex[:8]}"
        self.proc = ctx.Process(target=prefill_child, args=(child_conn, name, layout, seed), daemon=True)
        self.proc.start()
        if not self.conn.poll(30):
            self.proc.kill()
            raise RuntimeError("prefill child did not publish its endpoint")
        self.endpoint = self.conn.recv()

    def checksum(self, blocks, layers=None) -> int:
        self.conn.send(("checksum", list(blocks), layers))
        return self.conn.recv()

    def stop(self) -> None:
        if self.proc.is_alive():
            self.conn.send(("stop",))
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


def handoff(endpoint, blocks) -> KVHandoff:
    header = TransferHeader(f"req-{uuid.uuid4().hex[:6]}", "fp-test", "float32", 16, 4, len(blocks), 1)
    return KVHandoff(header.request_id, 0, None, len(blocks) * 16, 0, tuple(blocks), endpoint, "lease", time.time() + 60, header, 0)


def wait(transport, handle, timeout: float = 10.0):
    """(That poll and read never wait on the peer: test_kv_transfer_nixl_release.py, where a fake
    agent holds the connect and the post.)"""
    deadline = time.monotonic() + timeout
    while True:
        status = transport.poll(handle)
        if status.state is not TransferState.PENDING:
            return status
        assert time.monotonic() < deadline, "transfer still pending after timeout"
        time.sleep(0.001)


@pytest.fixture(scope="module")
def peer():
    p = Peer()
    yield p
    p.stop()


@pytest.fixture()
def decode():
    storage = make_storage(DST_LAYOUT, None)
    transport = NixlTransport()
    transport.register(storage, DST_LAYOUT, "localhost")
    yield transport, storage
    transport.close()


def check_read(peer, decode, src, dst, layers=None):
    transport, storage = decode
    handle = transport.read(handoff(peer.endpoint, src), dst, layers)
    status = wait(transport, handle)
    transport.release(handle)
    assert status.state is TransferState.DONE, status.reason
    expected = make_storage(SRC_LAYOUT, SEED)
    moved = layers if layers is not None else range(SRC_LAYOUT.num_layers)
    for layer in range(DST_LAYOUT.num_layers):
        for s, d in zip(src, dst):
            got = storage[layer, :, d]
            if layer in moved:
                assert torch.equal(got, expected[layer, :, s]), (layer, s, d)
            else:
                assert (got == SENTINEL).all(), f"layer {layer} was not asked for but changed"
    untouched = [b for b in range(DST_LAYOUT.num_blocks) if b not in dst]
    assert (storage[:, :, untouched] == SENTINEL).all(), "bytes landed outside the destination blocks"
    got_sum = kv_checksum(storage, DST_LAYOUT, dst, layers)
    assert got_sum == peer.checksum(src, layers) == kv_checksum(expected, SRC_LAYOUT, src, layers)
    assert handle.nbytes == len(moved) * 2 * len(src) * SRC_LAYOUT.block_bytes


def test_read_non_contiguous_blocks(peer, decode):
    check_read(peer, decode, src=[3, 4, 5, 30, 9, 1, 2], dst=[10, 11, 12, 0, 23, 5, 6])


def test_read_contiguous_blocks_is_few_descriptors(peer, decode, monkeypatch):
    transport, _ = decode
    posted = []
    real = transport._descriptors
    monkeypatch.setattr(transport, "_descriptors", lambda segs, info: posted.append(len(segs)) or real(segs, info))
    check_read(peer, decode, src=list(range(8, 20)), dst=list(range(4, 16)))
    assert posted == [4 * 2], "one descriptor per layer and K/V for a contiguous run"


def test_read_layer_range(peer, decode):
    check_read(peer, decode, src=[7, 8, 20], dst=[1, 2, 3], layers=range(1, 3))


def test_empty_read_is_done(peer, decode):
    transport, _ = decode
    handle = transport.read(handoff(peer.endpoint, []), [])
    assert transport.poll(handle).state is TransferState.DONE
    transport.release(handle)


def test_bad_plans_fail_as_header_without_posting(peer, decode):
    transport, _ = decode
    for src, dst in (([0, 1], [0, DST_LAYOUT.num_blocks]), ([0, 1], [0]), ([SRC_LAYOUT.num_blocks], [0])):
        handle = transport.read(handoff(peer.endpoint, src), dst)
        status = transport.poll(handle)
        transport.release(handle)
        assert status.state is TransferState.FAILED and status.reason.kind == "header", (src, dst, status)
        assert handle.xfer is None


def expect_failure(transport, src_handoff, dst, timeout=10.0):
    """A read from a dead peer must fail (raise, or poll FAILED "unreachable"), never hang: still
    PENDING after `timeout`, `wait` fails the test."""
    try:
        handle = transport.read(src_handoff, dst)
    except TransferError as e:
        assert e.kind == "unreachable", e
    else:
        status = wait(transport, handle, timeout)
        transport.release(handle)
        assert status.state is TransferState.FAILED
        assert status.reason.kind == "unreachable", status.reason


def test_read_from_agent_that_went_away(decode):
    transport, _ = decode
    gone = Peer()
    check_read(gone, decode, src=[0, 1], dst=[0, 1])
    gone.stop()
    # Connected once, then the peer exited: the next read fails instead of hanging.
    expect_failure(transport, handoff(gone.endpoint, [2, 3]), [2, 3])
    # Never connected: the metadata is all we have and nobody answers any more.
    with NixlTransport() as fresh:
        fresh.register(make_storage(DST_LAYOUT, None), DST_LAYOUT, "localhost")
        expect_failure(fresh, handoff(gone.endpoint, [2, 3]), [2, 3])


# 64 MiB of KV. With tcp,cma the whole READ completes inside read() itself (CMA copies
# synchronously), so to see a READ in flight this test pins UCX to plain TCP (~0.5 GB/s here).
BIG_LAYOUT = KVLayout(8, 64, 16, 8, 128, "float32", 4, "fp-test")


def test_over_tcp_pending_reads_abort_and_a_dying_peer_fails_them(monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp")  # read when an agent starts; the spawned child inherits it
    storage = torch.zeros(BIG_LAYOUT.storage_bytes // 4)
    all_blocks = list(range(BIG_LAYOUT.num_blocks))
    peer = Peer(BIG_LAYOUT, seed=None)
    try:
        with NixlTransport() as transport:
            transport.register(storage, BIG_LAYOUT, "localhost")
            ep = peer.endpoint
            # A READ released in flight is PENDING until none of its bytes can land any more: only
            # then FAILED("aborted"), and the blocks stay as they are. The transport stays usable.
            handle = transport.read(handoff(ep, all_blocks), all_blocks)
            transport.release(handle)
            status = wait(transport, handle)
            assert status.state is TransferState.FAILED and status.reason.kind == "aborted", status
            landed = storage.clone()
            time.sleep(0.2)
            assert torch.equal(storage, landed), "bytes landed after the released READ reported FAILED"
            handle = transport.read(handoff(ep, [0, 1]), [0, 1])
            assert wait(transport, handle).state is TransferState.DONE
            transport.release(handle)
            # The peer dies with a READ in flight: FAILED (unreachable) promptly, not a hang.
            handle = transport.read(handoff(ep, all_blocks), all_blocks)
            peer.proc.kill()
            status = wait(transport, handle, timeout=10)
            transport.release(handle)
            if status.state is TransferState.FAILED:  # DONE only if the READ beat the kill
                assert status.reason.kind == "unreachable", status.reason
            expect_failure(transport, handoff(ep, [0]), [0])
    finally:
        peer.stop()
