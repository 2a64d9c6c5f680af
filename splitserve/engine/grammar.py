"""Grammar-constrained sampling (issue 29): per-row token masks from llguidance, against one
model's tokenizer.

`GrammarMasks` compiles a request's `GrammarSpec` once (text/grammar.py checks and translates
it; the compiled matcher is kept in a bounded LRU by the spec's key and copied per request) and
fills one step's bitmask for the rows that carry a grammar. A `GrammarMatcher` is one sequence's
parser state: built from the spec and the tokens already accepted — so the decode worker that
takes a handoff, or the worker a stream migrates to, continues exactly where the first left —
advanced by each sampled token, stopped when the grammar is complete.

The caller compiles off its event loop (`EngineLoop.prepare`), so the engine thread only copies a
cached matcher; the offline `LLM` compiles inline.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from splitserve.text import grammar as grammars
from splitserve.types import GRAMMAR_CACHE_SIZE, ConfigError, GrammarSpec

log = logging.getLogger(__name__)


class GrammarMatcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher) -> None:
        self._m = matcher

    def accept(self, token: int) -> None:
        if not self._m.consume_token(token):  # the mask allowed it, so this is a bug, not input
            log.error("a sampled token left the request's grammar: %s", self._m.get_error())

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, in order, the grammar allows from here (the matcher does not move)."""
        return self._m.validate_tokens(list(tokens))

    def advanced(self, tokens: Sequence[int]) -> "GrammarMatcher":
        """A copy of this matcher moved over `tokens` (speculative verification: the grammar's
        state at a proposal's position; this one stays where it is)."""
        m = self._m.deep_copy()
        if tokens and not m.consume_tokens(list(tokens)):
            log.error("a proposal the grammar validated left it: %s", m.get_error())
        return GrammarMatcher(m)

    def forced(self) -> list[int]:
        """The tokens every continuation from here begins with (llguidance's fast-forward
        tokens: the bytes the grammar forces, tokenized canonically, a last token that could
        merge with what follows held back); [] where the grammar leaves a choice or is complete.
        The mask may still allow another tokenization of those bytes, so the model can, rarely,
        take a different token than the one proposed here."""
        return [] if self._m.is_stopped() else list(self._m.compute_ff_tokens())

    @property
    def done(self) -> bool:
        """The grammar is complete: nothing but the end of the sequence may follow."""
        return self._m.is_stopped()

    @property
    def raw(self):
        return self._m


class GrammarMasks:
    """Compiled grammars and per-step masks for one model's vocabulary."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        import llguidance

        if not Path(tokenizer_json).is_file():
            raise ConfigError(f"structured output needs the model's tokenizer.json; {tokenizer_json} is missing")
        self._llg = llguidance
        self.tokenizer = llguidance.LLTokenizer(str(tokenizer_json), n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self.vocab_size = vocab_size
        self._executor = llguidance.LLExecutor()
        self._compiled: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0  # grammars compiled (cache misses), for the tests and /metrics
        self._ahead: ThreadPoolExecutor | None = None  # fills masks during the forward pass
        self.compile_s = 0.0  # a miss's compile time, smoothed (admission adds it for an uncached spec)

    def compile(self, spec: GrammarSpec):
        """The compiled matcher of a spec (cached); ConfigError if it does not compile."""
        with self._lock:
            hit = self._compiled.get(spec.key)
            if hit is not None:
                self._compiled.move_to_end(spec.key)
                return hit
        start = time.perf_counter()
        compiled = self._build(spec)  # outside the lock: other specs compile meanwhile
        took = time.perf_counter() - start
        with self._lock:
            self._compiled[spec.key] = compiled
            self.compiles += 1
            self.compile_s = took if self.compiles == 1 else 0.8 * self.compile_s + 0.2 * took
            while len(self._compiled) > GRAMMAR_CACHE_SIZE:
                self._compiled.popitem(last=False)
        return compiled

    def _build(self, spec: GrammarSpec):
        m = self._llg.LLMatcher(self.tokenizer, grammars.check(spec), limits=grammars.limits(), log_level=0)
        if m.is_error():
            raise ConfigError(f"the {spec.kind.value} does not compile for this model: {m.get_error()[:300]}")
        return m

    def matcher(self, spec: GrammarSpec, accepted: Sequence[int] = ()) -> GrammarMatcher:
        """A fresh matcher advanced over the tokens this sequence already has (a handoff's first
        token; a migration's delivered ones)."""
        m = self.compile(spec).deep_copy()
        if accepted and not m.consume_tokens(list(accepted)):
            raise ConfigError("the tokens already generated for this request do not fit its grammar")
        return GrammarMatcher(m)

    def fill_ahead(self, matchers: Sequence[GrammarMatcher]) -> "PendingMasks":
        """Start filling these matchers' masks on a thread while the caller runs the forward pass
        (llguidance fills without the GIL; the matchers do not move until the step's tokens are
        accepted, after `apply`)."""
        if self._ahead is None:
            self._ahead = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return PendingMasks(matchers, self._ahead.submit(self._fill, list(matchers)))

    def _fill(self, matchers: Sequence[GrammarMatcher]) -> torch.Tensor:
        from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask_par

        mask = allocate_token_bitmask(len(matchers), self.vocab_size)
        fill_next_token_bitmask_par(self._executor, [(m.raw, i) for i, m in enumerate(matchers)], mask)
        return mask

    def apply(self, logits: torch.Tensor, rows: Sequence[int], matchers: Sequence[GrammarMatcher],
              ahead: "PendingMasks | None" = None) -> None:
        """Mask the tokens the grammar of each of `rows` (one matcher each) does not allow to
        -inf, in place. The masks come from `ahead` (filled during the forward pass) where it has
        them, else are filled now, in parallel by llguidance; they are unpacked here without
        torch.compile (llguidance's own apply compiles a kernel on first use: seconds, and a C
        compiler)."""
        mask = ahead.masks_of(matchers) if ahead is not None else None
        if mask is None:
            mask = self._fill(matchers)
        allowed = unpack(mask, logits.shape[1]).to(logits.device, non_blocking=True)
        if len(rows) == logits.shape[0]:  # rows ascend, so these are all of them
            logits.masked_fill_(~allowed, float("-inf"))
        else:
            idx = torch.tensor(list(rows), device=logits.device)
            logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))

    def close(self) -> None:
        if self._ahead is not None:
            self._ahead.shutdown(wait=True)


class PendingMasks:
    """Masks being filled for a step's matchers (`GrammarMasks.fill_ahead`)."""

    def __init__(self, matchers: Sequence[GrammarMatcher], future: Future) -> None:
        self._row = {id(m): i for i, m in enumerate(matchers)}
        self._future = future

    def masks_of(self, matchers: Sequence[GrammarMatcher]) -> torch.Tensor | None:
        """These matchers' masks, in their order (None: one was not filled ahead)."""
        mask = self._future.result()
        rows = [self._row.get(id(m)) for m in matchers]
        if any(r is None for r in rows):
            return None
        return mask if rows == list(range(mask.shape[0])) else mask[rows]


def unpack(mask: torch.Tensor, width: int) -> torch.Tensor:
    """[rows, words] int32 bitmasks (bit b of word w: token 32·w + b) -> [rows, width] bool."""
    bits = np.unpackbits(mask.numpy().view(np.uint8), axis=1, bitorder="little")
    allowed = torch.from_numpy(bits[:, :width]).bool()
    if width > bits.shape[1]:  # logits wider than the tokenizer's vocab: padding, never allowed
        allowed = torch.nn.functional.pad(allowed, (0, width - bits.shape[1]), value=False)
    return allowed
