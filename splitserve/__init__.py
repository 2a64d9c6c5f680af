"""splitserve: LLM serving with prefill and decode disaggregated on Ray."""

from splitserve.types import SamplingParams

__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy: `import splitserve` stays cheap (no torch) for the CLI and the router.
    if name in ("LLM", "RequestOutput", "CompletionOutput"):
        from splitserve import llm

        return getattr(llm, name)
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "__version__"]
