"""The engine's side of speculation before a step: which sequences get proposals, and how many.

A sequence is proposed for when it is decoding (all but its last token computed), not for a
prefill-only request (it stops after one token). A grammar-constrained one's proposal is cut
at the first token its grammar refuses from where the sequence stands (llguidance validates a
run of tokens without moving the matcher); verification then masks each position by the
grammar's state after the proposals before it (verify.py), so it emits what the
non-speculative engine would. A suffix proposer learns from, and proposes to, the request's
tenant only (its cache_salt). k is
capped so that the accepted run plus the model's own token never passes max_tokens (and so
the context length); EOS and stop ids cut the run in the core, exactly where the
non-speculative engine stops. A draft head (draft.py, a `BatchProposer`) is asked once for all
the step's decoding sequences: its chain runs batched."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from splitserve.config import SpeculativeConfig
from splitserve.engine.sequence import Sequence
from splitserve.engine.speculative.adaptive import AdaptiveK
from splitserve.engine.speculative.proposer import BatchProposer, Proposer
from splitserve.engine.speculative.registry import make_proposer
from splitserve.engine.speculative.suffix import SuffixProposer


@dataclass
class SeqSpec:
    """One sequence's proposal state (carried as `seq.spec_state`)."""

    proposer_state: object
    k: AdaptiveK


_NEVER = object()  # spec_state of a sequence that never gets proposals


class Speculator:
    """`proposer`: one built by the engine (a draft head's, which needs the model); None: the
    config's by name (registry.py)."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer | BatchProposer | None = None) -> None:
        self.config = config
        self.proposer = proposer if proposer is not None else make_proposer(config)

    def propose(self, running: Iterable[Sequence]) -> None:
        """Set every running sequence's proposals for the coming step ([] for none)."""
        batched = hasattr(self.proposer, "propose_batch")
        wants = []
        for seq in running:
            k = self._k(seq)
            seq.spec_tokens = []
            if k and batched:  # a draft head: every sequence in one chain, below
                wants.append((seq, k))
            elif k:
                seq.spec_tokens = self._cut(seq, self.proposer.propose(seq.token_ids, seq.spec_state.proposer_state, k))
        if wants:
            for (seq, _), proposal in zip(wants, self.proposer.propose_batch(wants)):
                seq.spec_tokens = self._cut(seq, proposal)

    def _k(self, seq: Sequence) -> int:
        """How many tokens to propose for `seq` this step (0: none)."""
        if seq.num_computed_tokens != seq.num_tokens - 1:
            return 0  # a prefill still running
        st = seq.spec_state
        if st is None:
            st = seq.spec_state = self._state(seq)
        if st is _NEVER:
            return 0
        return max(0, min(st.k.next_k(), seq.max_tokens - len(seq.output_token_ids) - 1))

    @staticmethod
    def _cut(seq: Sequence, proposal: list[int]) -> list[int]:
        grammar = seq.sampling.grammar
        return proposal[:grammar.valid_prefix(proposal)] if grammar is not None and proposal else proposal

    def _state(self, seq: Sequence):
        if seq.prefill_only:
            return _NEVER
        if isinstance(self.proposer, SuffixProposer):  # keyed by tenant: never shared across them
            state = self.proposer.new_state(seq.request.cache_salt)
        else:
            state = self.proposer.new_state()
        return SeqSpec(state, AdaptiveK(self.config.k, self.config.adaptive))

    def observe(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """A verified step's outcome for `seq`: the adaptive k learns from it."""
        st = seq.spec_state
        if isinstance(st, SeqSpec):
            st.k.observe(proposed, accepted)
