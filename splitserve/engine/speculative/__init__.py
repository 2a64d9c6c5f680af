"""Speculative decoding: a running sequence's step may verify proposed tokens as well as its own.

Where it sits in a step (engine/engine.py): before scheduling, the `Speculator` asks the
configured proposer (chosen by name, registry.py) for up to k tokens per decoding sequence, k
adapted per request to its recent acceptance (adaptive.py); the scheduler cuts them to the
step's budget and free blocks; the model runner scores the sequence's last token and the
proposals in one forward pass; `verify` accepts a prefix of them plus one token of the model's
own (greedy: the longest prefix the argmax agrees with; sampling: rejection sampling, exact in
distribution); the core appends the accepted run under the usual stop rules and rolls the
rest back (engine/core.py)."""
