"""The sliced KV handoff between tensor-parallel groups (kv_transfer/head_slices.py), without
Ray: source ranks' caches as separate shared-memory files (shm) or TCP servers (tcp), each with
only its KV heads; every destination rank pulls its heads and gets exactly the whole cache's;
a head corrupted after its checksum was taken is refused, never used. Latent-attention engines
of different TP sizes hand their latents over so, and decode as one engine does."""

import dataclasses
import os
import uuid

import pytest
import torch

from splitserve.engine.kv_cache import KVCacheTensors
from splitserve.engine.model.config import ModelConfig
from splitserve.kv_transfer import make_transport
from splitserve.kv_transfer.base import KVHandoff, KVLayout, TransferError, TransferHeader
from splitserve.kv_transfer.head_slices import RankSource, head_checksums, pull_heads
from splitserve.engine.parallel.kv_slices import plan
from splitserve.engine.parallel.shard import Shard

L, NB, B, D = 2, 12, 4, 8
SECRET = os.urandom(16).hex()
TOKEN = os.urandom(16)


def layout(heads: int, blocks: int = NB) -> KVLayout:
    return KVLayout(L, blocks, B, heads, D, "float32", 4, "fp")


class Sources:
    """P source ranks cut from one whole cache; each serves its part over `kind`."""

    def __init__(self, cfg, size: int, kind: str, blocks) -> None:
        self.full = torch.randn(L, 2, NB, B, cfg.num_kv_heads, D)
        self.caches, self.transports, self.ranks = [], [], []
        for r in range(size):
            heads = Shard.of(cfg, r, size).kv_heads
            kv = KVCacheTensors.allocate(L, NB, B, len(heads), D, torch.float32,
                                         shm_path=f"/dev/shm/splitserve-test-{uuid.uuid4().hex}")
            kv.storage.copy_(self.full[:, :, :, :, heads.start: heads.stop])
            t = make_transport(kind, **({"secret": SECRET} if kind == "tcp" else {}))
            ep = t.register(kv, layout(len(heads)), "127.0.0.1", serve=True)
            t.allow(TOKEN, blocks)
            self.caches.append(kv)
            self.transports.append(t)
            self.ranks.append(RankSource(r, heads, (ep,), head_checksums(kv.storage, blocks)))

    def handoff(self, blocks) -> KVHandoff:
        header = TransferHeader("r", "fp", "float32", B, L, len(blocks), 1)
        return KVHandoff("r", 1, None, 8, 0, tuple(blocks), self.ranks[0].endpoints[0], "lease", 1e12, header, 0,
                         TOKEN, tuple(self.ranks))

    def close(self) -> None:
        for t, kv in zip(self.transports, self.caches):
            t.close()
            kv.close()


@pytest.fixture
def cfg(tiny_checkpoint):
    return dataclasses.replace(ModelConfig.from_dir(tiny_checkpoint("llama")), num_kv_heads=4)  # 8 query heads


@pytest.mark.parametrize("kind", ["shm", "tcp"])
@pytest.mark.parametrize("src_size,dst_size", [(2, 1), (1, 2), (2, 4), (4, 2)])
def test_every_destination_rank_gets_exactly_its_heads(cfg, kind, src_size, dst_size):
    blocks, dst_blocks = [3, 4, 9, 1], [0, 1, 2, 7]
    src = Sources(cfg, src_size, kind, blocks)
    try:
        h, slices = src.handoff(blocks), plan(cfg, src_size, dst_size)
        for r in range(dst_size):
            heads = Shard.of(cfg, r, dst_size).kv_heads
            dst = torch.full((L, 2, 8, B, len(heads), D), float("nan"))
            moved = pull_heads(h, [s for s in slices if s.dst_rank == r], dst, dst_blocks, kind, SECRET)
            want = src.full[:, :, blocks][:, :, :, :, heads.start: heads.stop]
            assert torch.equal(dst[:, :, dst_blocks], want)
            exact = want.numel() * 4
            assert moved == exact if kind == "shm" or src_size >= dst_size else moved > exact
    finally:
        src.close()


@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_a_head_corrupted_after_its_checksum_is_refused(cfg, kind):
    blocks = [2, 5]
    src = Sources(cfg, 2, kind, blocks)
    try:
        src.caches[1].storage[1, 0, 5, 0, 1, 3] += 1.0  # rank 1's second head, after the checksums
        dst = torch.zeros(L, 2, 4, B, 4, D)
        with pytest.raises(TransferError, match="corrupt: KV head 3 from source rank 1"):
            pull_heads(src.handoff(blocks), plan(cfg, 2, 1), dst, [0, 1], kind, SECRET)
    finally:
        src.close()


