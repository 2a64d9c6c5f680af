"""Chaos under load, on the three-node local Ray cluster: 32 concurrent streams (greedy, and
seeded at temperature 0.8) through the ingress's own Frontend + RequestLease, while one fault
hits: a decode worker SIGKILLed; the prefill worker SIGKILLed while handoffs are in flight;
clients that leave before the body, after the first token, or mid-stream; every transfer
corrupted. (Pauses — SIGSTOP — are tests/chaos/test_pause_chaos.py.) Each scenario
asserts that every stream either completes with the single engine's tokens or ends with our
explicit error (no actor, pid or address in it), and that afterwards every live worker holds
no block, lease or handoff and admission is back to zero. Migrations and their added latency
are printed (run with -s)."""

import dataclasses
import os
import random
import signal
import time

import pytest

from splitserve.types import MoveKind, MoveReason, Role
from tests.chaos.harness import (Load, Recompute, assert_nothing_held, assert_outcomes, busiest, in_engine,
                                 migration_report, params, pid_of, prompts, reference, running, signal_worker)
from tests.chaos.harness import streamed_cluster as cluster

N, MAX_TOKENS = 32, 64
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def work(model):
    ps = prompts(N)
    out = {}
    for seeded in (False, True):
        sps = params(N, seeded, MAX_TOKENS)
        out[seeded] = (ps, sps, reference(model, ps, sps))
    return out


def pieces_landed(c) -> int:
    return sum(s.get("pieces_landed", 0) for s in c.check_invariants())


def report(name, c, outcomes, started):
    r = migration_report(c)
    errors = sum(o.error is not None for o in outcomes)
    print(f"\nchaos {name}: {len(outcomes)} streams, {errors} ended with the explicit error, {r['migrated']} "
          f"migrated ({r['migrations']} moves), added latency p50 {r['gap_p50_s']} s p99 {r['gap_p99_s']} s, "
          f"{time.time() - started:.1f} s")
    for e in sorted({o.error for o in outcomes if o.error is not None}):
        print(f"  error: {e}")
    return r


def test_sigkill_a_decode_worker(ray_session, model, work):
    """16 greedy and 16 seeded streams at once, one of the two decode workers SIGKILLed."""
    half = N // 2
    (gp, gs, gr), (sp_, ss, sr) = work[False], work[True]
    ps, sps, ref = gp[:half] + sp_[half:], gs[:half] + ss[half:], gr[:half] + sr[half:]
    started = time.time()
    with cluster(model, "chaos-kill-decode") as c:
        load = Load(c, ps, sps)
        load.wait_progress(3)
        victim = busiest(c.decodes)  # the one holding the most streams (placement may favour one)
        held = running(victim)
        signal_worker(victim, signal.SIGKILL)
        outcomes = load.result()
        r = report("SIGKILL decode (greedy + seeded)", c, outcomes, started)
        # the fault landed: the victim held streams mid-flight, and they moved (each at most once
        # for the kill; a survivor that goes silent may move one again)
        assert held >= 1 and r["migrated"] >= 1, (held, r)
        assert all(o.error is None for o in outcomes), [o.error for o in outcomes]
        greedy = assert_outcomes(outcomes[:half], ref[:half], min_exact=half)
        replay = Recompute(model, c, ps[half:], sps[half:])
        seeded = assert_outcomes(outcomes[half:], ref[half:], min_exact=half - 1, recomputed=replay)
        print(f"  greedy {greedy} of {half}, seeded {seeded} of {half} equal the uninterrupted run; "
              f"{replay.replayed} equal one engine's recompute from their migration point; the killed worker "
              f"held {held} streams")
        assert_nothing_held(c, load)


def test_sigkill_the_prefill_worker_mid_transfer(ray_session, model, work):
    """Killed while its engine computes the prompts (paced: each step also waits off the CPU,
    tests/fakes/workers.py, so the kill lands inside a step on any machine) and their KV streams
    to the decode workers: every request in it is placed again, and finishes exactly."""
    ps, sps, ref = work[False]
    started = time.time()
    with cluster(model, "chaos-kill-prefill", worker_classes={"prefill": "tests.fakes.workers:PacedPrefill"}) as c:
        load = Load(c, ps, sps)
        prefill = c.prefills[0]
        deadline = time.time() + 60
        while (computing := in_engine(prefill)) == 0:  # its engine has prompts: their calls are in flight
            assert time.time() < deadline and not load.future.done(), "the prefill worker never got the prompts"
            time.sleep(0.005)
        signal_worker(prefill, signal.SIGKILL)
        outcomes = load.result()
        report("SIGKILL prefill", c, outcomes, started)
        # the fault landed: requests in its engine at the kill were placed again
        retried = sum(m.total for m in c.backend.moves() if m.kind is MoveKind.RETRY and m.reason is MoveReason.DIED)
        print(f"  {computing} prompts in its engine at the kill, {retried} placed again")
        assert retried >= 1, c.backend.moves()
        assert all(o.error is None for o in outcomes), [o.error for o in outcomes]
        assert_outcomes(outcomes, ref, min_exact=N)
        assert_nothing_held(c, load)


