"""Validate Kubernetes objects as the API server and `kubectl apply` (strict field validation) do.

The custom resources are checked against their CRDs' own OpenAPI v3 schemas, kept in
tests/unit/data/crds/ (fetched from kubernetes-sigs/lws and ray-project/kuberay; the pod templates
inside them are the full core/v1 PodTemplateSpec schema, not x-kubernetes-preserve-unknown-fields,
so every container field is checked too). A structural schema prunes unknown fields silently;
kubectl's default strict field validation refuses them instead, and so does this: every object
schema with `properties` is closed (additionalProperties: false) unless it preserves unknown
fields. A core/v1 Service is checked against the subset of its schema that llmctl emits. A
RayService's serveConfigV2 is a string to the CRD: it is checked as the Ray dashboard checks
what KubeRay submits, with Ray Serve's own ServeDeploySchema.

jsonschema comes with ray, a test dependency.
"""

from __future__ import annotations

import copy
import functools
import re
from pathlib import Path

import jsonschema
import yaml

CRDS = Path(__file__).parent / "unit" / "data" / "crds"
_CRD_FILES = {
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): "leaderworkerset.x-k8s.io_leaderworkersets",
    ("ray.io/v1", "RayCluster"): "ray.io_rayclusters",
    ("ray.io/v1", "RayService"): "ray.io_rayservices",
}
# A DNS-1123 label: metadata.name of a Service (and, by our builders, of every object).
_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")

_INT_OR_STRING = {
    "anyOf": [{"type": "integer"}, {"type": "string"}],
    "x-kubernetes-int-or-string": True,
}
_SERVICE = {  # core/v1 Service, the fields llmctl emits (k8s.io/api/core/v1 types.go)
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"type": "string", "enum": ["v1"]},
        "kind": {"type": "string", "enum": ["Service"]},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object",
            "properties": {
                "selector": {"type": "object", "additionalProperties": {"type": "string"}},
                "type": {
                    "type": "string",
                    "enum": ["ClusterIP", "NodePort", "LoadBalancer", "ExternalName"],
                },  # fmt: skip
                "ports": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["port"],
                        "properties": {
                            "name": {"type": "string"},
                            "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                            "targetPort": _INT_OR_STRING,
                            "protocol": {"type": "string", "enum": ["TCP", "UDP", "SCTP"]},
                        },
                    },
                },
            },
        },
    },
}


def closed(schema):
    """The schema with every object that lists its properties refusing others."""
    schema = copy.deepcopy(schema)

    def close(node):
        if isinstance(node, dict):
            if (
                "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for value in node.values():
                close(value)
        elif isinstance(node, list):
            for value in node:
                close(value)

    close(schema)
    return schema


@functools.cache
def crd_schema(api_version: str, kind: str) -> dict:
    """The served version's openAPIV3Schema of the CRD for this apiVersion and kind, closed."""
    text = (CRDS / f"{_CRD_FILES[api_version, kind]}.yaml").read_text()
    crd = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # 0.5 MB each
    group, version = api_version.split("/")
    assert crd["spec"]["group"] == group and crd["spec"]["names"]["kind"] == kind
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version and v["served"]]
    return closed(served["schema"]["openAPIV3Schema"])


def errors(obj: dict) -> list[str]:
    """Every schema violation of `obj`, as "path: message"; empty when it is valid."""
    key = (obj.get("apiVersion"), obj.get("kind"))
    if key == ("v1", "Service"):
        schema = closed(_SERVICE)
    elif key in _CRD_FILES:
        schema = crd_schema(*key)
    else:
        return [f"no schema for {key}"]
    validator = jsonschema.Draft7Validator(schema)
    found = [
        f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in validator.iter_errors(obj)
    ]
    if key == ("ray.io/v1", "RayService") and "serveConfigV2" in obj.get("spec", {}):
        found += serve_config_errors(obj["spec"]["serveConfigV2"])
    name = obj.get("metadata", {}).get("name", "")
    if not _NAME.fullmatch(name) or len(name) > 63:
        found.append(f"metadata.name: {name!r} is not a DNS-1123 label")
    return found


def serve_config_errors(text: str) -> list[str]:
    """Every violation of Ray Serve's config schema (ServeDeploySchema) in a serveConfigV2: its
    validators, and (strict, as above) no field the schema does not name, which Ray ignores."""
    import pydantic
    from ray.serve.schema import ServeDeploySchema

    config = yaml.safe_load(text)
    if not isinstance(config, dict):
        return [f"serveConfigV2: not a mapping: {config!r}"]
    validator = jsonschema.Draft7Validator(closed(ServeDeploySchema.model_json_schema()))
    found = [
        f"serveConfigV2.{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in validator.iter_errors(config)
    ]
    try:
        ServeDeploySchema.model_validate(config)
    except pydantic.ValidationError as exc:
        found += [f"serveConfigV2.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
    return found
