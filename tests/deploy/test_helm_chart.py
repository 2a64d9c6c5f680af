"""The Helm chart (deploy/helm/splitserve): lint, what it renders for each case of the matrix,
that its Serve args are a DeployConfig splitserve accepts and agree with the pods they run on,
and that broken values are refused before anything reaches a cluster."""

from __future__ import annotations

import dataclasses
import importlib
import json
import re
import subprocess
from pathlib import Path

import pytest

from splitserve.config import EngineConfig

from splitserve.control.deploy_config import DeployConfig

from .chart import CHART, NAMESPACE, Case, Rendered, helm_template

MODEL_MOUNT = "/models"


@pytest.mark.parametrize("values", [None, "values-cpu-demo.yaml", "values-gpu.yaml"])
def test_lint(helm: Path, values: str | None) -> None:
    args = [str(helm), "lint", "--strict", str(CHART), "--namespace", NAMESPACE]
    if values:
        args += ["-f", str(CHART / values)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_renders_what_it_should(rendered: Rendered) -> None:
    v = rendered.case.values()
    kinds = sorted(d["kind"] for d in rendered.docs)
    expected = (["RayService", "Service", "Service"] + (["ServiceMonitor"] if v["metrics"]["serviceMonitor"]["enabled"] else [])
                + ["PodDisruptionBudget"] * (2 if v["podDisruptionBudget"]["enabled"] else 0)
                + (["NetworkPolicy"] if v["networkPolicy"]["enabled"] else [])
                + (["ConfigMap"] if v["metrics"]["grafanaDashboard"]["enabled"] else []))
    assert kinds == sorted(expected)
    for d in rendered.docs:
        assert d["metadata"]["namespace"] == NAMESPACE
        assert d["metadata"]["labels"]["app.kubernetes.io/instance"] == "splitserve"
    rs = rendered.rayservice
    assert rs["apiVersion"] == "ray.io/v1"
    spec = rs["spec"]["rayClusterConfig"]
    assert spec["rayVersion"] == v["rayVersion"]
    assert [g["groupName"] for g in spec["workerGroupSpecs"]] == ["prefill", "decode"]
    assert spec["enableInTreeAutoscaling"] is v["rayAutoscaler"]["enabled"]
    if v["rayAutoscaler"]["enabled"]:
        opts = spec["autoscalerOptions"]
        assert opts["idleTimeoutSeconds"] == v["rayAutoscaler"]["idleTimeoutSeconds"]
        assert opts["upscalingMode"] == v["rayAutoscaler"]["upscalingMode"]
        assert opts["resources"] == v["rayAutoscaler"]["resources"]
    else:
        assert "autoscalerOptions" not in spec


def _deploy_config(args: dict, tmp_path: Path) -> DeployConfig:
    """DeployConfig.from_options over the rendered args, the model being a directory here: the
    chart's is a path inside the pod (or absent: the demo model, which would be built)."""
    local = dict(args)
    local["model"] = str(tmp_path / "model")
    Path(local["model"]).mkdir()
    if "api_keys" in local:  # the key file of the operator's Secret, as mounted in the head pod
        assert local["api_keys"].startswith("/etc/splitserve/api-keys/")
        keys = tmp_path / "keys.yaml"
        keys.write_text("keys:\n  - {key_sha256: " + "ab" * 32 + ", tenant: alpha}\n")
        local["api_keys"] = str(keys)
    if "kv_secret_file" in local:  # likewise the KV secret's
        assert local["kv_secret_file"].startswith("/etc/splitserve/kv-secret/")
        kv = tmp_path / "kv_secret"
        kv.write_text("cd" * 32 + "\n")
        local["kv_secret_file"] = str(kv)
    return DeployConfig.from_options(local)


def test_serve_args_are_a_deploy_config(rendered: Rendered, tmp_path: Path) -> None:
    args, v = rendered.args, rendered.case.values()
    fields = {f.name for f in dataclasses.fields(DeployConfig)}
    assert set(args) <= fields | {"autoscale"}, f"not DeployConfig fields: {set(args) - fields}"
    assert set(args["engine"]) <= {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}
    if "autoscale" not in fields:  # the autoscaler's config not in DeployConfig yet: check the rest
        args = {k: a for k, a in args.items() if k != "autoscale"}
    cfg = _deploy_config(args, tmp_path)

    assert (cfg.prefill, cfg.decode) == (v["prefill"]["replicas"], v["decode"]["replicas"])
    assert cfg.prefill_resources == {v["prefill"]["rayResource"]: 1}
    assert cfg.decode_resources == {v["decode"]["rayResource"]: 1}
    assert cfg.ingress_replicas == v["serve"]["ingressReplicas"]
    assert (cfg.policy, cfg.transport) == (v["serve"]["policy"], v["serve"]["transport"])
    assert cfg.ttft_slo_ms == v["serve"].get("ttftSloMs") and cfg.tpot_slo_ms == v["serve"].get("tpotSloMs")
    assert cfg.max_tokens_default == v["serve"].get("maxTokensDefault")
    assert cfg.otlp_traces_endpoint == v["serve"].get("otlpTracesEndpoint")
    ratio = v["serve"].get("traceSampleRatio")  # (`--set` gives a number as a string)
    assert cfg.trace_sample_ratio == (None if ratio is None else float(ratio))
    assert (cfg.kv_streaming, cfg.kv_streaming_min_tokens) == (v["serve"]["kvStreaming"], v["serve"]["kvStreamingMinTokens"])
    spec = {"speculative": v["serve"]["speculative"]} if v["serve"].get("speculative") is not None else {}
    assert cfg.engine == {**{k: e for k, e in v["serve"]["engine"].items() if e is not None}, **spec}
    assert "speculative" not in cfg.pool_engine("prefill") or spec["speculative"]["method"] == "draft"  # decode's alone
    assert cfg.name == rendered.serve_config["applications"][0]["name"]  # `splitserve status --name` default
    if v["model"]["servedName"]:
        assert cfg.served_model_name == v["model"]["servedName"]


def test_autoscale_arg_bounds_are_the_worker_groups(rendered: Rendered, tmp_path: Path) -> None:
    args, v = rendered.args, rendered.case.values()
    if not v["autoscale"]["enabled"]:
        assert "autoscale" not in args
        return
    a = v["autoscale"]
    assert args["autoscale"] == {
        "prefill": {"min": v["prefill"]["minReplicas"], "max": v["prefill"]["maxReplicas"]},
        "decode": {"min": v["decode"]["minReplicas"], "max": v["decode"]["maxReplicas"]},
        "interval_s": a["intervalS"], "up_cooldown_s": a["upCooldownS"], "down_cooldown_s": a["downCooldownS"]}
    for role in ("prefill", "decode"):
        g = rendered.group(role)
        assert (g["minReplicas"], g["maxReplicas"]) == (args["autoscale"][role]["min"], args["autoscale"][role]["max"])
    if "autoscale" in {f.name for f in dataclasses.fields(DeployConfig)}:
        cfg = _deploy_config(args, tmp_path)
        assert (cfg.autoscale.prefill.min, cfg.autoscale.prefill.max) == (v["prefill"]["minReplicas"],
                                                                          v["prefill"]["maxReplicas"])
        assert (cfg.autoscale.decode.min, cfg.autoscale.decode.max) == (v["decode"]["minReplicas"],
                                                                        v["decode"]["maxReplicas"])
        assert cfg.autoscale.interval_s == a["intervalS"]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Ray Serve's own pydantic v1-style fields
def test_serve_config_is_what_ray_serve_reads(rendered: Rendered) -> None:
    from ray.serve.schema import ServeDeploySchema

    from splitserve.cli.app import GRPC_SERVICER, Ingress

    schema = ServeDeploySchema.model_validate(rendered.serve_config)
    assert (schema.http_options.host, schema.http_options.port) == ("0.0.0.0", 8000)
    assert schema.grpc_options.port == 50051
    assert schema.grpc_options.grpc_servicer_functions == [GRPC_SERVICER]
    module, fn = GRPC_SERVICER.rsplit(".", 1)
    assert callable(getattr(importlib.import_module(module), fn))
    (app,) = schema.applications
    assert (app.name, app.route_prefix, app.import_path) == ("splitserve", "/", "splitserve.deploy:build_app")
    module, fn = app.import_path.split(":")
    assert callable(getattr(importlib.import_module(module), fn))

    # The Ingress replicas are pinned to the head by its custom resource; a config's
    # ray_actor_options replace the code's, so the rest must stay what the code says.
    (ingress,) = app.deployments
    assert ingress.name == Ingress.name
    code = Ingress.ray_actor_options
    assert ingress.ray_actor_options.num_cpus == code.get("num_cpus")
    head = rendered.case.values()["head"]["rayResource"]
    assert ingress.ray_actor_options.resources == {head: 1}
    units = _ray_start_resources(rendered.group("head"))[head]
    assert units >= rendered.args["ingress_replicas"]


def _ray_start_resources(group: dict) -> dict:
    """rayStartParams.resources read the way Ray's KubeRay autoscaler reads it: outer quotes
    dropped, backslashes removed, JSON (autoscaling_config._get_custom_resources)."""
    text = group["rayStartParams"]["resources"]
    assert text.startswith('"') and text.endswith('"'), text
    return json.loads(text[1:-1].replace("\\", ""))


def test_worker_groups_agree_with_the_args(rendered: Rendered) -> None:
    args, v = rendered.args, rendered.case.values()
    for role in ("prefill", "decode"):
        g, want = rendered.group(role), v[role]
        assert _ray_start_resources(g) == args[f"{role}_resources"] == {want["rayResource"]: 1}
        assert g["replicas"] == args[role] == want["replicas"]
        assert args[f"{role}_tp"] == want.get("tp", 1)  # ranks per worker, one GPU each on a GPU pool
        assert args[f"{role}_pp"] == want.get("pp", 1)  # pipeline stages per worker
        assert (g["minReplicas"], g["maxReplicas"]) == (want["minReplicas"], want["maxReplicas"])
        pod = g["template"]["spec"]
        (container,) = pod["containers"]
        limits = container["resources"]["limits"]
        if want["gpus"]:
            assert limits["nvidia.com/gpu"] == str(want["gpus"])
        else:
            assert "nvidia.com/gpu" not in limits
        for k in ("cpu", "memory"):
            assert limits[k] == want["resources"]["limits"][k]
        assert pod.get("nodeSelector", {}) == want.get("nodeSelector", {})
        assert pod.get("tolerations", []) == want.get("tolerations", [])
        assert g["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == role
    head = rendered.group("head")
    assert head["rayStartParams"]["num-gpus"] == "0"
    assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0"
    (container,) = head["template"]["spec"]["containers"]
    assert not any("gpu" in k for k in container["resources"].get("limits", {}))
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"gcs-server": 6379, "dashboard": 8265, "client": 10001, "serve": 8000, "grpc": 50051,
                     "metrics": 8080}


def test_pod_templates_carry_only_stable_labels(rendered: Rendered) -> None:
    # A changed pod template makes KubeRay build a new Ray cluster: nothing version-dependent there.
    for name in ("head", "prefill", "decode"):
        labels = rendered.group(name)["template"]["metadata"]["labels"]
        assert not {"helm.sh/chart", "app.kubernetes.io/version"} & set(labels)


@pytest.mark.parametrize("component,ports", [("api", {"http": 8000, "grpc": 50051}),
                                               ("metrics", {"http-metrics": 8000, "ray-metrics": 8080})])
def test_services_select_the_serving_head(rendered: Rendered, component: str, ports: dict) -> None:
    """The API Service carries the API ports only; the metrics (splitserve's at /metrics on the
    HTTP port, Ray's on 8080) are a Service of their own. Both select the serving head alone."""
    svc = rendered.service(component)
    head = rendered.group("head")["template"]
    # What KubeRay adds to the head pod of a RayService's cluster once its Serve proxy is healthy.
    head_labels = {**head["metadata"]["labels"], "ray.io/node-type": "head", "ray.io/serve": "true"}
    selector = svc["spec"]["selector"]
    assert selector.items() <= head_labels.items()
    assert {"ray.io/node-type", "ray.io/serve"} <= set(selector)
    for role in ("prefill", "decode"):
        worker_labels = {**rendered.group(role)["template"]["metadata"]["labels"], "ray.io/node-type": "worker",
                         "ray.io/serve": "true"}
        assert not selector.items() <= worker_labels.items()
    container_ports = {p["name"]: p["containerPort"] for p in head["spec"]["containers"][0]["ports"]}
    got = {p["name"]: p for p in svc["spec"]["ports"]}
    assert {n: p["port"] for n, p in got.items()} == ports
    assert all(container_ports[p["targetPort"]] == p["port"] for p in got.values())


def test_service_monitor_scrapes_the_metrics_service(rendered: Rendered) -> None:
    """The ServiceMonitor reads the metrics Service; with a bearer-token Secret named, its
    /metrics scrape presents that key (the operator's), from the Secret, never inline."""
    v = rendered.case.values()["metrics"]["serviceMonitor"]
    monitors = rendered.all("ServiceMonitor")
    if not v["enabled"]:
        assert monitors == []
        return
    (sm,) = monitors
    svc = rendered.service("metrics")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert not sm["spec"]["selector"]["matchLabels"].items() <= rendered.service("api")["metadata"]["labels"].items()
    assert sm["spec"]["namespaceSelector"]["matchNames"] == [NAMESPACE]
    assert sm["metadata"]["labels"].items() >= v["labels"].items()
    endpoints = {e["port"]: e for e in sm["spec"]["endpoints"]}
    assert set(endpoints) == {p["name"] for p in svc["spec"]["ports"]} == {"http-metrics", "ray-metrics"}
    assert all(e["path"] == "/metrics" and e["interval"] == v["interval"] for e in endpoints.values())
    token = v["bearerTokenSecret"]
    if token["name"]:
        assert endpoints["http-metrics"]["authorization"] == {"type": "Bearer", "credentials": dict(token)}
    else:
        assert "authorization" not in endpoints["http-metrics"]
    assert "authorization" not in endpoints["ray-metrics"]  # Ray's has none: the NetworkPolicy decides


def test_the_dashboard_configmap_carries_the_repos_dashboard(rendered: Rendered) -> None:
    """The ConfigMap Grafana's sidecar loads: the sidecar's label, the folder annotation when
    one is asked for, and the dashboard JSON byte for byte as the repo holds it."""
    v = rendered.case.values()["metrics"]["grafanaDashboard"]
    maps = rendered.all("ConfigMap")
    if not v["enabled"]:
        assert maps == []
        return
    (cm,) = maps
    assert cm["metadata"]["labels"][v["label"]] == v["labelValue"]
    assert cm["metadata"].get("annotations", {}).get("grafana_folder", "") == v["folder"]
    shipped = (CHART / "dashboards" / "splitserve.json").read_text()
    assert json.loads(cm["data"]["splitserve.json"]) == json.loads(shipped)


def test_model_volume_on_every_pod(rendered: Rendered) -> None:
    m, args = rendered.case.values()["model"], rendered.args
    volume = "pvc" if m["pvc"]["claimName"] else "hostPath" if m["hostPath"] else None
    for name in ("head", "prefill", "decode"):
        pod = rendered.group(name)["template"]["spec"]
        mounts = [m for m in pod["containers"][0].get("volumeMounts", []) if m["name"] == "model"]
        models = [v for v in pod.get("volumes", []) if v["name"] == "model"]
        if volume is None:
            assert models == [] and mounts == []
            continue
        (vol,) = models
        assert mounts == [{"name": vol["name"], "mountPath": MODEL_MOUNT, "readOnly": True}]
        if volume == "pvc":
            assert vol["persistentVolumeClaim"] == {"claimName": m["pvc"]["claimName"], "readOnly": True}
        else:
            assert vol["hostPath"] == {"path": m["hostPath"], "type": "Directory"}
    if volume:
        assert args["model"] == (f"{MODEL_MOUNT}/{m['subPath'].strip('/')}" if m["subPath"] else MODEL_MOUNT)
    elif m["path"]:
        assert args["model"] == m["path"]
    else:
        assert "model" not in args  # the demo model


def test_gcs_fault_tolerance_only_when_asked(rendered: Rendered) -> None:
    """KubeRay's gcsFaultToleranceOptions from the values (the CRD tests check its schema)."""
    ft = rendered.case.values()["gcsFaultTolerance"]
    got = rendered.rayservice["spec"]["rayClusterConfig"].get("gcsFaultToleranceOptions")
    if not ft["enabled"]:
        assert got is None
        return
    want = {"redisAddress": ft["redisAddress"]}
    if ft["redisPasswordSecret"]["name"]:
        want["redisPassword"] = {"valueFrom": {"secretKeyRef": dict(ft["redisPasswordSecret"])}}
    if ft["externalStorageNamespace"]:
        want["externalStorageNamespace"] = ft["externalStorageNamespace"]
    assert got == want


def test_ray_token_auth_is_on_unless_turned_off(rendered: Rendered) -> None:
    """Ray's token auth (KubeRay's authOptions) in every rendering but the one that turns it off:
    the default, and every values file, lock the cluster (issue 31)."""
    auth = rendered.case.values()["rayAuth"]
    got = rendered.rayservice["spec"]["rayClusterConfig"].get("authOptions")
    if auth["mode"] == "disabled":
        assert got is None
        return
    assert got == {"mode": "token", **({"secretName": auth["secretName"]} if auth["secretName"] else {})}


@pytest.mark.parametrize("values_key,volume,arg,kind", [("apiKeys", "api-keys", "api_keys", "a key file"),
                                                           ("kvSecret", "kv-secret", "kv_secret_file", "the KV secret")])
def test_secrets_come_from_the_operators_secret(rendered: Rendered, values_key, volume, arg, kind) -> None:
    """apiKeys / kvSecret secretName: the Secret mounted read-only on the head only, the file in
    it the app's arg; the rendering holds the Secret's name, never its content."""
    v = rendered.case.values()[values_key]
    head = rendered.group("head")["template"]["spec"]
    vols = {x["name"]: x for x in head["volumes"]}
    if not v["secretName"]:
        assert volume not in vols and arg not in rendered.args
        return
    assert vols[volume]["secret"] == {"secretName": v["secretName"]}
    (mount,) = [m for m in head["containers"][0]["volumeMounts"] if m["name"] == volume]
    assert mount["readOnly"] is True and rendered.args[arg] == f"{mount['mountPath']}/{v['key']}", kind
    for role in ("prefill", "decode"):
        assert volume not in {x["name"] for x in rendered.group(role)["template"]["spec"]["volumes"]}


SECRET_NAME = re.compile(r"(?i)(secret|password|passwd|api_?keys?|credential|(^|_)token$)")  # not max_tokens


def inline_secrets(rendered: Rendered) -> list[str]:
    """Where a rendered object other than a Secret holds a secret's value rather than a
    reference to one: an env var or a Serve arg named like a secret with a literal value, or
    an API key file's content inlined in the args."""
    found = []
    for doc in rendered.docs:
        if doc["kind"] == "Secret":
            continue
        for path, env in _walk_env(doc):
            if SECRET_NAME.search(env["name"]) and "value" in env:
                found.append(f"{doc['kind']} {path}: env {env['name']}")
    for k, val in rendered.args.items():
        if k == "api_keys" and not (isinstance(val, str) and val.startswith("/")):
            found.append("serve args: api_keys inlined")
        elif SECRET_NAME.search(k) and not k.endswith("_file") and k != "api_keys":
            found.append(f"serve args: {k}")
    return found


def _walk_env(node, path=""):
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "env" and isinstance(v, list):
                yield from ((f"{path}.env", e) for e in v if isinstance(e, dict) and "name" in e)
            else:
                yield from _walk_env(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk_env(v, f"{path}[{i}]")


def test_no_secret_value_in_any_rendered_object(rendered: Rendered) -> None:
    """Every secret the chart uses (API keys, the KV secret, Ray's token, the GCS Redis password,
    Prometheus's key) reaches the pods by reference to a Secret: no rendered object holds one."""
    assert inline_secrets(rendered) == []


def test_the_inline_secret_check_can_fail(render) -> None:
    for sets in (("serve.extraArgs.kv_secret=" + "ab" * 32,), ("head.env[0].name=REDIS_PASSWORD", "head.env[0].value=x")):
        assert inline_secrets(render(Case("inlined-" + sets[0].split("=")[0], sets=sets)))


def test_each_worker_group_has_a_disruption_budget_over_its_pods(rendered: Rendered) -> None:
    """One PodDisruptionBudget per worker group, selecting exactly that group's pods."""
    v = rendered.case.values()["podDisruptionBudget"]
    budgets = {d["metadata"]["name"].rsplit("-", 1)[-1]: d["spec"] for d in rendered.all("PodDisruptionBudget")}
    if not v["enabled"]:
        assert budgets == {}
        return
    assert set(budgets) == {"prefill", "decode"}
    for role, spec in budgets.items():
        labels = rendered.group(role)["template"]["metadata"]["labels"]
        assert spec["maxUnavailable"] == v["maxUnavailable"]
        assert spec["selector"]["matchLabels"].items() <= labels.items()
        assert spec["selector"]["matchLabels"]["app.kubernetes.io/component"] == role  # this group only


def test_only_the_autoscaler_gets_a_service_account_token(rendered: Rendered) -> None:
    """No pod mounts a Kubernetes API token, but the head with the Ray autoscaler's sidecar."""
    autoscaler = rendered.case.values()["rayAutoscaler"]["enabled"]
    for role in ("head", "prefill", "decode"):
        mounted = rendered.group(role)["template"]["spec"]["automountServiceAccountToken"]
        assert mounted is (role == "head" and autoscaler), role


def admits(policy: dict, src: dict | None, dst_labels: dict, port: int) -> bool:
    """Whether a NetworkPolicy (ingress, the parts of the API the chart uses) lets `src` reach
    a pod labelled `dst_labels` on `port`. `src`: {"ns": name, "ns_labels": {...}, "labels":
    {...}} for a pod, None for a client outside the cluster."""
    def matches(selector: dict, labels: dict) -> bool:
        return selector.get("matchLabels", {}).items() <= labels.items()

    spec = policy["spec"]
    if not matches(spec["podSelector"], dst_labels):
        return True  # not a pod this policy isolates
    for rule in spec.get("ingress", []):
        if "ports" in rule and port not in {p["port"] for p in rule["ports"]}:
            continue
        if "from" not in rule:
            return True
        for peer in rule["from"]:
            if src is None:
                continue  # every peer the chart writes names pods: none matches the outside
            in_ns = (matches(peer["namespaceSelector"], src["ns_labels"]) if "namespaceSelector" in peer
                     else src["ns"] == NAMESPACE)
            if in_ns and matches(peer.get("podSelector", {}), src["labels"]):
                return True
    return False


def test_the_network_policy_admits_exactly_the_intended_paths(rendered: Rendered) -> None:
    v = rendered.case.values()["networkPolicy"]
    policies = rendered.all("NetworkPolicy")
    if not v["enabled"]:
        assert policies == []
        return
    (policy,) = policies
    pod = {r: rendered.group(r)["template"]["metadata"]["labels"] for r in ("head", "prefill", "decode")}
    here = {"kubernetes.io/metadata.name": NAMESPACE}
    app = lambda role: {"ns": NAMESPACE, "ns_labels": here, "labels": pod[role]}  # noqa: E731
    other_app = {"ns": NAMESPACE, "ns_labels": here, "labels": {**pod["head"], "app.kubernetes.io/instance": "other"}}
    operator = {"ns": "kuberay-system", "ns_labels": {"kubernetes.io/metadata.name": "kuberay-system"},
                "labels": {"app.kubernetes.io/name": "kuberay-operator"}}
    prometheus = {"ns": "monitoring", "ns_labels": {"kubernetes.io/metadata.name": "monitoring"},
                  "labels": {"app.kubernetes.io/name": "prometheus"}}
    scraped = bool(v["metricsFrom"])
    table = [  # (who, to, port, admitted)
        (None, "head", 8000, not v["apiFrom"]), (None, "head", 50051, not v["apiFrom"]),
        (None, "head", 6379, False), (None, "head", 8265, False), (None, "head", 10001, False),
        (None, "head", 8080, False), (None, "prefill", 41000, False),  # a KV server's port
        (app("prefill"), "head", 6379, True), (app("decode"), "prefill", 41000, True),
        (app("head"), "decode", 10002, True),  # Ray's worker ports
        (other_app, "head", 6379, False), (other_app, "prefill", 41000, False),
        (operator, "head", 8265, True), (operator, "head", 52365, True), (operator, "head", 6379, False),
        (prometheus, "head", 8080, scraped), (prometheus, "head", 8000, scraped or not v["apiFrom"]),
        (prometheus, "prefill", 41000, False),
    ]
    got = [(who and who["labels"].get("app.kubernetes.io/name", who["ns"]), to, port,
            admits(policy, who, pod[to], port)) for who, to, port, _ in table]
    assert got == [(who and who["labels"].get("app.kubernetes.io/name", who["ns"]), to, port, want)
                   for who, to, port, want in table]


# The Pod Security Standards' "restricted" profile (v1.30), as the API server's admission checks
# it: the volume types it allows, and per container what it requires.
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}


def restricted_violations(pod: dict) -> list[str]:
    out = []
    psc = pod.get("securityContext", {})
    for v in pod.get("volumes", []):
        kinds = set(v) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            out.append(f"volume {v['name']}: {sorted(kinds - RESTRICTED_VOLUMES)}")
    for c in pod["containers"] + pod.get("initContainers", []):
        sc, name = c.get("securityContext", {}), c["name"]
        if sc.get("privileged"):
            out.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation must be false")
        if "ALL" not in sc.get("capabilities", {}).get("drop", []):
            out.append(f"{name}: capabilities must drop ALL")
        if set(sc.get("capabilities", {}).get("add", [])) - {"NET_BIND_SERVICE"}:
            out.append(f"{name}: adds capabilities")
        if not (sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is True):
            out.append(f"{name}: runAsNonRoot must be true")
        if sc.get("runAsUser", psc.get("runAsUser")) == 0:
            out.append(f"{name}: runs as root")
        seccomp = sc.get("seccompProfile", psc.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: seccompProfile must be RuntimeDefault or Localhost")
        for p in c.get("ports", []):
            if "hostPort" in p:
                out.append(f"{name}: hostPort")
    if pod.get("hostNetwork") or pod.get("hostPID") or pod.get("hostIPC"):
        out.append("host namespaces")
    return out


def test_every_pod_meets_the_restricted_profile(rendered: Rendered) -> None:
    """Every pod of every rendering passes the "restricted" Pod Security Standard — but for a
    model on a hostPath, which the standard forbids (a PVC is the restricted way). The root
    filesystem is read-only, with emptyDirs where Ray and the engine write."""
    host_path = bool(rendered.case.values()["model"]["hostPath"])
    for role in ("head", "prefill", "decode"):
        pod = rendered.group(role)["template"]["spec"]
        problems = restricted_violations(pod)
        assert problems == (["volume model: ['hostPath']"] if host_path else []), (role, problems)
        (c,) = pod["containers"]
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert {"/tmp", "/home/ray", "/dev/shm"} <= mounts, mounts
        (shm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
        assert shm["emptyDir"]["medium"] == "Memory" and shm["emptyDir"]["sizeLimit"]


def test_the_restricted_check_can_fail() -> None:
    """The check above refuses what the profile refuses (so its passing means something)."""
    bad = {"volumes": [{"name": "h", "hostPath": {"path": "/"}}], "hostNetwork": True,
           "containers": [{"name": "c", "securityContext": {"privileged": True, "capabilities": {"add": ["SYS_ADMIN"]}},
                           "ports": [{"containerPort": 1, "hostPort": 1}]}]}
    got = restricted_violations(bad)
    assert len(got) == 9, got


# -- refused values -----------------------------------------------------------------------------

REFUSED = [
    # (case, what stderr must say)
    (Case("max-not-int", sets=("prefill.maxReplicas=abc",)), "prefill.maxReplicas: Invalid type"),
    (Case("min-over-max", sets=("prefill.minReplicas=3", "prefill.maxReplicas=2")),
     "prefill.minReplicas (3) > prefill.maxReplicas (2)"),
    (Case("replicas-over-max", sets=("decode.replicas=5",)), "decode.replicas (5) must be within"),
    (Case("decode-empty", sets=("decode.replicas=0", "decode.minReplicas=0")), "decode.minReplicas: Must be greater"),
    (Case("negative-gpus", sets=("prefill.gpus=-1",)), "prefill.gpus: Must be greater"),
    (Case("tp-without-its-gpus", ("values-gpu.yaml",), ("decode.tp=2",)), "decode.gpus (1) must equal decode.tp (2)"),
    (Case("tp-zero", sets=("prefill.tp=0",)), "prefill.tp: Must be greater"),
    (Case("dp-without-its-gpus", ("values-gpu.yaml",), ("serve.engine.data_parallel_size=2", "prefill.replicas=0",
                                                          "prefill.minReplicas=0", "autoscale.enabled=false")),
     "decode.gpus (1) must equal serve.engine.data_parallel_size (2)"),
    (Case("pp-without-its-gpus", ("values-gpu.yaml",), ("decode.pp=2", "prefill.replicas=0", "prefill.minReplicas=0",
                                                          "autoscale.enabled=false")),
     "decode.gpus (1) must equal decode.tp x decode.pp (1 x 2)"),
    (Case("prefill-pp-decode-tp", sets=("prefill.pp=2", "decode.tp=2")),
     "prefill.pp > 1 beside a prefill pool needs prefill.tp and decode.tp 1"),
    (Case("decode-pp-tp-with-prefill", sets=("decode.pp=2", "decode.tp=2")),
     "decode.pp > 1 beside a prefill pool needs prefill.tp and decode.tp 1"),
    (Case("pp-nixl", sets=("decode.pp=2", "serve.transport=nixl")), "not nixl yet"),
    (Case("pp-zero", sets=("decode.pp=0",)), "decode.pp: Must be greater"),
    (Case("typo", sets=("prefill.gpu=1",)), "Additional property gpu is not allowed"),
    (Case("policy", sets=("serve.policy=fastest",)), "serve.policy"),
    (Case("device", sets=("serve.engine.device=tpu",)), "serve.engine.device"),
    (Case("slo-zero", sets=("serve.ttftSloMs=0",)), "serve.ttftSloMs"),
    (Case("ray-resource-builtin", sets=("prefill.rayResource=GPU",)), "prefill.rayResource"),
    (Case("ray-resource-shared", sets=("decode.rayResource=prefill_node",)), "must differ"),
    (Case("autoscale-without-ray-autoscaler", sets=("autoscale.enabled=true",)), "needs rayAutoscaler.enabled"),
    (Case("two-volumes", sets=("model.pvc.claimName=w", "model.hostPath=/w")), "not both"),
    (Case("escape-volume", sets=("model.pvc.claimName=w", "model.subPath=a/../../etc")), "no .."),
    (Case("path-and-volume", sets=("model.pvc.claimName=w", "model.path=/opt/m")), "set model.subPath instead"),
    (Case("extra-arg-managed", sets=("serve.extraArgs.prefill=3",)), "serve.extraArgs.prefill is set by the chart"),
    (Case("extra-arg-engine-flag", sets=("serve.extraArgs.dtype=float16",)), "serve.extraArgs.dtype"),
    (Case("cuda-without-gpus", ("values-cpu-demo.yaml",), ("serve.engine.device=cuda",)), "needs prefill.gpus"),
    (Case("cpu-limit-missing", sets=("prefill.resources.limits=null",)), "prefill.resources"),
    (Case("start-param-not-string", sets=("head.rayStartParams.num-cpus=2",)), "head.rayStartParams.num-cpus"),
    (Case("ingress-zero", sets=("serve.ingressReplicas=0",)), "serve.ingressReplicas"),
    (Case("gcs-ft-without-redis", sets=("gcsFaultTolerance.enabled=true",)), "gcsFaultTolerance.redisAddress"),
    (Case("gcs-ft-bad-address", sets=("gcsFaultTolerance.redisAddress=redis://x",)), "gcsFaultTolerance.redisAddress"),
    (Case("ray-auth-unknown-mode", sets=("rayAuth.mode=password",)), "rayAuth.mode"),
    (Case("api-keys-twice", sets=("apiKeys.secretName=k", "serve.extraArgs.api_keys=/x")),
     "serve.extraArgs.api_keys is set by the chart"),
    (Case("kv-secret-twice", sets=("kvSecret.secretName=k", "serve.extraArgs.kv_secret=" + "ab" * 32)),
     "serve.extraArgs.kv_secret is set by the chart"),
    (Case("speculative-k-zero", json_sets=('serve.speculative={"method": "ngram", "k": 0}',)), "serve.speculative"),
    (Case("speculative-unknown-method", json_sets=('serve.speculative={"method": "medusa"}',)), "serve.speculative"),
    (Case("speculative-draft-prefill-pp", ("values-gpu.yaml",), ("prefill.pp=2", "prefill.gpus=2"),
          ('serve.speculative={"method": "draft"}',)),
     "serve.speculative method draft with prefill.pp > 1"),
    (Case("speculative-draft-path-empty", json_sets=('serve.speculative={"method": "draft", "draft_path": ""}',)),
     "serve.speculative"),
    (Case("speculative-typo", json_sets=('serve.speculative={"kk": 4}',)), "serve.speculative"),
    (Case("speculative-min-over-max", json_sets=('serve.speculative={"min_n": 4, "max_n": 2}',)),
     "serve.speculative.min_n (4) must not exceed max_n (2)"),
    (Case("speculative-twice", json_sets=('serve.speculative={"k": 2}', 'serve.engine.speculative={"k": 3}')),
     "serve.speculative and serve.engine.speculative are both set"),
    (Case("speculative-decode-pp", ("values-gpu.yaml",), ("decode.pp=2", "decode.gpus=2", "prefill.replicas=0",
                                                            "prefill.minReplicas=0", "autoscale.enabled=false"),
          ('serve.speculative={"method": "ngram"}',)), "serve.speculative with decode.pp > 1"),
    (Case("monitor-without-operator-key", sets=("metrics.serviceMonitor.enabled=true", "apiKeys.secretName=k")),
     "metrics.serviceMonitor.bearerTokenSecret.name"),
]


@pytest.mark.parametrize("case,message", REFUSED, ids=[c.name for c, _ in REFUSED])
def test_refused(helm: Path, case: Case, message: str) -> None:
    proc = helm_template(helm, case)
    assert proc.returncode != 0, f"{case.name} rendered:\n{proc.stdout[:2000]}"
    assert message in proc.stderr, proc.stderr


def test_start_params_the_chart_owns_are_refused(helm: Path) -> None:
    for key, group in (("num-gpus", "head"), ("resources", "head"), ("resources", "prefill")):
        proc = subprocess.run([str(helm), "template", "s", str(CHART), "--set-string",
                               f"{group}.rayStartParams.{key}=1"], capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0 and f"{group}.rayStartParams.{key}" in proc.stderr, proc.stderr
