"""A request across workers, in the ingress replica (DESIGN.md §1 steps 2–8): `Orchestrator` and
`RequestRun` (route, prefill, hand off, decode, retry, migrate), the request trace, the backends the
edge generates with (`ClusterBackend` over Ray workers, `LocalBackend` with the engine in this
process), and `Cluster`, the offline Python API over the same pieces. Imported lazily: `Cluster`
starts Ray."""


def __getattr__(name: str):
    if name == "Cluster":
        from splitserve.orchestrator.cluster import Cluster

        return Cluster
    raise AttributeError(name)


__all__ = ["Cluster"]
