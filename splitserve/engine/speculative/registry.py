"""Proposers by name (SpeculativeConfig.method). `draft` is built by the engine, which holds the
model (engine/speculative/draft.py)."""

from __future__ import annotations

from splitserve.config import SpeculativeConfig
from splitserve.engine.speculative.ngram import NgramProposer
from splitserve.engine.speculative.proposer import Proposer
from splitserve.engine.speculative.suffix import SuffixProposer
from splitserve.types import ConfigError

def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config.min_n, config.max_n)
    if config.method == "suffix":
        return SuffixProposer(config.min_n, config.max_n, config.suffix_tokens_per_tenant, config.suffix_tokens)
    if config.method == "draft":  # the head needs the model: the engine builds it (draft.py)
        raise ConfigError("speculative method 'draft' runs a draft head over the model's hidden states: the engine "
                          "builds its proposer (engine/speculative/draft.py), not the registry")
    raise ConfigError(f"unknown speculative method {config.method!r}; available: ngram, suffix, draft")
