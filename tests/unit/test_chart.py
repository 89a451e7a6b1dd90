"""The Helm chart (charts/tandem), proven without a cluster.

The chart is rendered with the real Helm v4 library (`helm-python-sdk`, offline) for several value
profiles, linted, and every manifest is validated against the Kubernetes API schemas
(`kubernetes-validate`); CRDs it does not know (KEDA, Prometheus Operator, Gateway API, GKE) are
checked against small structural schemas here. Then the semantics a cluster would only reveal
late are asserted: selectors match pod labels, Service/probe ports exist on the containers, TPU
chip counts match topologies, drains fit the grace periods, the NetworkPolicies and KEDA triggers
name what the services really use. The settings <-> environment mapping and the bad-values
messages are in test_chart_settings.py, the images in test_chart_images.py; both reuse the
rendering helpers below.

`python tests/unit/test_chart.py --write-schema` regenerates the settings parts of
charts/tandem/values.schema.json from the pydantic classes (test_schema_settings_are_generated
fails when they drift).
"""
from __future__ import annotations

import base64
import copy
import functools
import json
import math
import sys
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import kubernetes_validate.utils as kv_utils
import pytest
import yaml
from pydantic import BaseModel

if __name__ == "__main__":  # `python tests/unit/test_chart.py --write-schema`: import from this checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from decode_svc.settings import DecodeSettings
from gateway.settings import GatewaySettings
from planner.settings import PlannerSettings
from prefill_svc.settings import PrefillSettings
from tandem_core import keys
from tests.unit.crds import published_schema

KS = keys.KeySpace(1)  # a plain Redis: one key shard (a service builds its own from its settings)

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "tandem"
RELEASE, NAMESPACE = "rel", "ns"
# The chart's kubeVersion floor and the newest schemas kubernetes-validate ships.
K8S_VERSIONS = ("1.30", kubernetes_validate.latest_version())

# Redis settings the chart owns: one value for every service (externalRedis.url / redis, the
# password Secret, redis.cluster, redis.shards), so the services cannot disagree.
REDIS_OWNED = {"redis.url", "redis.username", "redis.password", "redis.cluster", "redis.shards"}
# A worker's mTLS files and the name it checks: from grpcTLS (the Secret mounted at its mountPath).
TLS_OWNED = {"grpc.tls_cert_file", "grpc.tls_key_file", "grpc.tls_ca_file", "grpc.tls_server_name"}
SERVICES = {
    # component: (settings class, env prefix, settings the chart owns instead of values.yaml)
    "gateway": (GatewaySettings, "TANDEM_GATEWAY_", REDIS_OWNED | {"api_keys", "admin_key"}),
    "prefill": (PrefillSettings, "TANDEM_PREFILL_", REDIS_OWNED | TLS_OWNED | {"grpc.advertise_host", "worker_id"}),
    "decode": (DecodeSettings, "TANDEM_DECODE_", REDIS_OWNED | TLS_OWNED | {"grpc.advertise_host", "worker_id"}),
    "planner": (PlannerSettings, "TANDEM_PLANNER_", REDIS_OWNED | {"profile_path", "prefill.deployment",
                                                                   "decode.deployment", "kubernetes.namespace",
                                                                   "kubernetes.lease_name"}),
}
# Components rendered only when their values turn them on.
OPTIONAL = {"planner"}
# Values whose chart default intentionally differs from the code's default.
DEFAULT_OVERRIDES = {
    ("gateway", "host"): "0.0.0.0",  # 127.0.0.1 is unreachable from outside a pod
    # the compilationCache emptyDir (the root filesystem is read-only)
    ("prefill", "engine.compile_cache_dir"): "/var/cache/jax",
    ("decode", "engine.compile_cache_dir"): "/var/cache/jax",
    # the plaintext health port of the probes (grpcTLS is on by default; 0 in the code = none)
    ("prefill", "grpc.health_port"): 50071,
    # /metrics on its own port, kept inside the cluster by the NetworkPolicy (0 in the code: on `port`)
    ("gateway", "metrics_port"): 9400,
    ("decode", "grpc.health_port"): 50072,
}
# Environment a Tandem container may carry besides its settings.
RUNTIME_ENV = {"HOME", "JAX_PLATFORMS", "JAX_COMPILATION_CACHE_DIR"}

PROFILES = {
    "default": [],
    "tpu": ["ci/tpu-values.yaml"],
    "external-redis-tls": ["ci/external-redis-values.yaml"],
    "external-redis-cluster": ["ci/external-redis-cluster-values.yaml"],
    "keda": ["ci/keda-values.yaml"],
    "everything-off": ["ci/minimal-values.yaml"],
    # Every optional object at once (KEDA + external Redis TLS + routes + monitoring).
    "everything-on": ["ci/tpu-values.yaml", "ci/external-redis-values.yaml", "ci/keda-values.yaml"],
    # The planner scaling the workers itself, and the InferencePool behind the HTTPRoute ...
    "planner": ["ci/planner-values.yaml"],
    # ... and KEDA following the planner instead.
    "planner-keda": ["ci/planner-values.yaml", "ci/planner-keda-values.yaml"],
    # The internal gRPC certificates from cert-manager instead of a chart-made CA.
    "cert-manager": ["ci/cert-manager-values.yaml"],
}

