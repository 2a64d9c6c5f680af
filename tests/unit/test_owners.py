"""The Controller's owners (control/owners.py): an ingress replica whose actor died is detached
even though its own detach never came, and the app counts as gone only after the grace; a
replica that is merely slow to answer stays attached."""

from __future__ import annotations

import asyncio

from ray.exceptions import ActorDiedError

from splitserve.control.owners import Owners


class Method:
    def __init__(self, answer):
        self.answer = answer

    def remote(self):
        async def call():
            if isinstance(self.answer, BaseException):
                raise self.answer
            await asyncio.sleep(self.answer)
            return True

        return call()


class Replica:
    """A fake actor handle: `__ray_ready__` answers after `delay` s, or raises."""

    def __init__(self, answer):
        self.__ray_ready__ = Method(answer)


def test_a_dead_replica_is_detached_and_a_slow_one_is_not(monkeypatch):
    import splitserve.control.owners as owners_mod

    owners = Owners()
    owners.attach("alive", Replica(0.0))
    owners.attach("slow", Replica(30.0))  # busy past the check's patience: still an owner
    owners.attach("dead", Replica(ActorDiedError()))
    monkeypatch.setattr(owners_mod, "CHECK_TIMEOUT_S", 0.05)

    async def rounds():
        task = asyncio.get_running_loop().create_task(owners.watch(0.01))
        await asyncio.sleep(0.3)
        task.cancel()

    asyncio.run(rounds())
    assert sorted(owners._handles) == ["alive", "slow"] and not owners.orphaned(0.0)
    owners.detach("alive")
    owners.detach("slow")
    assert owners.orphaned(0.0) and not owners.orphaned(60.0)  # gone, once the grace has passed
    owners.attach("redeployed", Replica(0.0))
    assert not owners.orphaned(0.0)


def test_an_owner_without_an_actor_is_never_probed():
    owners = Owners()
    owners.attach("driver")  # no handle: only its own detach ends it

    async def one_round():
        task = asyncio.get_running_loop().create_task(owners.watch(0.01))
        await asyncio.sleep(0.05)
        task.cancel()

    asyncio.run(one_round())
    assert not owners.orphaned(0.0)
    owners.detach("driver")
    assert owners.orphaned(0.0)
