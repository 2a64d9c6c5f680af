"""A stand-in for NIXL's agent, to test NixlTransport's ordering without NIXL or a peer: READs
move no bytes, and the test decides when a connect or a post returns and when each READ ends.
It records every request freed while it could still write: the bug NixlTransport must not have.

Install it with `install(monkeypatch)`: the transport then builds FakeAgents instead of NIXL's.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import splitserve.kv_transfer.nixl as nixl_transport

WAIT_S = 10.0  # a gate the test forgets to open fails the test instead of hanging it


class FakeXfer:
    def __init__(self, agent: "FakeAgent") -> None:
        self.agent = agent
        self.state = "NEW"  # NEW → posting → PROC → DONE | ERR
        self.released = False
        self.checks = 0  # how often the transport asked for its state

    def finish(self, state: str = "DONE") -> None:
        """The READ ends: from now on nothing of it lands."""
        self.state = state

    def release(self) -> None:
        if self.state in ("posting", "PROC"):
            self.agent.unsafe_releases.append(self)
        self.released = True


class FakeAgent:
    backends = {"UCX": object()}

    def __init__(self, name: str) -> None:
        self.name = name
        self.connect_gate, self.post_gate = threading.Event(), threading.Event()
        self.connect_gate.set()
        self.post_gate.set()
        self.connecting, self.posting = threading.Event(), threading.Event()  # a thread is inside
        self.xfers: list[FakeXfer] = []
        self.posted: list[FakeXfer] = []
        self.unsafe_releases: list[FakeXfer] = []
        self.in_flight_at_deregister: list[FakeXfer] | None = None

    def get_plugin_list(self) -> list[str]:
        return list(self.backends)

    def register_memory(self, tensor):
        return "registration"

    def deregister_memory(self, registration) -> None:
        self.in_flight_at_deregister = [x for x in self.xfers if x.state in ("posting", "PROC")]

    def get_agent_metadata(self) -> bytes:
        return self.name.encode()

    def add_remote_agent(self, metadata: bytes) -> bytes:
        self.connecting.set()
        assert self.connect_gate.wait(WAIT_S), "connect gate never opened"
        return metadata  # our metadata is the agent's name

    def remove_remote_agent(self, name: str) -> None:
        pass

    def get_xfer_descs(self, rows, mem: str):
        return rows

    def initialize_xfer(self, op: str, local, remote, peer: str) -> FakeXfer:
        xfer = FakeXfer(self)
        self.xfers.append(xfer)
        return xfer

    def transfer(self, xfer: FakeXfer) -> str:
        xfer.state = "posting"
        self.posted.append(xfer)
        self.posting.set()
        assert self.post_gate.wait(WAIT_S), "post gate never opened"
        xfer.state = "PROC"
        return "PROC"

    def check_xfer_state(self, xfer: FakeXfer) -> str:
        xfer.checks += 1
        return "PROC" if xfer.state == "posting" else xfer.state


def install(monkeypatch) -> dict[str, FakeAgent]:
    """NixlTransports built from now on get FakeAgents; returns them by agent name."""
    agents: dict[str, FakeAgent] = {}
    api = SimpleNamespace(nixl_agent_config=lambda **kw: SimpleNamespace(**kw),
                          nixl_thread_sync_t=SimpleNamespace(NIXL_THREAD_SYNC_STRICT="strict"))
    monkeypatch.setattr(nixl_transport, "default_ucx_tls", lambda: None)
    monkeypatch.setattr(nixl_transport, "import_nixl", lambda: api)
    monkeypatch.setattr(nixl_transport, "make_agent",
                        lambda api, name, config, delay: agents.setdefault(name, FakeAgent(name)))
    return agents
