"""Workers that fail to start, retried with exponential backoff (issue 30): a pool whose new
workers keep dying before they are READY (a node that cannot load the model, a crash in the
constructor) waits 1, 2, 4 … up to 60 s between attempts instead of spawning one every probe,
and `status` shows how many failed, the last error and when the next try is. A worker that
becomes READY resets its pool. A worker that *refused* its configuration is not retried at
all (Controller.errors): that is a config to change, not a fault to wait out."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from splitserve.types import Role

FIRST_S, MAX_S = 1.0, 60.0


@dataclass(frozen=True)
class StartFailures:
    count: int
    last_error: str
    retry_at: float  # time.time() of the next attempt

    def message(self, now: float) -> str:
        wait = max(0.0, self.retry_at - now)
        return (f"{self.count} worker start{'s' if self.count > 1 else ''} failed (last: {self.last_error}); "
                f"next try in {wait:.0f} s")


class StartBackoff:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._by_role: dict[Role, StartFailures] = {}
        self._clock = clock

    def failed(self, role: Role, error: str) -> None:
        n = self._by_role[role].count + 1 if role in self._by_role else 1
        self._by_role[role] = StartFailures(n, error, self._clock() + min(MAX_S, FIRST_S * 2 ** (n - 1)))

    def started(self, role: Role) -> None:
        self._by_role.pop(role, None)

    def may_spawn(self, role: Role) -> bool:
        f = self._by_role.get(role)
        return f is None or self._clock() >= f.retry_at

    def messages(self) -> dict[str, str]:
        now = self._clock()
        return {role.value: f.message(now) for role, f in self._by_role.items()}
