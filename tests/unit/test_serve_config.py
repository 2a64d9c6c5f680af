"""`splitserve serve --config FILE.yaml`: the file's options become defaults, flags on the command
line win, unknown keys are refused with the list of known ones."""

import pytest

from splitserve.cli.main import build_parser, main


def parse(argv):
    from splitserve.cli.main import _with_config_file

    parser = build_parser()
    args = parser.parse_args(argv)
    return _with_config_file(parser, argv, args.config) if args.config else args


def test_file_sets_defaults_and_flags_win(tmp_path):
    f = tmp_path / "serve.yaml"
    f.write_text("prefill: 2\ndecode: 3\nport: 8001\npolicy: round_robin\nttft_slo_ms: 1500\n"
                 "engine: {max_num_batched_tokens: 1024}\n")
    args = parse(["serve", "--config", str(f), "--port", "9000"])
    assert (args.prefill, args.decode, args.policy, args.ttft_slo_ms) == (2, 3, "round_robin", 1500)
    assert args.port == 9000  # the command line wins
    assert args.engine == {"max_num_batched_tokens": 1024}
    assert parse(["serve"]).prefill == 1 and parse(["serve"]).engine == {}  # defaults: 1 prefill + 1 decode


def test_unknown_keys_are_refused(tmp_path, capsys):
    f = tmp_path / "serve.yaml"
    f.write_text("prefil: 2\n")
    with pytest.raises(SystemExit) as e:
        main(["serve", "--config", str(f)])
    assert "prefil" in str(e.value) and "prefill" in str(e.value)


def test_negative_pools_are_an_error(capsys):
    assert main(["serve", "--prefill", "-1"]) == 1
    assert "--prefill and --decode must be >= 0" in capsys.readouterr().err


def test_engine_flags_reach_the_engine_options(tmp_path):
    from splitserve.cli.serve import _engine_options

    args = parse(["serve", "--device", "cpu", "--attention-backend", "triton", "--dtype", "bfloat16"])
    opts = _engine_options(args)
    assert (opts["device"], opts["attention_backend"], opts["dtype"]) == ("cpu", "triton", "bfloat16")
    f = tmp_path / "serve.yaml"
    f.write_text("device: cuda\nengine: {attention_backend: torch, cuda_graphs: false}\n")
    opts = _engine_options(parse(["serve", "--config", str(f)]))
    assert (opts["device"], opts["attention_backend"], opts["cuda_graphs"]) == ("cuda", "torch", False)
    opts = _engine_options(parse(["serve", "--config", str(f), "--attention-backend", "triton"]))
    assert opts["attention_backend"] == "triton"  # the command line wins over the file's engine: too
    with pytest.raises(SystemExit):
        parse(["serve", "--attention-backend", "flash-magic"])


def test_the_app_config_reads_serve_run_strings_and_refuses_bad_values(tiny_checkpoint):
    """build_app's args arrive as strings from `serve run ... key=value`; the same keys as the
    config file; a bad key or value is a ConfigError naming it, before any actor starts."""
    from splitserve.control.deploy_config import DeployConfig
    from splitserve.types import ConfigError

    model = str(tiny_checkpoint("llama"))
    cfg = DeployConfig.from_options({"model": model, "prefill": "2", "decode": "3", "dtype": "float32",
                                     "decode_resources": '{"decode_node": 1}', "no_admission": "true",
                                     "engine": "{num_kv_blocks: 64}"})
    assert (cfg.prefill, cfg.decode, cfg.admission) == (2, 3, False)
    assert cfg.decode_resources == {"decode_node": 1} and cfg.engine == {"num_kv_blocks": 64, "dtype": "float32"}
    for bad, match in [({"prefil": 1}, "unknown option 'prefil'"), ({"decode": 0}, "decode must be an integer >= 1"),
                       ({"policy": "random"}, "unknown policy"), ({"transport": "pigeon"}, "unknown transport"),
                       ({"decode_resources": {"CPU": 1}}, "set by splitserve itself"),
                       ({"prefill_resources": {"prefill_node": -1}}, "positive amount"),
                       ({"engine": {"block_size": 3}}, "block_size"), ({"probe_timeout_s": 0}, "probe_timeout_s"),
                       ({"tensor_parallel_size": 2}, "set per pool on a cluster: prefill_tp and decode_tp"),
                       ({"decode_tp": 0}, "decode_tp must be an integer >= 1"),
                       ({"prefill_tp": 2, "host_kv_blocks": 8}, "host_kv_blocks is not supported")]:
        with pytest.raises(ConfigError, match=match):
            DeployConfig.from_options({"model": model, **bad})


