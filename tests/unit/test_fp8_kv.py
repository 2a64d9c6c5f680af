"""The FP8 KV cache (engine/kv_cache/fp8.py): e4m3 values with one power-of-two scale per token
and KV head, the scale's exponent stored as the row's last byte.

  * the encoding against an independent statement of it (torch's own e4m3 rounding at the scale
    the stored exponent names, which is the smallest power of two that fits the row);
  * greedy tokens equal Hugging Face's when HF's cache rounds its K/V the same way (a cache
    subclass written here), plain, with prefix hits, chunked and preempted;
  * a prefill-to-decode handoff of FP8 blocks over shm, tcp and nixl on the demo model gives the
    in-process FP8 engine's tokens and logprobs, bit for bit, and moves at most 0.52x the bytes of
    a 16-bit cache's, scales included; a corrupted scale is caught by the checksum (the decode
    side recomputes, as an engine given the first token does);
  * a worker's cache holds at least 1.9x the tokens per GiB."""

import asyncio
import dataclasses
import math

import pytest
import torch
from greedy_parity import assert_greedy_equal, drained, hf_greedy, make_prompts

from splitserve import LLM, SamplingParams
from splitserve.config import EngineConfig
from splitserve.engine.kv_cache import fp8 as kv_fp8
from splitserve.engine.kv_cache.tensors import KVCacheTensors
from splitserve.types import ConfigError, Request
from tests.fakes.transports import CorruptScaleLanding
from tests.unit.test_decode_lifecycle import Local

MAX_NEW = 12


def reference_fake_fp8(x: torch.Tensor) -> torch.Tensor:
    """Each row (token, head) scaled by the smallest power of two that brings its largest
    magnitude within e4m3's 448, rounded to e4m3 by torch, scaled back."""
    amax = x.abs().amax(-1, keepdim=True).double()
    exp = torch.ceil(torch.log2(amax / 448.0)).clamp(min=-126).where(amax > 0, torch.full_like(amax, -126))
    scale = torch.pow(2.0, exp)
    return ((x.double() / scale).to(torch.float8_e4m3fn).double() * scale).to(x.dtype)


def test_encoding_is_e4m3_at_the_smallest_fitting_power_of_two():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 64, generator=g) * torch.logspace(-6, 4, 4)[None, :, None]
    x[0, 0] = 0.0  # an all-zero row
    rows = kv_fp8.encode(x)
    assert rows.dtype == torch.uint8 and rows.shape == (64, 4, 65)
    exp = rows[..., -1].view(torch.int8).double()
    amax = x.abs().amax(-1).double()
    fits = (amax / 2.0 ** exp <= 448) & ((amax == 0) | (amax / 2.0 ** (exp - 1) > 448))
    assert bool(fits.all())
    assert torch.equal(kv_fp8.decode(rows, torch.float32), reference_fake_fp8(x))
    assert torch.equal(rows[..., :-1].view(torch.float8_e4m3fn).float() * 2.0 ** exp[..., None].float(),
                       kv_fp8.decode(rows, torch.float32))


def test_a_cache_holds_about_twice_the_tokens_per_gib():
    for head_dim in (64, 128, 576):  # SmolLM2 / Llama 3 / DeepSeek's latent
        plain = KVCacheTensors.bytes_per_block(2, 16, 4, head_dim, torch.bfloat16)
        fp8 = KVCacheTensors.bytes_per_block(2, 16, 4, head_dim, torch.bfloat16, fp8=True)
        assert plain / fp8 >= 1.9 and fp8 / plain <= 0.52, (head_dim, plain, fp8)


def test_an_unknown_kv_dtype_is_refused(tiny_checkpoint):
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3, got 'int4'"):
        EngineConfig(model=str(tiny_checkpoint("llama")), kv_cache_dtype="int4")
    with pytest.raises(ConfigError, match="does not read an FP8 KV cache: flash-attn 2 takes"):
        LLM(str(tiny_checkpoint("llama")), num_kv_blocks=16, kv_cache_dtype="fp8", attention_backend="flash_attn")


@pytest.fixture(scope="module")
def hf_fp8_of(tiny_checkpoint):
    """shape -> (hf model, prompts, greedy continuations) with HF's cache rounding K/V as ours does."""
    from transformers import AutoModelForCausalLM, DynamicCache

    class Fp8Cache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            return super().update(reference_fake_fp8(key_states), reference_fake_fp8(value_states), layer_idx,
                                  *args, **kwargs)

    cache = {}

    def get(shape):
        if shape not in cache:
            hf = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(shape), dtype=torch.float32).eval()
            prompts = make_prompts(seed=3, lengths=(1, 7, 17, 33, 64, 97, 23, 50))
            refs = []
            for p in prompts:
                ids = torch.tensor([p])
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW,
                                  pad_token_id=0, past_key_values=Fp8Cache(config=hf.config))
                refs.append(out[0, len(p):].tolist())
            # the rounding matters: HF's plain cache differs somewhere
            assert hf_greedy(hf, prompts, MAX_NEW) != refs
            cache[shape] = (hf, prompts, refs)
        return cache[shape]

    return get


