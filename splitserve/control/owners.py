"""The Controller's owners: the app's ingress replicas, each attached with its actor handle.

A replica that stops detaches from its `__del__`, but that call can be lost: Serve may kill a
replica without running it (a `serve run` whose shutdown timed out on a slow machine), and a
fire-and-forget call from a process that is exiting may never leave it. So the Controller also
watches each owner's actor: one that died is detached here. When none is left for
`ORPHAN_GRACE_S` (an app being redeployed re-attaches within it), the app is gone and the
Controller stops its workers and exits.
"""

from __future__ import annotations

import asyncio
import time

ORPHAN_GRACE_S = 5.0
RESTART_GRACE_S = 30.0  # a restarted Controller waits this long for its replicas to attach again
CHECK_TIMEOUT_S = 5.0  # a replica that does not answer within this is busy, not dead


class Owners:
    def __init__(self) -> None:
        self._handles: dict[str, object] = {}  # owner id -> its actor handle (None: not an actor)
        self._orphaned_at: float | None = None

    def attach(self, owner: str, handle=None) -> None:
        self._handles[owner] = handle
        self._orphaned_at = None

    @property
    def owned(self) -> bool:
        """Some replica has attached (the app is served through Serve, not the offline API)."""
        return bool(self._handles) or self._orphaned_at is not None

    def expect(self, grace_s: float = RESTART_GRACE_S) -> None:
        """A restarted Controller knows no owner yet: if none attaches within `grace_s` (the app
        was deleted while it was away), it is orphaned."""
        if not self._handles:
            self._orphaned_at = time.monotonic() - ORPHAN_GRACE_S + grace_s

    def detach(self, owner: str) -> None:
        self._handles.pop(owner, None)
        if not self._handles and self._orphaned_at is None:
            self._orphaned_at = time.monotonic()

    def orphaned(self, grace_s: float = ORPHAN_GRACE_S) -> bool:
        """Attached once, and nobody has been attached for `grace_s`."""
        return self._orphaned_at is not None and time.monotonic() - self._orphaned_at > grace_s

    async def watch(self, interval_s: float) -> None:
        """Forever: detach every owner whose actor died."""
        while True:
            await asyncio.sleep(interval_s)
            await asyncio.gather(*(self._check(o, h) for o, h in list(self._handles.items()) if h is not None))

    async def _check(self, owner: str, handle) -> None:
        """A replica that does not answer in time is only busy; one whose actor died is gone."""
        import ray

        try:
            await asyncio.wait_for(handle.__ray_ready__.remote(), CHECK_TIMEOUT_S)
        except ray.exceptions.RayActorError:
            self.detach(owner)
        except (asyncio.TimeoutError, ray.exceptions.RayError):  # busy, or an error that is not its death
            pass