def test_autoscale_flag_and_config_key_reach_the_app_config(tmp_path, tiny_checkpoint):
    """`--autoscale` alone: the default bounds; `--autoscale MAPPING` or `autoscale:` in the
    file: those; either way the app's config holds a checked AutoscaleConfig."""
    from splitserve.control.autoscale import Bounds
    from splitserve.control.deploy_config import DeployConfig
    from splitserve.cli.serve import deploy_options

    model = str(tiny_checkpoint("llama"))

    def cfg(argv):
        return DeployConfig.from_options(deploy_options(parse(argv), model))

    assert cfg(["serve"]).autoscale is None
    assert cfg(["serve", "--autoscale"]).autoscale.decode == Bounds(1, 4)
    a = cfg(["serve", "--autoscale", "{prefill: {min: 1, max: 3}, interval_s: 5}", "--ttft-slo-ms", "800"]).autoscale
    assert (a.prefill, a.interval_s, a.ttft_slo_s) == (Bounds(1, 3), 5, 0.8)
    both = cfg(["serve", "--tensor-parallel-size", "2"])  # on a cluster: each pool's size
    assert (both.prefill_tp, both.decode_tp, both.engine.get("tensor_parallel_size")) == (2, 2, None)
    own = cfg(["serve", "--tensor-parallel-size", "2", "--decode-tp", "4"])
    assert (own.prefill_tp, own.decode_tp) == (2, 4)
    f = tmp_path / "serve.yaml"
    f.write_text("autoscale: {decode: {min: 2, max: 6}, down_cooldown_s: 300}\n")
    a = cfg(["serve", "--config", str(f)]).autoscale
    assert (a.decode, a.down_cooldown_s) == (Bounds(2, 6), 300)


def test_max_tokens_default_flag_and_config_key_reach_the_app_config(tmp_path, tiny_checkpoint):
    """--max-tokens-default / `max_tokens_default:` reach the app's config, checked; the model's
    generation_config.json max_new_tokens is read as its own default."""
    import json

    from splitserve.control.deploy_config import DeployConfig
    from splitserve.engine.model.config import ModelConfig
    from splitserve.cli.serve import deploy_options
    from splitserve.types import ConfigError

    model = str(tiny_checkpoint("llama"))

    def cfg(argv):
        return DeployConfig.from_options(deploy_options(parse(argv), model))

    assert cfg(["serve"]).max_tokens_default is None
    assert cfg(["serve", "--max-tokens-default", "300"]).max_tokens_default == 300
    f = tmp_path / "serve.yaml"
    f.write_text("max_tokens_default: 128\n")
    assert cfg(["serve", "--config", str(f)]).max_tokens_default == 128
    with pytest.raises(ConfigError, match="max_tokens_default must be an integer >= 1"):
        cfg(["serve", "--max-tokens-default", "0"])
    gen = {"max_new_tokens": 99, "do_sample": False}
    assert ModelConfig.from_hf(json.loads((tiny_checkpoint("llama") / "config.json").read_text()), gen).max_new_tokens == 99


