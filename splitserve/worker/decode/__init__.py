"""The decode role: take a handoff (allocate, pull, verify, or recompute) and decode the stream."""
