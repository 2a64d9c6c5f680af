"""KV transfer between two processes, as in production: a spawned child plays the prefill worker
(owns a source KV cache filled with known random data and serves it through shm and tcp), this
process plays the decode worker (reads into its own cache, verifies). Faults: flipped bits,
truncated payloads, unreachable sources, header mismatches. Every wait has a timeout."""

from __future__ import annotations

import glob
import multiprocessing as mp
import os
import socket
import threading
import time
import uuid

import pytest
import torch
from tests.fakes.tcp_faults import DroppingServer, StallingServer, TruncatingServer
from tests.loopback import free_port

from splitserve.engine.kv_cache.tensors import KVCacheTensors
from splitserve.router.transport_choice import choose_transport
from splitserve.kv_transfer import (
    KVHandoff,
    KVLayout,
    ShmTransport,
    TcpTransport,
    TransferError,
    TransferHeader,
    TransferState,
    TransportEndpoint,
    block_runs,
    check_header,
    kv_checksum,
    make_transport,
    plan_segments,
    verify_landed,
    wait_transfer,
)
from splitserve.kv_transfer.jobs import AsyncHandle
from splitserve.kv_transfer.regions import gathered_checksum
from splitserve.kv_transfer.shm import PeerMaps

pytestmark = pytest.mark.timeout(60)

SHM_PREFIX = "/dev/shm/splitserve-test-kv-"
GEOM = dict(num_layers=4, block_size=4, num_kv_heads=2, head_dim=8)
SRC_BLOCKS, DST_BLOCKS = 32, 24
SEED = 1234
FP = "tiny-model-fp"


def layout(num_blocks: int, **over) -> KVLayout:
    fields = dict(GEOM, num_blocks=num_blocks, dtype="float32", element_size=4, model_fingerprint=FP)
    fields.update(over)
    return KVLayout(**fields)


def allocate(num_blocks: int, shm_path: str | None) -> KVCacheTensors:
    g = GEOM
    return KVCacheTensors.allocate(g["num_layers"], num_blocks, g["block_size"], g["num_kv_heads"], g["head_dim"],
                                   torch.float32, shm_path=shm_path)


