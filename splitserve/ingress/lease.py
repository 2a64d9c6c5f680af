"""One owner per API request at the ingress (DESIGN.md §1 steps 3–8): a `RequestLease` is
entered before any response is built, and from then on owns everything the request holds on
the service — each choice's admission slot and outstanding load (`Frontend.admit`, given back
by `Frontend.release`) and its backend stream (`Frontend.drive`, whose closing aborts the
request on every worker). It gives all of it back exactly once, however the request ends:
finished, failed, cancelled, or its client gone before the response body ever started.

    paid = await front.prepay(tenant, n)           # before the prompt is tokenized
    ...
    async with RequestLease(front, opts, reqs, choices, paid) as lease:   # admits all or none
        ... iterate lease.streams ...
    # here every stream is closed and every slot released

A streamed HTTP answer outlives its handler, so the handler `hand_over()`s the lease to the
response, which closes it when its ASGI call ends however that ends (`http.LeasedStreamingResponse`).
"""

from __future__ import annotations

import logging
from typing import AsyncIterator

import anyio

from splitserve.ingress.frontend import Choice, Frontend, Prepaid
from splitserve.ingress.protocol import RequestOptions
from splitserve.ingress.request_span import RequestSpan
from splitserve.types import Request

log = logging.getLogger(__name__)


class RequestLease:
    def __init__(self, front: Frontend, opts: RequestOptions, reqs: list[Request], choices: list[Choice],
                 paid: Prepaid) -> None:
        self.front, self.opts, self.reqs, self.choices, self.paid = front, opts, reqs, choices, paid
        self.streams: list[AsyncIterator[None]] = []  # one per choice, once admitted
        self.span: RequestSpan | None = None  # a streamed answer's request span: ends with the lease
        self._handed_over = False
        self._closed = False

    async def __aenter__(self) -> RequestLease:
        # A refusal (APIError 429) or a failed plan raises here holding nothing: admit() is
        # all or nothing.
        await self.front.admit(self.opts, self.reqs, self.choices, self.paid)
        self.streams = [self.front.drive(r, c) for r, c in zip(self.reqs, self.choices)]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if not self._handed_over:
            await self.aclose()

    def hand_over(self) -> RequestLease:
        """The `async with` block no longer closes the lease: the caller passes it to an owner
        that outlives the block (a streamed response), which must `aclose()` it."""
        self._handed_over = True
        return self

    async def aclose(self) -> None:
        """Close every backend stream (aborting what is unfinished), then release every choice,
        including those whose stream never started. Nobody may be iterating a stream any more.
        Idempotent. Shielded: a cancel arriving meanwhile (a task group tearing down around
        us) must not leave some streams open."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            try:
                for s in self.streams:
                    await _close(s)
            finally:
                self.release()
                if self.span is not None:
                    self.span.end(200)

    def release(self) -> None:
        """Give every choice's admission slot and load back now, synchronously. Enough on its
        own only where no stream ever started (nothing to abort): a response dropped unsent.
        Idempotent (each choice is released once)."""
        for c in self.choices:
            self.front.release(c)


async def _close(stream: AsyncIterator[None]) -> None:
    # The answer is decided by now; a backend that fails to abort cleanly must not stop the
    # other choices from closing, nor the slots from coming back.
    try:
        await stream.aclose()  # type: ignore[attr-defined]
    except Exception:
        log.warning("closing a backend stream failed", exc_info=True)
