"""The engine's side of speculation before a step: which sequences get proposals, and how many.

A sequence is proposed for when it is decoding (all but its last token computed), not for a
prefill-only request (it stops after one token). A grammar-constrained one is proposed the
tokens its grammar forces first (forced.py), and its proposal is cut
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
from splitserve.engine.speculative.forced import with_forced
from splitserve.engine.speculative.proposer import BatchProposer, Proposer
from splitserve.engine.speculative.registry import make_proposer
from splitserve.engine.speculative.suffix import SuffixProposer


@dataclass
class SeqSpec:
    """One sequence's proposal state (carried as `seq.spec_state`)."""

    proposer_state: object
    k: AdaptiveK
    forced: int = 0  # the current proposal's leading tokens its grammar forces (forced.py)


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
        wants, rooms = [], []
        for seq in running:
            seq.spec_tokens = []
            room = self._room(seq)
            if not room:
                continue
            st = seq.spec_state
            k = min(st.k.next_k(), room)  # the proposer's guess; a grammar's forced tokens fill up to room
            if k and batched:  # a draft head: every sequence in one chain, below
                wants.append((seq, k))
                rooms.append(room)
            else:
                guess = self.proposer.propose(seq.token_ids, st.proposer_state, k) if k else []
                seq.spec_tokens = self._cut(seq, guess, room)
        if wants:
            for (seq, _), room, proposal in zip(wants, rooms, self.proposer.propose_batch(wants)):
                seq.spec_tokens = self._cut(seq, proposal, room)

    def _room(self, seq: Sequence) -> int:
        """The most tokens `seq` may be proposed this step (0: none): k, less where the accepted
        run plus the model's own token would pass max_tokens."""
        if seq.num_computed_tokens != seq.num_tokens - 1:
            return 0  # a prefill still running
        st = seq.spec_state
        if st is None:
            st = seq.spec_state = self._state(seq)
        if st is _NEVER:
            return 0
        return max(0, min(self.config.k, seq.max_tokens - len(seq.output_token_ids) - 1))

    @staticmethod
    def _cut(seq: Sequence, guess: list[int], room: int) -> list[int]:
        """The proposal: a grammar-constrained sequence's forced tokens first (forced.py), the
        whole cut at the first token its grammar refuses."""
        grammar = seq.sampling.grammar
        seq.spec_state.forced = 0
        if grammar is None:
            return guess
        proposal, forced = with_forced(grammar.forced(), guess, room)
        proposal = proposal[:grammar.valid_prefix(proposal)] if proposal else proposal
        seq.spec_state.forced = min(forced, len(proposal))
        return proposal

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
        if isinstance(st, SeqSpec) and accepted >= st.forced:  # k learns from the guesses alone
            st.k.observe(proposed - st.forced, accepted - st.forced)