def fill(storage: torch.Tensor, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    storage.copy_(torch.randn(storage.shape, generator=gen))


# -- the child: a prefill worker serving its cache --------------------------------------------

def serve_source(conn, shm_path: str) -> None:
    kv = allocate(SRC_BLOCKS, shm_path)
    fill(kv.storage, SEED)
    lay = layout(SRC_BLOCKS)
    stalling: list[StallingServer] = []  # the "tcp_stall" source's server: how many reads it holds

    def stalling_server(*args, **kwargs) -> StallingServer:
        stalling.append(StallingServer(*args, **kwargs))
        return stalling[-1]

    transports = {"shm": ShmTransport(), "tcp": TcpTransport(),
                  "tcp_truncate": TcpTransport(server_cls=TruncatingServer),
                  "tcp_drop": TcpTransport(server_cls=DroppingServer),
                  "tcp_stall": TcpTransport(server_cls=stalling_server),
                  "tcp_staged": TcpTransport(staged=True)}  # through host buffers, as a GPU cache is
    conn.send({name: t.register(kv, lay, "host-a") for name, t in transports.items()})
    raw = kv.storage.view(torch.uint8).view(-1)
    try:
        while True:
            cmd, *args = conn.recv()
            if cmd == "checksum":
                conn.send(kv_checksum(kv.storage, lay, args[0]))
            elif cmd == "allow":  # a lease on these blocks, as the prefill worker grants one
                for t in transports.values():
                    t.allow(*args)
                conn.send(True)
            elif cmd == "stalled":  # reads the stalling source holds now
                conn.send(stalling[0].stalled)
            elif cmd == "flip":  # xor one bit of the source (xor again to restore)
                raw[args[0]] ^= 0x10
                conn.send(True)
            elif cmd == "stop":
                break
    finally:
        for t in transports.values():
            t.close()
        kv.close()


@pytest.fixture(scope="module")
def source():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    path = f"{SHM_PREFIX}{uuid.uuid4().hex}"
    proc = ctx.Process(target=serve_source, args=(child, path), daemon=True)
    proc.start()
    try:
        assert parent.poll(60), "source process did not start"
        endpoints = parent.recv()
        yield Source(parent, endpoints)
        parent.send(("stop",))
        proc.join(10)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        for f in glob.glob(path + "*"):
            os.unlink(f)


class Source:
    def __init__(self, conn, endpoints: dict[str, TransportEndpoint]) -> None:
        self.conn, self.endpoints = conn, endpoints

    def ask(self, *cmd):
        self.conn.send(cmd)
        assert self.conn.poll(20), f"source did not answer {cmd}"
        return self.conn.recv()

    def stalls_beyond(self, held: int) -> None:
        """Wait until the stalling source holds more than `held` reads: one more is stalled in it."""
        deadline = time.monotonic() + 20
        while self.ask("stalled") <= held:
            assert time.monotonic() < deadline, "the read never reached the stalling source"
            time.sleep(0.01)

    def handoff(self, endpoint: str | TransportEndpoint, blocks, **header) -> KVHandoff:
        ep = self.endpoints[endpoint] if isinstance(endpoint, str) else endpoint
        token = os.urandom(16)
        self.ask("allow", token, tuple(blocks))
        return make_handoff(ep, blocks, self.ask("checksum", tuple(blocks)), token=token, **header)


def make_handoff(ep: TransportEndpoint, blocks, checksum: int, token: bytes = b"", **header) -> KVHandoff:
    fields = dict(request_id="req-1", model_fingerprint=FP, dtype="float32", block_size=GEOM["block_size"],
                  num_layers=GEOM["num_layers"], num_blocks=len(blocks), lease_epoch=1)
    fields.update(header)
    return KVHandoff(request_id="req-1", first_token=7, first_logprob=None, num_prompt_tokens=len(blocks) * 4,
                     num_cached_tokens=0, block_ids=tuple(blocks), endpoint=ep, lease_id="lease-1",
                     lease_expires_at=time.time() + 30, header=TransferHeader(**fields), checksum=checksum,
                     lease_token=token)


# -- this process: a decode worker --------------------------------------------------------------

@pytest.fixture(scope="module")
def local():
    kv = allocate(DST_BLOCKS, f"{SHM_PREFIX}{uuid.uuid4().hex}")
    # "tcp_impatient" gives up on a silent source fast; "tcp" tolerates a loaded test machine.
    transports = {"shm": ShmTransport(), "tcp": TcpTransport(connect_timeout=2.0, io_timeout=5.0),
                  "tcp_impatient": TcpTransport(connect_timeout=1.0, io_timeout=0.5),
                  "tcp_split": TcpTransport(connect_timeout=2.0, io_timeout=5.0, split_bytes=1),
                  "tcp_staged": TcpTransport(connect_timeout=2.0, io_timeout=5.0, staged=True)}
    for t in transports.values():
        t.register(kv, layout(DST_BLOCKS), "host-b")
    expected = torch.empty((GEOM["num_layers"], 2, SRC_BLOCKS, 4, 2, 8))
    fill(expected, SEED)
    yield kv, transports, expected
    for t in transports.values():
        t.close()
    kv.close()
    assert not os.path.exists(kv.shm_path)


def pull(transport, handoff: KVHandoff, dst, layers=None):
    handle = transport.read(handoff, dst, layers)
    status = wait_transfer(transport, handle, timeout=10)
    transport.release(handle)
    return handle, status


CASES = {
    "scattered": ((3, 4, 5, 9, 1, 30, 17), (0, 1, 2, 7, 8, 20, 11)),
    "contiguous": (tuple(range(8, 20)), tuple(range(4, 16))),
}


@pytest.mark.parametrize("name", ["shm", "tcp", "tcp_split", "tcp_staged"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_pull_lands_exact_bytes(source, local, name, case):
    """tcp_split: every transfer over two connections at once (large ones do that by default).
    tcp_staged: both sides move bytes through host buffers, the path of a GPU cache."""
    kv, transports, expected = local
    src, dst = CASES[case]
    kv.storage.zero_()
    handoff = source.handoff(name.removesuffix("_split"), src)
    check_header(handoff, layout(DST_BLOCKS))
    handle, status = pull(transports[name], handoff, dst)
    assert status.state is TransferState.DONE, status.reason
    assert handle.nbytes == len(src) * layout(1).block_bytes * 2 * GEOM["num_layers"]
    assert torch.equal(kv.storage[:, :, list(dst)], expected[:, :, list(src)])
    untouched = sorted(set(range(DST_BLOCKS)) - set(dst))
    assert not kv.storage[:, :, untouched].any()
    verify_landed(kv, layout(DST_BLOCKS), handoff, dst)


@pytest.mark.parametrize("name", ["shm", "tcp", "tcp_staged"])
def test_pull_layer_range(source, local, name):
    kv, transports, expected = local
    src, dst = CASES["scattered"]
    kv.storage.zero_()
    _, status = pull(transports[name], source.handoff(name, src), dst, layers=range(1, 3))
    assert status.state is TransferState.DONE, status.reason
    assert torch.equal(kv.storage[1:3][:, :, list(dst)], expected[1:3][:, :, list(src)])
    assert not kv.storage[[0, 3]].any()
    assert kv_checksum(kv.storage, layout(DST_BLOCKS), dst, range(1, 3)) == \
        kv_checksum(expected, layout(SRC_BLOCKS), src, range(1, 3))


@pytest.mark.parametrize("name", ["shm", "tcp"])
def test_flipped_bit_in_destination_is_corrupt(source, local, name):
    kv, transports, _ = local
    src, dst = CASES["contiguous"]
    handoff = source.handoff(name, src)
    assert pull(transports[name], handoff, dst)[1].state is TransferState.DONE
    kv.storage.view(torch.uint8)[2, 1, dst[3]].view(-1)[5] ^= 0x01
    with pytest.raises(TransferError) as e:
        verify_landed(kv, layout(DST_BLOCKS), handoff, dst)
    assert e.value.kind == "corrupt"


@pytest.mark.parametrize("name", ["shm", "tcp"])
def test_flipped_bit_in_source_after_checksum_is_corrupt(source, local, name):
    kv, transports, _ = local
    src, dst = CASES["scattered"]
    handoff = source.handoff(name, src)  # checksum taken before the flip
    offset = layout(SRC_BLOCKS).offset(1, 0, src[2]) + 3
    source.ask("flip", offset)
    try:
        assert pull(transports[name], handoff, dst)[1].state is TransferState.DONE
    finally:
        source.ask("flip", offset)
    with pytest.raises(TransferError) as e:
        verify_landed(kv, layout(DST_BLOCKS), handoff, dst)
    assert e.value.kind == "corrupt"


def test_truncated_tcp_payload_fails(source, local):
    _, transports, _ = local
    src, dst = CASES["contiguous"]
    _, status = pull(transports["tcp"], source.handoff("tcp_truncate", src), dst)
    assert status.state is TransferState.FAILED and status.reason.kind == "truncated", status


def test_tcp_source_that_drops_the_request_is_unreachable(source, local):
    _, transports, _ = local
    _, status = pull(transports["tcp"], source.handoff("tcp_drop", CASES["contiguous"][0]), CASES["contiguous"][1])
    assert status.state is TransferState.FAILED and status.reason.kind == "unreachable", status


def test_stalled_tcp_source_times_out(source, local):
    """The source holds the read to the end of the module: only the reader's io_timeout (0.5 s)
    can fail it "truncated" / "unreachable" (without one, wait_transfer would give up after its
    10 s and say "aborted")."""
    _, transports, _ = local
    held = source.ask("stalled")
    _, status = pull(transports["tcp_impatient"], source.handoff("tcp_stall", CASES["contiguous"][0]),
                     CASES["contiguous"][1])
    assert status.state is TransferState.FAILED and status.reason.kind in ("truncated", "unreachable"), status
    source.stalls_beyond(held)  # it reached the source, which still holds it: the reader gave up


def stalled_reader(source) -> tuple[TcpTransport, AsyncHandle, int]:
    """A reader whose read is stalled in the source, under an io_timeout far past this module's
    60 s: nothing but release() or close() can end that read while the test runs."""
    tcp = TcpTransport(connect_timeout=2.0, io_timeout=3600.0)
    tcp.register(allocate(DST_BLOCKS, None).storage, layout(DST_BLOCKS), "host-b", serve=False)
    held = source.ask("stalled")
    handle = tcp.read(source.handoff("tcp_stall", (1, 2)), (1, 2))
    source.stalls_beyond(held)
    assert tcp.poll(handle).state is TransferState.PENDING
    return tcp, handle, held


def test_release_aborts_a_stalled_tcp_read_at_once(source):
    tcp, handle, held = stalled_reader(source)
    try:
        tcp.release(handle)
        handle.future.exception(timeout=30)  # TimeoutError: release() left the read stalled
        status = tcp.poll(handle)
        assert status.state is TransferState.FAILED and status.reason.kind == "aborted", status
        source.stalls_beyond(held)  # the source still holds it: release() ended it
    finally:
        tcp.close()


def test_close_ends_inflight_reads(source):
    tcp, handle, held = stalled_reader(source)
    closing = threading.Thread(target=tcp.close, daemon=True)
    closing.start()
    closing.join(30)
    assert not closing.is_alive(), "close() waits on a read stalled in its source"
    status = tcp.poll(handle)
    assert status.state is TransferState.FAILED and status.reason.kind == "aborted", status
    source.stalls_beyond(held)


def test_dead_tcp_port_is_unreachable(source, local):
    """Refused at once; a reader that kept trying would end "aborted" in wait_transfer."""
    _, transports, _ = local
    # nothing listens there: not a port the kernel hands out for port 0, which another worker's
    # Ray process may bind before the read
    ep = TransportEndpoint("tcp", "host-a", f"127.0.0.1:{free_port()}", layout(SRC_BLOCKS))
    _, status = pull(transports["tcp"], source.handoff(ep, (1, 2)), (1, 2))
    assert status.state is TransferState.FAILED and status.reason.kind == "unreachable", status


def test_missing_or_short_shm_file_fails(source, local, tmp_path):
    _, transports, _ = local
    missing = TransportEndpoint("shm", "host-a", f"{SHM_PREFIX}missing-{uuid.uuid4().hex}", layout(SRC_BLOCKS))
    _, status = pull(transports["shm"], source.handoff(missing, (1, 2)), (1, 2))
    assert status.state is TransferState.FAILED and status.reason.kind == "unreachable", status
    short = tmp_path / "short-kv"
    short.write_bytes(b"\0" * 100)
    ep = TransportEndpoint("shm", "host-a", str(short), layout(SRC_BLOCKS))
    _, status = pull(transports["shm"], source.handoff(ep, (1, 2)), (1, 2))
    assert status.state is TransferState.FAILED and status.reason.kind == "truncated", status
    assert short.stat().st_size == 100  # the reader never grows a peer's file


# -- shm: maps of peers that are gone ----------------------------------------------------------

def write_peer(path: str, seed: int) -> torch.Tensor:
    """A peer's KV file as a (re)started prefill worker leaves it; this process does not map it.
    Written beside and renamed, so a path that existed names a new file."""
    storage = torch.empty((GEOM["num_layers"], 2, SRC_BLOCKS, 4, 2, 8))
    fill(storage, seed)
    storage.numpy().tofile(f"{path}.new")
    os.replace(f"{path}.new", path)
    return storage


def mapped(path: str) -> list[str]:
    """This process's mappings of `path` (/proc/self/maps): "live" for the file there now,
    "deleted" for one since unlinked or replaced."""
    path = os.path.realpath(path)
    with open("/proc/self/maps") as f:
        names = [line.rstrip("\n").split(maxsplit=5)[5:] for line in f]
    return ["live" if n[0] == path else "deleted" for n in names if n and n[0] in (path, f"{path} (deleted)")]


def test_shm_drops_the_maps_of_peers_that_restarted(local, tmp_path):
    kv = local[0]
    shm = ShmTransport()
    shm.register(kv, layout(DST_BLOCKS), "host-b")
    src, dst = CASES["scattered"]

    def pull_from(path: str, storage: torch.Tensor) -> None:
        ep = TransportEndpoint("shm", "host-a", path, layout(SRC_BLOCKS))
        handoff = make_handoff(ep, src, kv_checksum(storage, layout(SRC_BLOCKS), src))
        assert pull(shm, handoff, dst)[1].state is TransferState.DONE
        verify_landed(kv, layout(DST_BLOCKS), handoff, dst)

    old, new = str(tmp_path / "peer-1"), str(tmp_path / "peer-2")
    try:
        pull_from(old, write_peer(old, seed=1))
        assert mapped(old) == ["live"]
        os.unlink(old)  # the peer restarted: its old file went, the new one has a new path
        pull_from(new, write_peer(new, seed=2))
        assert mapped(old) == [] and mapped(new) == ["live"]
        pull_from(new, write_peer(new, seed=3))  # the same path, a new file
        assert mapped(new) == ["live"]
    finally:
        shm.close()
    assert mapped(new) == []


def test_peer_maps_never_unmap_under_a_read(tmp_path):
    maps = PeerMaps(max_maps=4)
    a, b = str(tmp_path / "peer-a"), str(tmp_path / "peer-b")
    want = write_peer(a, seed=1).view(torch.uint8).view(-1)
    write_peer(b, seed=2)
    reading = maps.get(a, len(want))  # what a copy in progress holds
    os.unlink(a)
    maps.get(b, len(want))  # the next lookup drops a's map...
    assert mapped(a) == ["deleted"]  # ...but its memory stays while the read goes on
    assert torch.equal(reading, want)
    del reading
    assert mapped(a) == []
    maps.close()
    assert mapped(b) == []


def test_peer_maps_keep_the_most_recently_used(tmp_path):
    maps = PeerMaps(max_maps=2)
    paths = [str(tmp_path / f"peer-{i}") for i in range(3)]
    nbytes = layout(SRC_BLOCKS).storage_bytes
    for i, path in enumerate(paths):
        write_peer(path, seed=i)
    for i in (0, 1, 0, 2):  # peer 1 is the least recently used when peer 2 comes
        maps.get(paths[i], nbytes)
    assert [mapped(p) for p in paths] == [["live"], [], ["live"]]
    maps.close()


@pytest.mark.parametrize("field,value", [("model_fingerprint", "other-model"), ("dtype", "bfloat16"),
                                         ("block_size", 16), ("num_layers", 2), ("num_blocks", 3)])
def test_header_mismatch_names_the_field(source, field, value):
    handoff = source.handoff("tcp", (1, 2), **{field: value})
    with pytest.raises(TransferError, match=field) as e:
        check_header(handoff, layout(DST_BLOCKS))
    assert e.value.kind == "header"


@pytest.mark.parametrize("name", ["shm", "tcp"])
def test_transport_refuses_mismatched_geometry_and_bad_ids(source, local, name):
    _, transports, _ = local
    ep = source.endpoints[name]
    wrong = TransportEndpoint(ep.transport, ep.host, ep.address, layout(SRC_BLOCKS, head_dim=16))
    for handoff, dst in [(source.handoff(wrong, (1, 2)), (1, 2)),
                         (source.handoff(name, (1, 2)), (1, DST_BLOCKS))]:  # dst id out of range
        _, status = pull(transports[name], handoff, dst)
        assert status.state is TransferState.FAILED and status.reason.kind == "header", status


def test_segment_planning_merges_consecutive_runs():
    src, dst = (3, 4, 5, 9, 1, 2), (0, 1, 2, 7, 8, 9)
    assert block_runs(src, dst) == [(3, 0, 3), (9, 7, 1), (1, 8, 2)]
    lay = layout(SRC_BLOCKS)
    assert len(plan_segments(lay, src, dst)) == 3 * 2 * GEOM["num_layers"]
    assert len(plan_segments(lay, src, dst, range(1, 3))) == 3 * 2 * 2
    assert len(plan_segments(lay, tuple(range(10)), tuple(range(5, 15)))) == 2 * GEOM["num_layers"]
    # different cache sizes: destination offsets follow the destination's layout
    seg = plan_segments(lay, (1,), (2,), range(1, 2), dst_layout=layout(DST_BLOCKS))[1]  # layer 1, V
    assert (seg.src_offset, seg.dst_offset) == (lay.offset(1, 1, 1), layout(DST_BLOCKS).offset(1, 1, 2))


def test_shm_register_needs_shm_storage():
    kv = allocate(4, None)
    with pytest.raises(ValueError, match="shm_path"):
        ShmTransport().register(kv, layout(4), "h")


def test_make_and_choose_transport():
    for name in ("tcp", "shm"):
        t = make_transport(name)
        assert t.name == name
        t.close()
    with pytest.raises(ValueError, match="nixl, shm, tcp"):
        make_transport("carrier-pigeon")
    every = ["shm", "nixl", "tcp"]
    assert choose_transport(True, every, every) == "shm"
    assert choose_transport(False, every, every) == "nixl"  # shm never crosses nodes
    assert choose_transport(True, ["tcp", "nixl"], every) == "nixl"
    assert choose_transport(False, ["shm", "tcp"], ["shm", "tcp"]) == "tcp"
    assert choose_transport(False, ["shm"], ["shm"]) == "shm"  # chosen by name: the only one offered
    with pytest.raises(ValueError, match="no KV transport in common"):
        choose_transport(True, ["tcp"], ["nixl"])


def test_sweep_removes_only_files_of_dead_owners(tmp_path):
    import subprocess

    from splitserve.engine.kv_cache.tensors import sweep_stale_shm

    dead = subprocess.Popen(["true"])
    dead.wait()
    prefix = str(tmp_path / "splitserve-kv-")
    stale, live, other = f"{prefix}{dead.pid}-a", f"{prefix}{os.getpid()}-b", str(tmp_path / "unrelated")
    for f in (stale, live, other):
        open(f, "wb").close()
    assert sweep_stale_shm(prefix) == [os.path.basename(stale)]
    assert not os.path.exists(stale) and os.path.exists(live) and os.path.exists(other)


def test_gathered_checksum_equals_the_segment_checksum():
    """A GPU cache is checksummed by gathering its blocks; the hash must equal the CPU path's
    (the other side of a transfer may be a CPU worker)."""
    storage = torch.empty((GEOM["num_layers"], 2, SRC_BLOCKS, 4, 2, 8))
    fill(storage, SEED)
    for blocks in ((3, 4, 5, 9, 1, 30, 17), tuple(range(8, 20)), (0,)):
        for layers in (None, range(1, 3)):
            assert gathered_checksum(storage, blocks, layers) == kv_checksum(storage, layout(SRC_BLOCKS), blocks, layers)
    assert gathered_checksum(storage, (3, 4)) != gathered_checksum(storage, (4, 3))  # order matters


@pytest.mark.parametrize("name", ["tcp", "tcp_staged"])
def test_server_reads_only_the_blocks_of_the_requests_lease(source, name):
    """A raw reader (no secret on this source) with a lease on blocks 1 and 2: its blocks are
    served; another block, a part of a block, its blocks twice over, a table longer than the
    lease can need, or a token of no lease, are refused before a byte of KV moves."""
    import numpy as np

    from splitserve.kv_transfer.tcp_wire import BAD_REQUEST, NO_LEASE, OK, REQ, REQ_MAGIC, RESP, SEG, VERSION, recv_exact

    lay, token = layout(SRC_BLOCKS), os.urandom(16)
    source.ask("allow", token, (1, 2))
    bb, plane = lay.block_bytes, lay.num_blocks * lay.block_bytes
    host, port = source.endpoints[name].address.rsplit(":", 1)

    def ask(segments, tok=token):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(REQ.pack(REQ_MAGIC, VERSION, 0, 9, tok, 0, len(segments))
                      + np.array(segments, dtype=SEG).reshape(-1, 2).tobytes())
            _, _, status, xfer_id, total, _ = RESP.unpack(recv_exact(s, RESP.size))
            assert xfer_id == 9
            return status, recv_exact(s, total)

    theirs = [(plane * p + bb, 2 * bb) for p in range(2 * lay.num_layers)]  # blocks 1-2 of every (layer, K/V)
    status, data = ask(theirs)
    assert status == OK and len(data) == 2 * bb * 2 * lay.num_layers
    refused = {"another block": [(0, bb)], "part of a block": [(bb, bb // 2)],
               "past its blocks": [(bb, 3 * bb)], "a plane past the storage": [(plane * 2 * lay.num_layers + bb, bb)],
               "twice over": theirs + theirs, "no lease": theirs}
    for why, segments in refused.items():
        status, msg = ask(segments, os.urandom(16) if why == "no lease" else token)
        assert status == (NO_LEASE if why == "no lease" else BAD_REQUEST), why
        assert ("no live lease" if why == "no lease" else "lease") in msg.decode(), (why, msg)
    status, msg = ask([(0, 0)] * (4 * lay.num_layers + 1))  # more segments than 2 blocks × planes
    assert status == BAD_REQUEST and b"segments for a lease of" in msg


@pytest.mark.parametrize("ranges", [
    [(64, 128), (512, 64), (0, 64)],  # whole blocks (unit 64), out of order: row gathers
    [(10, 100), (700, 3)],  # not block-aligned: range by range
])
def test_staged_bytes_round_trip(monkeypatch, ranges):
    """The GPU staging path, on CPU: read gathers the ranges back to back; receive + land
    scatters them; small device chunks (forced) give the same bytes."""
    from splitserve.kv_transfer.regions import StagedBytes

    monkeypatch.setattr(StagedBytes, "CHUNK_BYTES", 64)  # one block per gather step
    src = torch.randint(0, 255, (1024,), dtype=torch.uint8)
    staged = StagedBytes(src, unit=64)
    (view,) = staged.read(ranges)
    want = torch.cat([src[o: o + n] for o, n in ranges])
    assert bytes(view) == bytes(want.numpy())
    dst = torch.zeros(1024, dtype=torch.uint8)
    (into,), land = StagedBytes(dst, unit=64).receive(ranges)
    into[:] = bytes(want.numpy())
    land()
    inside = torch.zeros(1024, dtype=torch.bool)
    for o, n in ranges:
        assert torch.equal(dst[o: o + n], src[o: o + n])
        inside[o: o + n] = True
    assert not dst[~inside].any()  # nothing written outside the ranges
