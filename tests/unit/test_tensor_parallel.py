"""Tensor parallelism on CPU: an engine over 2 rank processes (gloo), each holding half of every
layer — query and KV heads (KV heads replicated where there are fewer than ranks; MLA's
latent on every rank), MLP and expert columns or whole experts, vocab rows — gives Hugging
Face's greedy tokens (tie rule as in test_engine_parity), and losing a rank fails the engine
with an error instead of hanging."""

import time

import pytest
import torch
from fake_backend import exported

from splitserve import LLM, SamplingParams
from splitserve.engine.model.config import ModelConfig
from splitserve.engine.parallel.shard import Shard
from splitserve.types import ConfigError, Request
from tests.unit.test_engine_parity import drained, reference, run_and_compare  # noqa: F401  (a fixture)


@pytest.mark.parametrize("shape, expert_parallel", [
    ("llama", False),  # GQA: 8 query heads, 2 KV heads -> 4 + 1 per rank
    ("mixtral", False),  # every expert's columns split
    ("qwen2_moe", False),  # and the shared expert's; a dense layer beside the sparse one
    ("qwen3_moe", True),  # whole experts per rank; one KV head, replicated on both ranks
])
def test_tp2_greedy_equals_transformers(tiny_checkpoint, reference, shape, expert_parallel):
    with LLM(str(tiny_checkpoint(shape)), num_kv_blocks=96, max_num_batched_tokens=64, tensor_parallel_size=2,
             expert_parallel=expert_parallel) as llm:
        full = llm.engine.model_config
        assert llm.engine.tp.size == 2 and llm.engine.runner.model.cfg.num_heads == full.num_heads // 2
        run_and_compare(llm, reference, shape)  # chunked prefill (64 tokens a step) and prefix hits included
        drained(llm)
        if llm.engine.model_config.moe is not None:
            routed = llm.engine.stats().expert_tokens_total
            assert len(routed) == llm.engine.model_config.moe.num_experts and min(routed) > 0


@pytest.mark.parametrize("expert_parallel, num_kv_blocks", [(False, 96), (True, 24)])
def test_tp2_latent_attention_equals_transformers(tiny_checkpoint, reference, expert_parallel, num_kv_blocks):
    """DeepSeek-V3 (MLA): 2 of the 4 heads per rank (q_b_proj and kv_b_proj by head, o_proj by
    its input columns), the latent replicated: each rank caches the whole latent. Chunked
    prefill (64 tokens a step) and prefix hits with every expert's columns split; with whole
    experts per rank, a pool too small for the batch (preemption)."""
    with LLM(str(tiny_checkpoint("deepseek_v3")), num_kv_blocks=num_kv_blocks, max_num_batched_tokens=64,
             tensor_parallel_size=2, expert_parallel=expert_parallel) as llm:
        local = llm.engine.runner.model.cfg
        assert (local.num_heads, local.num_kv_heads, local.head_dim) == (2, 1, llm.engine.model_config.mla.latent_dim)
        run_and_compare(llm, reference, "deepseek_v3")
        stats = llm.engine.stats()
        if num_kv_blocks < 96:
            assert stats.num_preempted_total > 0, "the pool was meant to be too small for the batch"
        else:
            assert stats.prefix_hit_tokens_total > 0  # a third of the prompts share a 40-token prefix
        drained(llm)
        assert min(stats.expert_tokens_total) > 0


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_stacked_experts_load_as_the_per_expert_layout_does(tiny_checkpoint, tmp_path, expert_parallel):
    """Hub checkpoints hold one tensor per expert projection; transformers 5 can write them
    stacked ([E, 2I, H] gate+up, [E, H, I] down). Both give the same parameters, whole and on
    each rank's shard."""
    import shutil

    from safetensors.torch import load_file, save_file

    from splitserve.engine.model.loader import load_model

    src = tiny_checkpoint("qwen2_moe")
    cfg = ModelConfig.from_dir(src)
    stacked = tmp_path / "stacked"
    shutil.copytree(src, stacked)
    weights = load_file(str(stacked / "model.safetensors"))
    out = {k: v for k, v in weights.items() if ".mlp.experts." not in k}
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}.mlp.experts."
        if f"{p}0.gate_proj.weight" not in weights:
            continue  # the dense layer
        e = range(cfg.moe.num_experts)
        out[p + "gate_up_proj"] = torch.stack([torch.cat((weights[f"{p}{i}.gate_proj.weight"],
                                                          weights[f"{p}{i}.up_proj.weight"])) for i in e])
        out[p + "down_proj"] = torch.stack([weights[f"{p}{i}.down_proj.weight"] for i in e])
    save_file(out, str(stacked / "model.safetensors"))
    for shard in [None] + [Shard.of(cfg, r, 2, expert_parallel) for r in range(2)]:
        a = load_model(src, cfg, torch.float32, 64, shard=shard).state_dict()
        b = load_model(stacked, cfg, torch.float32, 64, shard=shard).state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), shard


