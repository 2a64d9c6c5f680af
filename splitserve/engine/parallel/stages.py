"""Which layers each stage of a pipeline-parallel engine holds: the decoder's layers cut into
`size` contiguous ranges as evenly as possible (stage i: layers i*L//S .. (i+1)*L//S - 1), the
token embedding on the first stage, the final norm and the LM head on the last (and the
embedding there too when the LM head is tied to it). A stage's KV cache holds its layers only,
under the same block ids as every other stage's: one block pool (stage 0's) indexes them all.

A `Stage` is what a KV handoff between pipeline-parallel workers will address: the global layer
indices a stage holds (`layers`), which are its cache's layers 0..len(layers)-1 in order."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.types import ConfigError


@dataclass(frozen=True)
class Stage:
    index: int
    size: int
    layers: range  # the global indices of the decoder layers this stage holds (its cache's, in order)

    @staticmethod
    def of(num_layers: int, index: int, size: int) -> "Stage":
        check(num_layers, size)
        return Stage(index, size, split_layers(num_layers, size)[index])

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.size - 1

    def holds_embedding(self, tied: bool) -> bool:
        return self.first or (tied and self.last)

    def local(self, layer: int) -> int | None:
        """A global layer index as this stage's module and cache index; None if held elsewhere."""
        return layer - self.layers.start if layer in self.layers else None


def split_layers(num_layers: int, size: int) -> tuple[range, ...]:
    return tuple(range(i * num_layers // size, (i + 1) * num_layers // size) for i in range(size))


def check(num_layers: int, size: int) -> None:
    """Refuse, naming the reason, a pipeline size the model's layers cannot be cut into."""
    if size < 1:
        raise ConfigError(f"pipeline_parallel_size must be >= 1, got {size}")
    if size > num_layers:
        raise ConfigError(f"pipeline_parallel_size {size} exceeds the model's {num_layers} layers: "
                          "every stage needs at least one")
