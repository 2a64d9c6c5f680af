"""The TCP transport's wire format and socket helpers, shared by its server and its reader.

  request   REQ  magic "SKVQ", version, flags, xfer_id u64, lease token (16 bytes),
            len(request_id) u16, nseg u32, then request_id (utf-8), then nseg × (offset u64,
            length u64); the token names the blocks the reader may read (grants.py)
  response  RESP magic "SKVD", version, status, xfer_id u64, total bytes u64, nseg u32
            then, when status is OK, the raw bytes of the segments in request order;
            otherwise `total` bytes of a utf-8 error message (status BAD_REQUEST, or NO_LEASE
            when the request's token opens nothing: its lease ended, or there never was one).
With a secret (the app's, given to every worker), each connection starts with a challenge:
  hello     HELLO magic "SKVH", version, a 16-byte random nonce (server → reader)
  answer    HMAC-SHA256(secret, nonce), 32 bytes (reader → server)
and a server that gets a wrong answer closes the connection before reading any request.
Scatter/gather I/O (sendmsg / recvmsg_into over many memoryviews) keeps a fragmented block list
to few syscalls and no staging copies.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import time
from typing import Callable

import numpy as np

VERSION = 2
REQ = struct.Struct("<4sHHQ16sHI")
RESP = struct.Struct("<4sHHQQI")
SEG = np.dtype("<u8")  # the segment table: nseg × (offset, length), as one little-endian array
SEG_SIZE = 2 * SEG.itemsize
HELLO = struct.Struct("<4sH16s")
AUTH_SIZE = 32
REQ_MAGIC, RESP_MAGIC, HELLO_MAGIC = b"SKVQ", b"SKVD", b"SKVH"
OK, BAD_REQUEST, NO_LEASE = 0, 1, 2  # NO_LEASE: the token is of no live lease (it lapsed, or never was)
IOV_BATCH = min(512, os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 512)
BATCH_BYTES = 1 << 20


class Eof(Exception):
    """The peer closed the connection; `got` bytes of the current read had arrived."""

    def __init__(self, got: int) -> None:
        super().__init__(f"connection closed after {got} bytes")
        self.got = got


# -- the challenge ------------------------------------------------------------------------------

def _answer_to(secret: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, HELLO_MAGIC + nonce, hashlib.sha256).digest()


def challenge(sock: socket.socket, secret: bytes, within_s: float) -> bool:
    """Server side: whether the reader knows the secret (it answered this connection's nonce),
    all of it within `within_s`: a per-recv timeout alone would let a peer trickle a byte at a
    time and hold the connection. Raises socket.timeout past the deadline."""
    deadline = time.monotonic() + within_s
    nonce = os.urandom(16)
    sock.settimeout(within_s)
    sock.sendall(HELLO.pack(HELLO_MAGIC, VERSION, nonce))
    return hmac.compare_digest(bytes(recv_exact(sock, AUTH_SIZE, deadline)), _answer_to(secret, nonce))


def answer(sock: socket.socket, secret: bytes) -> None:
    """Reader side: prove the secret for this connection. Raises Eof / ValueError when the other
    end is not a KV server asking for it."""
    magic, version, nonce = HELLO.unpack(recv_exact(sock, HELLO.size))
    if magic != HELLO_MAGIC or version != VERSION:
        raise ValueError(f"not a KV server's challenge: magic {magic!r}, version {version}")
    sock.sendall(_answer_to(secret, nonce))


# -- socket helpers -----------------------------------------------------------------------------

def recv_into(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill `view`; with a `deadline` (time.monotonic), all of it by then."""
    got = 0
    while got < len(view):
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("the peer did not send in time")
            sock.settimeout(left)
        n = sock.recv_into(view[got:])
        if n == 0:
            raise Eof(got)
        got += n


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytearray:
    buf = bytearray(n)
    recv_into(sock, memoryview(buf), deadline)
    return buf


def advance(bufs: list[memoryview], i: int, n: int) -> int:
    """Consume n bytes from bufs[i:], trimming a partly used buffer in place; the next index."""
    while n and i < len(bufs):
        if n >= len(bufs[i]):
            n -= len(bufs[i])
            i += 1
        else:
            bufs[i] = bufs[i][n:]
            n = 0
    while i < len(bufs) and len(bufs[i]) == 0:
        i += 1
    return i


def batch(bufs: list[memoryview], i: int) -> list[memoryview]:
    """The buffers for one sendmsg/recvmsg_into: up to IOV_BATCH of them, about BATCH_BYTES.
    A syscall pays for every buffer it is handed (Python acquires each one) but moves at most a
    socket buffer's worth: offering 512 × 16 KiB when a few hundred KiB will move only costs."""
    j, got, end = i, 0, min(len(bufs), i + IOV_BATCH)
    while j < end and got < BATCH_BYTES:
        got += len(bufs[j])
        j += 1
    return bufs[i:j]


def send_all(sock: socket.socket, bufs: list[memoryview]) -> None:
    """sendmsg over many buffers, resuming after partial sends; zero-copy from the caller's memory."""
    i = advance(bufs, 0, 0)
    while i < len(bufs):
        i = advance(bufs, i, sock.sendmsg(batch(bufs, i)))


def recv_scatter(sock: socket.socket, bufs: list[memoryview], between: Callable[[], None]) -> None:
    """recvmsg_into many buffers at once: a fragmented block list costs few syscalls, not one
    per 16 KiB segment. `between` runs between syscalls (the abort check)."""
    i, got = advance(bufs, 0, 0), 0
    while i < len(bufs):
        between()
        n = sock.recvmsg_into(batch(bufs, i))[0]
        if n == 0:
            raise Eof(got)
        got += n
        i = advance(bufs, i, n)


def shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv/send on it
    except OSError:
        pass


def peer(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "peer"
