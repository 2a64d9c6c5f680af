"""Workers that show where in its life a request was when its cancel reached them, for the
cancel-at-every-phase chaos test (tests/chaos/test_cancel_phases.py).

The test arms a request (by its prompt: the one thing a client chooses that every attempt and
every worker sees) with a phase. When the request reaches that phase on a worker, the worker
says so (`reached`) and holds it there — an asyncio wait, or the engine thread waiting before
the step that would carry it on — until its cancel arrives (or `HOLD_S` passes, which the test
counts as a failure, or the test `release`s it). The cancel's arrival (a cancelled `prefill`
call, `abort`, `drop_staging`) is recorded with the phase the request was held in (`landed`):
the phase a cancel landed in is read off the worker at that moment, not assumed. Holding
changes only *when* the real code runs, never *what* it does: no branch of a production class
knows about it.

Phases, by where they are held:
  queued       prefill worker: admitted, its prefill call begun (its stream's lease granted, the
               decode worker's staging reserving blocks), not yet in the engine
  prefill      prefill worker: its prompt chunk is in the step about to be computed
  kv_stream    decode worker: a streamed piece of its KV about to be read into its staged blocks
  first_decode decode worker: landed (in the batch), its first decode step about to run here
  decode       decode worker: a plain decode step (one token, 3+ out already) about to run
  spec_verify  decode worker: a step verifying its speculative proposals about to run (not its first)
  grammar      decode worker: a decode step of a grammar-constrained request (3+ tokens out)
  migration    either worker: a request moved off a lost decode worker (engine id `<id>~<n>`),
               at its new prefill (or aggregated decode) before anything of it is computed
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from types import SimpleNamespace

from splitserve.worker.decode.worker import DecodeWorker
from splitserve.worker.prefill.worker import PrefillWorker

HOLD_S = 20.0  # a hold the test never cancelled nor released ends here, and is reported
PHASES = ("queued", "prefill", "kv_stream", "first_decode", "decode", "spec_verify", "grammar", "migration")


def moved(req) -> bool:
    return "~" in req.request_id


class _Hold:
    def __init__(self, key: tuple, rid: str, phase: str) -> None:
        self.key, self.rid, self.phase = key, rid, phase
        self.done = threading.Event()  # set by the cancel's arrival, or a release


class Probe:
    """What one worker was armed with, reached, and where the cancels landed (thread-safe: the
    engine thread holds steps, the event loop records cancels)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.armed: dict[tuple, str] = {}  # prompt -> the phase to hold it in
        self.reached: list[tuple[tuple, str, str]] = []  # (prompt, engine id, phase), in order
        self.seen: set[tuple] = set()  # prompts held once already (a request is held once)
        self.holds: dict[str, _Hold] = {}  # engine id -> its hold, while held
        self.landed: list[tuple[tuple, str, str]] = []  # (prompt, engine id, phase) of each cancel that hit a hold
        self.expired: list[tuple[tuple, str]] = []
        self.trail: collections.deque = collections.deque(maxlen=20000)  # (engine id, what happened), for diagnosis

    def note(self, rid: str, what: str) -> None:
        self.trail.append((rid, what, time.monotonic()))

    def start(self, req, phase: str | None) -> _Hold | None:
        """A hold for this request in `phase`, if it is armed for it and was not held before."""
        key = tuple(req.prompt_token_ids)
        with self.lock:
            if phase is None or self.armed.get(key) != phase or key in self.seen:
                return None
            self.seen.add(key)
            h = self.holds[req.request_id] = _Hold(key, req.request_id, phase)
            self.reached.append((key, req.request_id, phase))
            return h

    def end(self, h: _Hold, waited: bool) -> None:
        with self.lock:
            self.holds.pop(h.rid, None)
            if not waited:
                self.expired.append((h.key, h.phase))

    def wait(self, h: _Hold, until: float) -> None:
        """On the engine thread."""
        self.end(h, h.done.wait(max(0.0, until - time.monotonic())))

    async def await_(self, h: _Hold) -> None:
        """On the event loop (never blocks it)."""
        until = time.monotonic() + HOLD_S
        try:
            while not h.done.is_set() and time.monotonic() < until:
                await asyncio.sleep(0.002)
        finally:  # (cancelled too: the cancel that landed here ends it)
            self.end(h, h.done.is_set())

    def land(self, rid: str) -> None:
        """A cancel of `rid` reached this worker: noted where it is held, and the hold ends."""
        with self.lock:
            h = self.holds.get(rid)
            if h is None or h.done.is_set():
                return
            self.landed.append((h.key, rid, h.phase))
            h.done.set()

    def release(self, key: tuple) -> bool:
        with self.lock:
            hs = [h for h in self.holds.values() if h.key == key]
        for h in hs:
            h.done.set()
        return bool(hs)


