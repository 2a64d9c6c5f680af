"""`splitserve serve`: bring the whole service up, say where it listens, and take it down cleanly
on Ctrl-C / SIGTERM.

Disaggregated (the default, 1 prefill + 1 decode worker): start or join a Ray cluster, create the
worker pools (progress printed as each worker loads), then deploy the ingress as a Ray Serve
application (HTTP and gRPC proxies). In-process (`--prefill 0 --decode 0`): one engine in this
process, the same HTTP app under uvicorn and the same gRPC service under grpc.aio, no Ray.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
import time

from splitserve import tracing
from splitserve.control.deploy_config import ENGINE_FLAG_KEYS
from splitserve.router.admission import AdmissionConfig
from splitserve.tracing import TraceConfig


def run_serve(args: argparse.Namespace) -> int:
    if args.prefill < 0 or args.decode < 0:
        raise ValueError("--prefill and --decode must be >= 0")
    if args.max_tokens_default is not None and args.max_tokens_default < 1:
        raise ValueError(f"--max-tokens-default must be >= 1, got {args.max_tokens_default}")
    model = args.model
    if model is None:
        from splitserve.engine.model.demo import ensure_demo_model

        model = str(ensure_demo_model())
    admission = AdmissionConfig(args.max_inflight, args.ttft_slo_ms, args.tpot_slo_ms, enabled=not args.no_admission)
    _say(f"loading {model}")
    if args.prefill == 0 and args.decode == 0:
        return _serve_in_process(args, model, admission)
    return _serve_on_ray(args, model)


def _engine_options(args: argparse.Namespace) -> dict:
    """Engine settings: the flags (the config file's values for them already folded in, see
    cli.main._with_config_file) and the rest of the file's `engine:` section."""
    engine = dict(args.engine or {})
    if "model" in engine:
        raise ValueError("set the model with --model (or `model:` at the top of the config file), not under engine:")
    return {**{k: getattr(args, k) for k in ENGINE_FLAG_KEYS}, **engine}


def _say(msg: str) -> None:
    print(f"splitserve: {msg}", flush=True)


def _say_keys(keys) -> None:
    if keys.open:
        _say("no API keys configured (--api-keys, SPLITSERVE_API_KEY): the server is open to anyone who reaches it")
    else:
        tenants = sorted({k.tenant.name for k in keys.keys})
        _say(f"API keys required: {len(keys.keys)} key(s), tenants {', '.join(tenants)}")


def _listening(args: argparse.Namespace, name: str) -> None:
    _say(f"serving {name!r}: HTTP http://{args.host}:{args.port}/v1 · gRPC {args.host}:{args.grpc_port} "
         f"(splitserve.v1.Generation) · metrics http://{args.host}:{args.port}/metrics — Ctrl-C to stop")


def deploy_options(args: argparse.Namespace, model: str) -> dict:
    """The app's args (control.deploy_config.DeployConfig keys) from the serve flags and the config file."""
    keys = ("prefill", "decode", "prefill_resources", "decode_resources", "transport", "policy",
            "disagg_min_tokens", "pd_decider", "max_inflight", "ttft_slo_ms", "tpot_slo_ms", "served_model_name",
            "ingress_replicas", "no_admission", "migration_limit", "decode_inactivity_timeout_s", "prefill_timeout_s",
            "autoscale", "api_keys", "redis_url", "max_tokens_default", "tool_call_parser", "otlp_traces_endpoint",
            "trace_sample_ratio", "pp_placement")
    engine = _engine_options(args)
    streaming = {"kv_streaming": getattr(args, "kv_streaming", "on") == "on",
                 "kv_streaming_min_tokens": getattr(args, "kv_streaming_min_tokens", 2048)}
    tp = engine.pop("tensor_parallel_size", 1)  # on a cluster each pool has its own
    pools_tp = {f"{r}_tp": getattr(args, f"{r}_tp", None) or tp for r in ("prefill", "decode")}
    pools_tp.update({f"{r}_pp": getattr(args, f"{r}_pp", None) or 1 for r in ("prefill", "decode")})
    return {"model": model, "engine": engine, **pools_tp, **streaming, **{k: getattr(args, k) for k in keys}}


def bound_grpc_messages() -> None:
    """Serve's gRPC proxy takes messages of up to 2 GiB unless told otherwise: bound them like an
    HTTP body, in the environment of a Ray this process starts (its processes inherit it). On
    a cluster we join, the nodes' environment decides (the chart sets it)."""
    from splitserve.ingress.protocol import MAX_BODY_BYTES

    os.environ.setdefault("RAY_SERVE_GRPC_MAX_MESSAGE_SIZE", str(MAX_BODY_BYTES))


