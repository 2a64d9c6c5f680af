"""The ingress as a Ray Serve application (DESIGN.md §4 "Ray") and its builder, `build_app` — the
import path a KubeRay RayService's `serveConfigV2` names (`splitserve.deploy:build_app`, a shim to
this one), what `serve run splitserve.deploy:build_app model=DIR prefill=1 decode=1` runs, and what
`splitserve serve` deploys (one path, not two). Its args are the keys of `splitserve serve
--config` (DeployConfig: model, pools, transport, policy, SLOs, resources, engine settings,
ingress_replicas ...). Building starts nothing:

    applications:
      - name: splitserve
        route_prefix: /
        import_path: splitserve.deploy:build_app
        args: {model: /models/llama, prefill: 2, decode: 4, decode_resources: {decode_node: 1}}

`Ingress` replicas (as many as
`ingress_replicas`) each hold a router — a `ClusterBackend` over the registry of the app's
Controller, its own KV index and worker views — and answer HTTP through Serve's HTTP proxy
(the OpenAI ASGI app) and gRPC through Serve's gRPC proxy (`Generate` / `Health`).

A replica starting gets or creates the app's Controller (which creates the pools) and attaches
to it as an owner; a replica stopping detaches, and when the app is deleted the last one
leaving makes the Controller stop every worker.
"""

from __future__ import annotations

import uuid
from typing import Any

import ray
from ray import serve

from splitserve import tracing
from splitserve.control import controller as controller_mod
from splitserve.orchestrator.cluster_backend import ClusterBackend, ControllerSource
from splitserve.control.deploy_config import DeployConfig
from splitserve.router.admission import Admission, AdmissionConfig
from splitserve.ingress.grpc_service import GenerationService, RpcFailure
from splitserve.ingress.http import OpenAIServer

GRPC_SERVICER = "splitserve.v1.generation_pb2_grpc.add_GenerationServicer_to_server"


def admission_config(cfg: DeployConfig) -> AdmissionConfig:
    return AdmissionConfig(cfg.max_inflight, cfg.ttft_slo_ms, cfg.tpot_slo_ms, enabled=cfg.admission)


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096)
@serve.ingress()
class Ingress:
    async def __init__(self, cfg: DeployConfig, joined: bool = True) -> None:
        self.owner = uuid.uuid4().hex
        tracing.setup(cfg.trace, "splitserve-ingress", f"ingress:{ray.get_runtime_context().get_actor_id()}")
        self.controller = controller_mod.get_or_create(cfg, joined)
        # with this replica's actor, which the Controller watches: a replica killed before its
        # __del__ could detach (or whose detach never left the dying process) still lets go
        await self.controller.attach.remote(self.owner, ray.get_runtime_context().current_actor)  # (again on its restart)
        await self.controller.configure.remote(cfg)
        await self.controller.start.remote()
        me = (self.owner, ray.get_runtime_context().current_actor)
        self.backend = ClusterBackend(cfg, ControllerSource(self.controller, owner=me))
        await self.backend.start()
        limiter = stored = None
        if self.backend.redis is not None:  # every replica charges the same buckets, keeps the same responses
            from splitserve.ingress.shared import SharedRateLimiter, SharedResponseStore

            limiter, stored = SharedRateLimiter(self.backend.redis), SharedResponseStore(self.backend.redis)
        self.http = OpenAIServer(self.backend, admission=Admission(admission_config(cfg)), keys=cfg.api_keys,
                                 limiter=limiter, max_tokens_default=cfg.max_tokens_default,
                                 tool_call_parser=cfg.tool_call_parser, responses=stored)
        self.grpc = GenerationService(self.http.front)

    def __serve_build_asgi_app__(self):
        return self.http.app

    async def Generate(self, request, grpc_context):  # noqa: N802 (the gRPC method's name)
        trailing: list = []
        try:
            async for msg in self.grpc.generate_traced(request, grpc_context.invocation_metadata(), trailing):
                yield msg
            grpc_context.set_trailing_metadata(trailing)
        except RpcFailure as f:  # Serve's proxy sends the code set here as the call's status
            grpc_context.set_code(f.code)
            grpc_context.set_details(f.details)
            grpc_context.set_trailing_metadata(list(f.trailing_metadata()) + trailing)
            raise

    async def Health(self, request, grpc_context=None):  # noqa: N802
        return self.grpc.health()

    def __del__(self) -> None:
        # Serve calls this when the replica stops (the app deleted, or scaled down); fire and
        # forget, so it also works when the interpreter collects the object.
        owner, self.owner = getattr(self, "owner", None), None
        if owner is None:
            return
        if getattr(self, "backend", None) is not None:
            self.backend.stop()
        try:
            self.controller.detach.remote(owner)
        except Exception:
            pass


def build_app(args: dict[str, Any]):
    """Serve's application builder: exactly one parameter, the app's args."""
    return bind_app(DeployConfig.from_options(dict(args or {})))


def bind_app(cfg: DeployConfig, joined: bool = True):
    """The app for a checked config. `joined=False`: the driver started this Ray cluster, so a
    GPU asked for and absent is an error rather than something to wait for."""
    return Ingress.options(num_replicas=cfg.ingress_replicas).bind(cfg, joined)
