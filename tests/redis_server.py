"""A real redis-server for the tests, on a free loopback port, with no persistence; it can be
killed and started again on the same port (Redis lost, Redis back)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

from tests.loopback import free_port


class RedisServer:
    def __init__(self) -> None:
        self.binary = shutil.which("redis-server")
        # Not a port the kernel hands out for port 0: another worker's Ray process may take it
        # before redis-server binds it, or while it is down between kill() and start().
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen([self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None
