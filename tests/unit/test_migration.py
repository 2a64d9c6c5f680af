"""Migration in the orchestrator, without Ray: fake decode workers over a fake registry. A
decode worker that dies or goes silent mid-stream hands the request to another one, which is
given the tokens already delivered and continues; the caller's stream is the uninterrupted one,
no token lost or repeated. Past the limit, or with no decode worker left, the stream ends with
our own ServiceUnavailable, whose message names no actor, process or address."""

import asyncio
import re

import pytest

from splitserve.orchestrator.orchestrator import Orchestrator
from splitserve.types import (FinishReason, MoveCount, MoveKind, MoveReason, Request, Role, SamplingParams,
                              ServiceUnavailable, TokenChunk)
from tests.fakes.cluster import Call, FakeSource, FakeWorker, directory

MAX_TOKENS = 12
SLOW_S = 1.0  # a "slow" fake's pause: five inactivity timeouts of 0.2 s
PROMPT = tuple(range(3, 43))


def next_token(context: tuple[int, ...]) -> int:
    """The fakes' "model": deterministic in the whole context, as greedy decoding is."""
    return (sum(context) * 31 + len(context)) % 997


def reference() -> list[int]:
    ctx, out = PROMPT, []
    for _ in range(MAX_TOKENS):
        out.append(next_token(ctx))
        ctx += (out[-1],)
    return out


class FakeDecode(FakeWorker):
    """`generate` streams the fake model's tokens after the prompt and `outputs`; after
    `fail_after` tokens it dies ("die", with Ray-like internals in the message), stalls ("stall":
    the stream, and from then on its pings, never answer, as a stopped process), or pauses
    ("slow": the stream for `SLOW_S` while its pings answer, as a busy one), on its first
    `faulty` streams (all of them when None); "slow_start": its first token comes 0.5 s late
    (the prompt computed there first)."""

    def __init__(self, fault=None, fail_after=3, faulty=None):
        super().__init__()
        self.fault, self.fail_after, self.faulty = fault, fail_after, faulty
        self.given, self.ids, self.aborted = [], [], []
        self.stopped, self.pings = False, 0
        self.generate = type("G", (), {"options": lambda _self, **kw: Call(self._stream)})()
        self.abort = Call(self._abort)
        self.__ray_ready__ = Call(self._ping)

    async def _abort(self, rid):
        self.aborted.append(rid)

    async def _ping(self):
        self.pings += 1
        if self.stopped:
            await asyncio.Event().wait()

    def _stream(self, req, handoff, prefill, outputs=(), caller=None):
        assert caller is None  # a driver's stream: no replica to watch
        self.given.append(tuple(outputs))
        self.ids.append(req.request_id)
        faulty = self.fault is not None and (self.faulty is None or len(self.given) <= self.faulty)
        return self._chunks(req, tuple(outputs), faulty)

    async def _chunks(self, req, outputs, faulty):
        ctx, n = req.prompt_token_ids + outputs, len(outputs)
        for i in range(MAX_TOKENS - n):
            if faulty and i == 0 and self.fault == "slow_start":  # a long prompt computed here first
                await asyncio.sleep(0.5)
            if faulty and i == self.fail_after:
                if self.fault == "die":
                    raise RuntimeError("The actor 7f3a9c died: pid=4242, ip=10.1.2.3")
                if self.fault == "abort":  # ends the stream as if someone had aborted it
                    yield _ready(TokenChunk(req.request_id, (), finish_reason=FinishReason.ABORT))
                    return
                if self.fault == "slow":
                    await asyncio.sleep(SLOW_S)
                else:
                    self.stopped = True
                    await asyncio.Event().wait()
            tok = next_token(ctx)
            ctx += (tok,)
            done = n + i + 1 == MAX_TOKENS
            yield _ready(TokenChunk(req.request_id, (tok,), finish_reason=FinishReason.LENGTH if done else None))


def _ready(value):
    f = asyncio.get_running_loop().create_future()
    f.set_result(value)
    return f


