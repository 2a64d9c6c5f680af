"""Worker classes that inject one fault each into real workers, for Ray tests: name one in a
deployment's `worker_classes` ({"decode": "tests.fakes.workers:CorruptingDecode"}) and the
pool runs it. The worker code itself has no fault branches: these wrap its transports or one of
its steps."""

from __future__ import annotations

import asyncio
import os
import tempfile
import time

from splitserve.worker.decode.worker import DecodeWorker
from splitserve.worker.prefill.worker import PrefillWorker
from tests.fakes import transports as faulty
from tests.fakes.tcp_faults import TruncatingServer


class _WrapsTransports(DecodeWorker):
    wrapper: type = faulty.Wrapped

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.transports = {k: self.wrapper(t, self) for k, t in self.transports.items()}


class CorruptingDecode(_WrapsTransports):
    """What lands is corrupted: verification fails ("corrupt")."""

    wrapper = faulty.CorruptLanding


class LateDecode(DecodeWorker):
    """Starts every read only after its lease lapsed, renewing nothing meanwhile: a reader that
    fell far behind ("lease_expired")."""

    async def _read(self, h, dst, prefill, ho):
        await asyncio.sleep(max(0.0, h.lease_expires_at - time.time()) + 0.2)
        await super()._read(h, dst, prefill, ho)


class HoldingDecode(_WrapsTransports):
    """Every read stays in flight for 10 s: aborts land mid-transfer."""

    wrapper = faulty.HeldOpen


class PrefillKillingDecode(DecodeWorker):
    """Kills the prefill worker it is about to read from (the source dies mid-transfer)."""

    async def _read(self, h, dst, prefill, ho):
        import ray

        if prefill is not None:
            ray.kill(prefill)
            await asyncio.sleep(0.2)
        await super()._read(h, dst, prefill, ho)


class TruncatingPrefill(PrefillWorker):
    """Its TCP KV server sends half of every payload ("truncated" on the reader's side)."""

    def __init__(self, *args, transport_options: dict | None = None, **kwargs) -> None:
        opts = dict(transport_options or {})
        opts["tcp"] = {**opts.get("tcp", {}), "server_cls": TruncatingServer}  # the app's secret kept
        super().__init__(*args, transport_options=opts, **kwargs)


class BreakableDecode(DecodeWorker):
    """Its engine's steps raise once the test creates `break_flag(pid)` (the engine is broken
    from then on: the loop stops after its failure limit)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        real, flag = self.engine.step, break_flag(os.getpid())

        def step():
            if os.path.exists(flag):
                raise RuntimeError("injected: the engine is broken")
            return real()

        self.engine.step = step


def break_flag(pid: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"splitserve-test-break-{pid}")


# -- emulated accelerators --------------------------------------------------------------------
# On this 2-core machine N CPU workers share the same cores, so a pool's capacity does not grow
# with its size. These workers run the real engine and then wait, off the CPU, as long as a
# device of a fixed speed would take for the step — each worker's capacity is its own, as on a
# GPU — so scaling a pool really adds capacity (autoscaling tests and the ramp benchmark).

def pace(engine, base_s: float, per_prefill_token_s: float, per_decode_seq_s: float) -> None:
    run = engine.runner.run

    def paced(sched):
        out = run(sched)
        decodes = sum(1 for item in sched.scheduled if item.num_new_tokens == 1)
        time.sleep(base_s + (sched.num_tokens - decodes) * per_prefill_token_s + decodes * per_decode_seq_s)
        return out

    engine.runner.run = paced


class PacedPrefill(PrefillWorker):
    """~3,200 prompt tokens/s in 512-token chunks."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        pace(self.engine, 0.005, 0.0003, 0.002)


class PacedDecode(DecodeWorker):
    """A step of B sequences takes 10 ms + 2 ms · B (a batch of 16: 42 ms per token)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        pace(self.engine, 0.01, 0.0003, 0.002)
