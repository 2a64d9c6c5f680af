"""splitserve: LLM serving with prefill and decode disaggregated on Ray.

The public API: `LLM` (the engine in this process), `Cluster` (prefill and decode pools on Ray,
`Cluster.start(...)`), `SamplingParams`; the CLI (`splitserve serve | status | scale | bench |
sim | demo-model`); and `splitserve.deploy:build_app`, the Ray Serve app a RayService names."""

from splitserve.types import SamplingParams

__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy: `import splitserve` stays cheap (no torch, no Ray) for the CLI and the ingress.
    if name in ("LLM", "RequestOutput", "CompletionOutput"):
        from splitserve import llm

        return getattr(llm, name)
    if name == "Cluster":
        from splitserve.orchestrator.cluster import Cluster

        return Cluster
    raise AttributeError(name)


__all__ = ["Cluster", "LLM", "SamplingParams", "__version__"]