async def run(decodes, load_interval_s=60, **kw):
    src = FakeSource()
    ids = [src.add(Role.DECODE, worker=d) for d in decodes]
    d = directory(src, "round_robin", load_interval_s=load_interval_s)
    await d.start()
    o = Orchestrator(d, **kw)
    req = Request("m", PROMPT, SamplingParams(max_tokens=MAX_TOKENS))
    got, error = [], None
    try:
        async for c in o.stream(req):
            got += c.token_ids
    except ServiceUnavailable as e:
        error = e
    counts = {w: d.pending.count(w, None) for w in d.records}
    healthy = {w: d.view(d.records[w]).healthy for w in ids}
    d.stop()
    return got, error, o.traces[-1], counts, healthy, o.moves()


def no_internals(message: str) -> None:
    assert not re.search(r"actor|pid|\d+\.\d+\.\d+\.\d+", message, re.I), message


@pytest.mark.parametrize("fault", ["die", "stall"])
def test_a_lost_decode_worker_migrates_the_stream_with_no_token_lost_or_repeated(fault):
    first, second = FakeDecode(fault, fail_after=4), FakeDecode()
    got, error, trace, counts, healthy, moves = asyncio.run(run([first, second], inactivity_timeout_s=0.2))
    assert error is None and got == reference()
    assert trace.migrations == 1 and len(trace.migration_gaps_s) == 1
    # counted by why (/metrics: splitserve_request_moves_total): a stream that raised (not an actor
    # death Ray reports: this fake's error only says so) or went silent
    reason = MoveReason.FAILED if fault == "die" else MoveReason.SILENT
    assert moves == (MoveCount(MoveKind.MIGRATION, reason, 1),)
    assert second.given == [tuple(reference()[:4])]  # the new worker continued after what was delivered
    # A stalled worker is told to stop (it gets it when it resumes); one whose stream raised
    # has aborted the request itself, and an abort now would only linger there.
    assert first.aborted == (["m"] if fault == "stall" else [])
    assert set(counts.values()) == {0}  # no pending count of either route lingers
    assert list(healthy.values()) == [False, True]  # the lost one left placement


def test_a_decode_worker_computing_the_prompt_before_its_first_token_is_slow_not_silent():
    """Its first token may wait for a whole prompt computed there (aggregated, or migrated): that
    wait is bounded by the prefill timeout, not the inactivity timeout — no migration."""
    slow = FakeDecode("slow_start", fail_after=MAX_TOKENS)
    got, error, trace, *_ = asyncio.run(run([slow, FakeDecode()], inactivity_timeout_s=0.1, prefill_timeout_s=10.0))
    assert error is None and got == reference() and trace.migrations == 0


def test_with_no_decode_worker_left_the_stream_ends_with_our_error(monkeypatch):
    from splitserve.orchestrator import request_run

    monkeypatch.setattr(request_run, "PLACE_WAIT_S", 0.2)  # it waits that long for one to come back
    got, error, trace, *_ = asyncio.run(run([FakeDecode("die", fail_after=5)]))
    assert got == reference()[:5]  # what was delivered stays delivered
    assert isinstance(error, ServiceUnavailable) and "no other worker" in str(error)
    no_internals(str(error))


def test_a_survivor_out_of_placement_for_a_moment_still_takes_the_stream():
    """The only other decode worker is out of placement (its calls fail) when the first dies,
    and answers again 0.3 s later: the stream waits for it and migrates, nothing lost."""
    async def go():
        src = FakeSource()
        first, second = FakeDecode("die", fail_after=4), FakeDecode()
        a, b = src.add(Role.DECODE, worker=first), src.add(Role.DECODE, worker=second)
        second.mode = "fail"
        d = directory(src, "round_robin", load_interval_s=0.02)
        await d.start()
        while d.view(d.records[b]).healthy:  # until this router has seen its call fail
            await asyncio.sleep(0.01)
        o = Orchestrator(d)
        req = Request("m", PROMPT, SamplingParams(max_tokens=MAX_TOKENS))
        got = []
        stream = o.stream(req)
        got += (await stream.__anext__()).token_ids  # placed on `a`, the only one in placement

        async def back():
            await asyncio.sleep(0.3)
            second.mode = "ok"

        task = asyncio.create_task(back())
        async for c in stream:
            got += c.token_ids
        await task
        d.stop()
        return got, o.traces[-1], first.given, second.given

    got, trace, on_first, on_second = asyncio.run(go())
    assert on_first and got == reference() and trace.migrations == 1 and on_second


