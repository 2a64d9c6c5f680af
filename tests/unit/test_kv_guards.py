"""The KV data plane's guards: the transfer fingerprint covers the weights' content (workers of
two fine-tunes never exchange KV), the TCP KV server caps its connections, challenges for the
app's secret and serves a lease's token only that lease's blocks."""

import os


def test_the_kv_fingerprint_tells_fine_tunes_apart(tmp_path, tiny_checkpoint):
    """Two checkpoints of one architecture with files of equal names and sizes but other weights
    (a fine-tune) get different fingerprints, so their workers never exchange KV; a copy gets
    the same one; so does a file too big to read whole, through its samples."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from splitserve.worker.kv_layout import SAMPLES, _content_digest, model_fingerprint

    src = tiny_checkpoint("llama")
    copy, tuned = tmp_path / "copy", tmp_path / "tuned"
    shutil.copytree(src, copy)
    shutil.copytree(src, tuned)
    for f in tuned.glob("*.safetensors"):
        w = load_file(f)
        name = sorted(w)[len(w) // 2]
        w[name] = w[name] + 0.01 * torch.ones_like(w[name])
        save_file(w, f, metadata={"format": "pt"})
        assert f.stat().st_size == (src / f.name).stat().st_size  # names and sizes equal
    fp = model_fingerprint(src, "float32")
    assert model_fingerprint(copy, "float32") == fp and model_fingerprint(src, "bfloat16") != fp
    assert model_fingerprint(tuned, "float32") != fp
    f = next(tuned.glob("*.safetensors"))
    size = f.stat().st_size
    small = max(1, size // (4 * SAMPLES))
    sampled = _content_digest(str(f), size, 0, SAMPLES * small, small)
    assert sampled == _content_digest(str(f), size, 1, SAMPLES * small, small) != _content_digest(str(f), size, 0)
    assert sampled != _content_digest(str(next(copy.glob("*.safetensors"))), size, 0, SAMPLES * small, small)


def test_the_tcp_kv_server_caps_its_connections():
    """Past `max_connections` a new connection is closed at once; one closing frees its place."""
    import socket
    import time

    import torch

    from splitserve.kv_transfer.grants import Grants
    from splitserve.kv_transfer.regions import HostBytes
    from splitserve.kv_transfer.tcp_server import KVServer
    from tests.unit.test_kv_transfer import layout

    lay = layout(8)
    storage = torch.zeros(lay.storage_bytes // 4)
    server = KVServer(HostBytes(storage), "127.0.0.1", 0, 5.0, 5.0, grants=Grants(lay), max_connections=2)

    def closed_at_once(s: socket.socket) -> bool:
        s.settimeout(1.0)
        try:
            return s.recv(1) == b""
        except socket.timeout:
            return False  # held open, waiting for a request

    try:
        held = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(2)]
        time.sleep(0.2)  # both accepted
        extra = socket.create_connection(("127.0.0.1", server.port))
        assert closed_at_once(extra) and not closed_at_once(held[0])
        held.pop().close()
        time.sleep(0.3)
        again = socket.create_connection(("127.0.0.1", server.port))
        assert not closed_at_once(again)
        for s in held + [extra, again]:
            s.close()
    finally:
        server.close()


def test_a_tcp_reader_without_the_apps_secret_reads_no_kv_byte():
    """A source with the app's secret: a reader with it pulls the blocks exactly; a reader with
    another secret or none, and a raw client sending a well-formed request, get no KV byte."""
    import socket
    import uuid

    import numpy as np
    import torch

    from splitserve.kv_transfer import TcpTransport, TransferState, kv_checksum, wait_transfer
    from splitserve.kv_transfer.tcp_wire import REQ, REQ_MAGIC, VERSION, recv_exact
    from tests.unit.test_kv_transfer import DST_BLOCKS, SRC_BLOCKS, allocate, fill, layout, make_handoff

    secret, other = uuid.uuid4().hex * 2, uuid.uuid4().hex * 2
    src_kv, src = allocate(SRC_BLOCKS, None), TcpTransport(secret=secret)
    fill(src_kv.storage, 5)
    ep = src.register(src_kv, layout(SRC_BLOCKS), "host-a")
    blocks, token = (3, 9, 1), os.urandom(16)
    src.allow(token, blocks)
    handoff = make_handoff(ep, blocks, kv_checksum(src_kv.storage, layout(SRC_BLOCKS), blocks), token=token)
    readers = {"same": TcpTransport(secret=secret, io_timeout=2.0), "other": TcpTransport(secret=other, io_timeout=2.0),
               "none": TcpTransport(io_timeout=1.0)}
    kvs = {}
    try:
        for name, t in readers.items():
            kvs[name] = allocate(DST_BLOCKS, None)
            kvs[name].storage.zero_()
            t.register(kvs[name], layout(DST_BLOCKS), "host-b")
            h = t.read(handoff, (0, 1, 2))
            status = wait_transfer(t, h, timeout=10)
            t.release(h)
            got = kvs[name].storage[:, :, :3]
            if name == "same":
                assert status.state is TransferState.DONE and torch.equal(got, src_kv.storage[:, :, list(blocks)])
            else:
                assert status.state is TransferState.FAILED and not got.any(), (name, status)
        host, port = ep.address.rsplit(":", 1)
        raw = socket.create_connection((host, int(port)), timeout=2.0)
        raw.sendall(REQ.pack(REQ_MAGIC, VERSION, 0, 1, token, 0, 1) + np.array([0, 4096], dtype="<u8").tobytes())
        hello = recv_exact(raw, 22)  # the challenge it did not answer (its request was read as a wrong answer)
        assert hello[:4] == b"SKVH"
        raw.settimeout(2.0)
        try:
            rest = raw.recv(1 << 16)
        except ConnectionResetError:  # closed with our request unread: a reset
            rest = b""
        assert rest == b""  # closed: no byte of KV
        raw.close()
    finally:
        for t in (src, *readers.values()):
            t.close()
        for kv in (src_kv, *kvs.values()):
            kv.close()


def test_a_reader_with_another_leases_token_reads_no_kv_byte():
    """Two live leases on one source (with the app's secret): a reader that knows the secret but
    shows lease A's token for lease B's blocks, or asks B's blocks plus one more, gets FAILED
    and nothing lands; B's own token reads B's blocks exactly until B is revoked. A decode
    worker's transport (serve=False) runs no server at all."""
    import uuid

    import torch

    from splitserve.kv_transfer import TcpTransport, TransferState, kv_checksum, wait_transfer
    from tests.unit.test_kv_transfer import DST_BLOCKS, SRC_BLOCKS, allocate, fill, layout, make_handoff

    secret = uuid.uuid4().hex * 2
    src_kv, src = allocate(SRC_BLOCKS, None), TcpTransport(secret=secret)
    dst_kv, dst = allocate(DST_BLOCKS, None), TcpTransport(secret=secret, io_timeout=2.0)
    fill(src_kv.storage, 7)
    lay = layout(SRC_BLOCKS)
    ep = src.register(src_kv, lay, "host-a")
    receiver = dst.register(dst_kv, layout(DST_BLOCKS), "host-b", serve=False)
    a, b = os.urandom(16), os.urandom(16)
    src.allow(a, (3, 9))
    src.allow(b, (1, 4))

    def pull(blocks, token):
        dst_kv.storage.zero_()
        handoff = make_handoff(ep, blocks, kv_checksum(src_kv.storage, lay, blocks), token=token)
        h = dst.read(handoff, tuple(range(len(blocks))))
        status = wait_transfer(dst, h, timeout=10)
        dst.release(h)
        return status, dst_kv.storage[:, :, :len(blocks)]

    try:
        assert receiver.address == "" and dst.granted() == 0
        for blocks, token in [((1, 4), a), ((1, 4, 3), b)]:
            status, got = pull(blocks, token)
            assert status.state is TransferState.FAILED and not got.any(), (blocks, status)
        status, got = pull((1, 4), b)
        assert status.state is TransferState.DONE and torch.equal(got, src_kv.storage[:, :, [1, 4]])
        src.revoke(b)
        assert src.granted() == 1
        status, got = pull((1, 4), b)  # its lease ended: the reader says so (it recomputes)
        assert status.state is TransferState.FAILED and status.reason.kind == "lease_expired" and not got.any()
    finally:
        for t in (src, dst):
            t.close()
        for kv in (src_kv, dst_kv):
            kv.close()


def test_peers_trickling_bytes_without_the_secret_cannot_hold_the_server():
    """300 connections that never finish the challenge, each trickling a byte every 0.5 s (under
    any per-recv timeout): each is dropped by the handshake deadline (or refused at once past the
    few allowed in their handshake), and meanwhile a reader with the secret still pulls exactly."""
    import socket
    import time
    import uuid

    import torch

    from splitserve.kv_transfer import TcpTransport, TransferState, kv_checksum, wait_transfer
    from splitserve.kv_transfer.tcp_server import HANDSHAKE_S
    from tests.unit.test_kv_transfer import DST_BLOCKS, SRC_BLOCKS, allocate, fill, layout, make_handoff

    secret = uuid.uuid4().hex * 2
    src_kv, src = allocate(SRC_BLOCKS, None), TcpTransport(secret=secret, io_timeout=30.0)
    fill(src_kv.storage, 7)
    ep = src.register(src_kv, layout(SRC_BLOCKS), "host-a")
    host, port = ep.address.rsplit(":", 1)
    dst_kv, dst = allocate(DST_BLOCKS, None), TcpTransport(secret=secret, io_timeout=5.0)
    dst.register(dst_kv, layout(DST_BLOCKS), "host-b")
    blocks, token = (2, 4), os.urandom(16)
    src.allow(token, blocks)
    handoff = make_handoff(ep, blocks, kv_checksum(src_kv.storage, layout(SRC_BLOCKS), blocks), token=token)
    tricklers, began = [], time.monotonic()
    try:
        for _ in range(300):
            s = socket.create_connection((host, int(port)), timeout=5.0)
            s.setblocking(False)
            tricklers.append(s)
        dropped: set[int] = set()
        pulled = None
        while len(dropped) < len(tricklers) and time.monotonic() - began < 10 * HANDSHAKE_S:
            for i, s in enumerate(tricklers):
                if i in dropped:
                    continue
                try:
                    s.send(b"x")  # one byte of a 32-byte answer that will never be right
                    while s.recv(4096):
                        pass  # the challenge
                    dropped.add(i)  # recv() == b"": closed by the server
                except BlockingIOError:
                    pass
                except OSError:
                    dropped.add(i)  # reset: closed by the server
            if pulled is None:  # a real reader, while the tricklers are at it
                h = dst.read(handoff, (0, 1))
                pulled = wait_transfer(dst, h, timeout=10)
                dst.release(h)
            time.sleep(0.5)
        took = time.monotonic() - began
        print(f"\n300 tricklers all dropped in {took:.1f} s (handshake deadline {HANDSHAKE_S} s)")
        assert len(dropped) == len(tricklers), f"{len(tricklers) - len(dropped)} connections still held"
        assert pulled.state is TransferState.DONE
        assert torch.equal(dst_kv.storage[:, :, :2], src_kv.storage[:, :, list(blocks)])
    finally:
        for s in tricklers:
            s.close()
        for t in (src, dst):
            t.close()
        for kv in (src_kv, dst_kv):
            kv.close()
