"""The ingress's spans of a request's trace (tracing.py): the API request's root span — a child
of the caller's W3C `traceparent` when it sent one — and under it `tokenize` and `admission`
(the plan it admitted: the worker pair, the cached prefix, the predicted first token). The
root is this task's current request span (a context variable), so the frontend's steps find it
without being handed it; its context goes to the workers inside every `Request`
(`Request.traceparent`). It ends with the response — a streamed one's when its lease closes.
While tracing is off every span is the no-op one and the caller's `traceparent` is echoed."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

from opentelemetry.trace import INVALID_SPAN, Span, SpanKind, Status, StatusCode, set_span_in_context

from splitserve import tracing

_current: contextvars.ContextVar[Span | None] = contextvars.ContextVar("splitserve_request_span", default=None)


class RequestSpan:
    """One API request's root span, current in this task from its making until `detach`."""

    def __init__(self, name: str, traceparent: str | None, attributes: dict) -> None:
        self.incoming = traceparent
        self.span = tracing.tracer().start_span(name, tracing.parent(traceparent), SpanKind.SERVER,
                                                attributes=attributes)
        self._token = _current.set(self.span)
        self._ended = False

    @property
    def traceparent(self) -> str | None:
        """What the response returns: this span's context (the caller's while tracing is off)."""
        return tracing.traceparent_of(self.span) or self.incoming

    def detach(self) -> None:
        """No longer this task's current span (it may go on, ended later by its owner)."""
        try:
            _current.reset(self._token)
        except ValueError:  # closed from another context (a generator finalized elsewhere): nothing to undo there
            pass

    def fail(self, e: BaseException) -> None:
        self.span.record_exception(e)
        self.span.set_status(Status(StatusCode.ERROR, type(e).__name__))

    def end(self, status_code: int | None = None) -> None:
        if self._ended:
            return
        self._ended = True
        if status_code is not None:
            self.span.set_attribute("http.response.status_code", status_code)
            if status_code >= 500:
                self.span.set_status(Status(StatusCode.ERROR))
        self.span.end()


def traceparent() -> str | None:
    """The current request span's `traceparent`, for the workers' spans (None: untraced)."""
    span = _current.get()
    return tracing.traceparent_of(span) if span is not None else None


@contextlib.contextmanager
def step(name: str, **attributes) -> Iterator[Span]:
    """A child of the current request span for one step of the request (a no-op span without one)."""
    root = _current.get()
    if root is None or not root.get_span_context().is_valid:
        yield INVALID_SPAN  # untraced: attributes set on it go nowhere
        return
    with tracing.tracer().start_as_current_span(name, set_span_in_context(root), attributes=attributes,
                                                end_on_exit=True) as span:
        yield span