def _hold_steps(engine, probe: Probe, phase_of) -> None:
    """Before each engine step: hold it while a row of it is at an armed request's phase."""
    run = engine.runner.run

    def run_held(sched):
        holds = [h for item in sched.scheduled if (h := probe.start(item.seq.request, phase_of(item))) is not None]
        until = time.monotonic() + HOLD_S
        for h in holds:
            probe.wait(h, until)
        return run(sched)

    engine.runner.run = run_held


def _hold_submits(loop, probe: Probe, phase_of) -> None:
    """Before a request enters the engine: hold it while it is at an armed request's phase."""
    submit = loop.submit

    async def submit_held(req, **kwargs):
        h = probe.start(req, phase_of(req))
        if h is not None:
            await probe.await_(h)
        return await submit(req, **kwargs)

    loop.submit = submit_held


class _Probed:
    """The test's side of a probed worker (Ray actor methods)."""

    probe: Probe

    async def arm(self, phases: dict) -> None:
        with self.probe.lock:
            self.probe.armed.update(phases)

    async def reached_since(self, n: int) -> list:
        with self.probe.lock:
            return self.probe.reached[n:]

    async def release(self, key: tuple) -> bool:
        return self.probe.release(tuple(key))

    async def trail_of(self, rid: str) -> list:
        base = rid.split("~")[0]
        return [t for t in self.probe.trail if t[0].split("~")[0] == base]

    async def probe_report(self) -> dict:
        """Where cancels landed, holds that timed out, holds still open."""
        with self.probe.lock:
            report = {"landed": list(self.probe.landed), "expired": list(self.probe.expired),
                      "holding": [(h.key, h.rid, h.phase) for h in self.probe.holds.values()]}
        leases = getattr(self, "leases", None)  # a prefill worker's: whose blocks it still pins
        report["leased"] = [] if leases is None else sorted(lease.request_id for lease in leases._leases.values())
        return report


class PhasePrefill(_Probed, PrefillWorker):
    async def ack(self, lease_id: str) -> bool:
        lease = self.leases._leases.get(lease_id)
        live = await super().ack(lease_id)
        self.probe.note(lease.request_id if lease else "?", f"ack live={live}")
        return live

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.probe = Probe()
        _hold_submits(self.loop, self.probe, lambda req: "migration" if moved(req) else "queued")
        _hold_steps(self.engine, self.probe, _prefill_row)
        submit = self.loop.submit

        async def submit_followed(req, **kwargs):
            """A request armed for kv_stream is computed once its reader follows the stream (its
            pieces are then streamed, not all sent with the handoff); a few seconds at most."""
            if self.probe.armed.get(tuple(req.prompt_token_ids)) == "kv_stream":
                until = time.monotonic() + 5.0
                while time.monotonic() < until and getattr(self.streams.get(req.request_id), "held", 0) is None:
                    await asyncio.sleep(0.002)
            return await submit(req, **kwargs)

        self.loop.submit = submit_followed

    async def prefill(self, req, *args, **kwargs):
        """The real prefill; its cancel is noted the moment it arrives, before any of the
        prefill's own cleanup runs (which may wait for the engine thread this probe holds)."""
        task = asyncio.ensure_future(super().prefill(req, *args, **kwargs))
        self.probe.note(req.request_id, "prefill")
        try:
            r = await asyncio.shield(task)
            self.probe.note(req.request_id, f"prefilled streamed={r.handoff.streamed if r.handoff else None}")
            return r
        except asyncio.CancelledError:
            self.probe.note(req.request_id, f"prefill cancelled, done={task.done()}")
            self.probe.land(req.request_id)
            task.cancel()
            await asyncio.wait([task])
            if not task.cancelled() and task.exception() is None and task.result().handoff is not None:
                await self.ack(task.result().handoff.lease_id)  # it had finished: nobody will read it
            raise