# Structural schemas for the CRDs kubernetes-validate cannot know.
_NAME = {"type": "string", "minLength": 1}
_META = {"type": "object", "required": ["name", "namespace", "labels"],
         "properties": {"name": _NAME, "namespace": _NAME, "labels": {"type": "object"}}}
_TARGET = {"type": "object", "required": ["name"], "properties": {"name": _NAME, "kind": _NAME, "apiVersion": _NAME}}


def _crd(spec: dict) -> dict:
    return {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
            "properties": {"metadata": _META, "spec": spec}}


CRD_SCHEMAS = {
    ("keda.sh/v1alpha1", "ScaledObject"): _crd({
        "type": "object", "additionalProperties": False, "required": ["scaleTargetRef", "triggers"],
        "properties": {
            "scaleTargetRef": _TARGET,
            "minReplicaCount": {"type": "integer", "minimum": 0},
            "maxReplicaCount": {"type": "integer", "minimum": 1},
            "pollingInterval": {"type": "integer"}, "cooldownPeriod": {"type": "integer"},
            "advanced": {"type": "object"},
            "triggers": {"type": "array", "minItems": 1, "items": {"oneOf": [{
                "type": "object", "required": ["type", "metadata"], "additionalProperties": False,
                "properties": {
                    "type": {"const": "redis-streams"},
                    # KEDA requires every metadata value to be a string.
                    "metadata": {"type": "object", "additionalProperties": {"type": "string"},
                                 "required": ["address", "stream", "consumerGroup", "lagCount"]},
                    "authenticationRef": {"type": "object", "required": ["name"]},
                }}, {
                "type": "object", "required": ["type", "metadata"], "additionalProperties": False,
                "properties": {
                    "type": {"const": "metrics-api"},
                    "metricType": {"enum": ["AverageValue", "Value"]},
                    "metadata": {"type": "object", "additionalProperties": {"type": "string"},
                                 "required": ["url", "valueLocation", "targetValue"]},
                }}]}},
        }}),
    ("keda.sh/v1alpha1", "TriggerAuthentication"): _crd({
        "type": "object", "additionalProperties": False, "required": ["secretTargetRef"],
        "properties": {"secretTargetRef": {"type": "array", "minItems": 1, "items": {
            "type": "object", "additionalProperties": False, "required": ["parameter", "name", "key"],
            "properties": {"parameter": {"enum": ["password", "ca", "cert", "key", "username"]},
                           "name": _NAME, "key": _NAME}}}}}),
    ("monitoring.coreos.com/v1", "ServiceMonitor"): _crd({
        "type": "object", "required": ["selector", "endpoints"],
        "properties": {"selector": {"type": "object", "required": ["matchLabels"]},
                       "endpoints": {"type": "array", "minItems": 1, "items": {
                           "type": "object", "required": ["port"],
                           "properties": {"port": _NAME, "path": {"type": "string"}, "interval": {"type": "string"}}}}}}),
    ("monitoring.googleapis.com/v1", "PodMonitoring"): _crd({
        "type": "object", "required": ["selector", "endpoints"],
        "properties": {"selector": {"type": "object", "required": ["matchLabels"]},
                       "endpoints": {"type": "array", "minItems": 1, "items": {"type": "object", "required": ["port"]}}}}),
    # Gateway API and Inference Extension objects: the published CRDs' own schemas (tests/unit/crds).
    **{(api, kind): {"allOf": [published_schema(api, kind), _crd({"type": "object"})]}
       for api, kind in (("gateway.networking.k8s.io/v1", "HTTPRoute"), ("inference.networking.k8s.io/v1", "InferencePool"))},
    ("cert-manager.io/v1", "Issuer"): _crd({
        "type": "object", "minProperties": 1, "maxProperties": 1,
        "properties": {"selfSigned": {"type": "object"},
                       "ca": {"type": "object", "required": ["secretName"], "properties": {"secretName": _NAME}}}}),
    ("cert-manager.io/v1", "Certificate"): _crd({
        "type": "object", "required": ["secretName", "issuerRef"],
        "properties": {"secretName": _NAME, "isCA": {"type": "boolean"}, "commonName": _NAME,
                       "duration": {"type": "string", "pattern": "^[0-9]+h$"},
                       "dnsNames": {"type": "array", "items": _NAME},
                       "usages": {"type": "array", "items": {"enum": [
                           "server auth", "client auth", "digital signature", "key encipherment"]}},
                       "privateKey": {"type": "object"},
                       "issuerRef": {"type": "object", "required": ["name", "kind"],
                                     "properties": {"name": _NAME, "kind": {"enum": ["Issuer", "ClusterIssuer"]}}}}}),
    ("networking.gke.io/v1", "HealthCheckPolicy"): _crd({
        "type": "object", "required": ["default", "targetRef"],
        "properties": {"targetRef": {"type": "object", "required": ["group", "kind", "name"]}}}),
}


# ------------------------------------------------------------------------------------------------
# Rendering
# ------------------------------------------------------------------------------------------------

def _deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


# Every render here passes a secretSeed, as an install must give one (or existingSecrets, or the
# values themselves; test_chart_gitops.py covers each and the failure without any).
TEST_SEED = "0123456789abcdef0123456789abcdef-test-only"


def seeded(values: dict) -> dict:
    """`values` with the test seed underneath (a value's own secretSeed, even "", wins)."""
    return _deep_merge({"secretSeed": TEST_SEED}, values)


