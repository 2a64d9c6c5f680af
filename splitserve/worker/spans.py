"""A worker's spans of a request's trace (tracing.py): the prefill worker's `prefill`, the
decode worker's `decode` and, under it, its `kv_transfer` — each a child of the span the
orchestrator made for the call (`Request.traceparent`). Attributes follow the OpenTelemetry
GenAI conventions where they have a name (gen_ai.*), ours otherwise (splitserve.*). While
tracing is off every span here is the no-op one."""

from __future__ import annotations

import dataclasses
import time

from opentelemetry.trace import Span, SpanKind, Status, StatusCode, set_span_in_context

from splitserve import tracing
from splitserve.kv_transfer.base import KVHandoff
from splitserve.types import PhaseTimes, Request, TokenChunk


def _request_attributes(req: Request, outputs: tuple[int, ...]) -> dict:
    p = req.params
    attrs = {"gen_ai.request.id": req.request_id, "gen_ai.usage.input_tokens": len(req.prompt_token_ids),
             "gen_ai.request.temperature": p.temperature, "splitserve.context_tokens": len(outputs)}
    if p.max_tokens is not None:
        attrs["gen_ai.request.max_tokens"] = p.max_tokens
    return attrs


def prefill(req: Request, transport: str | None, stream: bool) -> Span:
    return tracing.tracer().start_span("prefill", tracing.parent(req.traceparent), SpanKind.SERVER, attributes={
        **_request_attributes(req, ()), "splitserve.kv.transport": transport or "", "splitserve.kv.streamed": stream})


def prefilled(span: Span, chunk: TokenChunk, handoff: KVHandoff | None) -> None:
    """The prefill's result: its phases (queue wait, compute), its first token, its handoff."""
    attrs = {"splitserve.prefill.cached_tokens": chunk.num_cached_tokens,
             "gen_ai.usage.output_tokens": len(chunk.token_ids)}
    if chunk.phases is not None:
        attrs.update(_phases(chunk.phases))
    if handoff is not None:
        attrs.update({"splitserve.kv.blocks": len(handoff.block_ids), "splitserve.kv.streamed_blocks": handoff.streamed})
    span.set_attributes(attrs)


def decode(req: Request, handoff: KVHandoff | None, outputs: tuple[int, ...]) -> Span:
    return tracing.tracer().start_span("decode", tracing.parent(req.traceparent), SpanKind.SERVER, attributes={
        **_request_attributes(req, outputs), "splitserve.route": "disaggregated" if handoff else "aggregated"})


def kv_transfer(parent: Span, h: KVHandoff, phases: PhaseTimes) -> None:
    """The landing of `h`, which ended now and took `phases.transfer_s`: a span of its own."""
    end = time.time_ns()
    span = tracing.tracer().start_span("kv_transfer", set_span_in_context(parent), SpanKind.CLIENT,
                                       start_time=end - int(phases.transfer_s * 1e9), attributes={
                                           "splitserve.kv.transport": h.endpoint.transport,
                                           "splitserve.kv.blocks": len(h.block_ids),
                                           "splitserve.kv.streamed_blocks": h.streamed,
                                           **_phases(phases)})
    span.end(end_time=end)


def finished(span: Span, chunk: TokenChunk, emitted: int) -> None:
    """The last chunk: how it ended and how many tokens were sent."""
    span.set_attributes({"gen_ai.response.finish_reasons": (chunk.finish_reason.value,),
                         "gen_ai.usage.output_tokens": emitted})


def failed(span: Span, e: BaseException) -> None:
    span.record_exception(e)
    span.set_status(Status(StatusCode.ERROR, type(e).__name__))


def _phases(p: PhaseTimes) -> dict:
    names = {"queue_s": "splitserve.queue_s", "prefill_s": "splitserve.prefill_s",
             "transfer_s": "splitserve.kv.transfer_s", "transfer_bytes": "splitserve.kv.bytes",
             "exposed_transfer_s": "splitserve.kv.exposed_transfer_s"}
    return {names[k]: v for k, v in dataclasses.asdict(p).items() if v is not None and k in names}
