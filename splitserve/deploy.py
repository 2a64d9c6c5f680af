"""`splitserve.deploy:build_app`: the Ray Serve application builder — the import path a KubeRay
RayService's `serveConfigV2` names, what `serve run splitserve.deploy:build_app model=DIR
prefill=1 decode=1` runs, and what `splitserve serve` deploys (one path, not two).

Its args are the keys of `splitserve serve --config` (config.DeployConfig: model, prefill,
decode, transport, policy, SLOs, resources, engine settings, ingress_replicas ...). Building
starts nothing: when the app's first ingress replica starts it gets or creates the app's
Controller, which creates the pools.

    applications:
      - name: splitserve
        route_prefix: /
        import_path: splitserve.deploy:build_app
        args: {model: /models/llama, prefill: 2, decode: 4, decode_resources: {decode_node: 1}}
"""

from __future__ import annotations

from typing import Any

from splitserve.config import DeployConfig


def build_app(args: dict[str, Any]):
    """Serve's application builder: exactly one parameter, the app's args."""
    return bind_app(DeployConfig.from_options(dict(args or {})))


def bind_app(cfg: DeployConfig, joined: bool = True):
    """The app for a checked config. `joined=False`: the driver started this Ray cluster, so a
    GPU asked for and absent is an error rather than something to wait for."""
    from splitserve.cli.app import Ingress

    return Ingress.options(num_replicas=cfg.ingress_replicas).bind(cfg, joined)