def profile_values(profile: str) -> dict:
    vals: dict = {}
    for f in PROFILES[profile]:
        vals = _deep_merge(vals, yaml.safe_load((CHART / f).read_text()) or {})
    return vals


@functools.lru_cache(maxsize=1)
def _chart() -> helm.Chart:
    return helm.Chart.load(CHART)


def render(values: dict) -> dict[str, str]:
    return _chart().render(seeded(values), name=RELEASE, namespace=NAMESPACE, is_install=True)


class Rendered:
    def __init__(self, values: dict):
        self.user_values = values
        self.values = _chart().merge_values(seeded(values))
        self.files = render(values)
        self.docs: list[dict] = []
        for path, text in self.files.items():
            if path.endswith(".txt"):
                continue
            for doc in yaml.safe_load_all(text):
                if doc:
                    doc.setdefault("_file", path)
                    self.docs.append(doc)

    def kind(self, kind: str) -> list[dict]:
        return [d for d in self.docs if d["kind"] == kind]

    def get(self, kind: str, name: str) -> dict:
        found = [d for d in self.kind(kind) if d["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
        return found[0]

    def workloads(self) -> list[dict]:
        return [d for d in self.docs if d["kind"] in ("Deployment", "StatefulSet")]

    def component(self, component: str) -> dict:
        return self.get("Deployment", f"{RELEASE}-tandem-{component}")

    def container_env(self, component: str) -> dict[str, dict]:
        """Every variable a component's container gets: env, and envFrom ConfigMaps' keys."""
        c = self.component(component)["spec"]["template"]["spec"]["containers"][0]
        env: dict[str, dict] = {}
        for src in c.get("envFrom", []):
            cm = self.get("ConfigMap", src["configMapRef"]["name"])
            for k, v in cm["data"].items():
                assert k not in env, f"{component}: {k} set twice"
                env[k] = {"value": v}
        for e in c.get("env", []):
            assert e["name"] not in env, f"{component}: {e['name']} set twice"
            env[e["name"]] = e
        return env


@functools.lru_cache(maxsize=None)
def rendered(profile: str) -> Rendered:
    return Rendered(profile_values(profile))


def components(profile: str) -> list[str]:
    """The services a profile runs (the OPTIONAL ones only when its values enable them)."""
    vals = profile_values(profile)
    return [c for c in SERVICES if c not in OPTIONAL or vals.get(c, {}).get("enabled")]


def planner_scaled(r: Rendered) -> set[str]:
    """Deployments the planner resizes itself (mode kubernetes), by the names the chart gives it."""
    if not (r.values["planner"]["enabled"] and r.values["planner"]["settings"]["mode"] == "kubernetes"):
        return set()
    env = r.container_env("planner")
    return {env[f"TANDEM_PLANNER_{role}__DEPLOYMENT"]["value"] for role in ("PREFILL", "DECODE")}


def pod_labels(workload: dict) -> dict:
    return workload["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def containers(workload: dict) -> list[dict]:
    spec = workload["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


# ------------------------------------------------------------------------------------------------
# Settings <-> values <-> env
# ------------------------------------------------------------------------------------------------

def settings_fields(cls: type[BaseModel], prefix: str = "") -> dict[str, Any]:
    """Leaf fields of a settings class as dotted paths -> FieldInfo (nested models flattened)."""
    out = {}
    for name, info in cls.model_fields.items():
        path = f"{prefix}{name}"
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out.update(settings_fields(ann, f"{path}."))
        else:
            out[path] = info
    return out


def env_name(prefix: str, path: str) -> str:
    return prefix + "__".join(p.upper() for p in path.split("."))


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def field_default(cls: type[BaseModel], path: str) -> Any:
    obj: Any = cls.model_construct()
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


_KEEP = ("type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "pattern", "enum", "anyOf")
# Chart-side tightening: a gRPC port must be fixed (probes and NetworkPolicies name it).
_TIGHTEN = {"grpc.port": {"minimum": 1}, "port": {"minimum": 1}, "grpc_port": {"minimum": 1}}


def settings_schema(cls: type[BaseModel], owned: set[str]) -> dict:
    """The values.schema.json block for `<component>.settings`, derived from the pydantic class."""
    full = cls.model_json_schema()
    defs = full.get("$defs", {})

    def conv(node: dict, path: str) -> dict:
        if "$ref" in node:
            node = defs[node["$ref"].rsplit("/", 1)[-1]]
        if "properties" in node:
            props = {}
            for name, sub in node["properties"].items():
                p = f"{path}.{name}" if path else name
                if p not in owned:
                    props[name] = conv(sub, p)
            return {"type": "object", "additionalProperties": False, "required": sorted(props), "properties": props}
        out = {k: node[k] for k in _KEEP if k in node}
        if "items" in node:
            out["items"] = {k: node["items"][k] for k in _KEEP if k in node["items"]}
        out.update(_TIGHTEN.get(path, {}))
        return out

    block = conv(full, "")
    block["description"] = f"Mirrors {cls.__module__}.{cls.__name__} one to one (env {cls.model_config['env_prefix']}*)."
    return block


def write_schema() -> None:
    path = CHART / "values.schema.json"
    schema = json.loads(path.read_text())
    for component, (cls, _, owned) in SERVICES.items():
        schema["properties"][component]["properties"]["settings"] = settings_schema(cls, owned)
    path.write_text(json.dumps(schema, indent=2) + "\n")


# ------------------------------------------------------------------------------------------------
# Render, lint, validate
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("profile", PROFILES)
def test_lint_reports_no_errors(profile):
    report = helm.lint(CHART, seeded(profile_values(profile)), strict=True, namespace=NAMESPACE,
                       kube_version=f"v{K8S_VERSIONS[0]}.0")
    errors = [m for m in report["messages"] if m["severity"] >= 3]
    assert not report["errors"] and not errors, report


@functools.lru_cache(maxsize=None)
def _schema_file(filename: str, version: str) -> Any:
    return _orig_schema_contents(filename, version)


_orig_schema_contents = kv_utils.schema_contents


@pytest.fixture(scope="module", autouse=True)
def _cache_kubernetes_schemas():
    """kubernetes-validate reloads the (large) definitions file per object; cache it."""
    kv_utils.schema_contents = _schema_file
    yield
    kv_utils.schema_contents = _orig_schema_contents


@pytest.mark.parametrize("profile", PROFILES)
def test_every_manifest_validates(profile):
    r = rendered(profile)
    assert r.docs
    for doc in r.docs:
        body = {k: v for k, v in doc.items() if k != "_file"}
        key = (body["apiVersion"], body["kind"])
        where = f"{doc['_file']}: {body['kind']}/{body['metadata']['name']}"
        if key in CRD_SCHEMAS:
            try:
                jsonschema.validate(body, CRD_SCHEMAS[key])
            except jsonschema.ValidationError as e:
                pytest.fail(f"{where}: {e.message} at {list(e.path)}")
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(body, version, strict=True)
            except kubernetes_validate.SchemaNotFoundError:
                pytest.fail(f"{where}: no Kubernetes schema and no structural CRD schema in this test")
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{where} (Kubernetes {version}): {e.message} at {'.'.join(map(str, e.path))}")
        assert body["metadata"]["namespace"] == NAMESPACE, where


def test_profiles_render_what_they_promise():
    kinds = lambda p: {d["kind"] for d in rendered(p).docs}  # noqa: E731
    assert {"StatefulSet", "PersistentVolumeClaim"} & kinds("default") == {"StatefulSet"}
    assert {"Deployment", "Service", "Secret", "NetworkPolicy", "PodDisruptionBudget"} <= kinds("default")
    assert {"HTTPRoute", "HealthCheckPolicy", "PodMonitoring"} <= kinds("tpu")
    assert "StatefulSet" not in kinds("external-redis-tls") and "Ingress" in kinds("external-redis-tls")
    assert {"ScaledObject", "TriggerAuthentication", "ServiceMonitor", "HorizontalPodAutoscaler"} <= kinds("keda")
    off = kinds("everything-off")
    assert not off & {"NetworkPolicy", "PodDisruptionBudget", "ServiceAccount", "ScaledObject",
                      "HorizontalPodAutoscaler", "Ingress", "HTTPRoute", "ServiceMonitor"}, off
    # Only Redis' password remains secret (the bundled Redis is the one thing that cannot be off).
    assert [s["metadata"]["name"] for s in rendered("everything-off").kind("Secret")] == [f"{RELEASE}-tandem-redis"]
    assert {d["kind"] for d in rendered("everything-on").docs} >= {"ScaledObject", "HTTPRoute", "Ingress", "ServiceMonitor", "PodMonitoring", "ConfigMap"}


# ------------------------------------------------------------------------------------------------
# Semantics a cluster would catch late
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("profile", PROFILES)
def test_selectors_match_pod_labels(profile):
    r = rendered(profile)
    workloads = r.workloads()
    for w in workloads:
        assert selects(w["spec"]["selector"]["matchLabels"], pod_labels(w)), w["metadata"]["name"]
    # No two workloads share a selector (a Service or PDB would span both).
    for a in workloads:
        for b in workloads:
            if a is not b:
                assert not selects(a["spec"]["selector"]["matchLabels"], pod_labels(b))

    def matched(selector: dict) -> list[dict]:
        return [w for w in workloads if selects(selector, pod_labels(w))]

    for svc in r.kind("Service"):
        assert len(matched(svc["spec"]["selector"])) == 1, svc["metadata"]["name"]
    for pdb in r.kind("PodDisruptionBudget"):
        assert len(matched(pdb["spec"]["selector"]["matchLabels"])) == 1, pdb["metadata"]["name"]
    for np in r.kind("NetworkPolicy"):
        assert len(matched(np["spec"]["podSelector"]["matchLabels"])) == 1, np["metadata"]["name"]
    for sm in r.kind("ServiceMonitor") + r.kind("PodMonitoring"):
        assert matched(sm["spec"]["selector"]["matchLabels"])
    for obj in r.kind("HorizontalPodAutoscaler") + r.kind("ScaledObject"):
        ref = obj["spec"]["scaleTargetRef"]
        assert r.get(ref.get("kind", "Deployment"), ref["name"])
    for sts in r.kind("StatefulSet"):
        assert r.get("Service", sts["spec"]["serviceName"])["spec"]["clusterIP"] == "None"


def _port_of(container: dict, port: Any) -> dict | None:
    for p in container.get("ports", []):
        if port in (p.get("name"), p["containerPort"]):
            return p
    return None


@pytest.mark.parametrize("profile", PROFILES)
def test_service_target_ports_exist_on_containers(profile):
    r = rendered(profile)
    for svc in r.kind("Service"):
        (w,) = [w for w in r.workloads() if selects(svc["spec"]["selector"], pod_labels(w))]
        for port in svc["spec"]["ports"]:
            assert any(_port_of(c, port["targetPort"]) for c in containers(w)), (svc["metadata"]["name"], port)

    def service_port(name: str, port: Any) -> None:
        svc = r.get("Service", name)
        assert any(port in (p["name"], p["port"]) for p in svc["spec"]["ports"]), (name, port)

    for ing in r.kind("Ingress"):
        for rule in ing["spec"]["rules"]:
            for path in rule["http"]["paths"]:
                b = path["backend"]["service"]
                service_port(b["name"], b["port"].get("name", b["port"].get("number")))
    for route in r.kind("HTTPRoute"):
        for rule in route["spec"]["rules"]:
            for b in rule["backendRefs"]:
                if b.get("kind") != "InferencePool":
                    service_port(b["name"], b["port"])
                    continue
                # The pool's pods serve its target ports, and its endpoint picker's Service exists.
                pool = r.get("InferencePool", b["name"])["spec"]
                (w,) = [w for w in r.workloads() if selects(pool["selector"]["matchLabels"], pod_labels(w))]
                for tp in pool["targetPorts"]:
                    assert any(_port_of(c, tp["number"]) for c in containers(w)), (b["name"], tp)
                service_port(pool["endpointPickerRef"]["name"], pool["endpointPickerRef"]["port"]["number"])
    for sm in r.kind("ServiceMonitor"):
        (svc,) = [s for s in r.kind("Service") if selects(sm["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])]
        for ep in sm["spec"]["endpoints"]:
            service_port(svc["metadata"]["name"], ep["port"])
    for pm in r.kind("PodMonitoring"):
        (w,) = [w for w in r.workloads() if selects(pm["spec"]["selector"]["matchLabels"], pod_labels(w))]
        for ep in pm["spec"]["endpoints"]:
            assert any(_port_of(c, ep["port"]) for c in containers(w))


@pytest.mark.parametrize("profile", PROFILES)
def test_probe_ports_exist_and_grpc_probes_are_native(profile):
    r = rendered(profile)
    for w in r.workloads():
        for c in containers(w):
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = c.get(kind)
                if not probe:
                    continue
                handler = next(h for h in ("grpc", "httpGet", "tcpSocket", "exec") if h in probe)
                if handler != "exec":
                    assert _port_of(c, probe[handler]["port"]), (w["metadata"]["name"], kind, probe)
                port = _port_of(c, probe[handler]["port"]) if handler != "exec" else None
                if port and port.get("name") in ("grpc", "grpc-health"):
                    assert handler == "grpc", f"{w['metadata']['name']} {kind}: gRPC port probed with {handler}"
    tls = r.values["grpcTLS"]["enabled"]
    for component in ("prefill", "decode"):
        c = r.component(component)["spec"]["template"]["spec"]["containers"][0]
        grpc = r.values[component]["settings"]["grpc"]
        env = r.container_env(component)
        prefix = SERVICES[component][1]
        # The port the probes use answers plaintext grpc.health.v1 by construction: with mTLS on
        # the gRPC port, the pod's plaintext health port (tandem_core/worker_pod.py serves it
        # whenever GRPC__HEALTH_PORT is set; tests/integration/test_security.py), never the TLS one.
        if tls:
            assert grpc["health_port"] and grpc["health_port"] != grpc["port"]
            assert int(env[prefix + "GRPC__HEALTH_PORT"]["value"]) == grpc["health_port"]
            assert _port_of(c, grpc["health_port"])["name"] == "grpc-health"
        want = grpc["health_port"] or grpc["port"]
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[kind]["grpc"]["port"] == want, (component, kind)
    gw = r.component("gateway")["spec"]["template"]["spec"]["containers"][0]
    assert gw["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert gw["livenessProbe"]["httpGet"]["path"] == "/healthz"


@pytest.mark.parametrize("profile", PROFILES)
def test_tpu_chips_match_topology(profile):
    r = rendered(profile)
    for component in ("prefill", "decode"):
        spec = r.component(component)["spec"]["template"]["spec"]
        c = spec["containers"][0]
        tpu = r.values[component]["tpu"]
        res = c["resources"]
        if not tpu["enabled"]:
            assert "google.com/tpu" not in res.get("limits", {}) and "nodeSelector" not in spec
            assert "tpu" not in c["image"]
            continue
        topology = spec["nodeSelector"]["cloud.google.com/gke-tpu-topology"]
        chips = math.prod(int(x) for x in topology.split("x"))
        assert res["limits"]["google.com/tpu"] == res["requests"]["google.com/tpu"] == chips == tpu["chips"]
        assert spec["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"] == tpu["accelerator"]
        assert {"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
        assert "worker-tpu" in c["image"]
        assert {"name": "JAX_PLATFORMS", "value": "tpu"} in c["env"]
    if profile == "tpu":
        sel = lambda comp: r.component(comp)["spec"]["template"]["spec"]["nodeSelector"]  # noqa: E731
        assert sel("prefill") == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
                                  "cloud.google.com/gke-tpu-topology": "2x4"}
        assert sel("decode")["cloud.google.com/gke-tpu-accelerator"] == "tpu-v6e-slice"
        # The gateway never lands on (or asks for) a TPU node.
        gw = r.component("gateway")["spec"]["template"]["spec"]
        assert "nodeSelector" not in gw and "google.com/tpu" not in json.dumps(gw)


@pytest.mark.parametrize("profile", PROFILES)
def test_lifecycle_matches_each_services_drain(profile):
    r = rendered(profile)
    for component in ("prefill", "decode"):
        d = r.component(component)
        spec = d["spec"]["template"]["spec"]
        c = spec["containers"][0]
        drain = r.values[component]["settings"]["drain_timeout_s"]
        pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert spec["terminationGracePeriodSeconds"] > pre_stop + drain
        startup = c["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "too short for JAX compilation"
        live = c["livenessProbe"]
        assert live["periodSeconds"] * live["failureThreshold"] > drain
        assert d["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
    decode = r.component("decode")
    assert decode["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0, "rollouts must keep decode capacity"
    gw = r.component("gateway")["spec"]["template"]["spec"]
    assert gw["terminationGracePeriodSeconds"] > (gw["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"]
                                                  + r.values["gateway"]["settings"]["shutdown_grace_s"])
    if r.values["prefill"]["pdb"]["enabled"]:
        for component in ("gateway", "prefill", "decode"):
            assert r.get("PodDisruptionBudget", f"{RELEASE}-tandem-{component}")
    autoscaled = {o["spec"]["scaleTargetRef"]["name"] for o in r.kind("HorizontalPodAutoscaler") + r.kind("ScaledObject")}
    autoscaled |= planner_scaled(r)
    for d in r.kind("Deployment"):
        # A fixed replica count would fight the autoscaler on every upgrade.
        assert ("replicas" in d["spec"]) == (d["metadata"]["name"] not in autoscaled)


@pytest.mark.parametrize("profile", PROFILES)
def test_pods_are_hardened(profile):
    r = rendered(profile)
    # Only pods that call the Kubernetes API get a token, each on a ServiceAccount of its own.
    api_clients = ({f"{RELEASE}-tandem-planner"} if planner_scaled(r) else set()) | (
        {f"{RELEASE}-tandem-epp"} if r.values["inferencePool"]["enabled"] else set())
    for w in r.workloads():
        spec = w["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] != 0
        name = w["metadata"]["name"]
        assert spec["automountServiceAccountToken"] is (name in api_clients), name
        if name in api_clients:
            assert spec["serviceAccountName"] == name and r.get("ServiceAccount", name)["automountServiceAccountToken"]
        for c in containers(w):
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"] and not sc.get("privileged")
            # A read-only root needs somewhere to write.
            assert any(m["mountPath"] in ("/tmp", "/data") for m in c["volumeMounts"])


def _peers_allow(policy: dict, labels: dict, port: int) -> bool:
    for rule in policy["spec"].get("ingress", []):
        if any(p["port"] == port for p in rule.get("ports", [])) and any(
            "podSelector" in peer and "namespaceSelector" not in peer and selects(peer["podSelector"]["matchLabels"], labels)
            for peer in rule.get("from", [])
        ):
            return True
    return False


@pytest.mark.parametrize("profile", ["default", "keda", "external-redis-tls", "planner", "planner-keda"])
def test_network_policy_allows_what_the_services_need_and_nothing_else(profile):
    r = rendered(profile)
    netpol = r.values["networkPolicy"]
    running = components(profile) + (["epp"] if r.values["inferencePool"]["enabled"] else [])
    labels = {c: pod_labels(r.component(c)) for c in running}
    pol = {c: r.get("NetworkPolicy", f"{RELEASE}-tandem-{c}") for c in running}
    assert len(r.kind("NetworkPolicy")) == len(running) + r.values["redis"]["enabled"]
    kv_port = r.values["prefill"]["settings"]["grpc"]["port"]
    assert _peers_allow(pol["prefill"], labels["decode"], kv_port)
    assert not _peers_allow(pol["prefill"], labels["gateway"], kv_port)
    assert len(pol["prefill"]["spec"]["ingress"]) == 1 and len(pol["prefill"]["spec"]["ingress"][0]["from"]) == 1
    assert pol["decode"]["spec"]["ingress"] == []
    gw_port = r.values["gateway"]["settings"]["port"]
    gw_ports = {p["containerPort"] for p in r.component("gateway")["spec"]["template"]["spec"]["containers"][0]["ports"]}
    gw_rules = pol["gateway"]["spec"]["ingress"]
    # /metrics on its own port: the API's peers (load balancers, client pods) reach the HTTP and
    # gRPC ports only; the metrics port only metricsFrom and the endpoint picker.
    metrics_port = r.values["gateway"]["settings"]["metrics_port"]
    assert metrics_port and metrics_port in gw_ports
    assert {p["port"] for p in gw_rules[0]["ports"]} == gw_ports - {metrics_port}
    assert all(rule["ports"] == [{"port": metrics_port, "protocol": "TCP"}] for rule in gw_rules[1:])
    assert not _peers_allow(pol["gateway"], labels["prefill"], gw_port)
    assert len(gw_rules) == 1 + bool(netpol["metricsFrom"]) + ("epp" in running)
    if netpol["metricsFrom"]:
        assert gw_rules[1]["from"] == netpol["metricsFrom"]
    if "epp" in running:
        # The endpoint picker scrapes the gateways' /metrics (the metrics port only, told by its
        # --model-server-metrics-port); the proxy calls it.
        assert _peers_allow(pol["gateway"], labels["epp"], metrics_port)
        assert not _peers_allow(pol["gateway"], labels["epp"], gw_port)
        assert not _peers_allow(pol["gateway"], labels["epp"], r.values["gateway"]["settings"]["grpc_port"])
        epp_args = r.component("epp")["spec"]["template"]["spec"]["containers"][0]["args"]
        assert f"--model-server-metrics-port={metrics_port}" in epp_args
        epp_rules = pol["epp"]["spec"]["ingress"]
        assert epp_rules[0]["from"][1:] == netpol["gatewayFrom"] and {p["port"] for p in epp_rules[0]["ports"]} == {9002, 9003}
        assert [(rule["from"], [p["port"] for p in rule["ports"]]) for rule in epp_rules[1:]] == (
            [(netpol["metricsFrom"], [9090])] if netpol["metricsFrom"] else [])
    if "planner" in running:
        # Only KEDA (when it follows the planner) and the metrics scrapers reach the planner.
        want = (netpol["kedaFrom"] if r.values["planner"]["keda"] else []) + netpol["metricsFrom"]
        rules = pol["planner"]["spec"]["ingress"]
        assert rules == ([{"from": want, "ports": [{"port": r.values["planner"]["settings"]["port"], "protocol": "TCP"}]}]
                         if want else [])
        assert not any(_peers_allow(p, labels["planner"], port) for p in pol.values() for port in (gw_port, kv_port))
    if r.values["redis"]["enabled"]:
        redis_pol = r.get("NetworkPolicy", f"{RELEASE}-tandem-redis")
        for c in components(profile):
            assert _peers_allow(redis_pol, labels[c], r.values["redis"]["port"]), c
        if "epp" in running:
            assert not _peers_allow(redis_pol, labels["epp"], r.values["redis"]["port"])
        # KEDA reaches Redis only when a trigger reads the streams (not when it follows the planner).
        keda_reads = any(t["type"] == "redis-streams" for so in r.kind("ScaledObject") for t in so["spec"]["triggers"])
        assert (len(redis_pol["spec"]["ingress"]) == 2) == keda_reads
        assert len(redis_pol["spec"]["ingress"][0]["from"]) == len(components(profile))
    else:
        assert all(p["metadata"]["name"] != f"{RELEASE}-tandem-redis" for p in r.kind("NetworkPolicy"))


@pytest.mark.parametrize("profile", ["keda", "everything-on"])
def test_keda_scales_on_the_real_streams(profile):
    r = rendered(profile)
    expected = {
        "prefill": ({KS.admission_stream(r.values["prefill"]["settings"]["pool"], p, 0) for p in keys.PRIORITIES}, keys.PREFILL_GROUP),
        "decode": ({KS.ready_stream(r.values["decode"]["settings"]["pool"], 0)}
                   | ({KS.direct_stream(r.values["decode"]["settings"]["pool"], 0)} if r.values["decode"]["settings"]["direct_prefill"] else set()),
                   keys.DECODE_GROUP),
    }
    for component, (streams, group) in expected.items():
        so = r.get("ScaledObject", f"{RELEASE}-tandem-{component}")
        trig = so["spec"]["triggers"]
        assert {t["metadata"]["stream"] for t in trig} == streams
        assert {t["metadata"]["consumerGroup"] for t in trig} == {group}
        assert all(int(t["metadata"]["lagCount"]) == r.values[component]["keda"]["lagCount"] for t in trig)
        auth = r.get("TriggerAuthentication", trig[0]["authenticationRef"]["name"])
        params = {s["parameter"] for s in auth["spec"]["secretTargetRef"]}
        if r.values["redis"]["enabled"]:
            svc = r.get("Service", f"{RELEASE}-tandem-redis")
            assert trig[0]["metadata"]["address"] == f"{svc['metadata']['name']}.{NAMESPACE}.svc:{svc['spec']['ports'][0]['port']}"
            assert params == {"password"} and "enableTLS" not in trig[0]["metadata"]
        else:
            assert trig[0]["metadata"]["address"] == "10.0.0.3:6378"
            assert trig[0]["metadata"]["enableTLS"] == "true" and params == {"password", "ca"}


def test_bundled_redis_persists_and_uses_a_password():
    r = rendered("default")
    sts = r.get("StatefulSet", f"{RELEASE}-tandem-redis")
    args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    opt = dict(zip(args[::2], args[1::2]))
    assert opt["--appendonly"] == "yes" and opt["--dir"] == "/data"
    assert "--requirepass" not in args  # from a file (test_chart_redis_auth.py), never a command line
    assert opt["--maxmemory-policy"] == "noeviction"
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "data" and claim["spec"]["resources"]["requests"]["storage"]
    secret = r.get("Secret", f"{RELEASE}-tandem-redis")
    assert len(secret["data"]["redis-password"]) > 20
    for component in components("default"):
        ref = r.container_env(component)[SERVICES[component][1] + "REDIS__PASSWORD"]["valueFrom"]["secretKeyRef"]
        # each role its own Redis user and password (redis.acl, test_chart_redis_auth.py)
        assert ref == {"name": secret["metadata"]["name"], "key": f"redis-password-{component}"}


def test_external_redis_uses_tls_with_the_mounted_ca():
    r = rendered("external-redis-tls")
    assert not r.kind("StatefulSet")
    for component in components("external-redis-tls"):
        prefix = SERVICES[component][1]
        env = r.container_env(component)
        url = env[prefix + "REDIS__URL"]["value"]
        assert url.startswith("rediss://10.0.0.3:6378/0?ssl_ca_certs=")
        ca_path = url.split("ssl_ca_certs=")[1]
        c = r.component(component)["spec"]["template"]["spec"]["containers"][0]
        mount = next(m for m in c["volumeMounts"] if m["name"] == "redis-ca")
        assert ca_path == f"{mount['mountPath']}/ca.crt"
        assert env[prefix + "REDIS__PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "memorystore-auth", "key": "password"}
        # Internal gRPC mTLS material: mounted into the workers (the KV transfer's ends) only; the
        # gateway, which faces clients, holds no key that could pull KV.
        assert any(m["name"] == "grpc-tls" and m["readOnly"] for m in c["volumeMounts"]) == (component in ("prefill", "decode"))


def test_gateway_api_keys_come_from_a_secret():
    created = rendered("default")
    secret = created.get("Secret", f"{RELEASE}-tandem-gateway-auth")
    assert len(json.loads(base64.b64decode(secret["data"]["api-keys"]))) == 1
    given = Rendered({"gateway": {"auth": {"apiKeys": ["a", "b"], "adminKey": "adm"}}})
    data = given.get("Secret", f"{RELEASE}-tandem-gateway-auth")["data"]
    assert json.loads(base64.b64decode(data["api-keys"])) == ["a", "b"] and base64.b64decode(data["admin-key"]) == b"adm"
    existing = rendered("external-redis-tls")
    assert not [s for s in existing.kind("Secret") if "gateway-auth" in s["metadata"]["name"]]
    env = existing.container_env("gateway")
    assert env["TANDEM_GATEWAY_API_KEYS"]["valueFrom"]["secretKeyRef"]["name"] == "tandem-api-keys"
    assert "TANDEM_GATEWAY_API_KEYS" not in rendered("everything-off").container_env("gateway")


def test_notes_say_how_to_reach_the_gateway():
    notes = rendered("default").files["tandem/templates/NOTES.txt"]
    assert f"port-forward svc/{RELEASE}-tandem-gateway" in notes and "/v1/models" in notes
    assert "https://tandem.example.com/v1/models" in rendered("external-redis-tls").files["tandem/templates/NOTES.txt"]


def test_grafana_dashboard_ships_the_key_panels():
    dash = json.loads((CHART / "dashboards" / "tandem.json").read_text())
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
    for metric in ("tandem_ttft_seconds", "tandem_itl_seconds", "tandem_admission_backlog",
                   "tandem_decode_slots_used", "tandem_prefill_held_kv_bytes"):
        assert metric in exprs
    cm = rendered("keda").get("ConfigMap", f"{RELEASE}-tandem-dashboard")
    assert json.loads(cm["data"]["tandem.json"]) == dash


# ------------------------------------------------------------------------------------------------
if __name__ == "__main__":
    if sys.argv[1:] == ["--write-schema"]:
        write_schema()
        print("wrote", CHART / "values.schema.json")
    else:
        sys.exit("usage: python tests/unit/test_chart.py --write-schema")


def test_metrics_are_on_their_own_port_and_kept_inside():
    """gateway.settings.metrics_port: the scrape annotations, the Service, the ServiceMonitor and
    PodMonitoring name it; the NetworkPolicy admits metricsFrom to it and to nothing else, and the
    API's peers not to it; with 0, everything points at the HTTP port as before."""
    scraper = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    on = {"networkPolicy": {"metricsFrom": scraper}, "planner": {"enabled": True},
          "metrics": {"serviceMonitor": {"enabled": True}, "podMonitoring": {"enabled": True}}}
    for metrics_port, want_name in ((9400, "metrics"), (0, "http")):
        vals = _deep_merge(on, {"gateway": {"settings": {"metrics_port": metrics_port}}})
        r = Rendered(vals)
        port = metrics_port or r.values["gateway"]["settings"]["port"]
        gw = r.component("gateway")
        assert gw["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(port)
        assert r.container_env("gateway")["TANDEM_GATEWAY_METRICS_PORT"]["value"] == str(metrics_port)
        svc_ports = {p["name"]: p["port"] for p in r.get("Service", f"{RELEASE}-tandem-gateway")["spec"]["ports"]}
        assert svc_ports.get("metrics") == (metrics_port or None)
        for kind in ("ServiceMonitor", "PodMonitoring"):
            assert r.get(kind, f"{RELEASE}-tandem-gateway")["spec"]["endpoints"][0]["port"] == want_name
            assert r.get(kind, f"{RELEASE}-tandem-planner")["spec"]["endpoints"][0]["port"] == "http"
        rules = r.get("NetworkPolicy", f"{RELEASE}-tandem-gateway")["spec"]["ingress"]
        assert rules[1] == {"from": scraper, "ports": [{"port": port, "protocol": "TCP"}]}
        api_ports = {p["port"] for p in rules[0]["ports"]}
        assert (metrics_port in api_ports) is False and r.values["gateway"]["settings"]["port"] in api_ports
