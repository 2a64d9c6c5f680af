"""What a pipeline-parallel worker's stages do for the KV handoff by stage (each runs through
`on_all_stages`, engine/parallel/pipeline.py, on every stage between steps): a prefill worker's
stages 1..S-1 serve their caches through transports of their own and let a lease's token read
its blocks (rank_kv's `allow` / `revoke` / `granted` on those transports); every stage
checksums its layers of a handoff's blocks; a decode worker's stages each pull their layers
(kv_transfer/stage_slices.py). Stage 0's own transports are the worker's; these functions
leave them to it. A single (non-pipelined) worker runs them on its one engine, as one stage
holding every layer."""

from __future__ import annotations

from typing import Sequence

from splitserve.kv_transfer import make_transport
from splitserve.kv_transfer.head_slices import SLICED_TRANSPORTS
from splitserve.kv_transfer.stage_slices import layer_checksums, pull_layers
from splitserve.worker.kv_layout import layout_of
from splitserve.worker.rank_kv import own_transports


def layers_of(engine) -> range:
    """The global layers this engine's cache holds."""
    return engine.stage.layers if getattr(engine, "stage", None) is not None else range(engine.kv.storage.shape[0])


def serve_kv(engine, kinds: Sequence[str], options: dict, hosts: Sequence[str]):
    """Stages 1..S-1: serve this stage's cache; its endpoints (None on stage 0). `hosts`: each
    process's, stage 0's first; a stage on a node of its own listens there (its readers reach
    it over tcp, stage_slices._kind_for)."""
    if engine.stage.first:
        return None
    host = hosts[engine.pp.rank]
    if host != hosts[0]:
        options = {**options, "tcp": {**options.get("tcp", {}), "bind_host": host}}
    own, layout = own_transports(engine), layout_of(engine)
    for kind in kinds:
        if kind in SLICED_TRANSPORTS and kind not in own:
            own[kind] = make_transport(kind, **options.get(kind, {}))
    return tuple(t.register(engine.kv, layout, host, serve=True) for t in own.values())


def checksums(engine, blocks: Sequence[int]) -> tuple[range, tuple[int, ...]]:
    """This stage's layers, and the checksum of each over `blocks`."""
    return layers_of(engine), layer_checksums(engine.kv.storage, blocks)


def pull(engine, handoff, dst_blocks: Sequence[int], kind: str, secret: str | None) -> int:
    """This stage's layers of `handoff` into its cache; bytes moved."""
    return pull_layers(handoff, layers_of(engine), engine.kv.storage, dst_blocks, kind, secret)
