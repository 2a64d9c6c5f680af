"""Incremental detokenization and stop strings: the front end's half of finishing a request.

The engine works in token ids. As chunks arrive, `RequestText` turns the new ids into text
without re-decoding the whole output each time (decode a short window, emit only text that is
complete — no dangling partial UTF-8 sequence), and watches for stop strings. When one appears,
the text is cut there and the caller aborts the request in the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.text.tokenizer import Tokenizer
from splitserve.types import FinishReason, SamplingParams, TokenChunk, TokenLogprob

_CONTEXT = 6  # prompt tokens decoded with the output so the first word's leading space is right


@dataclass
class RequestText:
    tokenizer: Tokenizer
    params: SamplingParams
    prompt_token_ids: tuple[int, ...]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0
    _window: list[int] = field(default_factory=list)
    _prefix_offset: int = 0
    _read_offset: int = 0

    def __post_init__(self) -> None:
        self._window = list(self.prompt_token_ids[-_CONTEXT:])
        self._read_offset = len(self._window)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, chunk: TokenChunk) -> bool:
        """Take one engine chunk; True if a stop string ended the request here (the caller
        must then abort it in the engine, which does not know about text)."""
        if chunk.num_cached_tokens:
            self.num_cached_tokens = chunk.num_cached_tokens
        for i, tok in enumerate(chunk.token_ids):
            self.token_ids.append(tok)
            if chunk.logprobs is not None:
                self.logprobs.append(chunk.logprobs[i])
            if tok == chunk.stop_token_id and not self.params.include_stop_str_in_output:
                continue  # the EOS / stop token's own text is never shown
            if self._add_text(tok):
                return True
        if chunk.finish_reason is not None:
            before = len(self.text)
            self.text += self._flush()
            if self._check_stop(before):
                return True
            self.finish_reason = chunk.finish_reason
            self.stop_reason = chunk.stop_token_id
        return False

    def _add_text(self, tok: int) -> bool:
        before = len(self.text)
        self.text += self._decode_next(tok)
        return self._check_stop(before)

    def _decode_next(self, tok: int) -> str:
        self._window.append(tok)
        skip = self.params.skip_special_tokens
        prefix = self.tokenizer.decode(self._window[self._prefix_offset:self._read_offset], skip)
        full = self.tokenizer.decode(self._window[self._prefix_offset:], skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # incomplete character: wait for the next token
        self._prefix_offset, self._read_offset = self._read_offset, len(self._window)
        if self._prefix_offset > 64:  # keep the window short
            drop = self._prefix_offset
            self._window = self._window[drop:]
            self._prefix_offset, self._read_offset = 0, self._read_offset - drop
        return full[len(prefix):]

    def _flush(self) -> str:
        """At the end, text held back as an incomplete character is emitted as it decodes."""
        skip = self.params.skip_special_tokens
        prefix = self.tokenizer.decode(self._window[self._prefix_offset:self._read_offset], skip)
        full = self.tokenizer.decode(self._window[self._prefix_offset:], skip)
        self._prefix_offset = self._read_offset = len(self._window)
        return full[len(prefix):] if len(full) > len(prefix) else ""

    def _check_stop(self, before: int) -> bool:
        hits = [(at, stop) for stop in self.params.stop
                if (at := self.text.find(stop, max(0, before - len(stop) + 1))) >= 0]
        if not hits:
            return False
        at, stop = min(hits)  # the earliest stop string in the text wins
        end = at + len(stop) if self.params.include_stop_str_in_output else at
        self.text = self.text[:end]
        self.finish_reason = FinishReason.STOP
        self.stop_reason = stop
        return True
