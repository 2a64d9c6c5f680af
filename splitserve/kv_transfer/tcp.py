"""KV transfer over TCP: works between any two machines that can open a socket (DESIGN.md §4).

Where it sits in a request's life (§1 steps 5–6): a prefill worker `register`s its KV cache
to serve it, which starts a small server thread that serves byte ranges of that cache (the
endpoint address is "ip:port"), each lease's blocks to the holder of that lease's token
(`allow` / `revoke`, checked by `grants.py`); a decode worker registers its cache only to
receive into it (`serve=False`: no server). A decode worker pulling a handoff computes the
source segments itself (block ids + the layout published in the endpoint), sends them with the
handoff's lease token in one small request over a pooled connection, and receives the bytes
straight into its own cache at the destination offsets.

Wire format and socket helpers: `tcp_wire`; the serving side: `tcp_server`. For a CPU cache the
server sends from memoryviews of its storage (`sendmsg` over slices, no staging copy) and the
reader `recv_into`s memoryviews of its own storage; a GPU cache goes through one host buffer on
each side (`regions.StagedBytes`). An `xfer_id` ties each response to its request, so a pooled
connection can never deliver a stale payload. Transfers of 4 MiB or more are split over two
connections (one loopback stream stops well short of what two cores can copy).

Failures never hang (socket timeouts) and surface through `poll`: nothing listening or dropped
before a response → FAILED("unreachable"); cut short mid-payload → FAILED("truncated"); a
request the server rejects (segments outside the lease, version skew) → FAILED("header"); a
token of no live lease (it lapsed before the read) → FAILED("lease_expired").
`server_cls` chooses the serving side's class (a KVServer subclass): tests install sources that
misbehave (tests/fakes/tcp_faults.py).
"""

from __future__ import annotations

import itertools
import socket
import struct
import threading
from typing import Sequence

import numpy as np

from splitserve.kv_transfer.base import KVHandoff, KVLayout, TransferError, TransferHandle, TransportEndpoint
from splitserve.kv_transfer.grants import TOKEN_SIZE, Grants
from splitserve.kv_transfer.jobs import AsyncHandle, PooledTransport, TransferPool, start_read
from splitserve.kv_transfer.regions import HostBytes, Segment, StagedBytes, plan_transfer, storage_bytes, storage_tensor
from splitserve.kv_transfer.tcp_server import KVServer
from splitserve.kv_transfer.tcp_wire import (
    RESP,
    RESP_MAGIC,
    REQ,
    REQ_MAGIC,
    SEG,
    NO_LEASE,
    OK,
    VERSION,
    Eof,
    answer,
    peer,
    recv_exact,
    recv_scatter,
    shutdown,
)

_SPLIT_BYTES = 4 << 20  # transfers this large use several connections
_STREAMS = 2  # measured on 2 cores, 64 MiB loopback: 1 → 2.9 GB/s, 2 → 3.3-3.5, 3 → 2.8, 4 → 2.7


def _split(segments: list[Segment], n: int) -> list[list[Segment]]:
    """Up to n parts of about equal bytes, cut at segment boundaries."""
    total = sum(s.nbytes for s in segments)
    parts: list[list[Segment]] = [[]]
    acc = 0
    for seg in segments:
        if parts[-1] and acc * n >= total * len(parts) and len(parts) < n:
            parts.append([])
        parts[-1].append(seg)
        acc += seg.nbytes
    return parts


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


# -- the reading side ---------------------------------------------------------------------------