def test_kv_heads_are_split_or_replicated_by_which_query_heads_read_them(tiny_checkpoint):
    llama = ModelConfig.from_dir(tiny_checkpoint("llama"))  # 8 heads, 2 KV heads
    assert [(s.heads, s.kv_heads) for s in (Shard.of(llama, r, 2) for r in range(2))] == \
        [(range(0, 4), range(0, 1)), (range(4, 8), range(1, 2))]
    four = [Shard.of(llama, r, 4) for r in range(4)]  # 2 query heads each; KV head h // 4 of 8 / 2
    assert [s.kv_heads for s in four] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert [s.vocab for s in four] == [range(0, 96), range(96, 192), range(192, 288), range(288, 384)]
    qwen3_moe = ModelConfig.from_dir(tiny_checkpoint("qwen3_moe"))
    assert [Shard.of(qwen3_moe, r, 2, expert_parallel=True).experts for r in range(2)] == [range(0, 4), range(4, 8)]
    deepseek = ModelConfig.from_dir(tiny_checkpoint("deepseek_v3"))  # 4 heads over one latent "KV head"
    assert [(s.heads, s.kv_heads) for s in (Shard.of(deepseek, r, 4) for r in range(4))] == \
        [(range(r, r + 1), range(0, 1)) for r in range(4)]  # the latent: on every rank


def test_latent_attention_shards_add_up_to_the_whole_layer(tiny_checkpoint):
    """MLA at TP 2: the per-head projections' rows (o_proj's columns) of the two ranks put
    together are the whole model's; the latent's projections and norms are on both, whole."""
    from splitserve.engine.model.loader import load_model

    path = tiny_checkpoint("deepseek_v3")
    cfg = ModelConfig.from_dir(path)
    whole = load_model(path, cfg, torch.float32, 64).state_dict()
    ranks = [load_model(path, cfg, torch.float32, 64, shard=Shard.of(cfg, r, 2)).state_dict() for r in range(2)]
    a = "layers.1.self_attn."
    for name, dim in [("q_b_proj.weight", 0), ("kv_b_proj.weight", 0), ("o_proj.weight", 1)]:
        assert torch.equal(torch.cat([r[a + name] for r in ranks], dim), whole[a + name]), name
    for name in ("q_a_proj.weight", "q_a_layernorm.weight", "kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight"):
        assert all(torch.equal(r[a + name], whole[a + name]) for r in ranks), name


def test_a_size_the_shapes_do_not_divide_is_refused_before_any_rank_starts(tiny_checkpoint):
    with pytest.raises(ConfigError, match="tensor_parallel_size 3 does not divide num_attention_heads 8"):
        LLM(str(tiny_checkpoint("llama")), num_kv_blocks=16, tensor_parallel_size=3)
    with pytest.raises(ConfigError, match="tensor_parallel_size 3 does not divide num_attention_heads 4"):
        LLM(str(tiny_checkpoint("deepseek_v3")), num_kv_blocks=16, tensor_parallel_size=3)


def test_the_meeting_point_holds_its_port_until_the_group_is_gone():
    """Process 0 listens before any other process starts and keeps the port: a group starting
    beside it (another test's, in the other xdist worker) cannot be given the same port and have
    its ranks meet ours. CI saw exactly that when the port was probed free and closed again
    (EADDRINUSE in one group, a rendezvous timeout in the other)."""
    import errno
    import socket

    from splitserve.engine.parallel.group import meeting_point

    one, two = meeting_point("127.0.0.1", 2, 5.0), meeting_point("127.0.0.1", 2, 5.0)
    ports = [int(address.rsplit(":", 1)[1]) for _, address in (one, two)]
    assert ports[0] != ports[1] and min(ports) > 0
    for port in ports:
        with socket.socket() as s, pytest.raises(OSError) as taken:
            s.bind(("127.0.0.1", port))
        assert taken.value.errno == errno.EADDRINUSE


def test_losing_a_rank_fails_the_engine_with_an_error_not_a_hang(tiny_checkpoint):
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with LLM(str(tiny_checkpoint("llama")), num_kv_blocks=32, tensor_parallel_size=2) as llm:
        assert len(llm.generate([[5, 6, 7]], sp)[0].outputs[0].token_ids) == 4
        assert llm.engine.ranks.lost() is None
        rank1 = llm.engine.ranks.procs[0]
        rank1.kill()
        rank1.join(10)
        assert llm.engine.ranks.lost() == "tensor-parallel rank 1 exited"  # seen while idle, before any step
        with pytest.raises(RuntimeError, match="tensor-parallel group is broken: tensor-parallel rank 1 exited"):
            llm.generate([[8, 9, 10]], sp)  # refused before the step: no collective waits on the dead rank
        assert llm.engine.pool.num_in_use == 0  # the failed request's blocks went back


