"""The prefill role: compute a prompt's KV and hold it under a lease until its reader has pulled it."""
