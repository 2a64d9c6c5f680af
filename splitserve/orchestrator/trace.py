"""`RequestTrace`: where one request ran and how its tokens travelled (the orchestrator keeps
the recent ones, for tests, benchmarks and `Cluster.timings`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestTrace:
    request_id: str
    started_at: float = 0.0  # time.time()
    prefill_worker: str | None = None
    decode_worker: str | None = None  # the last one
    transport: str | None = None
    prefill_done_to_first_token_s: float | None = None  # prefill worker sampled → the caller has it
    first_to_second_token_s: float | None = None
    prefill_s: float | None = None  # the prefill worker's: first scheduled → first token sampled
    transfer_s: float | None = None  # the KV hand-over as the decode worker saw it, and its bytes
    transfer_bytes: int | None = None
    exposed_transfer_s: float | None = None  # the prefill's last pass ended → the KV verified (on the critical path)
    inter_token_s: list[float] = field(default_factory=list)  # gaps between later decode chunks (the first 64)
    migrations: int = 0
    migrated_after: list[int] = field(default_factory=list)  # tokens delivered when each migration began
    migration_gaps_s: list[float] = field(default_factory=list)  # last token before → first after (client-seen)
