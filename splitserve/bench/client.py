"""Async streaming client for `splitserve bench`: one `POST /v1/completions` per request.

It sends `"stream": true` with `stream_options.include_usage`, reads the SSE lines
(`data: {...}` ... `data: [DONE]`) and times them: TTFT is the first event carrying text, each
later text event adds one inter-token latency, end-to-end is until the stream ends. The output
token count comes from `usage.completion_tokens` when the server sends it, else from the number
of text events. A request never raises: an HTTP error (429 with its `Retry-After`, 5xx, ...) or an
exception becomes a `RequestResult` with that status, so one bad request never ends a run.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from splitserve.bench.datasets import BenchRequest

OK = "ok"
ERROR = "error"  # an exception: connection refused, timeout, bad stream, ...


@dataclass(frozen=True)
class RequestResult:
    """What one request measured. Times in seconds; `start_s` is relative to the run's start."""

    status: str  # "ok", "http_<code>" (e.g. "http_429"), or "error"
    start_s: float
    e2e_s: float
    ttft_s: float | None = None
    itl_s: tuple[float, ...] = ()
    output_tokens: int = 0
    prompt_tokens: int | None = None
    retry_after_s: float | None = None
    error: str | None = None
    server_timings_ms: dict[str, float] | None = None  # the server's breakdown (splitserve servers)

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def rejected(self) -> bool:
        return self.status == "http_429"

    @property
    def tpot_s(self) -> float | None:
        """(e2e - ttft) / (output tokens - 1); None with fewer than two tokens."""
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class _StreamState:
    """Mutable timing state while a stream is read."""

    t0: float
    ttft_s: float | None = None
    last: float | None = None
    itl: list[float] = field(default_factory=list)
    events: int = 0
    usage: dict[str, Any] | None = None

    def on_text(self, now: float) -> None:
        if self.ttft_s is None:
            self.ttft_s = now - self.t0
        else:
            self.itl.append(now - self.last)
        self.last = now
        self.events += 1


def request_body(model: str, req: BenchRequest, ignore_eos: bool = True) -> dict[str, Any]:
    """The JSON body of a streaming completion for `req`."""
    prompt = list(req.prompt) if isinstance(req.prompt, tuple) else req.prompt
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": req.output_len,
                            "temperature": 0.0, "stream": True,
                            "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True  # so the output length is what the dataset asked for
    return body


def _parse_retry_after(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None  # an HTTP date; rare for 429 and not worth parsing here


async def send_request(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                       run_start: float) -> RequestResult:
    """Send one streaming completion; return its measurements (never raises, except cancel)."""
    t0 = time.perf_counter()
    start_s = t0 - run_start
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                return await _http_error(resp, start_s, t0)
            state = _StreamState(t0)
            await _read_stream(resp, state)
    except Exception as e:  # noqa: BLE001 - one bad request must not end the run
        return RequestResult(ERROR, start_s, time.perf_counter() - t0, error=f"{type(e).__name__}: {e}")
    return _finish(state, start_s, time.perf_counter() - t0)


async def _http_error(resp: httpx.Response, start_s: float, t0: float) -> RequestResult:
    text = (await resp.aread()).decode(errors="replace")[:500]
    return RequestResult(f"http_{resp.status_code}", start_s, time.perf_counter() - t0,
                         retry_after_s=_parse_retry_after(resp.headers.get("retry-after")), error=text)


async def _read_stream(resp: httpx.Response, state: _StreamState) -> None:
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators, comments, "event:" lines
        data = line[5:].strip()
        if data == "[DONE]":
            return
        event = json.loads(data)
        if "error" in event and "choices" not in event:
            raise RuntimeError(f"error event in stream: {event['error']}")
        choices = event.get("choices") or []
        if choices and choices[0].get("text"):
            state.on_text(time.perf_counter())
        if event.get("usage"):
            state.usage = event["usage"]
    raise RuntimeError("stream ended without data: [DONE]")


def _finish(state: _StreamState, start_s: float, e2e_s: float) -> RequestResult:
    usage = state.usage or {}
    out = int(usage.get("completion_tokens") or state.events)
    if state.ttft_s is None:
        return RequestResult(ERROR, start_s, e2e_s, output_tokens=out, error="stream carried no text")
    return RequestResult(OK, start_s, e2e_s, ttft_s=state.ttft_s, itl_s=tuple(state.itl),
                         output_tokens=out, prompt_tokens=usage.get("prompt_tokens"),
                         server_timings_ms=usage.get("splitserve_timings_ms"))
