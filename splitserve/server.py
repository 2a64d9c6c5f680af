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
import signal
import sys
import time

from splitserve.cli import ENGINE_FLAGS
from splitserve.router.admission import AdmissionConfig


def run_serve(args: argparse.Namespace) -> int:
    if args.prefill < 0 or args.decode < 0:
        raise ValueError("--prefill and --decode must be >= 0")
    model = args.model
    if model is None:
        from splitserve.demo import ensure_demo_model

        model = str(ensure_demo_model())
    admission = AdmissionConfig(args.max_inflight, args.ttft_slo_ms, args.tpot_slo_ms, enabled=not args.no_admission)
    _say(f"loading {model}")
    if args.prefill == 0 and args.decode == 0:
        return _serve_in_process(args, model, admission)
    return _serve_on_ray(args, model, admission)


def _engine_options(args: argparse.Namespace) -> dict:
    """Engine settings: the flags (the config file's values for them already folded in, see
    cli._with_config_file) and the rest of the file's `engine:` section."""
    engine = dict(args.engine or {})
    if "model" in engine:
        raise ValueError("set the model with --model (or `model:` at the top of the config file), not under engine:")
    return {**{k: getattr(args, k) for k in ENGINE_FLAGS}, **engine}


def _say(msg: str) -> None:
    print(f"splitserve: {msg}", flush=True)


def _listening(args: argparse.Namespace, name: str) -> None:
    _say(f"serving {name!r}: HTTP http://{args.host}:{args.port}/v1 · gRPC {args.host}:{args.grpc_port} "
         f"(splitserve.v1.Generation) · metrics http://{args.host}:{args.port}/metrics — Ctrl-C to stop")


def _serve_on_ray(args: argparse.Namespace, model: str, admission: AdmissionConfig) -> int:
    from splitserve.cluster import Cluster
    from splitserve.cluster.serve_app import run_serve_app, stop_serve_app

    started = time.monotonic()
    cluster = Cluster.start(model=model, prefill=args.prefill, decode=max(1, args.decode), transport=args.transport,
                            disagg_min_tokens=args.disagg_min_tokens, address=args.address, policy=args.policy,
                            on_ready=lambda done, total: _say(f"workers ready {done}/{total} "
                                                              f"({time.monotonic() - started:.0f} s)"),
                            **_engine_options(args))
    try:
        _say("starting the Ray Serve ingress")
        run_serve_app(cluster, admission, args.served_model_name, args.host, args.port, args.grpc_port)
        _listening(args, args.served_model_name or model.rstrip("/").rsplit("/", 1)[-1])
        _wait_for_signal()
    finally:
        _say("shutting down")
        try:
            if args.address is not None:
                stop_serve_app()
        finally:
            cluster.shutdown()
    return 0


def _wait_for_signal() -> None:
    def stop(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass


def _serve_in_process(args: argparse.Namespace, model: str, admission: AdmissionConfig) -> int:
    from splitserve.config import EngineConfig
    from splitserve.router.admission import Admission
    from splitserve.router.backend import LocalBackend
    from splitserve.router.http import OpenAIServer

    ecfg = EngineConfig.from_dict({"model": model, **_engine_options(args)})
    http = OpenAIServer(LocalBackend(ecfg, args.served_model_name), admission=Admission(admission))
    _listening(args, http.backend.model_name)
    asyncio.run(_run_both(http, args))
    return 0


async def _run_both(http, args: argparse.Namespace) -> None:
    """uvicorn and grpc.aio on one event loop; uvicorn owns SIGINT/SIGTERM, and when it stops
    the gRPC server gets a grace period for calls in flight."""
    import uvicorn

    from splitserve.router.grpc_service import GenerationService, serve

    grpc_server, _ = await serve(GenerationService(http.front), args.host, args.grpc_port)
    try:
        await uvicorn.Server(uvicorn.Config(http.app, host=args.host, port=args.port, log_level="warning")).serve()
    finally:
        await grpc_server.stop(grace=5)
        print("splitserve: stopped", file=sys.stderr, flush=True)
