"""The Ray side of splitserve (DESIGN.md §2): the Controller and its worker registry, the worker
actor shells, each router replica's Directory, the request Orchestrator, the Serve app, and
`Cluster` (the offline Python API over the same pieces). Imported lazily: `registry` and
`directory` are usable without Ray."""


def __getattr__(name: str):
    if name == "Cluster":
        from splitserve.cluster.cluster import Cluster

        return Cluster
    raise AttributeError(name)


__all__ = ["Cluster"]
