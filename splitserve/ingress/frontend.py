"""What the HTTP and gRPC ingresses share (DESIGN.md §1 steps 2–3, 7): prompt checks after
tokenization, one engine request per (prompt, sample), admission against the placement the
backend plans, driving each request's chunks into its text, and the metrics and timings of
every request that ends.

Per request: `prepay()` applies the tenant's limits before the prompt is touched; `requests()`
makes the engine requests and their `Choice`s; `admit()` plans each
one on the backend and asks admission (an `APIError` 429 refuses them all, nothing started);
`drive()` streams one request's chunks into its `RequestText` and, however it ends (finish,
stop string, client gone), closes the backend stream — which aborts the request on every
worker — then records it. One `lease.RequestLease` per API request owns all of that from
admission on, so nothing is left held when a stream never starts. `failure()` is the answer
a request that failed gets, in the OpenAI error shape and in words safe for its client.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator

from splitserve.text.detokenizer import RequestText
from splitserve.text.tool_calls import ToolFormat
from splitserve.metrics import Metrics, Phase
from splitserve.router.admission import Admission, Decision, Plan
from splitserve.ingress import request_span
from splitserve.ingress.backend import Backend
from splitserve.ingress.protocol import APIError, RequestDefaults, RequestOptions
from splitserve.tenancy import KeyRing, RateLimiter, Tenant, Unauthenticated
from splitserve.types import STEP_TERMS, ConfigError, PhaseTimes, Request, ServiceUnavailable, as_token_ids

log = logging.getLogger(__name__)

INTERNAL_ERROR = "the server failed while generating this response; the failure has been logged"


@dataclass(frozen=True)
class Prepaid:
    """What a request was charged before its prompt was looked at (`Frontend.prepay`): its
    choices against the request rate, and one token each (the least a choice costs)."""

    choices: int

    @property
    def tokens(self) -> int:
        return self.choices


@dataclass
class Choice:
    """One engine request of an API request: a sample `index` continuing prompt `prompt_index`."""

    index: int
    prompt_index: int
    prompt_ids: tuple[int, ...]
    text: RequestText
    emitted: int = 0  # characters already streamed
    ids_sent: int = 0  # token ids already streamed (gRPC sends them too)
    arrived: float = field(default_factory=time.monotonic)
    first_at: float | None = None
    ended_at: float | None = None
    phases: PhaseTimes = field(default_factory=PhaseTimes)
    plan: Plan | None = None
    decision: Decision | None = None
    released: bool = False
    tenant: str = "default"
    request_id: str = ""  # the engine request's
    tools: ToolFormat | None = None  # a chat with tools: how its model writes calls

    def take_text(self) -> str:
        """The text not streamed yet, holding back what a stop string might still claim until
        the request is done — and, in a chat with tools, everything from where a call may begin."""
        t = self.text
        hold = 0 if t.finished else max((len(s) - 1 for s in t.params.stop), default=0)
        upto = max(self.emitted, len(t.text) - hold)
        if self.tools is not None and not t.finished:
            upto = min(upto, _call_start(t.text, self.tools.open))
        new, self.emitted = t.text[self.emitted:upto], upto
        return new

    def timings(self) -> dict[str, float]:
        """Seconds per phase (DESIGN.md §1): queue and prefill on the worker that computed the
        prompt, the KV transfer, first token as the ingress saw it, and decode after it; and
        the first-token time admission predicted for it."""
        p = self.phases
        out = {"queue": p.queue_s, "prefill": p.prefill_s, "transfer": p.transfer_s,
               "exposed_transfer": p.exposed_transfer_s,
               "first_token": None if self.first_at is None else self.first_at - self.arrived,
               "decode": None if self.first_at is None or self.ended_at is None else self.ended_at - self.first_at,
               "predicted_first_token": self.decision.predicted_ttft_s if self.decision is not None else None}
        return {k: v for k, v in out.items() if v is not None}


def _call_start(text: str, marker: str) -> int:
    """Where a tool call may begin in `text`: its marker, or a tail that may grow into it."""
    at = text.find(marker)
    if at >= 0:
        return at
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return len(text) - k
    return len(text)


def worst_timings(choices: list[Choice]) -> dict[str, float]:
    """Per phase, the slowest choice's: what the caller waited for."""
    out: dict[str, float] = {}
    for c in choices:
        for k, v in c.timings().items():
            out[k] = max(v, out.get(k, 0.0))
    return out


