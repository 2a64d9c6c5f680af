"""The ingress as a Ray Serve application (DESIGN.md §3 "Ray"): one deployment whose replica holds
the router (a `Cluster` view over the worker actors: KV index, placement, admission) and answers
HTTP through Serve's HTTP proxy (the OpenAI ASGI app) and gRPC through Serve's gRPC proxy
(`Generate` / `Health`, reflection on). A KubeRay `RayService` deploys and upgrades it like
any Serve app.

`run_serve_app` is what `splitserve serve` calls once the worker pools exist: it starts Serve
with both proxies and deploys the app at route prefix "/" (the gRPC proxy only sees apps that
have one).
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.config import gRPCOptions

from splitserve.cluster.cluster import Cluster, ClusterConfig
from splitserve.router.admission import Admission, AdmissionConfig
from splitserve.router.backend import ClusterBackend
from splitserve.router.grpc_service import GenerationService, RpcFailure
from splitserve.router.http import OpenAIServer

APP_NAME = "splitserve"
GRPC_SERVICER = "splitserve.v1.generation_pb2_grpc.add_GenerationServicer_to_server"


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096)
@serve.ingress()
class Ingress:
    def __init__(self, cfg: ClusterConfig, prefills: list, decodes: list, readers: list,
                 admission: AdmissionConfig, model_name: str | None) -> None:
        cluster = Cluster(cfg, prefills, decodes, started_ray=False, readers=readers)
        self.http = OpenAIServer(ClusterBackend(cluster, model_name), admission=Admission(admission))
        self.grpc = GenerationService(self.http.front)

    def __serve_build_asgi_app__(self):
        return self.http.app

    async def Generate(self, request, grpc_context):  # noqa: N802 (the gRPC method's name)
        try:
            async for msg in self.grpc.generate(request):
                yield msg
        except RpcFailure as f:  # Serve's proxy sends the code set here as the call's status
            grpc_context.set_code(f.code)
            grpc_context.set_details(f.details)
            grpc_context.set_trailing_metadata(list(f.trailing_metadata()))
            raise

    async def Health(self, request, grpc_context=None):  # noqa: N802
        return self.grpc.health()


def run_serve_app(cluster: Cluster, admission: AdmissionConfig, model_name: str | None, host: str, http_port: int,
                  grpc_port: int) -> Any:
    """Start Serve (HTTP on host:http_port, gRPC on grpc_port) and deploy the ingress over
    `cluster`'s workers; returns the app's handle once it is running."""
    serve.start(http_options={"host": host, "port": http_port},
                grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=[GRPC_SERVICER]))
    app = Ingress.bind(cluster.cfg, cluster.prefills, cluster.decodes, cluster.readers, admission, model_name)
    return serve.run(app, name=APP_NAME, route_prefix="/")


def stop_serve_app() -> None:
    """Delete the app from a cluster we joined (Serve and its other apps stay). On a cluster we
    started there is nothing to do here: shutting Ray down takes Serve with it, and waiting on
    Serve's controller could hang if a signal already reached Ray's worker processes."""
    serve.delete(APP_NAME, _blocking=False)
