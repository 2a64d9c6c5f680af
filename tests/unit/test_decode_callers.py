"""A decode worker's watch on the ingress replicas it streams to (worker/decode/callers.py):
a replica whose actor died has its streams aborted (after a second failed ping: one failure
may be a blip); a slow one and its streams are left alone; a stream without a caller (a
driver) is never watched; a finished stream stops being watched."""

from __future__ import annotations

import asyncio

from splitserve.worker.decode.callers import Callers


class Ping:
    def __init__(self, replica) -> None:
        self.replica = replica

    def remote(self):
        async def answer():
            if self.replica.dead:
                raise RuntimeError("the actor died")
            await asyncio.sleep(self.replica.delay)

        return answer()


class Replica:
    def __init__(self, delay: float = 0.0) -> None:
        self.dead, self.delay = False, delay
        self.__ray_ready__ = Ping(self)


def test_a_dead_replicas_streams_are_aborted_and_a_slow_ones_are_not():
    async def go():
        aborted = []

        async def abort(rid):
            aborted.append(rid)

        callers = Callers(abort, interval_s=0.01, timeout_s=0.05)
        dead, slow, alive = Replica(), Replica(delay=10), Replica()
        for rid, who in (("d1", dead), ("d2", dead), ("s1", slow), ("a1", alive), ("a2", alive), ("x", None)):
            callers.add(who, rid)
        callers.remove(alive, "a2")  # finished
        dead.dead = True
        await asyncio.sleep(0.3)
        assert sorted(aborted) == ["d1", "d2"] and callers.gone == 1
        assert set(callers._streams) == {slow, alive}
        callers.remove(slow, "s1")
        callers.remove(alive, "a1")
        await asyncio.sleep(0.05)
        assert callers._watch.done()  # nothing left to watch: the loop ends
        callers.close()

    asyncio.run(go())


def test_one_failed_ping_is_not_a_death():
    async def go():
        aborted = []

        async def abort(rid):
            aborted.append(rid)

        callers = Callers(abort, interval_s=60)  # rounds driven by hand below
        blip = Replica()
        callers.add(blip, "r")
        blip.dead = True
        await callers._check(blip)
        blip.dead = False
        await callers._check(blip)  # answered again: the count starts over
        blip.dead = True
        await callers._check(blip)
        assert aborted == [] and callers.gone == 0
        await callers._check(blip)  # a second failure in a row: gone
        assert aborted == ["r"] and callers.gone == 1
        callers.close()

    asyncio.run(go())