def test_past_the_migration_limit_the_stream_ends_with_our_error():
    workers = [FakeDecode("die", fail_after=1) for _ in range(4)]
    got, error, trace, *_ = asyncio.run(run(workers, migration_limit=2))
    assert trace.migrations == 2 and got == reference()[:3]
    assert isinstance(error, ServiceUnavailable) and "limit" in str(error)
    no_internals(str(error))


@pytest.mark.parametrize("fault", ["die", "abort"])
def test_a_worker_that_failed_a_request_never_gets_it_back(fault):
    """It still answers its snapshots (so it is back in placement for others at once), but this
    request moves on to the other worker, even when it is the least loaded again."""
    first, second = FakeDecode(fault, fail_after=2), FakeDecode()
    got, error, trace, *_, moves = asyncio.run(run([first, second], load_interval_s=0.005))
    assert error is None and got == reference()
    assert moves == (MoveCount(MoveKind.MIGRATION, MoveReason.FAILED if fault == "die" else MoveReason.ENDED, 1),)
    assert len(first.given) == 1 and second.given == [tuple(reference()[:2])]


def test_a_busy_worker_keeps_its_stream():
    """Its stream sends nothing for five inactivity timeouts while the worker answers its pings
    (busy, not stalled): the stream waits for it and continues there; nothing moves or aborts."""
    slow, other = FakeDecode("slow", fail_after=4), FakeDecode()
    got, error, trace, counts, healthy, moves = asyncio.run(run([slow, other], inactivity_timeout_s=0.2))
    assert slow.pings >= 3  # it was asked, each time the stream was late
    assert error is None and got == reference() and trace.migrations == 0 and moves == ()
    assert slow.aborted == [] and other.given == [] and list(healthy.values()) == [True, True]
    assert set(counts.values()) == {0}


def test_a_worker_that_only_went_silent_takes_the_request_again_when_no_other_can():
    """Both decode workers stall on the request once (a survivor stopped for a while): with no
    worker it has not stalled on, it goes back to one that answers again, under a fresh engine
    id, so the abort that worker was sent for the stalled attempt cannot end the new one."""
    first, second = FakeDecode("stall", fail_after=2, faulty=1), FakeDecode("stall", fail_after=2, faulty=1)
    got, error, trace, counts, _, _ = asyncio.run(run([first, second], load_interval_s=0.005, inactivity_timeout_s=0.2))
    assert error is None and got == reference() and trace.migrations == 2
    assert first.ids == ["m", "m~2"] and second.ids == ["m~1"]
    assert first.aborted == ["m"] and second.aborted == ["m~1"]  # each silent attempt, never the live one
    assert set(counts.values()) == {0}


def test_a_caller_that_leaves_after_the_first_token_stops_the_worker_at_once():
    async def go():
        src = FakeSource()
        dec = FakeDecode()
        src.add(Role.DECODE, worker=dec)
        d = directory(src, "round_robin", load_interval_s=60)
        await d.start()
        gen = Orchestrator(d).stream(Request("m", PROMPT, SamplingParams(max_tokens=MAX_TOKENS)))
        await gen.__anext__()
        await gen.aclose()
        aborted = list(dec.aborted)  # no event-loop turn in between: closing is synchronous all the way
        counts = {w: d.pending.count(w, None) for w in d.records}
        d.stop()
        return aborted, counts

    aborted, counts = asyncio.run(go())
    assert aborted == ["m"] and set(counts.values()) == {0}
