"""What a test leaves alive on the shared Ray cluster, reported against the test that left it.

Every integration test shares one Ray cluster (conftest.ray_session). A test that leaves an app,
a Controller, a worker or a placement group behind does not fail itself — the next test that
needs the CPUs, the route prefix or the app's name does, far away. So around every test that
uses the cluster (`no_leaked_ray_state`) the actors and placement groups alive before it are
compared with those alive after it, once its own teardown had a moment to finish; what is new
fails *that* test (at its teardown) and is then removed, so the next test starts clean. Between
modules (`no_ray_state_between_modules`) the cluster must hold nothing at all: that catches a
module-scoped fixture that leaks.

Uses Ray's GCS tables directly (test code: private APIs are fine here).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest

TEARDOWN_S = 20.0  # what a test's own teardown may take to finish after it returned (killing is async)
LIVE = ("DEPENDENCIES_UNREADY", "PENDING_CREATION", "ALIVE", "RESTARTING")


@dataclass(frozen=True)
class Thing:
    """One live actor or placement group."""

    id: str
    what: str  # how a report names it

    @property
    def is_group(self) -> bool:
        return self.what.startswith("placement group")


def alive() -> frozenset[Thing]:
    import ray
    from ray._private import state

    things = set()
    for name in LIVE:
        for aid, a in state.actors(actor_state_name=name).items():
            label = f"actor {a['ActorClassName']}" + (f" {a['Name']!r}" if a["Name"] else "")
            things.add(Thing(aid, f"{label} ({name.lower()})"))
    for gid, g in ray.util.placement_group_table().items():
        if g["state"] != "REMOVED":
            things.add(Thing(gid, f"placement group {g.get('name') or gid[:12]} ({g['state'].lower()}, "
                                  f"bundles {list(g['bundles'].values())})"))
    return frozenset(things)


def left_behind(before: frozenset[Thing]) -> list[Thing]:
    """What is alive now and was not in `before`, once gone or after TEARDOWN_S."""
    deadline = time.monotonic() + TEARDOWN_S
    new = sorted(alive() - before, key=lambda t: t.what)
    while new and time.monotonic() < deadline:
        time.sleep(0.2)
        new = sorted(alive() - before, key=lambda t: t.what)
    return new


def remove(things: list[Thing]) -> None:
    """Take a leak down: Serve (its apps, replicas, proxies), named actors, placement groups
    (which takes the workers inside them along)."""
    import ray
    from ray._private import state
    from ray.util.placement_group import PlacementGroup

    if any("SERVE" in t.what or "ServeController" in t.what for t in things):
        from ray import serve

        try:
            serve.shutdown()
        except Exception:
            pass
    named = {(a["Name"], a.get("RayNamespace")) for t in things if not t.is_group
             for a in [state.actors(actor_id=t.id)] if a and a.get("Name")}
    for name in {n for n, _ in named}:
        for entry in ray.util.list_named_actors(all_namespaces=True):
            if entry["name"] == name:
                try:
                    ray.kill(ray.get_actor(name, namespace=entry["namespace"]), no_restart=True)
                except Exception:
                    pass
    for t in things:
        if t.is_group:
            ray.util.remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(t.id))))


def report(who: str, things: list[Thing]) -> str:
    return f"{who} left {len(things)} thing(s) alive on the test cluster: " + "; ".join(t.what for t in things)


@pytest.fixture(autouse=True)
def no_leaked_ray_state(request):
    """Around each test that uses the shared cluster: what it started, it must have stopped."""
    if "ray_session" not in request.fixturenames:
        yield
        return
    request.getfixturevalue("ray_session")
    before = alive()
    yield
    leaked = left_behind(before)
    if leaked:
        remove(leaked)
        pytest.fail(report(f"this test ({request.node.nodeid})", leaked), pytrace=False)


@pytest.fixture(scope="module", autouse=True)
def no_ray_state_between_modules(request):
    """After a module that used the cluster (its module-scoped fixtures torn down): nothing."""
    yield
    import ray

    if not ray.is_initialized():
        return
    leaked = left_behind(frozenset())
    if leaked:
        remove(leaked)
        pytest.fail(report(f"module {request.module.__name__}", leaked), pytrace=False)