def failure(e: Exception) -> APIError:
    """What a client is told about a request that failed with `e`. Only messages known to be
    ours reach it: an APIError, validation the engine repeated (400), a ServiceUnavailable
    (503). Anything else may carry internals (actor ids, pids, addresses): it is logged here
    and answered with a 500 in general words."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, ConfigError):
        return APIError(400, str(e))
    if isinstance(e, ServiceUnavailable):
        return APIError(503, str(e))
    log.error("request failed", exc_info=e)
    return APIError(500, INTERNAL_ERROR)


class Frontend:
    def __init__(self, backend: Backend, metrics: Metrics | None = None, admission: Admission | None = None,
                 keys: KeyRing | None = None, limiter: RateLimiter | None = None,
                 max_tokens_default: int | None = None) -> None:
        self.backend = backend
        self.metrics = metrics or Metrics()
        self.admission = admission or Admission()
        self.keys = keys or KeyRing()
        self.limiter = limiter or RateLimiter()
        self.tenant_inflight: collections.Counter[str] = collections.Counter()  # admitted choices per tenant
        # what a request omitting them gets: the model's recommended sampling and max_new_tokens
        # (generation_config.json), the server's max_tokens default above the model's
        self.defaults = RequestDefaults.of(dict(getattr(backend, "sampling_defaults", ())),
                                           getattr(backend, "max_new_tokens", None), max_tokens_default)

    # -- tenants --------------------------------------------------------------------------------
    def tenant(self, authorization: str | None) -> Tenant:
        """The tenant an `Authorization` value names; APIError 401 when keys are configured and
        it names none."""
        try:
            return self.keys.tenant(authorization)
        except Unauthenticated as e:
            raise APIError(401, f"{e}", code="invalid_api_key") from None

    # -- prompts --------------------------------------------------------------------------------
    def encode(self, p: str | tuple[int, ...]) -> tuple[int, ...]:
        ids = tuple(self.backend.tokenizer.encode(p)) if isinstance(p, str) else p
        return self.check_ids(ids)

    async def encode_all(self, prompts) -> list[tuple[int, ...]]:
        """Every prompt as checked token ids. Text is tokenized on a worker thread: a large
        prompt must not stall the event loop that streams every other request's tokens."""
        if not any(isinstance(p, str) for p in prompts):
            return [self.check_ids(p) for p in prompts]
        with request_span.step("tokenize", **{"splitserve.prompts": len(prompts)}):
            return await asyncio.to_thread(lambda: [self.encode(p) for p in prompts])

    def check_ids(self, ids: tuple[int, ...], param: str = "prompt") -> tuple[int, ...]:
        try:
            as_token_ids(ids, self.backend.vocab_size)
        except ConfigError as e:
            raise APIError(400, str(e), param) from None
        if not ids:
            raise APIError(400, "the prompt is empty after tokenization", param)
        if len(ids) >= self.backend.max_model_len:
            raise APIError(400, f"the prompt has {len(ids)} tokens; this model's context length is "
                                f"{self.backend.max_model_len}", param, code="context_length_exceeded")
        return ids

    def requests(self, opts: RequestOptions, prompts: list[tuple[int, ...]]) -> tuple[str, list[Choice], list[Request]]:
        """The engine requests of one API request, salted with its tenant's cache salt (so
        tenants never share cached prompt blocks, nor learn whether another's are cached)."""
        rid = f"cmpl-{uuid.uuid4().hex}"  # always fresh: engine ids must never collide
        choices, reqs = [], []
        for i, ids in enumerate(prompts):
            self._check_room(opts, ids)
            for j in range(opts.params.n):
                k = i * opts.params.n + j
                sp = opts.params.for_choice(j)
                reqs.append(Request(f"{rid}-{k}", ids, sp, priority=opts.priority, arrival_time=time.time(),
                                    cache_salt=opts.tenant.cache_salt, traceparent=request_span.traceparent()))
                choices.append(Choice(k, i, ids, RequestText(self.backend.tokenizer, sp, ids), tenant=opts.tenant.name,
                                      request_id=reqs[-1].request_id))
        return rid, choices, reqs

    def _check_room(self, opts: RequestOptions, ids: tuple[int, ...]) -> None:
        """A max_tokens the client set that the context cannot hold is refused, as vLLM does
        (a default one is only what the context leaves)."""
        limit, wanted = self.backend.max_model_len, opts.params.max_tokens
        if opts.max_tokens_given and wanted is not None and len(ids) + wanted > limit:
            raise APIError(400, f"this model's context length is {limit} tokens; the request asks for "
                                f"{len(ids) + wanted} ({len(ids)} in the prompt, {wanted} to generate)",
                           "max_tokens", code="context_length_exceeded")

    def _tokens(self, reqs: list[Request]) -> int:
        """What the rate limit charges: each request's prompt and the most it may generate."""
        limit = self.backend.max_model_len
        return sum(min(limit, len(r.prompt_token_ids) + (r.params.max_tokens or limit)) for r in reqs)

    # -- admission ------------------------------------------------------------------------------
    async def prepay(self, tenant: Tenant, choices: int) -> Prepaid:
        """The tenant's limits before any work on the prompt (tokenizing, templating): its cap on
        requests in flight, its request rate, and a token per choice. Refused: APIError 429.
        What it charges stays charged when the request then proves bad (asking has a cost)."""
        self._check_concurrency(tenant, choices)
        paid = Prepaid(choices)
        await self._charge(tenant, paid.choices, paid.tokens)
        return paid

    async def _charge(self, tenant: Tenant, requests: int, tokens: int, tokens_paid: int = 0) -> None:
        wait = await self.limiter.charge(tenant, requests, tokens, tokens_paid)
        if wait > 0:
            self.metrics.rejections.labels(reason="rate_limit").inc()
            raise APIError(429, f"rate limit of tenant {tenant.name!r} exceeded; retry in {max(1, math.ceil(wait))} s",
                           code="rate_limit_exceeded", retry_after=wait)

    async def admit(self, opts: RequestOptions, reqs: list[Request], choices: list[Choice], paid: Prepaid) -> None:
        """Plan and admit every request of one API request, or none (APIError 429; a failed
        plan releases what was admitted before it too). First the rest of its token charge
        (`paid` covered the least), then each plan against admission; a request that admission
        refuses is refunded everything."""
        if paid.choices != len(reqs):
            raise RuntimeError(f"prepaid for {paid.choices} choices, admitting {len(reqs)}")
        tenant, tokens = opts.tenant, self._tokens(reqs)
        self._check_concurrency(tenant, len(reqs))
        await self._charge(tenant, 0, tokens - paid.tokens, paid.tokens)
        admitted: list[Choice] = []
        try:
            for req, c in zip(reqs, choices):
                with request_span.step("admission") as span:
                    c.plan = await self.backend.plan(req)
                    grammar = None if req.params.grammar is None else req.params.grammar.key
                    d = self.admission.decide(c.plan, opts.priority, len(req.prompt_token_ids), opts.ttft_slo_ms,
                                              opts.tpot_slo_ms, grammar)
                    span.set_attributes(_admission_attributes(c.plan, d))
                if not d.admit:
                    self.backend.abandon(c.plan)
                    self.metrics.rejections.labels(reason=d.reason).inc()
                    raise APIError(429, f"rejected ({d.reason}): the request cannot be served within its targets "
                                        f"now; retry in {d.retry_after_s:.0f} s", code=d.reason,
                                   retry_after=d.retry_after_s)
                c.decision = d
                self.tenant_inflight[c.tenant] += 1
                admitted.append(c)
        except BaseException:
            for done in admitted:  # all or nothing
                self.release(done)
            self.limiter.refund(tenant, len(reqs), tokens)
            raise

    def _check_concurrency(self, tenant: Tenant, wanted: int) -> None:
        """A tenant with `max_inflight` may not have more requests in flight on this replica."""
        cap = tenant.max_inflight
        if cap is not None and self.tenant_inflight[tenant.name] + wanted > cap:
            self.metrics.rejections.labels(reason="tenant_concurrency").inc()
            raise APIError(429, f"tenant {tenant.name!r} has {self.tenant_inflight[tenant.name]} requests in flight, "
                                f"at most {cap} at once; retry when one has finished", code="tenant_concurrency",
                           retry_after=1.0)

    def release(self, c: Choice) -> None:
        """An admitted choice is over, however it ended (also when its stream never started):
        admission gets its slot and its TTFT back, metrics record it. Idempotent."""
        if c.decision is None or c.released:
            return
        c.released = True
        self.tenant_inflight[c.tenant] -= 1
        if not self.tenant_inflight[c.tenant]:
            del self.tenant_inflight[c.tenant]
        self.backend.abandon(c.plan)  # a plan whose stream never ran holds no reservation any more
        c.ended_at = c.ended_at or time.monotonic()
        ttft = None if c.first_at is None else c.first_at - c.arrived
        self.admission.finished(c.decision, ttft)
        self._record(c)

    # -- running --------------------------------------------------------------------------------
    async def drive(self, req: Request, choice: Choice) -> AsyncIterator[None]:
        """Feed one request's chunks into its RequestText; yields after each chunk. Closing the
        generator (client gone, stop string) aborts the request in the backend. A generator
        that never started runs no cleanup: its owner (the `RequestLease`) releases it."""
        gen = self.backend.generate(req, choice.plan)
        try:
            async for chunk in gen:
                if choice.first_at is None and chunk.token_ids:
                    choice.first_at = time.monotonic()
                    if choice.decision is not None:
                        self.admission.prefilled(choice.decision)
                choice.phases = choice.phases.merged(chunk.phases)
                if choice.text.add(chunk) or choice.text.finished:
                    choice.ended_at = time.monotonic()  # before the caller sees the end
                    yield None
                    return
                yield None
        finally:
            try:
                await gen.aclose()
            finally:
                self.release(choice)

    def _record(self, c: Choice) -> None:
        m, t = self.metrics, c.text
        status = t.finish_reason.value if t.finish_reason else "abort"
        m.requests.labels(status=status, tenant=c.tenant).inc()
        log.info("request %s tenant=%s status=%s prompt=%d cached=%d completion=%d", c.request_id, c.tenant, status,
                 len(c.prompt_ids), t.num_cached_tokens, len(t.token_ids))
        if c.first_at is not None:
            m.ttft.observe(c.first_at - c.arrived)
            m.e2e.observe(c.ended_at - c.arrived)
            if len(t.token_ids) > 1:
                m.tpot.observe((c.ended_at - c.first_at) / (len(t.token_ids) - 1))
        if c.plan is not None:  # (a request never placed was looked up in no cache)
            m.prefix_query.labels(worker=str(c.plan.first_worker)).inc(len(c.prompt_ids))
            m.prefix_hit.labels(worker=str(c.plan.first_worker)).inc(t.num_cached_tokens)
        p = c.phases
        if p.transfer_s is not None:
            transport = p.transport or "unknown"
            m.kv_transfer_seconds.labels(transport=transport).observe(p.transfer_s)
            m.kv_transfer_bytes.labels(transport=transport).inc(p.transfer_bytes or 0)
            if p.transfer_bytes and p.transfer_s > 0:
                m.kv_transfer_rate.labels(transport=transport).observe(p.transfer_bytes / p.transfer_s / 1e9)
        if p.exposed_transfer_s is not None:
            m.kv_exposed_transfer_seconds.observe(max(0.0, p.exposed_transfer_s))
        route = "disaggregated" if c.plan is not None and c.plan.first_worker != c.plan.decode_worker else "aggregated"
        for phase, seconds in _phases(c):
            m.phase.labels(phase=phase.value, route=route, tenant=c.tenant).observe(max(0.0, seconds))

    def export_worker_gauges(self) -> None:
        """Worker load gauges, as of the backend's last look at its workers (a gone worker's removed)."""
        m = self.metrics
        roles: dict[str, int] = {}
        views = self.backend.worker_views()
        m.forget_workers({w.worker_id for w in views})
        for w in views:
            m.kv_usage.labels(role=w.role, worker=w.worker_id).set(w.kv_usage)
            m.queue.labels(role=w.role, worker=w.worker_id).set(w.num_waiting)
            m.slow.labels(role=w.role, worker=w.worker_id).set(1 if w.slow else 0)
            for term, c in zip(STEP_TERMS, w.step_time_coeffs):
                m.step_time.labels(role=w.role, worker=w.worker_id, term=term).set(c)
            if w.expert_tokens:
                for e, n in enumerate(w.expert_tokens):
                    m.expert_tokens.labels(role=w.role, worker=w.worker_id, expert=str(e)).set(n)
                mean = sum(w.expert_tokens) / len(w.expert_tokens)
                m.expert_imbalance.labels(role=w.role, worker=w.worker_id, scope="expert").set(
                    max(w.expert_tokens) / mean if mean else 0)
            if w.expert_balance is not None:
                b = w.expert_balance
                m.expert_imbalance.labels(role=w.role, worker=w.worker_id, scope="rank").set(b.imbalance)
                m.expert_imbalance.labels(role=w.role, worker=w.worker_id, scope="rank_before_rebalance").set(
                    b.imbalance_before)
            m.export_speculation(w.role, w.worker_id, w.spec_proposed_tokens, w.spec_accepted_tokens,
                                 w.spec_verify_steps, w.spec_verify_step_seconds, w.spec_verify_step_plain_seconds)
            roles[w.role] = roles.get(w.role, 0) + (1 if w.healthy else 0)
        for role, n in roles.items():
            m.pool_size.labels(role=role).set(n)
        m.export_moves(self.backend.moves())
        report = self.backend.autoscale_report()
        if report is not None:
            m.export_autoscale(report)


