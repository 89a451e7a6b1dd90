"""CRDs vendored as published (README.md says from where), for validating rendered objects
against their real `openAPIV3Schema` instead of a hand-written outline.

jsonschema checks types, required fields, enums, patterns, lengths and item counts; the CEL rules
(`x-kubernetes-validations`) and `x-kubernetes-*` list semantics are left to the API server.
"""
from __future__ import annotations

import functools
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
FILES = {
    ("gateway.networking.k8s.io", "HTTPRoute"): "gateway.networking.k8s.io_httproutes.yaml",
    ("inference.networking.k8s.io", "InferencePool"): "inference.networking.k8s.io_inferencepools.yaml",
}


@functools.lru_cache(maxsize=None)
def published_schema(api_version: str, kind: str) -> dict:
    """The openAPIV3Schema of `kind` at `api_version` (group/version), which must be served."""
    group, version = api_version.split("/")
    crd = yaml.safe_load((HERE / FILES[(group, kind)]).read_text())
    assert crd["spec"]["group"] == group and crd["spec"]["names"]["kind"] == kind
    (v,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    assert v["served"], f"{kind} {api_version} is not served by the vendored CRD"
    return v["schema"]["openAPIV3Schema"]
