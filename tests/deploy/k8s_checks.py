"""Offline checks of rendered manifests, standing in for an API server we do not have.

  * `CrdValidator`: a custom resource against its CRD's openAPIV3Schema with jsonschema, made as
    strict as the API server's structural pruning would make a typo visible (an object with
    `properties` and no `additionalProperties` / `x-kubernetes-preserve-unknown-fields` refuses
    unknown fields), with `x-kubernetes-int-or-string` and `nullable` read as the API server
    reads them; then the CRD's `x-kubernetes-validations` CEL rules, each evaluated with
    cel-python at its own level of the object (`self` = that sub-object). Transition rules
    (`oldSelf`) are evaluated as an update that changes nothing (a no-op `helm upgrade`). A rule
    cel-python cannot compile is listed in `uncompilable`, never silently skipped.
  * `validate_builtin`: a built-in kind (Service, a PodTemplate) with kubernetes-validate, strict.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import celpy
import jsonschema
import kubernetes_validate
import yaml

CRD_DIR = Path(__file__).resolve().parents[2] / "deploy" / "crds"
CRD_FILES = {"RayService": "ray.io_rayservices.yaml", "RayCluster": "ray.io_rayclusters.yaml"}
# The Kubernetes versions built-in kinds are checked against: the oldest the chart's kubeVersion
# range is likely to meet in practice and the newest kubernetes-validate ships.
K8S_VERSIONS = ("1.30.0", kubernetes_validate.utils.latest_version())


@dataclass(frozen=True)
class CelRule:
    path: str  # where in the schema, e.g. spec.rayClusterConfig.managedBy
    rule: str
    message: str


@dataclass(frozen=True)
class CelFailure:
    at: str  # where in the object
    rule: CelRule
    result: str  # what it evaluated to (false, or the evaluation error)


def strict_schema(schema: dict) -> dict:
    """A copy of an openAPIV3Schema that jsonschema reads as the API server would (see module doc)."""
    def fix(node: dict) -> dict:
        node = dict(node)
        if "properties" in node:
            node["properties"] = {name: fix(sub) for name, sub in node["properties"].items()}
            if "additionalProperties" not in node and not node.get("x-kubernetes-preserve-unknown-fields"):
                node["additionalProperties"] = False
        for key in ("items", "additionalProperties", "not"):
            if isinstance(node.get(key), dict):
                node[key] = fix(node[key])
        for key in ("anyOf", "allOf", "oneOf"):
            if key in node:
                node[key] = [fix(sub) for sub in node[key]]
        if node.get("x-kubernetes-int-or-string"):
            node.pop("type", None)
            node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        if node.get("nullable") and "type" in node:
            node["type"] = [node["type"], "null"]
        return node

    return fix(copy.deepcopy(schema))


@functools.cache
def crd_schema(kind: str, version: str = "v1") -> dict:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: the CRDs are 1 MB each
    crd = yaml.load((CRD_DIR / CRD_FILES[kind]).read_text(), Loader=loader)
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            return v["schema"]["openAPIV3Schema"]
    raise KeyError(f"{kind} CRD has no version {version}")


def iter_rules(schema: dict, path: str = "") -> Iterator[CelRule]:
    for r in schema.get("x-kubernetes-validations", []):
        yield CelRule(path or "<root>", r["rule"], r.get("message", ""))
    for name, sub in schema.get("properties", {}).items():
        yield from iter_rules(sub, f"{path}.{name}" if path else name)
    if isinstance(schema.get("items"), dict):
        yield from iter_rules(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from iter_rules(schema["additionalProperties"], f"{path}{{}}")


class CrdValidator:
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.schema = crd_schema(kind)
        self._json = jsonschema.Draft7Validator(strict_schema(self.schema))
        self._env = celpy.Environment()
        self.rules = list(iter_rules(self.schema))
        self.programs: dict[CelRule, Any] = {}
        self.uncompilable: dict[CelRule, str] = {}
        for rule in self.rules:
            try:
                self.programs[rule] = self._env.program(self._env.compile(rule.rule))
            except Exception as e:  # celpy raises its own CELParseError / CELSyntaxError
                self.uncompilable[rule] = f"{type(e).__name__}: {e}"
        self.evaluated = 0  # rule evaluations over the life of this validator (a test sees they ran)

    def schema_errors(self, obj: dict) -> list[str]:
        errors = sorted(self._json.iter_errors(obj), key=lambda e: list(e.absolute_path))
        return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors]

    def cel_failures(self, obj: dict) -> list[CelFailure]:
        failures: list[CelFailure] = []
        self._walk(self.schema, obj, "", "", failures)
        return failures

    def errors(self, obj: dict) -> list[str]:
        return self.schema_errors(obj) + [f"{f.at}: CEL {f.rule.rule!r} ({f.rule.message}) -> {f.result}"
                                          for f in self.cel_failures(obj)]

    def _walk(self, schema: dict, value: Any, at: str, path: str, out: list[CelFailure]) -> None:
        for r in schema.get("x-kubernetes-validations", []):
            rule = CelRule(path or "<root>", r["rule"], r.get("message", ""))
            program = self.programs.get(rule)
            if program is None:
                continue  # listed in self.uncompilable; the tests assert on that list
            cel = celpy.json_to_cel(value)
            activation = {"self": cel, "oldSelf": cel} if "oldSelf" in rule.rule else {"self": cel}
            self.evaluated += 1
            try:
                result = program.evaluate(activation)
            except Exception as e:  # an evaluation error is a failed rule, as on the API server
                result = e
            if result is not True and not (isinstance(result, celpy.celtypes.BoolType) and bool(result)):
                out.append(CelFailure(at or "<root>", rule, repr(result)))
        if isinstance(value, dict):
            for name, sub in schema.get("properties", {}).items():
                if name in value:
                    here = f"{at}.{name}" if at else name
                    self._walk(sub, value[name], here, f"{path}.{name}" if path else name, out)
            extra = schema.get("additionalProperties")
            if isinstance(extra, dict):
                for key, v in value.items():
                    if key not in schema.get("properties", {}):
                        self._walk(extra, v, f"{at}.{key}", f"{path}{{}}", out)
        elif isinstance(value, list) and isinstance(schema.get("items"), dict):
            for i, v in enumerate(value):
                self._walk(schema["items"], v, f"{at}[{i}]", f"{path}[]", out)


def validate_builtin(obj: dict) -> list[str]:
    """kubernetes-validate's strict check of a built-in kind, for each of K8S_VERSIONS."""
    errors = []
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"k8s {version}: {'.'.join(map(str, e.path))}: {e.message}")
    return errors


def ray_cluster_of(rayservice: dict) -> dict:
    """The RayCluster KubeRay makes from a RayService (its spec is rayClusterConfig)."""
    meta = rayservice["metadata"]
    return {"apiVersion": "ray.io/v1", "kind": "RayCluster",
            "metadata": {"name": meta["name"], "namespace": meta.get("namespace", "default")},
            "spec": rayservice["spec"]["rayClusterConfig"]}


def pod_templates(rayservice: dict) -> dict[str, dict]:
    """Each group's pod template (head and workers by group name) as a v1 PodTemplate object."""
    spec = rayservice["spec"]["rayClusterConfig"]
    groups = {"head": spec["headGroupSpec"], **{g["groupName"]: g for g in spec["workerGroupSpecs"]}}
    return {name: {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"check-{name}"},
                   "template": g["template"]} for name, g in groups.items()}