class _ConnPool:
    """Idle connections per address, so back-to-back transfers skip the TCP handshake."""

    def __init__(self, connect_timeout: float, io_timeout: float, max_idle: int = 4, secret: bytes | None = None) -> None:
        self._secret = secret
        self._idle: dict[str, list[socket.socket]] = {}
        self._lock = threading.Lock()
        self._connect_timeout, self._io_timeout, self._max_idle = connect_timeout, io_timeout, max_idle

    def take(self, address: str) -> tuple[socket.socket, bool]:
        with self._lock:
            idle = self._idle.get(address)
            if idle:
                return idle.pop(), True
        try:
            sock = socket.create_connection(_split_address(address), timeout=self._connect_timeout)
        except (OSError, ValueError) as e:
            raise TransferError("unreachable", f"cannot connect to {address}: {e}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(self._io_timeout)
        if self._secret is not None:
            try:
                answer(sock, self._secret)
            except (OSError, Eof, ValueError, struct.error) as e:
                sock.close()
                raise TransferError("unreachable", f"the KV server at {address} refused the handshake: {e}") from None
        return sock, False

    def give(self, address: str, sock: socket.socket) -> None:
        with self._lock:
            idle = self._idle.setdefault(address, [])
            if len(idle) < self._max_idle:
                idle.append(sock)
                return
        sock.close()

    def close(self) -> None:
        with self._lock:
            socks = [s for idle in self._idle.values() for s in idle]
            self._idle.clear()
        for s in socks:
            s.close()


class _Stale(Exception):
    """A pooled connection turned out dead before any response byte: retry on a fresh one."""


class TcpTransport(PooledTransport):
    name = "tcp"

    def __init__(self, bind_host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None,
                 connect_timeout: float = 2.0, io_timeout: float = 10.0, idle_timeout: float = 300.0,
                 max_workers: int = 4, split_bytes: int = _SPLIT_BYTES, streams: int = _STREAMS,
                 staged: bool = False, server_cls: type[KVServer] = KVServer, secret: str | None = None) -> None:
        """`staged`: move bytes through host buffers even for a CPU storage (a device storage
        always is): the GPU path, testable on CPU. `server_cls`: what `register` starts to serve
        this worker's cache, called as server_cls(source, bind_host, port, io_timeout,
        idle_timeout, secret=...). `secret`: the app's KV secret (hex): this worker's server
        challenges every reader for it, and this worker answers other servers' challenges."""
        if streams < 1:
            raise ValueError(f"streams must be >= 1, got {streams}")
        self._split_bytes, self._streams = split_bytes, streams
        self._bind_host, self._port, self._advertise_host = bind_host, port, advertise_host
        self._io_timeout, self._idle_timeout, self._server_cls = io_timeout, idle_timeout, server_cls
        self._pool = TransferPool(self.name, max_workers)
        self._secret = None if secret is None else bytes.fromhex(secret)
        self._conns = _ConnPool(connect_timeout, io_timeout, secret=self._secret)
        self._server: KVServer | None = None
        self._grants: Grants | None = None
        self._staged = staged
        self._dst: HostBytes | StagedBytes | None = None
        self._layout: KVLayout | None = None
        self._handles: set[AsyncHandle] = set()
        self._xfer_ids = itertools.count(1)
        # in flight: release() / close() shut a transfer's socket so its mover wakes at once
        self._active: dict[AsyncHandle, set[socket.socket]] = {}
        self._active_lock = threading.Lock()

    def register(self, storage, layout: KVLayout, host: str, serve: bool = True) -> TransportEndpoint:
        """`storage`: a KVCacheTensors or its storage tensor (contiguous; CPU or GPU). `serve`:
        start the server peers read this cache from (a decode worker only receives: no server,
        and an endpoint with no address)."""
        if self._dst is not None:
            raise RuntimeError("TcpTransport.register called twice; one KV cache per transport")
        mem = storage_bytes(storage_tensor(storage), self._staged, unit=layout.block_bytes)
        if len(mem) != layout.storage_bytes:
            raise ValueError(f"storage has {len(mem)} bytes, layout says {layout.storage_bytes}")
        self._dst, self._layout = mem, layout
        if not serve:
            return TransportEndpoint(transport=self.name, host=host, address="", layout=layout)
        self._grants = Grants(layout)
        self._server = self._server_cls(mem, self._bind_host, self._port, self._io_timeout, self._idle_timeout,
                                        grants=self._grants, secret=self._secret)
        address = f"{self._advertised_ip()}:{self._server.port}"
        return TransportEndpoint(transport=self.name, host=host, address=address, layout=layout)

    def allow(self, token: bytes, blocks: Sequence[int]) -> None:
        if self._grants is None:
            raise RuntimeError("this TcpTransport serves no KV cache (registered with serve=False)")
        self._grants.allow(token, blocks)

    def revoke(self, token: bytes) -> None:
        if self._grants is not None:
            self._grants.revoke(token)

    def granted(self) -> int:
        return len(self._grants) if self._grants is not None else 0

    def _advertised_ip(self) -> str:
        if self._advertise_host:
            return self._advertise_host
        if self._bind_host not in ("0.0.0.0", "", "::"):
            return self._bind_host
        try:  # listening everywhere: publish the address peers resolve us by
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "127.0.0.1"

    def read(self, src: KVHandoff, dst_blocks: Sequence[int], layers: range | None = None) -> TransferHandle:
        handle, segments = start_read(self.name, self._layout if self._dst is not None else None, src, dst_blocks,
                                      layers, lambda h: plan_transfer(src.endpoint.layout, self._layout,
                                                                      src.block_ids, h.dst_blocks, h.layers))
        if segments is None:
            return handle
        handle.nbytes = sum(s.nbytes for s in segments)
        self._handles.add(handle)
        return self._pool.submit(handle, lambda: self._fetch(handle, src.endpoint.address, segments))

    def _fetch(self, handle: AsyncHandle, address: str, segments: list[Segment]) -> None:
        """Large transfers go over two connections at once: on loopback one stream stops at
        ~2.5 GB/s, well short of what two cores copy."""
        parts = _split(segments, self._streams) if handle.nbytes >= self._split_bytes else [segments]
        if len(parts) == 1:
            return self._fetch_part(handle, address, parts[0])
        errors: list[BaseException] = []

        def other(part: list[Segment]) -> None:
            try:
                self._fetch_part(handle, address, part)
            except BaseException as e:  # reported through the first part's thread
                errors.append(e)
                handle.aborted.set()  # stop the other parts early

        threads = [threading.Thread(target=other, args=(p,), name="kv-tcp-part", daemon=True) for p in parts[1:]]
        for t in threads:
            t.start()
        try:
            self._fetch_part(handle, address, parts[0])
        finally:
            for t in threads:
                t.join()
        if errors:
            raise errors[0]

    def _fetch_part(self, handle: AsyncHandle, address: str, segments: list[Segment]) -> None:
        for _attempt in range(2):
            sock, pooled = self._conns.take(address)
            with self._active_lock:
                self._active.setdefault(handle, set()).add(sock)
            try:
                self._exchange(sock, handle, next(self._xfer_ids), segments, pooled)
            except _Stale:
                sock.close()
                continue
            except BaseException:
                sock.close()  # mid-stream state unknown: never reuse
                handle.check_aborted()  # released / closed under us: say so, not "truncated"
                raise
            finally:
                with self._active_lock:
                    socks = self._active.get(handle, set())
                    socks.discard(sock)
                    if not socks:
                        self._active.pop(handle, None)
            self._conns.give(address, sock)
            return
        raise TransferError("unreachable", f"{address} closed two connections before answering")

    def _exchange(self, sock: socket.socket, handle: AsyncHandle, xfer_id: int, segments: list[Segment],
                  pooled: bool) -> None:
        rid = handle.request_id.encode()[:65535]
        token = handle.src.lease_token.ljust(TOKEN_SIZE, b"\0")[:TOKEN_SIZE]
        request = REQ.pack(REQ_MAGIC, VERSION, 0, xfer_id, token, len(rid), len(segments)) + rid
        request += np.array([(s.src_offset, s.nbytes) for s in segments], dtype=SEG).tobytes()
        try:
            sock.sendall(request)
            head = recv_exact(sock, RESP.size)
        except (Eof, OSError) as e:
            if pooled and (not isinstance(e, Eof) or e.got == 0) and not isinstance(e, socket.timeout):
                raise _Stale() from None
            raise TransferError("unreachable", f"no response from {peer(sock)}: {e}") from None
        total = self._check_response(sock, head, xfer_id, sum(s.nbytes for s in segments), len(segments))
        self._receive(sock, handle, segments, total)

    def _check_response(self, sock: socket.socket, head: bytes, xfer_id: int, nbytes: int, nseg: int) -> int:
        magic, version, status, got_id, total, got_nseg = RESP.unpack(head)
        if magic != RESP_MAGIC or version != VERSION:
            raise TransferError("header", f"peer speaks {magic!r} v{version}, expected {RESP_MAGIC!r} v{VERSION}")
        if got_id != xfer_id:
            raise TransferError("internal", f"response for transfer {got_id}, expected {xfer_id}")
        if status != OK:
            msg = recv_exact(sock, min(total, 1 << 16)).decode(errors="replace")
            raise TransferError("lease_expired" if status == NO_LEASE else "header", f"source rejected the request: {msg}")
        if total != nbytes or got_nseg != nseg:
            raise TransferError("header", f"source answers {total} bytes in {got_nseg} segments, asked {nbytes} in {nseg}")
        return total

    def _receive(self, sock: socket.socket, handle: AsyncHandle, segments: list[Segment], total: int) -> None:
        views, land = self._dst.receive([(seg.dst_offset, seg.nbytes) for seg in segments])
        try:
            recv_scatter(sock, views, handle.check_aborted)
            land()
        except Eof as e:
            raise TransferError("truncated", f"payload cut at {e.got} of {total} bytes") from None
        except OSError as e:  # includes timeouts: a stalled source must not hang the reader
            raise TransferError("truncated", f"payload of {total} bytes stopped: {e}") from None

    def _stop(self, handle: AsyncHandle) -> None:
        # A reader blocked in recv on a slow source only notices when its sockets go.
        with self._active_lock:
            socks = list(self._active.get(handle, ()))
        for sock in socks:
            shutdown(sock)

    def close(self) -> None:
        self._abort_all()
        if self._server is not None:
            self._server.close()
            self._server = None
        with self._active_lock:
            active = [sock for socks in self._active.values() for sock in socks]
        for sock in active:  # wake readers blocked on a slow source; they end FAILED("aborted")
            shutdown(sock)
        self._pool.close()
        self._conns.close()
        self._dst = None


