"""The serving side of the TCP transport: a listener thread plus a thread per connection, each
answering requests for byte ranges of this worker's KV storage (straight from its memory on
CPU, through one host copy on a GPU: `regions.storage_bytes`) — only ranges inside the blocks
of the lease whose token the request carries (`grants.py`).
A subclass may override `send_data`, the one step where a response's bytes go out (the faulty
sources of tests/fakes/tcp_faults.py do); `TcpTransport(server_cls=...)` installs it.
"""

from __future__ import annotations

import socket
import struct
import threading

import numpy as np

from splitserve.kv_transfer.grants import Grants
from splitserve.kv_transfer.regions import HostBytes, StagedBytes
from splitserve.kv_transfer.tcp_wire import (
    BAD_REQUEST,
    NO_LEASE,
    OK,
    REQ,
    REQ_MAGIC,
    RESP,
    RESP_MAGIC,
    SEG,
    SEG_SIZE,
    VERSION,
    Eof,
    challenge,
    recv_exact,
    send_all,
    shutdown,
)


MAX_CONNECTIONS = 256  # readers pool a connection or two per peer: more is someone else's doing
MAX_UNAUTHENTICATED = 16  # connections in their handshake at once; one more evicts the oldest
HANDSHAKE_S = 2.0  # for the whole challenge: a reader with the secret answers in a round trip


class KVServer:
    """Serves byte ranges of one worker's KV storage; a thread per connection, at most
    `max_connections` of them (one more is closed at once: a reader takes that as a failed
    transfer, which the decode side recomputes). With a `secret`, a connection whose reader does
    not answer its challenge (tcp_wire) within HANDSHAKE_S is closed before any request is read,
    and at most MAX_UNAUTHENTICATED connections are in their handshake at once: a new one evicts
    the oldest. A reader with the secret answers within a round trip, so peers without it, however
    many and however slow, cannot hold the slots readers need (they would have to connect faster
    than one round trip per slot). `grants`: what each lease token may read; a request under no
    live lease is refused."""

    def __init__(self, source: HostBytes | StagedBytes, bind_host: str, port: int, io_timeout: float,
                 idle_timeout: float, *, grants: Grants, max_connections: int = MAX_CONNECTIONS,
                 secret: bytes | None = None) -> None:
        if len(source) != grants.layout.storage_bytes:
            raise ValueError(f"source has {len(source)} bytes, the grants' layout {grants.layout.storage_bytes}")
        self._src, self._io_timeout, self._idle_timeout = source, io_timeout, idle_timeout
        self._grants, self._secret = grants, secret
        self._max_connections = max_connections
        self._stop = threading.Event()
        self._conns: set[socket.socket] = set()
        self._handshaking: dict[socket.socket, None] = {}  # of those, still in their challenge, oldest first
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._listener = socket.create_server((bind_host, port), backlog=64)
        self._listener.settimeout(0.1)  # accept() wakes up to notice close()
        self.port = self._listener.getsockname()[1]
        self._spawn(self._accept_loop, "kv-tcp-accept")

    def _spawn(self, target, name: str, *args) -> None:
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        with self._lock:
            self._threads = [x for x in self._threads if x.is_alive()] + [t]
        t.start()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except (socket.timeout, BlockingIOError):
                continue
            except OSError:
                return  # listener closed
            evicted = None
            with self._lock:
                full = len(self._conns) >= self._max_connections
                if not full:
                    self._conns.add(conn)
                    if self._secret is not None:
                        if len(self._handshaking) >= MAX_UNAUTHENTICATED:
                            evicted = next(iter(self._handshaking))
                            del self._handshaking[evicted]
                        self._handshaking[conn] = None
            if evicted is not None:
                shutdown(evicted)  # its thread's recv returns: it closes and frees its place
            if full:
                conn.close()
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._spawn(self._serve, "kv-tcp-conn", conn)

    def _serve(self, conn: socket.socket) -> None:
        try:
            if self._secret is not None and not self._authenticated(conn):
                return  # a reader without the secret: no byte of KV
            conn.settimeout(self._io_timeout)
            while not self._stop.is_set() and self._serve_one(conn):
                pass
        except (OSError, Eof, struct.error, UnicodeDecodeError):
            pass  # the reader went away or spoke garbage: drop the connection, keep serving others
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _authenticated(self, conn: socket.socket) -> bool:
        try:
            return challenge(conn, self._secret, HANDSHAKE_S)
        finally:
            with self._lock:
                self._handshaking.pop(conn, None)

    def _serve_one(self, conn: socket.socket) -> bool:
        """Answer one request; False when the connection should close."""
        conn.settimeout(self._idle_timeout)  # a pooled connection may sit idle between transfers
        try:
            head = recv_exact(conn, REQ.size)
        except Eof as e:
            if e.got == 0:
                return False  # clean close between requests
            raise
        conn.settimeout(self._io_timeout)
        magic, version, _flags, xfer_id, token, rid_len, nseg = REQ.unpack(head)
        if magic != REQ_MAGIC or version != VERSION:
            self._reply_error(conn, xfer_id, f"bad request: magic {magic!r}, version {version}")
            return False
        grant = self._grants.get(token)
        if grant is None:  # refused before its table is read
            self._reply_error(conn, xfer_id, "no live lease has this token", NO_LEASE)
            return False
        if nseg > grant.max_segments:
            self._reply_error(conn, xfer_id, f"{nseg} segments for a lease of {grant.max_segments}")
            return False
        recv_exact(conn, rid_len)  # request id: for logs only, the xfer id is what matches
        table = np.frombuffer(recv_exact(conn, nseg * SEG_SIZE), dtype=SEG).reshape(nseg, 2)
        refusal = self._grants.refusal(grant, table[:, 0], table[:, 1])
        if refusal is not None:
            self._reply_error(conn, xfer_id, refusal)
            return True
        return self._reply_data(conn, xfer_id, table.tolist())

    def _reply_data(self, conn: socket.socket, xfer_id: int, segs: list[tuple[int, int]]) -> bool:
        total = sum(n for _, n in segs)
        views = [memoryview(RESP.pack(RESP_MAGIC, VERSION, OK, xfer_id, total, len(segs)))]
        return self.send_data(conn, views + self._src.read(segs))

    def send_data(self, conn: socket.socket, views: list[memoryview]) -> bool:
        """Send one OK response: `views[0]` is its header, the rest the payload. False closes the
        connection."""
        send_all(conn, views)
        return True

    def _reply_error(self, conn: socket.socket, xfer_id: int, message: str, status: int = BAD_REQUEST) -> None:
        msg = message.encode()
        send_all(conn, [memoryview(RESP.pack(RESP_MAGIC, VERSION, status, xfer_id, len(msg), 0) + msg)])

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        with self._lock:
            conns, threads = list(self._conns), list(self._threads)
        for c in conns:
            shutdown(c)
        for t in threads:
            t.join(timeout=5)
