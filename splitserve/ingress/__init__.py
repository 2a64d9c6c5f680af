"""The edge, in each ingress replica (a Ray Serve replica with no CPU or GPU of its own): the
OpenAI HTTP API and the gRPC API, the protocol they share, the frontend (tenants, admission,
detokenizing), the request lease, the `Backend` protocol they generate through, and the state the
replicas share (`shared/`, Redis). It never loads the engine or torch (import-linter contract)."""