def _prefill_row(item) -> str | None:
    seq = item.seq
    if moved(seq.request) or not seq.prefill_only or seq.num_computed_tokens >= seq.num_prompt_tokens:
        return None
    return "prefill"


class PhaseDecode(_Probed, DecodeWorker):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.probe = Probe()
        self._stepped: collections.OrderedDict[str, None] = collections.OrderedDict()  # engine thread only
        self._prompts: dict[str, tuple] = {}  # the prompts of the stagings in progress
        _hold_submits(self.loop, self.probe, lambda req: "migration" if moved(req) else None)
        _hold_steps(self.engine, self.probe, self._decode_row)

    def _decode_row(self, item) -> str | None:
        seq = item.seq
        if moved(seq.request) or seq.num_computed_tokens < seq.num_tokens - 1:
            return None  # a prompt computed here (recompute, aggregated)
        first = seq.request_id not in self._stepped
        self._stepped[seq.request_id] = None
        while len(self._stepped) > 4096:
            self._stepped.popitem(last=False)
        if first:
            return "first_decode"
        if seq.request.params.grammar is not None:
            return "grammar" if len(seq.output_token_ids) >= 3 else None
        if item.num_new_tokens > 1:
            return "spec_verify"
        return "decode" if len(seq.output_token_ids) >= 3 else None

    async def _read(self, h, dst, prefill, ho, layers=None):
        prompt = self._prompts.get(h.request_id)
        if prefill is None and prompt is not None and "~" not in h.request_id:  # a streamed piece
            held = self.probe.start(SimpleNamespace(request_id=h.request_id, prompt_token_ids=prompt), "kv_stream")
            if held is not None:
                await self.probe.await_(held)
        return await super()._read(h, dst, prefill, ho, layers)

    async def stage(self, req, prefill, outputs=()) -> None:
        self._prompts[req.request_id] = tuple(req.prompt_token_ids)  # a piece's read names only the id
        self.probe.note(req.request_id, "stage")
        try:
            await super().stage(req, prefill, outputs)
        finally:
            self.probe.note(req.request_id, "stage ended")
            self._prompts.pop(req.request_id, None)

    async def generate(self, req, handoff=None, prefill=None, outputs=(), caller=None):
        rid = req.request_id
        self.probe.note(rid, f"generate staged={rid in self.staged} streamed={handoff.streamed if handoff else None}")
        try:
            async for chunk in super().generate(req, handoff, prefill, outputs, caller):
                yield chunk
        finally:
            self.probe.note(rid, "generate ended")

    async def _settle(self, h, prefill) -> bool:
        self.probe.note(h.request_id, "settle")
        return await super()._settle(h, prefill)

    async def free_staging(self, request_id: str) -> None:
        self.probe.note(request_id, "free_staging")
        await super().free_staging(request_id)

    async def abort(self, request_id: str) -> None:
        self.probe.note(request_id, f"abort handoff={request_id in self.handoffs} staged={request_id in self.staged}")
        self.probe.land(request_id)
        await super().abort(request_id)

    async def drop_staging(self, request_id: str) -> None:
        self.probe.note(request_id, "drop_staging")
        self.probe.land(request_id)
        await super().drop_staging(request_id)
