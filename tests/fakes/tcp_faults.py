"""KV sources that misbehave the ways a real one can, for TcpTransport(server_cls=...): each
overrides `KVServer.send_data`, the one step where a response's bytes go out, after the request
was read and checked like any other."""

from __future__ import annotations

import socket
import threading

from splitserve.kv_transfer.tcp_server import KVServer
from splitserve.kv_transfer.tcp_wire import send_all


class TruncatingServer(KVServer):
    """Sends the header and half the payload, then closes: the reader fails "truncated"."""

    def send_data(self, conn: socket.socket, views: list[memoryview]) -> bool:
        payload = sum(len(v) for v in views[1:])
        send_all(conn, _first_bytes(views, len(views[0]) + payload // 2))
        return False


class DroppingServer(KVServer):
    """Closes the connection without answering: the reader fails "unreachable"."""

    def send_data(self, conn: socket.socket, views: list[memoryview]) -> bool:
        return False


class StallingServer(KVServer):
    """Never answers (until the server closes): only the reader's io_timeout or release ends it.
    `stalled`: how many requests it holds now, so a test can tell a read is stalled in it (and
    still is when the reader ends: the reader, not the source, gave up)."""

    def __init__(self, *args, **kwargs) -> None:
        self._closing = threading.Event()  # before the base starts serving threads
        self._count = threading.Lock()
        self.stalled = 0
        super().__init__(*args, **kwargs)

    def send_data(self, conn: socket.socket, views: list[memoryview]) -> bool:
        with self._count:
            self.stalled += 1
        try:
            self._closing.wait()
        finally:
            with self._count:
                self.stalled -= 1
        return False

    def close(self) -> None:
        self._closing.set()  # the base joins the serving threads: let the stalled ones go first
        super().close()


def _first_bytes(views: list[memoryview], nbytes: int) -> list[memoryview]:
    out = []
    for v in views:
        if nbytes <= 0:
            break
        out.append(v[:nbytes])
        nbytes -= len(out[-1])
    return out
