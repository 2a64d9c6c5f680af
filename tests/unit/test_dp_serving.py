"""Data-parallel attention on the serving path, in-process (`splitserve serve --prefill 0 --decode 0
--config f.yaml` with `engine: {data_parallel_size: 2}`): the config file's key reaches the
engine, `EngineLoop.start` builds the data-parallel front (two replicas, two local processes),
the OpenAI app serves concurrent requests with the single engine's greedy tokens on both
replicas, the stats the app reads are both replicas' summed; forced tool calls (a grammar on each
replica) come back as tool_calls and a grammar that does not compile is one engine's 400; and a
replica that exits stops the idle serving loop by name, as a lost tensor-parallel rank does."""

import asyncio
import json

import httpx
import jsonschema
import pytest

from splitserve import LLM
from splitserve.config import EngineConfig
from splitserve.engine.parallel.dp_engine import DataParallelEngine
from splitserve.ingress.http import OpenAIServer
from splitserve.orchestrator.local_backend import LocalBackend
from splitserve.types import ConfigError, Request, SamplingParams
from splitserve.worker.engine_loop import EngineFailed
from tests.chaos.harness import prompts
from tests.unit.test_dp_grammar import ARGS, NOT_FOR_THIS_MODEL, TOOL, _compiles

SHAPE = "qwen3_moe"
MAX_TOKENS = 8


def serve_args(tmp_path, model: str):
    """What `splitserve serve --prefill 0 --decode 0 --config f.yaml` turns into its engine config."""
    from splitserve.cli.main import _with_config_file, build_parser
    from splitserve.cli.serve import _engine_options

    f = tmp_path / "serve.yaml"
    f.write_text("engine: {data_parallel_size: 2, num_kv_blocks: 64}\n")
    argv = ["serve", "--model", model, "--prefill", "0", "--decode", "0", "--config", str(f)]
    parser = build_parser()
    args = _with_config_file(parser, argv, str(f))
    return EngineConfig.from_dict({"model": model, **_engine_options(args)})


def test_a_cluster_config_takes_data_parallel_workers_in_aggregated_apps_only(tiny_checkpoint):
    """DeployConfig: D replicas per decode worker count as D processes; beside a prefill pool
    (no handoff into the front) and with TP or PP inside a replica it is refused by name."""
    from splitserve.control.actors import worker_placement
    from splitserve.control.deploy_config import DeployConfig
    from splitserve.types import Role

    model = str(tiny_checkpoint(SHAPE))
    dp = {"engine": {"data_parallel_size": 2}}
    cfg = DeployConfig(model=model, prefill=0, decode=3, **dp)
    assert cfg.dp == 2 and cfg.ranks(0, 3) == 6
    assert worker_placement(cfg, Role.DECODE, ["tcp"], 0.0).engine.data_parallel_size == 2
    with pytest.raises(ConfigError, match="each data-parallel replica needs a GPU of its own"):
        worker_placement(cfg, Role.DECODE, ["tcp"], 0.5)
    with pytest.raises(ConfigError, match="data_parallel_size 2 beside a prefill pool"):
        DeployConfig(model=model, prefill=1, decode=1, **dp)
    with pytest.raises(ConfigError, match="data_parallel_size 2 with decode_tp 2"):
        DeployConfig(model=model, prefill=0, decode=1, decode_tp=2, **dp)
    with pytest.raises(ConfigError, match="data_parallel_size 2 with decode_pp 2"):
        DeployConfig(model=model, prefill=0, decode=1, decode_pp=2, **dp)
    assert DeployConfig.from_options({"model": model, "prefill": "0", "engine": "{data_parallel_size: 2}"}).dp == 2


def test_a_step_of_the_data_parallel_group_that_fails_stops_the_loop_at_once(tiny_checkpoint):
    """EngineLoop with D=2 (`EngineLoop.start` builds the front): a step whose gather fails
    (injected here) leaves the replicas inside that step, so the loop stops on the first
    failure, not after retries; close then kills the replicas instead of ordering them. (Before
    the module's app starts: one process holds one data-parallel group at a time.)"""
    from splitserve.worker.engine_loop import EngineLoop

    loop = EngineLoop.start(EngineConfig(model=str(tiny_checkpoint(SHAPE)), num_kv_blocks=32, data_parallel_size=2))
    group = loop.engine.group

    def broken_gather(obj):
        raise RuntimeError("injected: the step's gather failed")

    try:
        assert isinstance(loop.engine, DataParallelEngine) and loop.stopped() is None
        group.gather_step = broken_gather

        async def go():
            q = await loop.submit(Request("doomed", (5, 6, 7), SamplingParams(temperature=0, max_tokens=4)))
            return await asyncio.wait_for(q.get(), 60)

        item = asyncio.run(go())
        assert isinstance(item, EngineFailed) and "this engine has stopped" in str(item)
        assert loop.failure == "a step of its data-parallel group failed with RuntimeError"  # at once, no retries
        with pytest.raises(EngineFailed):
            asyncio.run(loop.submit(Request("after", (5, 6, 7), SamplingParams(max_tokens=2))))
    finally:
        loop.close()
        procs = list(loop.engine.ranks.procs)
        loop.engine.close()
    assert not any(p.is_alive() for p in procs)