def _phases(c: Choice) -> Iterator[tuple[Phase, float]]:
    """The phases one finished choice went through, each as long as it took (the route's own:
    an aggregated request has no transfer)."""
    p = c.phases
    for phase, seconds in ((Phase.QUEUE, p.queue_s), (Phase.PREFILL, p.prefill_s), (Phase.TRANSFER, p.transfer_s),
                           (Phase.EXPOSED_TRANSFER, p.exposed_transfer_s)):
        if seconds is not None:
            yield phase, seconds
    if c.first_at is not None:
        yield Phase.FIRST_TOKEN, c.first_at - c.arrived
        yield Phase.E2E, c.ended_at - c.arrived
        if len(c.text.token_ids) > 1:
            yield Phase.INTER_TOKEN, (c.ended_at - c.first_at) / (len(c.text.token_ids) - 1)


def _admission_attributes(plan, d) -> dict:
    """What a trace shows of a request's placement and its admission: the pair and why."""
    attrs = {"splitserve.admitted": d.admit, "splitserve.route": "aggregated" if plan.first_worker == plan.decode_worker
             else "disaggregated", "splitserve.first_worker": str(plan.first_worker),
             "splitserve.decode_worker": str(plan.decode_worker), "splitserve.cached_tokens": plan.cached_tokens,
             "splitserve.predicted_ttft_s": d.predicted_ttft_s, "splitserve.predicted_tpot_s": d.predicted_tpot_s}
    if d.reason:
        attrs["splitserve.rejected_because"] = d.reason
    return attrs
