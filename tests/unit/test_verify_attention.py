"""Batched verification attention (torch and cpu backends): short chunks that follow context —
a speculative verify row, its last token and k proposals — attend in one batched call, query j
of a chunk seeing the context up to its own position. Their output equals the one-sequence-at-a-
time prefill path's and a dense causal attention over the same K/V (fp32, to rounding)."""

import math

import pytest
import torch

from splitserve.engine.attention import AttentionBatch, SeqSlice, get_backend

BS, D = 4, 16


def _step(kvh: int, heads: int, ctx_lens, q_lens, decodes=0, seed=0):
    """A random paged cache and a step: `decodes` one-token rows first, then a chunk of q_lens[i]
    new tokens ending at ctx_lens[i] for each sequence; blocks shuffled over the pool."""
    g = torch.Generator().manual_seed(seed)
    lens = [(c, 1) for c in ctx_lens[:decodes]] + list(zip(ctx_lens[decodes:], q_lens))
    need = sum(-(-c // BS) for c, _ in lens)
    perm = torch.randperm(need + 3, generator=g).tolist()
    k_cache = torch.randn(need + 3, BS, kvh, D, generator=g)
    v_cache = torch.randn(need + 3, BS, kvh, D, generator=g)
    slices, slots, q_start = [], [], 0
    for c, ql in lens:
        blocks = tuple(perm[:-(-c // BS)])
        perm = perm[len(blocks):]
        slices.append(SeqSlice(q_start, ql, c, blocks))
        slots += [blocks[p // BS] * BS + p % BS for p in range(c - ql, c)]
        q_start += ql
    n = q_start
    q, k, v = (torch.randn(n, h, D, generator=g) for h in (heads, kvh, kvh))
    batch = AttentionBatch(n, torch.tensor(slots), tuple(slices[:decodes]), tuple(slices[decodes:]), BS)
    return q, k, v, k_cache, v_cache, batch


def _run(backend, multi_query_max, q, k, v, k_cache, v_cache, batch):
    backend.multi_query_max = multi_query_max
    kc, vc = k_cache.clone(), v_cache.clone()
    meta = backend.prepare(batch)
    return backend.forward(q, k, v, kc, vc, meta, 1 / math.sqrt(D)), meta


def _dense(q, k, v, k_cache, v_cache, batch):
    """Each sequence alone: its whole context (cache, then the new K/V written at their slots)
    by dense causal attention, GQA by repeating KV heads."""
    kc, vc = k_cache.clone(), v_cache.clone()
    kc.view(-1, *kc.shape[2:])[batch.slot_mapping] = k
    vc.view(-1, *vc.shape[2:])[batch.slot_mapping] = v
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    for s in batch.decodes + batch.prefills:
        ks = kc[list(s.block_ids)].reshape(-1, *kc.shape[2:])[: s.ctx_len].repeat_interleave(group, 1)
        vs = vc[list(s.block_ids)].reshape(-1, *vc.shape[2:])[: s.ctx_len].repeat_interleave(group, 1)
        qs = q[s.q_start: s.q_start + s.q_len]
        att = torch.einsum("qhd,khd->hqk", qs, ks) / math.sqrt(D)
        pos = torch.arange(s.ctx_len - s.q_len, s.ctx_len)
        att = att.masked_fill(torch.arange(s.ctx_len)[None, None, :] > pos[None, :, None], float("-inf"))
        out[s.q_start: s.q_start + s.q_len] = torch.einsum("hqk,khd->qhd", att.softmax(-1), vs)
    return out


@pytest.mark.parametrize("name", ["torch", "cpu"])
@pytest.mark.parametrize("kvh,heads", [(2, 2), (2, 8)])
def test_a_verify_batch_matches_the_per_sequence_prefills_and_dense_attention(name, kvh, heads):
    """Decodes, then sequences verifying 0..4 proposals at contexts across block edges, plus a
    long chunk that still takes the per-sequence path."""
    backend = get_backend(name)
    ctx = [9, 3, 17, 5, 8, 13, 12, 40]
    q_lens = [5, 2, 3, 5, 4, 30]  # the last: a 30-token chunk after 10 of context
    step = _step(kvh, heads, ctx, q_lens, decodes=2)
    batched, meta = _run(backend, 16, *step)
    assert meta.multi is not None and meta.multi.dst.numel() == sum(q_lens[:-1]) and len(meta.prefills) == 1
    per_seq, meta0 = _run(backend, 0, *step)
    assert meta0.multi is None and len(meta0.prefills) == len(q_lens)
    dense = _dense(*step)
    torch.testing.assert_close(batched, per_seq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(batched, dense, rtol=1e-5, atol=1e-5)


def test_the_batched_path_writes_each_new_token_at_its_slot():
    """The new K/V reach the cache as the per-sequence path writes them."""
    backend = get_backend("torch")
    q, k, v, k_cache, v_cache, batch = _step(2, 4, [7, 11], [5, 3], seed=1)
    kc, vc = k_cache.clone(), v_cache.clone()
    backend.forward(q, k, v, kc, vc, backend.prepare(batch), 0.25)
    torch.testing.assert_close(kc.view(-1, 2, D)[batch.slot_mapping], k)
    torch.testing.assert_close(vc.view(-1, 2, D)[batch.slot_mapping], v)


def test_the_triton_backend_verifies_a_batch_in_one_prefill_launch():
    """The triton backend (its interpreter on CPU) takes the same step through its prefill kernel
    over all the chunks at once; its output matches dense attention."""
    pytest.importorskip("triton")
    from splitserve.engine.attention.paged_backends import triton_unavailable

    if triton_unavailable(torch.device("cpu")) and not torch.cuda.is_available():
        pytest.skip("triton runs on CUDA or under TRITON_INTERPRET=1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    step = _step(2, 4, [9, 17, 6, 13], [5, 3, 2], decodes=1, seed=2)
    q, k, v, k_cache, v_cache, batch = (x.to(device) if isinstance(x, torch.Tensor) else x for x in step)
    batch = AttentionBatch(batch.num_tokens, batch.slot_mapping.to(device), batch.decodes, batch.prefills, BS)
    backend = get_backend("triton", torch.float32, device, block_size=BS, head_dim=D)
    out = backend.forward(q, k, v, k_cache.clone(), v_cache.clone(), backend.prepare(batch), 1 / math.sqrt(D))
    torch.testing.assert_close(out.cpu(), _dense(*step), rtol=1e-4, atol=1e-4)
