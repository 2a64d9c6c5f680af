"""The offline API: `LLM(model=DIR).generate(prompts, params)` and `.chat(messages, params)`,
shaped like vLLM's so that code written for it runs unchanged.

Each prompt (× n) becomes an engine request; the engine is stepped until all finish; chunks are
turned into text by `RequestText`, which also applies stop strings.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Sequence

from splitserve.config import EngineConfig
from splitserve.text.detokenizer import RequestText
from splitserve.engine.engine import Engine
from splitserve.engine.parallel.dp_engine import DataParallelEngine
from splitserve.text.tokenizer import Tokenizer
from splitserve.types import ConfigError, FinishReason, Request, SamplingParams, TokenLogprob


@dataclass(frozen=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        return None if self.logprobs is None else sum(lp.logprob for lp in self.logprobs)


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]
    num_cached_tokens: int
    finished: bool = True


Prompt = str | Sequence[int]


class LLM:
    def __init__(self, model: str | None = None, **engine_kwargs: Any) -> None:
        if model is None:
            from splitserve.engine.model.demo import ensure_demo_model

            model = str(ensure_demo_model())
        config = EngineConfig.from_dict({"model": str(model), **engine_kwargs})
        # data-parallel attention: D replicas behind one front, to this class one engine
        self.engine = Engine(config) if config.data_parallel_size == 1 else DataParallelEngine(config)
        self.tokenizer = Tokenizer(model)
        self._ids = itertools.count()

    def close(self) -> None:
        """Free what the engine holds beyond this process (its other tensor-parallel ranks, a
        shared-memory KV file)."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        prompts = _as_prompt_list(prompts)
        plist = _as_params_list(params, len(prompts))
        return self._run([(p if isinstance(p, str) else None, self._encode(p), sp) for p, sp in zip(prompts, plist)])

    def chat(self, messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
             params: SamplingParams | None = None, **template_kwargs: Any) -> list[RequestOutput]:
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        items = []
        for conv in convs:
            text = self.tokenizer.apply_chat_template(conv, add_generation_prompt=True, **template_kwargs)
            items.append((text, self.tokenizer.encode(text, add_special_tokens=False), params or SamplingParams()))
        return self._run(items)

    def _encode(self, p: Prompt) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(p)) if isinstance(p, str) else tuple(p)

    def _run(self, items: list[tuple[str | None, tuple[int, ...], SamplingParams]]) -> list[RequestOutput]:
        texts: dict[str, RequestText] = {}
        groups: list[tuple[str, str | None, tuple[int, ...], list[str]]] = []
        try:
            for text, ids, sp in items:
                gid = str(next(self._ids))
                rids = [f"{gid}-{i}" for i in range(sp.n)]
                for i, rid in enumerate(rids):
                    p = sp.for_choice(i)
                    self.engine.add_request(Request(rid, ids, p))
                    texts[rid] = RequestText(self.tokenizer, p, ids)
                groups.append((gid, text, ids, rids))
            self._drive(texts)
        except BaseException:
            for rid, t in texts.items():
                if not t.finished:
                    self.engine.abort(rid)
            raise
        return [request_output(gid, text, ids, [texts[r] for r in rids]) for gid, text, ids, rids in groups]

    def _drive(self, texts: dict[str, RequestText]) -> None:
        live = set(texts)
        while live:
            for chunk in self.engine.step():
                t = texts.get(chunk.request_id)
                if t is None or t.finished:
                    continue
                if t.add(chunk):
                    self.engine.abort(chunk.request_id)
                if t.finished:
                    live.discard(chunk.request_id)


def request_output(gid: str, prompt: str | None, ids: tuple[int, ...], texts: list[RequestText]) -> RequestOutput:
    """The vLLM-shaped result of one prompt's n samples, from their finished RequestTexts."""
    outs = tuple(
        CompletionOutput(i, t.text, tuple(t.token_ids), t.finish_reason.value if t.finish_reason else None,
                         t.stop_reason, tuple(t.logprobs) if t.params.logprobs is not None else None)
        for i, t in enumerate(texts))
    return RequestOutput(gid, prompt, ids, outs, texts[0].num_cached_tokens)


def _as_prompt_list(prompts: Any) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    if not prompts:
        raise ConfigError("no prompts given")
    return prompts


def _as_params_list(params: Any, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ConfigError(f"{len(params)} sampling params for {n} prompts")
    return params


__all__ = ["LLM", "RequestOutput", "CompletionOutput", "FinishReason"]