def test_clients_that_leave_at_random_points(ray_session, model, work):
    ps, sps, ref = work[False]
    rng = random.Random(5)
    cuts = {i: rng.choice([0, 1, rng.randint(2, MAX_TOKENS - 2)]) for i in rng.sample(range(N), N // 2)}
    started = time.time()
    with cluster(model, "chaos-disconnect") as c:
        load = Load(c, ps, sps, cut_after=cuts)
        outcomes = load.result()
        report("client disconnects", c, outcomes, started)
        assert sum(o.cut for o in outcomes) == len(cuts)
        assert_outcomes(outcomes, ref, min_exact=N - len(cuts))
        assert_nothing_held(c, load)


def test_every_transfer_corrupted(ray_session, model, work):
    ps, sps, ref = work[True]
    started = time.time()
    with cluster(model, "chaos-corrupt", worker_classes={"decode": "tests.fakes.workers:CorruptingDecode"}) as c:
        load = Load(c, ps, sps)
        outcomes = load.result()
        report("corrupt transfers", c, outcomes, started)
        assert_outcomes(outcomes, ref, min_exact=N)
        failures = sum(s.get("transfer_failures", {}).get("corrupt", 0) for s in c.check_invariants())
        assert failures >= N // 2, failures  # caught by verification, recomputed: right answers anyway
        assert pieces_landed(c) == 0  # every piece (or tail) was caught corrupt: none landed
        assert_nothing_held(c, load)


def test_a_decode_engine_that_keeps_failing(ray_session, model, work):
    """Its streams move on; it reports the failure to its health probe and is replaced."""
    from tests.fakes.workers import break_flag

    ps, sps, ref = work[False]
    started = time.time()
    with cluster(model, "chaos-broken-engine", worker_classes={"decode": "tests.fakes.workers:BreakableDecode"}) as c:
        load = Load(c, ps, sps)
        load.wait_progress(3)
        rec = next(r for r in c.directory.records.values() if r.role is Role.DECODE)
        victim_id, flag = str(rec.id), break_flag(pid_of(rec.handle))
        open(flag, "w").close()
        try:
            outcomes = load.result()
            # New requests keep coming, and some land there (it is still in placement) until its
            # steps have failed often enough for it to stop and report it.
            dead = []
            while not dead:
                more = Load(c, ps[:8], sps[:8])
                outcomes += more.result()
                dead = [w for w in c.status().workers if w.id == victim_id and w.state == "dead"]
                assert time.time() - started < 120, "the broken worker was never replaced"
        finally:
            os.unlink(flag)
        r = report("broken decode engine", c, outcomes, started)
        assert_outcomes(outcomes, ref + ref[:8] * ((len(outcomes) - N) // 8), min_exact=len(outcomes))
        assert r["migrated"] >= 1
        assert "engine stopped" in dead[0].reason, dead
        assert_nothing_held(c, more)


# an answer long enough (the note: 40+ characters) that a kill lands mid-stream on a fast machine
GRAMMAR_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["n", "kind", "ok", "note", "tags"],
                  "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                 "kind": {"enum": ["cat", "dog", "bird"]}, "ok": {"type": "boolean"},
                                 "note": {"type": "string", "minLength": 40, "maxLength": 60},
                                 "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}}}


def test_sigkill_a_decode_worker_under_a_grammar(ray_session, model):
    """Structured output across the split (issue 29): 16 streams under a JSON schema (8 greedy,
    8 seeded at temperature 0.8), every prompt disaggregated, one of two decode workers
    SIGKILLed mid-way. The streams it held migrate; the new worker rebuilds each matcher from the
    tokens delivered. Every greedy stream finishes as the uninterrupted run did; a seeded one too,
    or as one engine's recompute from its migration point (as above); every text is valid
    against the schema."""
    import json

    import jsonschema

    from splitserve.text.grammar import json_schema_spec
    from splitserve.text.tokenizer import Tokenizer

    half, spec = 8, json_schema_spec(GRAMMAR_SCHEMA)
    ps = prompts(2 * half, seed=5)
    sps = [dataclasses.replace(p, grammar=spec, ignore_eos=False)
           for p in params(half, False, 120) + params(half, True, 120)]
    ref = reference(model, ps, sps)
    started = time.time()
    with cluster(model, "chaos-grammar") as c:  # a SIGKILL is seen at once: the stream errors
        load = Load(c, ps, sps)
        load.wait_progress(3)
        signal_worker(busiest(c.decodes), signal.SIGKILL)  # the one holding the most streams
        outcomes = load.result()
        r = report("SIGKILL decode under a grammar", c, outcomes, started)
        assert r["migrated"] >= 1  # the fault landed: streams moved
        assert all(o.error is None for o in outcomes), [o.error for o in outcomes]
        greedy = assert_outcomes(outcomes[:half], ref[:half], min_exact=half)
        replay = Recompute(model, c, ps[half:], sps[half:])
        seeded = assert_outcomes(outcomes[half:], ref[half:], min_exact=half - 1, recomputed=replay)
        print(f"  greedy {greedy} of {half}, seeded {seeded} of {half} equal the uninterrupted run")
        tok = Tokenizer(model)
        for o in outcomes:
            jsonschema.validate(json.loads(tok.decode(o.tokens)), GRAMMAR_SCHEMA)
        assert_nothing_held(c, load)
