"""The engine's own step-time form with fixed coefficients (engine/step_model.py fits the same
five online): c0 + c1·prefill tokens + c2·decode sequences + c3·decode context tokens +
c4·(prefill attention pairs: what makes a long prompt superlinear). Its numbers come from a
measured machine — `splitserve simulate --calibrate` (calibrate.py) or served workers' online
fits (`from_online_fit`) — or from a GPU bench JSON (profiled.py); it is saved and read as
JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from splitserve.engine.step_shape import StepShape
from splitserve.sim.cost import Link
from splitserve.types import ConfigError


@dataclass(frozen=True)
class LinearCost:
    c0: float  # s per step
    c1: float  # s per prefill token
    c2: float  # s per decode sequence
    c3: float  # s per context token a decode reads
    num_kv_blocks: int  # of `block_size` tokens, one worker
    block_size: int
    kv_bytes_per_token: int
    link: Link = field(default_factory=lambda: Link(2e9, 1e9, 1e-3, 2e-3))
    c4: float = 0.0  # s per causal attention pair of prefill chunks (what makes a long prompt superlinear)
    name: str = "linear"
    source: str = ""  # where the numbers were measured
    gpus_per_worker: int = 1  # a tensor-parallel worker's GPUs (what goodput per GPU divides by)

    def __post_init__(self) -> None:
        if min(self.c0, self.c1, self.c2, self.c3, self.c4) < 0:
            raise ConfigError(f"step-time coefficients must be >= 0, got {self.coeffs()}")
        if self.num_kv_blocks < 1 or self.block_size < 1 or self.kv_bytes_per_token < 1:
            raise ConfigError("num_kv_blocks, block_size and kv_bytes_per_token must be >= 1")
        if not isinstance(self.gpus_per_worker, int) or self.gpus_per_worker < 1:
            raise ConfigError(f"gpus_per_worker must be an integer >= 1, got {self.gpus_per_worker!r}")

    def step_s(self, s: StepShape) -> float:
        return (self.c0 + self.c1 * s.prefill_tokens + self.c2 * s.decode_seqs + self.c3 * s.decode_context
                + self.c4 * s.prefill_attended)

    def kv_blocks(self, block_size: int) -> int:
        return self.num_kv_blocks * self.block_size // block_size

    def coeffs(self) -> tuple[float, float, float, float, float]:
        return (self.c0, self.c1, self.c2, self.c3, self.c4)

    def describe(self) -> dict:
        return asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.describe(), indent=2) + "\n")

    @staticmethod
    def load(path: str | Path) -> "LinearCost":
        try:
            d = json.loads(Path(path).read_text())
            link = Link(**d.pop("link")) if "link" in d else None
            return LinearCost(**d, **({"link": link} if link else {}))
        except (OSError, ValueError, TypeError) as e:
            raise ConfigError(f"{path}: not a calibrated cost model ({e})") from None
