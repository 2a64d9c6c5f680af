"""On a CUDA machine only (skipped elsewhere): tcp moves KV between two GPU caches through host
buffers, byte-exact, and the gathered checksum of a GPU cache equals the CPU path's."""

import time

import pytest
import torch

from splitserve.kv_transfer import (
    KVHandoff,
    KVLayout,
    TcpTransport,
    TransferHeader,
    TransferState,
    kv_checksum,
    verify_landed,
    wait_transfer,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _layout(num_blocks: int) -> KVLayout:
    return KVLayout(num_layers=3, num_blocks=num_blocks, block_size=16, num_kv_heads=2, head_dim=64, dtype="bfloat16",
                    element_size=2, model_fingerprint="fp")


def test_tcp_between_gpu_caches():
    src = torch.randn(3, 2, 40, 16, 2, 64, device="cuda").to(torch.bfloat16)
    dst = torch.zeros(3, 2, 30, 16, 2, 64, device="cuda", dtype=torch.bfloat16)
    a, b = TcpTransport(), TcpTransport()
    try:
        ep = a.register(src, _layout(40), "host-a")
        b.register(dst, _layout(30), "host-b")
        blocks, into = (3, 4, 5, 30, 17), (0, 1, 2, 9, 20)
        checksum = kv_checksum(src, _layout(40), blocks)
        assert checksum == kv_checksum(src.cpu(), _layout(40), blocks)
        header = TransferHeader(request_id="r", model_fingerprint="fp", dtype="bfloat16", block_size=16, num_layers=3,
                                num_blocks=len(blocks), lease_epoch=1)
        handoff = KVHandoff(request_id="r", first_token=1, first_logprob=None, num_prompt_tokens=80,
                            num_cached_tokens=0, block_ids=blocks, endpoint=ep, lease_id="l",
                            lease_expires_at=time.time() + 30, header=header, checksum=checksum)
        handle = b.read(handoff, into)
        assert wait_transfer(b, handle, timeout=20).state is TransferState.DONE
        b.release(handle)
        assert torch.equal(dst[:, :, list(into)], src[:, :, list(blocks)])
        verify_landed(dst, _layout(30), handoff, into)
    finally:
        a.close()
        b.close()
