"""A worker actor's body (Ray wraps it in control/actors.py): the engine on its own thread
(`engine_loop`), the KV worker both roles build on (transports, KV events, registration info,
its tensor-parallel ranks' caches), and the two roles, `prefill/` (compute a prompt's KV, grant
leases on it) and `decode/` (pull, verify and decode: the handoff state machine)."""