def test_a_slice_the_source_does_not_hold_is_a_header_error(cfg):
    blocks = [0]
    src = Sources(cfg, 2, "shm", blocks)
    try:
        bad = dataclasses.replace(plan(cfg, 2, 1)[1], src_heads=range(1, 3))  # rank 1 holds two heads: 0..1
        with pytest.raises(TransferError, match="header"):
            pull_heads(src.handoff(blocks), [bad], torch.zeros(L, 2, 2, B, 4, D), [0], "shm")
    finally:
        src.close()


def test_latents_hand_over_between_groups_of_different_sizes(tiny_checkpoint):
    """MLA (DeepSeek-V3) engines, P(TP 1) → D(TP 2) and P(TP 2) → D(TP 1) over shm: every rank
    caches the whole latent (the same bytes on every rank of a group), each decode rank pulls it
    from one prefill rank as the plan says, and the decode continues as the single engine does."""
    from splitserve.config import EngineConfig
    from splitserve.engine.engine import Engine
    from splitserve.types import Request, SamplingParams

    path = str(tiny_checkpoint("deepseek_v3"))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (1, 17, 40, 90)]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    # no prefix cache: each side computes every prompt's latents itself
    one, two = (Engine(EngineConfig(model=path, num_kv_blocks=64, tensor_parallel_size=t, kv_shared_memory=True,
                                    enable_prefix_caching=False)) for t in (1, 2))
    try:
        for i, p in enumerate(prompts):
            one.add_request(Request(str(i), p, sp))
        want = run_to_end(one)
        assert hand_over(one, two, prompts, sp) == want
        assert hand_over(two, one, prompts, sp) == want
        for e in (one, two):
            e.check_invariants()
            assert e.pool.num_in_use == 0
    finally:
        one.close()
        two.close()


def run_to_end(engine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for c in engine.step():
            out.setdefault(c.request_id, []).extend(c.token_ids)
    return out


def hand_over(pre, dec, prompts, sp) -> dict[str, list[int]]:
    """Prefill `prompts` on `pre`, move each one's KV heads (or latents) to `dec` as a decode
    worker's ranks pull them (worker/rank_kv.py), and decode them there."""
    from splitserve.engine.parallel.rank_calls import on_all_ranks
    from splitserve.types import Request
    from splitserve.worker import rank_kv
    from splitserve.worker.kv_layout import layout_of

    for i, p in enumerate(prompts):
        pre.add_request(Request(str(i), p, sp), prefill_only=True)
    firsts = {}
    while pre.has_unfinished():
        firsts.update((c.request_id, (c.token_ids[0], c.kv_blocks)) for c in pre.step())
    own = make_transport("shm")
    try:
        endpoints = on_all_ranks(pre, rank_kv.serve_kv, ("shm",), {}, "127.0.0.1")
        endpoints[0] = (own.register(pre.kv, layout_of(pre), "127.0.0.1"),)
        cfg = pre.model_config
        slices = plan(cfg, pre.tp.size, dec.tp.size)
        for i, p in enumerate(prompts):
            rid = str(i)
            first, blocks = firsts[rid]
            sums = on_all_ranks(pre, rank_kv.checksums, blocks)
            if cfg.mla is not None:
                assert len(set(sums)) == 1  # one latent, replicated bit for bit
            ranks = tuple(RankSource(r, Shard.of(cfg, r, pre.tp.size).kv_heads, endpoints[r], sums[r])
                          for r in range(pre.tp.size))
            # every cache layer: a draft head's too (speculative/draft.py)
            header = TransferHeader(rid, "fp", "float32", pre.config.block_size, pre.cache_layers, len(blocks),
                                    cfg.num_kv_heads)
            h = KVHandoff(rid, first, None, len(p), 0, tuple(blocks), endpoints[0][0], "lease", 1e12, header, 0,
                          TOKEN, ranks)
            own.allow(TOKEN, blocks)
            on_all_ranks(pre, rank_kv.allow, TOKEN, blocks)
            dst = dec.add_pulled(Request(rid, p, sp), first)
            on_all_ranks(dec, rank_kv.pull, h, slices, dst, "shm", None)
            dec.kv_ready(rid)
            assert pre.release_detached(rid)
        out = run_to_end(dec)
    finally:
        own.close()
    return {rid: [firsts[rid][0]] + toks for rid, toks in out.items()}