def test_expert_load_and_its_imbalance_are_exported_per_worker():
    from splitserve.router.policy import WorkerView

    text = exported([WorkerView("w1", "decode", "h", expert_tokens=(3, 1, 0, 4)), WorkerView("w2", "prefill", "h")]
                    ).exposition().decode()
    got = {ln.split("{")[1].split("}")[0]: float(ln.split()[-1]) for ln in text.splitlines()
           if ln.startswith("splitserve_worker_expert_")}
    assert got['expert="3",role="decode",worker="w1"'] == 4
    assert got['role="decode",scope="expert",worker="w1"'] == 2.0  # 4 / mean 2
    assert not any('worker="w2"' in k for k in got)  # a dense worker exports none


def test_a_failed_start_leaves_no_rank_behind(tiny_checkpoint, tmp_path):
    import multiprocessing
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(tiny_checkpoint("qwen2"), broken)
    weights = load_file(str(broken / "model.safetensors"))
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, str(broken / "model.safetensors"))
    with pytest.raises(ConfigError, match="missing weights for: layers.1.mlp.down_proj.weight"):
        LLM(str(broken), num_kv_blocks=16, tensor_parallel_size=2)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("splitserve-tp-rank")]


class UnwatchedRanks:
    """The ranks, with their loss unseen until a step meets it (a wrapper: the step path)."""

    def __init__(self, ranks) -> None:
        self.ranks = ranks

    def lost(self):
        return None

    def __getattr__(self, name):
        return getattr(self.ranks, name)


def test_a_serving_loop_stops_its_engine_at_the_first_step_a_rank_fails(tiny_checkpoint):
    """Under tensor parallelism a failed step leaves the other ranks inside one of its
    collectives: no step after it can line up with theirs, so the loop does not retry (it would
    wait out the group's timeout each time) — the engine stops, and its worker is replaced."""
    import asyncio

    from splitserve.config import EngineConfig
    from splitserve.worker.engine_loop import EngineLoop

    loop = EngineLoop.start(EngineConfig(model=str(tiny_checkpoint("llama")), num_kv_blocks=32, tensor_parallel_size=2))
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    watched = loop.engine.ranks
    loop.engine.ranks = UnwatchedRanks(watched)

    async def go():
        rank1 = watched.procs[0]
        rank1.kill()
        rank1.join(10)
        q = await loop.submit(Request("after-rank-loss", (5, 6, 7), sp))
        return await asyncio.wait_for(q.get(), 60)

    try:
        item = asyncio.run(go())
        assert isinstance(item, Exception) and "this engine has stopped" in str(item)
        assert loop.failure == "a step of its tensor-parallel group failed with RuntimeError"  # at once, no retries
    finally:
        loop.close()
        loop.engine.close()


def test_an_idle_serving_loop_stops_when_a_rank_exits(tiny_checkpoint):
    """No step has to meet the loss: a health probe (`stopped`) sees the rank gone, and nothing
    more is admitted."""
    import asyncio

    from splitserve.config import EngineConfig
    from splitserve.worker.engine_loop import EngineFailed, EngineLoop

    loop = EngineLoop.start(EngineConfig(model=str(tiny_checkpoint("llama")), num_kv_blocks=32, tensor_parallel_size=2))
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    async def waiter_hears_it():
        q = loop.watch("landing")  # a request waiting on this engine (its KV arriving, say)
        rank1 = loop.engine.ranks.procs[0]
        rank1.kill()
        rank1.join(10)
        assert loop.stopped() == "tensor-parallel rank 1 exited"
        return await asyncio.wait_for(q.get(), 10)

    try:
        assert loop.stopped() is None
        heard = asyncio.run(waiter_hears_it())
        assert isinstance(heard, EngineFailed) and "tensor-parallel rank 1 exited" in str(heard)
        with pytest.raises(EngineFailed, match="tensor-parallel rank 1 exited"):
            asyncio.run(loop.submit(Request("after-rank-loss", (5, 6, 7), sp)))
    finally:
        loop.close()
        loop.engine.close()


def test_a_group_idle_longer_than_its_collective_timeout_still_serves(tiny_checkpoint):
    """Followers wait for the next step on a broadcast of its own, without the collectives'
    timeout: an engine left idle (here 3x the 2 s timeout; in service, hours) still serves."""
    import functools

    from splitserve.config import EngineConfig
    from splitserve.engine.engine import Engine
    from splitserve.engine.parallel.launch import start_local_group

    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    path = str(tiny_checkpoint("llama"))
    want = LLM(path, num_kv_blocks=32).generate([[5, 6, 7]], sp)[0].outputs[0].token_ids
    engine = Engine(EngineConfig(model=path, num_kv_blocks=32, tensor_parallel_size=2),
                    start_ranks=functools.partial(start_local_group, timeout_s=2.0))
    try:
        for i in range(2):
            engine.add_request(Request(f"r{i}", (5, 6, 7), sp))
            got = []
            while engine.has_unfinished():
                got += [t for c in engine.step() for t in c.token_ids]
            assert got == list(want)
            assert engine.ranks.lost() is None
            if i == 0:
                time.sleep(6.0)
    finally:
        engine.close()