@pytest.fixture(scope="module")
def hf_fp8(hf_fp8_of):
    return hf_fp8_of("qwen3")


def generate_and_compare(llm, reference, passes=2):
    hf, prompts, refs = reference
    for _ in range(passes):  # a second pass hits the first's cached blocks (when the pool keeps them)
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
        for p, o, r in zip(prompts, outs, refs):
            assert_greedy_equal(hf, p, list(o.outputs[0].token_ids), r)


@pytest.mark.parametrize("engine", [dict(num_kv_blocks=256), dict(num_kv_blocks=12, max_num_batched_tokens=24)],
                         ids=["plain+prefix", "chunked+preempted"])
def test_greedy_equals_transformers_with_the_same_kv_rounding(tiny_checkpoint, hf_fp8, engine):
    llm = LLM(str(tiny_checkpoint("qwen3")), kv_cache_dtype="fp8", **engine)
    assert llm.engine.kv.dtype_name == "fp8_e4m3"
    generate_and_compare(llm, hf_fp8)
    stats = llm.engine.stats()
    assert stats.num_preempted_total > 0 if engine["num_kv_blocks"] < 24 else stats.prefix_hit_tokens_total > 0
    drained(llm)


def test_prefix_blocks_come_back_from_the_host_tier_with_their_scales(tiny_checkpoint, hf_fp8):
    """A pool too small to keep the first pass's prefixes: they go to the host tier (rows and
    scales as bytes) and are promoted back for the second pass."""
    llm = LLM(str(tiny_checkpoint("qwen3")), kv_cache_dtype="fp8", num_kv_blocks=20, host_kv_blocks=64)
    generate_and_compare(llm, hf_fp8)
    assert llm.engine.host.promoted_total > 0
    drained(llm)


def test_tensor_parallel_ranks_hold_their_heads_rows_and_scales(hf_fp8_of, tiny_checkpoint):
    """TP 2 on a Llama with 2 KV heads: each rank's FP8 cache holds its head (values and scale)."""
    with LLM(str(tiny_checkpoint("llama")), kv_cache_dtype="fp8", num_kv_blocks=96, tensor_parallel_size=2) as llm:
        assert llm.engine.kv.storage.shape[-2:] == (1, llm.engine.model_config.head_dim + 1)
        generate_and_compare(llm, hf_fp8_of("llama"))
        assert llm.engine.stats().prefix_hit_tokens_total > 0
        drained(llm)


PROMPTS = [tuple(range(5, 5 + n)) for n in (9, 40, 150)]
SP = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SP_LOGPROBS = dataclasses.replace(SP, logprobs=0)


def _tokens_and_logprobs(engine, req: Request, outputs=()) -> tuple[list[int], list[float]]:
    engine.add_request(req, outputs=outputs)
    chunks = []
    while engine.has_unfinished():
        chunks += engine.step()
    return [t for c in chunks for t in c.token_ids], [lp.logprob for c in chunks for lp in c.logprobs or ()]


@pytest.fixture(scope="module")
def demo_fp8(demo_model_dir):
    """What the in-process FP8 engine computes in the shapes the workers compute in: the prompts
    one at a time, in order, on one engine (the prefill worker's: the third prompt hits the
    second's cached blocks there too); and, for a recompute, an engine given the prompt and the
    prefill's first token. Batched together the three would be the same math in other shapes, and
    FP8 does not keep that to fp32's last bits: a K/V value that lands the other side of an e4m3
    rounding step moves by 1/16 of itself, and the logprobs by up to 0.02 (here, AVX2 kernels):
    enough to flip a near-tie, as it did on an AVX2-only run."""
    from splitserve.engine.engine import Engine

    cfg = EngineConfig(model=str(demo_model_dir), num_kv_blocks=64, kv_cache_dtype="fp8", dtype="float32")
    engine = Engine(cfg)
    expected = [_tokens_and_logprobs(engine, Request(f"ref-{i}", p, SP_LOGPROBS)) for i, p in enumerate(PROMPTS)]
    engine = Engine(cfg)  # a cache of its own, as the decode worker's: no prefix to hit
    recomputed = _tokens_and_logprobs(engine, Request("recompute", PROMPTS[1], SP_LOGPROBS),
                                      outputs=(expected[1][0][0],))
    return cfg, expected, recomputed