@pytest.fixture(scope="module")
def app(tiny_checkpoint, tmp_path_factory):
    model = str(tiny_checkpoint(SHAPE))
    server = OpenAIServer(LocalBackend(serve_args(tmp_path_factory.mktemp("dp"), model), model_name="tiny"))
    yield server
    server.backend.loop.close()
    server.backend.engine.close()


def test_the_in_process_app_serves_dp2_with_the_single_engines_tokens(app, tiny_checkpoint):
    backend = app.backend
    assert isinstance(backend.engine, DataParallelEngine) and backend.engine.config.data_parallel_size == 2
    ps = [list(p) for p in prompts(6)]
    with LLM(str(tiny_checkpoint(SHAPE)), num_kv_blocks=256) as single:
        ref = [o.outputs[0].text for o in single.generate(ps, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                                               ignore_eos=True))]

    async def go():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app.app), base_url="http://test")
        async with http:
            rs = await asyncio.gather(*(http.post("/v1/completions", json={
                "model": "tiny", "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
                for p in ps))
        return rs

    rs = asyncio.run(go())
    assert [r.status_code for r in rs] == [200] * len(ps), [r.text for r in rs]
    assert [r.json()["choices"][0]["text"] for r in rs] == ref

    eng = backend.engine
    per = eng.replica_stats()
    assert len(per) == 2 and all(s.prefill_tokens_total > 0 for s in per), [s.prefill_tokens_total for s in per]
    views = backend.worker_views()  # what the app's load report reads: both replicas', summed
    assert views[0].kv_usage == 0 and sum(views[0].expert_tokens) == sum(sum(s.expert_tokens_total) for s in per)
    eng.check_invariants()
    assert not eng.has_unfinished() and eng.holds_nothing()
    counts = eng.block_counts()
    assert counts["in_use"] == 0 and counts["total"] == 128, counts
    assert eng.memory is eng.engine.memory and eng.kv is eng.engine.kv  # what a worker's describe / layout read
    with pytest.raises(ConfigError, match="data_parallel_size > 1"):
        eng.add_pulled(Request("pulled", (1, 2, 3), SamplingParams()), 4, ())


def test_the_in_process_app_serves_forced_tool_calls_and_refuses_a_bad_grammar_with_dp2(app):
    """tool_choice required (a grammar) on both replicas: tool_calls whose arguments validate; a
    grammar that does not compile for the model is the 400 one engine answers, and the app serves on."""
    tool = {"type": "function", "function": {"name": TOOL.name, "description": TOOL.description,
                                             "parameters": ARGS}}
    chats = [{"model": "tiny", "messages": [{"role": "user", "content": f"The forecast for day {i}?"}],
              "tools": [tool], "tool_choice": "required", "max_tokens": 200, "temperature": 0} for i in range(4)]
    bad = {"model": "tiny", "prompt": "x", "max_tokens": 4, "structured_outputs": {"grammar": NOT_FOR_THIS_MODEL.text}}

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app.app), base_url="http://test") as http:
            calls = await asyncio.gather(*(http.post("/v1/chat/completions", json=c) for c in chats))
            refused = await http.post("/v1/completions", json=bad)
            after = await http.post("/v1/chat/completions", json=chats[0])
        return calls, refused, after

    calls, refused, after = asyncio.run(go())
    assert [r.status_code for r in calls] == [200] * len(chats), [r.text for r in calls]
    for r in calls:
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == TOOL.name
        jsonschema.validate(json.loads(call["function"]["arguments"]), ARGS)
    assert refused.status_code == 400 and "does not compile for this model" in refused.json()["error"]["message"]
    assert after.status_code == 200
    assert [c["function"] for c in after.json()["choices"][0]["message"]["tool_calls"]] == \
        [c["function"] for c in calls[0].json()["choices"][0]["message"]["tool_calls"]]  # greedy: the same call
    eng = app.backend.engine
    assert all(n >= 1 for n in eng.on_all_replicas(_compiles)), "each replica built its own requests' grammar"
    eng.check_invariants()
    assert not eng.has_unfinished()


def test_a_replica_that_exits_stops_the_idle_serving_loop_by_name(app):
    """Last in this file: it breaks the module's app. No step has to meet the loss: the health
    check (`stopped`) sees the replica gone, and nothing more is admitted."""
    loop = app.backend.loop
    assert loop.stopped() is None

    async def waiter_hears_it():
        q = loop.watch("waiting")
        replica1 = loop.engine.ranks.procs[0]
        replica1.kill()
        replica1.join(10)
        assert loop.stopped() == "data-parallel replica 1 exited"
        return await asyncio.wait_for(q.get(), 10)

    heard = asyncio.run(waiter_hears_it())
    assert isinstance(heard, EngineFailed) and "data-parallel replica 1 exited" in str(heard)
    with pytest.raises(EngineFailed, match="data-parallel replica 1 exited"):
        asyncio.run(loop.submit(Request("after-loss", (5, 6, 7), SamplingParams(max_tokens=2))))
