"""The heterogeneous KV handoff's plan (engine/parallel/kv_slices.py): every decode rank's KV heads,
each exactly once, from prefill ranks holding them, for the TP pairs the issue names — moved
here between tensors cut as each rank's cache is cut, and compared with the whole cache; MLA's
latent, which every rank holds whole, read once per decode rank from one prefill rank."""

import dataclasses

import pytest
import torch

from splitserve.engine.model.config import ModelConfig
from splitserve.engine.parallel.kv_slices import plan
from splitserve.engine.parallel.shard import Shard


@pytest.mark.parametrize("kv_heads", [2, 4])
@pytest.mark.parametrize("src_size, dst_size", [(2, 1), (1, 2), (2, 4), (4, 2), (4, 4), (1, 4)])
def test_each_decode_rank_gets_exactly_its_heads(tiny_checkpoint, kv_heads, src_size, dst_size):
    cfg = dataclasses.replace(ModelConfig.from_dir(tiny_checkpoint("llama")), num_kv_heads=kv_heads)  # 8 query heads
    full = torch.randn(5, 16, kv_heads, 8)  # [blocks, block size, KV heads, head dim]
    src = [full[:, :, s.kv_heads.start: s.kv_heads.stop] for s in (Shard.of(cfg, r, src_size) for r in range(src_size))]
    want = [full[:, :, s.kv_heads.start: s.kv_heads.stop] for s in (Shard.of(cfg, r, dst_size) for r in range(dst_size))]
    got = [torch.full_like(w, float("nan")) for w in want]
    slices = plan(cfg, src_size, dst_size)
    for sl in slices:
        got[sl.dst_rank][:, :, sl.dst_heads.start: sl.dst_heads.stop] = \
            src[sl.src_rank][:, :, sl.src_heads.start: sl.src_heads.stop]
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    # one slice per contiguous run: a rank whose heads all sit on one source reads them at once
    assert len(slices) <= sum(len(Shard.of(cfg, r, dst_size).kv_heads) for r in range(dst_size))
    if src_size > kv_heads:  # replicated heads: the decode ranks spread their reads over the copies
        sources = {sl.src_rank for sl in slices}
        assert len(sources) == min(src_size, dst_size * max(1, kv_heads // dst_size))


def test_p2_to_d1_reads_one_run_from_each_prefill_rank(tiny_checkpoint):
    cfg = ModelConfig.from_dir(tiny_checkpoint("llama"))  # 2 KV heads
    s = plan(cfg, 2, 1)
    assert [(x.src_rank, x.src_heads, x.dst_heads) for x in s] == [(0, range(0, 1), range(0, 1)),
                                                                    (1, range(0, 1), range(1, 2))]


@pytest.mark.parametrize("src_size, dst_size", [(2, 1), (1, 2), (2, 4), (4, 2)])
def test_a_latent_is_read_whole_from_one_prefill_rank(tiny_checkpoint, src_size, dst_size):
    """MLA: every rank of either group holds the whole latent (its one "KV head"), so each
    decode rank reads it once, from prefill rank d mod P (P ≥ D: each from a different one)."""
    cfg = ModelConfig.from_dir(tiny_checkpoint("deepseek_v3"))
    for ep in (False, True):
        got = [(x.dst_rank, x.src_rank, x.src_heads, x.dst_heads) for x in plan(cfg, src_size, dst_size, ep, ep)]
        assert got == [(d, d % src_size, range(0, 1), range(0, 1)) for d in range(dst_size)]