@pytest.mark.parametrize("transport", ["shm", "tcp", "nixl"])
def test_a_handoff_of_fp8_blocks_gives_the_in_process_tokens(demo_fp8, transport):
    from splitserve.worker.decode.worker import DecodeWorker
    from splitserve.worker.prefill.worker import PrefillWorker

    if transport == "nixl":
        pytest.importorskip("nixl")
    cfg, expected, recomputed = demo_fp8
    cfg = dataclasses.replace(cfg, kv_shared_memory=transport == "shm")
    pre, dec = PrefillWorker(cfg, [transport]), DecodeWorker(cfg, [transport])
    try:
        assert pre.layout.dtype == "fp8_e4m3" and pre.layout.head_dim == 64 + 1
        got, moved = asyncio.run(_hand_over_all(pre, dec, transport))
        # the decode side's logprobs too: a wrong scale that flips no token still shows there
        assert got == [(tokens, logprobs[1:]) for tokens, logprobs in expected]
        plain_row = 64 * 2  # a 16-bit cache's row of one head
        plain_bytes = [pre.layout.num_layers * 2 * pre.layout.num_kv_heads * plain_row * 16 * -(-len(p) // 16)
                       for p in PROMPTS]
        assert all(m <= 0.52 * b for m, b in zip(moved, plain_bytes)), (moved, plain_bytes)
        if transport == "tcp":
            dec.transports["tcp"] = CorruptScaleLanding(dec.transports["tcp"], dec)
            before = _recomputes(dec)
            got, _ = asyncio.run(_hand_over_all(pre, dec, transport, only=1))
            assert _recomputes(dec) == before + 1
            assert got == [([expected[1][0][0]] + recomputed[0], recomputed[1])]
    finally:
        pre.close()
        dec.close()


def _recomputes(dec) -> int:
    from splitserve.worker.decode.handoff import HandoffState

    return dec.handoff_outcomes[HandoffState.RECOMPUTE]


async def _hand_over_all(pre, dec, transport, only=None):
    """Each prompt's (first token + the decode side's tokens, the decode side's logprobs), and the
    bytes the decode worker reports having moved."""
    got, moved = [], []
    for i, p in enumerate(PROMPTS):
        if only is not None and i != only:
            continue
        req = Request(f"{transport}-{i}-{only}", p, SP_LOGPROBS)
        result = await pre.prefill(req, transport)
        chunks = [c async for c in dec.generate(req, result.handoff, Local(pre))]
        got.append(([result.handoff.first_token] + [t for c in chunks for t in c.token_ids],
                    [lp.logprob for c in chunks for lp in c.logprobs or ()]))
        # what the decode worker reports having moved (PhaseTimes, counted on /metrics)
        moved.append(next(c.phases.transfer_bytes for c in chunks if c.phases and c.phases.transfer_bytes))
    await asyncio.sleep(0.05)
    p, d = await pre.check_invariants(), await dec.check_invariants()
    assert (p["in_use"], p["leases"], d["in_use"], d["handoffs"]) == (0, 0, 0, 0), (p, d)
    return got, moved


def test_a_decode_worker_with_another_kv_dtype_refuses_the_blocks_and_recomputes(tiny_checkpoint, caplog):
    """One app gives both pools one engine config, so their KV dtypes agree by construction; a
    prefill worker whose cache is FP8 meeting a 32-bit decode worker anyway (two apps, a stale
    worker) is refused at the handoff's header check, naming the dtypes, never copied as if the
    bytes meant the same thing, and the decode side recomputes."""
    import logging

    from splitserve.engine.engine import Engine
    from splitserve.worker.decode.handoff import HandoffState
    from splitserve.worker.decode.worker import DecodeWorker
    from splitserve.worker.prefill.worker import PrefillWorker

    cfg = EngineConfig(model=str(tiny_checkpoint("llama")), num_kv_blocks=64)
    prompt = tuple(range(5, 45))
    eng = Engine(cfg)
    eng.add_request(Request("ref", prompt, SP))
    reference = []
    while eng.has_unfinished():
        reference += [t for c in eng.step() for t in c.token_ids]
    pre, dec = PrefillWorker(dataclasses.replace(cfg, kv_cache_dtype="fp8"), ["tcp"]), DecodeWorker(cfg, ["tcp"])
    try:
        async def go():
            req = Request("mixed", prompt, SP)
            result = await pre.prefill(req, "tcp")
            chunks = [c async for c in dec.generate(req, result.handoff, Local(pre))]
            return [t for c in chunks for t in c.token_ids]

        with caplog.at_level(logging.WARNING):
            tokens = asyncio.run(go())
        assert dec.transfer_failures == {"header": 1}
        assert dec.handoff_outcomes[HandoffState.RECOMPUTE] == 1
        assert "header: dtype: source 'fp8_e4m3', local 'float32'" in caplog.text
        assert tokens == reference[1:]  # the first token came from the prefill, the rest recomputed here
    finally:
        pre.close()
        dec.close()


def test_a_migrated_stream_continues_exactly_on_an_fp8_decode_worker(tiny_checkpoint):
    """Migration's decode side: a request arrives without a handoff, with the tokens another
    worker already streamed; this worker computes its FP8 KV itself and continues as the
    in-process FP8 engine does."""
    from splitserve.worker.decode.worker import DecodeWorker

    cfg = EngineConfig(model=str(tiny_checkpoint("llama")), num_kv_blocks=64, kv_cache_dtype="fp8")
    prompt = tuple(range(5, 45))
    reference = list(LLM(**dataclasses.asdict(cfg)).generate([list(prompt)], SP)[0].outputs[0].token_ids)
    dec = DecodeWorker(cfg, ["tcp"])
    try:
        async def go():
            chunks = [c async for c in dec.generate(Request("moved", prompt, SP), outputs=tuple(reference[:3]))]
            return [t for c in chunks for t in c.token_ids]

        assert asyncio.run(go()) == reference[3:]
    finally:
        dec.close()