def test_pipeline_parallel_pools_are_checked_and_reach_the_engine_config(tmp_path, tiny_checkpoint):
    """decode_pp / prefill_pp: integers >= 1; pipeline_parallel_size is set per pool on a cluster;
    beside a prefill pool (the KV handed off by stage) no TP group meets a PP worker and nixl is
    refused; pp_placement is pack or spread, and spread refuses stages of several ranks. The
    pool's EngineConfig gets the stages, and the worker's placement group one bundle per
    stage x TP rank."""
    from splitserve.cli.serve import deploy_options
    from splitserve.control.actors import worker_placement
    from splitserve.control.deploy_config import DeployConfig
    from splitserve.types import ConfigError, Role

    model = str(tiny_checkpoint("llama"))
    for bad, match in [({"decode_pp": 0}, "decode_pp must be an integer >= 1"),
                       ({"prefill_pp": "x"}, "prefill_pp must be an integer >= 1"),
                       ({"engine": {"pipeline_parallel_size": 2}}, "set per pool on a cluster: prefill_pp and decode_pp"),
                       ({"prefill_pp": 2, "decode_tp": 2}, "prefill_pp 2 with decode_tp 2 beside a prefill pool: "
                                                            "the KV handoff by pipeline stage"),
                       ({"decode_pp": 2, "decode_tp": 2}, "decode_pp 2 with decode_tp 2 beside a prefill pool"),
                       ({"decode_pp": 2, "prefill_tp": 2}, "decode_pp 2 with prefill_tp 2 beside a prefill pool"),
                       ({"decode_pp": 2, "decode_tp": 2, "prefill": 0,
                         "autoscale": {"prefill": {"min": 0, "max": 2}}}, "beside a prefill pool"),
                       ({"prefill_pp": 2, "transport": "nixl"}, "moves over shm or tcp"),
                       ({"pp_placement": "far"}, "pp_placement must be one of pack, spread"),
                       ({"decode_pp": 2, "decode_tp": 2, "prefill": 0, "pp_placement": "spread"},
                        "would spread each stage's tensor-parallel ranks too"),
                       ({"decode_pp": 2, "prefill": 0, "host_kv_blocks": 8}, "host_kv_blocks is not supported")]:
        with pytest.raises(ConfigError, match=match):
            DeployConfig.from_options({"model": model, **bad})
    cfg = DeployConfig.from_options({"model": model, "prefill": 0, "decode_pp": 2, "decode_tp": 2,
                                     "engine": {"pipeline_micro_batches": 2}})
    assert (cfg.decode_pp, cfg.prefill_pp, cfg.ranks(0, 3)) == (2, 1, 12)
    p = worker_placement(cfg, Role.DECODE, ["shm", "tcp"], 0.0)
    assert (p.engine.pipeline_parallel_size, p.engine.tensor_parallel_size, p.engine.pipeline_micro_batches) == (2, 2, 2)
    pp_only = DeployConfig.from_options({"model": model, "prefill": 0, "decode_pp": 2})
    with pytest.raises(ConfigError, match="each pipeline stage needs a GPU of its own"):
        worker_placement(pp_only, Role.DECODE, ["tcp"], 0.5)
    assert worker_placement(cfg, Role.PREFILL, ["tcp"], 0.0).engine.pipeline_micro_batches == 1  # no stages there
    auto = DeployConfig.from_options({"model": model, "prefill": 0, "decode_pp": 2,
                                      "autoscale": {"prefill": {"min": 0, "max": 0}}})
    assert auto.decode_pp == 2
    flags = DeployConfig.from_options(deploy_options(parse(["serve", "--prefill", "0", "--decode-pp", "2"]), model))
    assert (flags.prefill, flags.prefill_pp, flags.decode_pp) == (0, 1, 2)
    staged = DeployConfig.from_options(deploy_options(parse(["serve", "--prefill-pp", "2", "--decode-pp", "2"]), model))
    assert (staged.prefill, staged.prefill_pp, staged.decode_pp, staged.pp_placement) == (1, 2, 2, "pack")
    spread = DeployConfig.from_options(deploy_options(parse(["serve", "--prefill-pp", "2", "--pp-placement", "spread"]),
                                                      model))
    assert spread.pp_placement == "spread"
    assert worker_placement(spread, Role.PREFILL, ["tcp"], 0.0).engine.pipeline_parallel_size == 2
    f = tmp_path / "serve.yaml"
    f.write_text("prefill: 0\ndecode_pp: 2\npp_placement: spread\n")
    file = DeployConfig.from_options(deploy_options(parse(["serve", "--config", str(f)]), model))
    assert (file.prefill, file.decode_pp, file.pp_placement) == (0, 2, "spread")
