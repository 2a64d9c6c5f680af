"""Checks that stand between bytes landing and bytes being used (DESIGN.md §1 step 6).

The decode worker calls `check_header` before it reads (does this handoff fit my cache at all?)
and `verify_landed` after the transport reports DONE (are the bytes that landed the bytes the
prefill worker checksummed?). Either raises TransferError; the caller then drops the blocks and
recomputes locally — a transfer's data is never used unverified.
"""

from __future__ import annotations

from typing import Sequence

from splitserve.kv_transfer.base import KVHandoff, KVLayout, TransferError, layers_differ
from splitserve.kv_transfer.regions import kv_checksum, storage_tensor

# (header field, local layout field) pairs that must be equal. The KV dtype first: the model's
# fingerprint covers it too, and "dtype: source 'fp8_e4m3', local 'bfloat16'" says what differs.
_HEADER_FIELDS = (
    ("dtype", "dtype"),
    ("model_fingerprint", "model_fingerprint"),
    ("block_size", "block_size"),
    ("num_layers", "num_layers"),
)
# Geometry the header does not carry but the source's published layout does.
_LAYOUT_FIELDS = ("num_kv_heads", "head_dim", "element_size")


def check_header(handoff: KVHandoff, local_layout: KVLayout, heads_may_differ: bool = False) -> None:
    """Raise TransferError("header") naming the first field where the handoff does not fit.
    `heads_may_differ`: a sliced handoff between tensor-parallel groups, whose caches hold
    different KV heads (head_slices.py checks each slice's)."""
    h = handoff.header
    if h.request_id != handoff.request_id:
        raise TransferError("header", f"request_id: header says {h.request_id!r}, handoff {handoff.request_id!r}")
    for hf, lf in _HEADER_FIELDS:
        if hf == "num_layers" and h.num_layers != local_layout.num_layers:
            raise TransferError("header", layers_differ(h.num_layers, local_layout.num_layers))
        if getattr(h, hf) != getattr(local_layout, lf):
            raise TransferError("header", f"{hf}: source {getattr(h, hf)!r}, local {getattr(local_layout, lf)!r}")
    if h.num_blocks != len(handoff.block_ids):
        raise TransferError("header", f"num_blocks: header says {h.num_blocks}, handoff lists {len(handoff.block_ids)}")
    src_layout = handoff.endpoint.layout
    for f in _LAYOUT_FIELDS:
        if heads_may_differ and f == "num_kv_heads":
            continue
        if getattr(src_layout, f) != getattr(local_layout, f):
            raise TransferError("header", f"{f}: source {getattr(src_layout, f)!r}, local {getattr(local_layout, f)!r}")


# The name base.py's docstring uses.
check_handoff = check_header


def verify_landed(storage, layout: KVLayout, handoff: KVHandoff, dst_blocks: Sequence[int],
                  layers: range | None = None) -> None:
    """Raise TransferError("corrupt") unless dst_blocks (`layers`, default all) hash to
    handoff.checksum. `storage`: the local KV storage tensor (or a KVCacheTensors)."""
    if len(dst_blocks) != len(handoff.block_ids):
        raise TransferError("header", f"{len(dst_blocks)} destination blocks for {len(handoff.block_ids)} source blocks")
    got = kv_checksum(storage_tensor(storage), layout, dst_blocks, layers)
    if got != handoff.checksum:
        raise TransferError("corrupt", f"checksum of {len(dst_blocks)} landed blocks is {got:#018x}, "
                                       f"source sent {handoff.checksum:#018x}")