def _serve_on_ray(args: argparse.Namespace, model: str) -> int:
    from ray import serve
    from ray.serve.config import gRPCOptions

    from splitserve.control import controller as controller_mod
    from splitserve.control.launch import check_files, connect_ray, local_cpus, precheck, stop_local_ray, wait_ready
    from splitserve.cli.app import GRPC_SERVICER
    from splitserve.control.deploy_config import DeployConfig
    from splitserve.cli.app import bind_app

    cfg = DeployConfig.from_options(deploy_options(args, model))
    _say_keys(cfg.api_keys)
    began = time.monotonic()
    check_files(cfg)
    bound_grpc_messages()
    started = connect_ray(args.address, local_cpus(cfg))
    _say(f"{'started a local Ray cluster' if started else 'joined the Ray cluster'}")
    try:
        precheck(cfg, joined=not started)
        serve.start(http_options={"host": args.host, "port": args.port},
                    grpc_options=gRPCOptions(port=args.grpc_port, grpc_servicer_functions=[GRPC_SERVICER]))
        _say("starting the Controller and the Ray Serve ingress")
        serve.run(bind_app(cfg, joined=not started), name=cfg.name, route_prefix="/")
        controller = controller_mod.find(cfg.name, cfg.namespace)
        # on a cluster we joined an autoscaler may add the nodes a worker waits for: say why, wait
        wait_ready(controller, lambda done, total: _say(f"workers ready {done}/{total} "
                                                        f"({time.monotonic() - began:.0f} s)"),
                   unplaced_s=10.0 if started else None, on_unplaced=lambda why: _say(f"waiting: {why}"))
        _listening(args, cfg.served_model_name or model.rstrip("/").rsplit("/", 1)[-1])
        _wait_for_signal()
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the teardown short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _say("shutting down")
        _stop_app(cfg, started)
        if started:
            stop_local_ray()
    return 0


def _stop_app(cfg, started: bool) -> None:
    """Delete the app and stop its workers (on a cluster we joined, Serve and its other apps
    stay). On a cluster we started, shutting Ray down takes everything with it, and waiting on
    Serve's controller could hang if a signal already reached Ray's worker processes."""
    from ray import serve

    from splitserve.control import controller as controller_mod
    from splitserve.orchestrator.cluster import _stop_controller

    if started:
        return
    try:
        serve.delete(cfg.name, _blocking=False)
        _stop_controller(controller_mod.find(cfg.name, cfg.namespace), cfg)
    except Exception as e:
        _say(f"stopping the app: {e}")


def _wait_for_signal() -> None:
    def stop(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)  # also when started with SIGINT ignored (a background job)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass


def _serve_in_process(args: argparse.Namespace, model: str, admission: AdmissionConfig) -> int:
    from splitserve.config import EngineConfig
    from splitserve.router.admission import Admission
    from splitserve.orchestrator.local_backend import LocalBackend
    from splitserve.ingress.http import OpenAIServer

    from splitserve.tenancy import KeyRing

    ecfg = EngineConfig.from_dict({"model": model, **_engine_options(args)})
    # one process: its spans are the ingress's and its engine's (no prefill / decode hop)
    tracing.setup(TraceConfig.resolve(args.otlp_traces_endpoint, args.trace_sample_ratio), "splitserve-ingress",
                  f"{socket.gethostname()}:{os.getpid()}")
    keys = KeyRing.from_options(args.api_keys).with_env()
    _say_keys(keys)
    limiter = stored = None
    if args.redis_url:  # one in-process server has no peers to place with, but may share limits and responses
        from splitserve.ingress.shared import RedisLink, SharedRateLimiter, SharedResponseStore

        link = RedisLink(args.redis_url)
        limiter, stored = SharedRateLimiter(link), SharedResponseStore(link)
    http = OpenAIServer(LocalBackend(ecfg, args.served_model_name), admission=Admission(admission), keys=keys,
                        limiter=limiter, max_tokens_default=args.max_tokens_default,
                        tool_call_parser=args.tool_call_parser, responses=stored)
    _listening(args, http.backend.model_name)
    asyncio.run(_run_both(http, args))
    return 0


async def _run_both(http, args: argparse.Namespace) -> None:
    """uvicorn and grpc.aio on one event loop; uvicorn owns SIGINT/SIGTERM, and when it stops
    the gRPC server gets a grace period for calls in flight."""
    import uvicorn

    from splitserve.ingress.grpc_service import GenerationService, serve

    grpc_server, _ = await serve(GenerationService(http.front), args.host, args.grpc_port)
    try:
        await uvicorn.Server(uvicorn.Config(http.app, host=args.host, port=args.port, log_level="warning")).serve()
    finally:
        await grpc_server.stop(grace=5)
        print("splitserve: stopped", file=sys.stderr, flush=True)
