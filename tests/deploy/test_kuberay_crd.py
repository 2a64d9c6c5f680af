"""What the API server would say: every rendered RayService (and the RayCluster KubeRay makes of
it) against KubeRay's CRDs (deploy/crds: openAPIV3Schema, strict about unknown fields, and the
x-kubernetes-validations CEL rules), the built-in kinds against Kubernetes' own schemas."""

from __future__ import annotations

import copy

import pytest

from .chart import CASES, Rendered
from .k8s_checks import CrdValidator, pod_templates, ray_cluster_of, validate_builtin

# The CEL rules of the pinned CRDs (deploy/crds/COMMIT), by schema path. All of them compile
# with cel-python; a CRD update that brings one it cannot compile shows up here, by name.
EXPECTED_RULES = {
    "RayService": {
        ("spec.managedBy", "self == oldSelf"),
        ("spec.managedBy", "self in ['ray.io/kuberay-operator', 'kueue.x-k8s.io/multikueue']"),
        ("spec.rayClusterConfig.gcsFaultToleranceOptions.backend", "self == oldSelf"),
        ("spec.rayClusterConfig.managedBy", "self == oldSelf"),
        ("spec.rayClusterConfig.managedBy", "self in ['ray.io/kuberay-operator', 'kueue.x-k8s.io/multikueue']"),
    },
    "RayCluster": {
        ("spec.gcsFaultToleranceOptions.backend", "self == oldSelf"),
        ("spec.managedBy", "self == oldSelf"),
        ("spec.managedBy", "self in ['ray.io/kuberay-operator', 'kueue.x-k8s.io/multikueue']"),
    },
}
EXPECTED_UNCOMPILABLE: dict[str, set[str]] = {"RayService": set(), "RayCluster": set()}


def _with(doc: dict, path: str, value) -> dict:
    """A copy of doc with value set at path (dotted; a number indexes a list)."""
    out = copy.deepcopy(doc)
    *parents, leaf = path.split(".")
    node = out
    for key in parents:
        node = node[int(key)] if key.isdigit() else node[key]
    node[int(leaf) if leaf.isdigit() else leaf] = value
    return out


CLUSTER = "spec.rayClusterConfig"
HEAD_CONTAINER = f"{CLUSTER}.headGroupSpec.template.spec.containers.0"
WORKER_LIMITS = f"{CLUSTER}.workerGroupSpecs.0.template.spec.containers.0.resources.limits"


@pytest.fixture(scope="module")
def validators() -> dict[str, CrdValidator]:
    return {kind: CrdValidator(kind) for kind in EXPECTED_RULES}


def test_cel_rules_all_compile(validators: dict[str, CrdValidator]) -> None:
    for kind, v in validators.items():
        assert {(r.path, r.rule) for r in v.rules} == EXPECTED_RULES[kind]
        assert {r.rule for r in v.uncompilable} == EXPECTED_UNCOMPILABLE[kind], v.uncompilable


def test_rayservice_passes_the_crd(rendered: Rendered, validators: dict[str, CrdValidator]) -> None:
    assert validators["RayService"].errors(rendered.rayservice) == []


def test_its_raycluster_passes_the_crd(rendered: Rendered, validators: dict[str, CrdValidator]) -> None:
    assert validators["RayCluster"].errors(ray_cluster_of(rendered.rayservice)) == []


def test_builtin_kinds_pass_kubernetes_schemas(rendered: Rendered) -> None:
    builtin = [d for d in rendered.docs if d["kind"] not in ("RayService", "ServiceMonitor")]
    assert {d["kind"] for d in builtin} <= {"ConfigMap", "NetworkPolicy", "PodDisruptionBudget", "Service"}
    for doc in builtin + list(pod_templates(rendered.rayservice).values()):
        assert validate_builtin(doc) == [], doc["kind"]


def test_cel_rules_run_where_they_apply(render, validators: dict[str, CrdValidator]) -> None:
    rs = render(CASES[0]).rayservice
    v = validators["RayService"]
    before = v.evaluated
    assert v.errors(_with(rs, f"{CLUSTER}.managedBy", "ray.io/kuberay-operator")) == []
    assert v.evaluated - before == 2  # both managedBy rules, at spec.rayClusterConfig.managedBy

    (failure,) = v.cel_failures(_with(rs, f"{CLUSTER}.managedBy", "someone-else"))
    assert failure.at == "spec.rayClusterConfig.managedBy"
    assert "must be either" in failure.rule.message


def test_schema_is_strict(render, validators: dict[str, CrdValidator]) -> None:
    rs = render(CASES[0]).rayservice
    errors = validators["RayService"].schema_errors
    typo = errors(_with(rs, f"{CLUSTER}.workerGroupSpecs.0.maxReplica", 3))
    assert any("maxReplica" in e for e in typo), typo
    assert errors(_with(rs, f"{CLUSTER}.workerGroupSpecs.0.replicas", "two"))
    deep = errors(_with(rs, f"{HEAD_CONTAINER}.imagePull", "x"))
    assert any("imagePull" in e for e in deep), deep
    assert errors(_with(rs, f"{CLUSTER}.headGroupSpec.rayStartParams.num-cpus", 2))  # strings only
    # int-or-string: a quantity may be either, nothing else.
    assert errors(_with(rs, f"{WORKER_LIMITS}.cpu", 8)) == []
    assert errors(_with(rs, f"{WORKER_LIMITS}.cpu", "8")) == []
    assert errors(_with(rs, f"{WORKER_LIMITS}.cpu", [8]))


def test_builtin_check_is_strict(render) -> None:
    svc = copy.deepcopy(render(CASES[0]).service("api"))
    svc["spec"]["ports"][0]["targetport"] = "serve"
    assert validate_builtin(svc)
