"""The chart's planner and InferencePool: the planner is told this release's Deployments, namespace,
Lease and profile; only it (when it scales) and the endpoint picker get an API token, with Roles
that allow no more than they use; KEDA follows the planner's /keda exactly; owners of the worker
replicas never overlap; the InferencePool and HTTPRoute validate against the CRDs' published
schemas (tests/unit/crds), which do reject bad objects. Rendering helpers: test_chart.py; the
profiles `planner` and `planner-keda` also run every generic test there.
"""
from __future__ import annotations

import copy
import hashlib
import json
import re
from pathlib import Path

import helm_python as helm
import jsonschema
import pytest
import yaml

from planner.decide import ROLES
from planner.profile import parse_profile
from planner.settings import PlannerSettings
from tests.unit.crds import published_schema
from tests.unit.test_chart import (
    CHART, NAMESPACE, RELEASE, ROOT, Rendered, containers, pod_labels, profile_values, render,
    rendered, selects,
)

PLANNER, EPP, POOL = f"{RELEASE}-tandem-planner", f"{RELEASE}-tandem-epp", f"{RELEASE}-tandem-gateway"
WORKERS = {role: f"{RELEASE}-tandem-{role}" for role in ROLES}


def _pod(r: Rendered, name: str) -> dict:
    return r.get("Deployment", name)["spec"]["template"]["spec"]


def _mounted_file(r: Rendered, env_path: str) -> str:
    """The content a container would read at `env_path`, through its ConfigMap volume."""
    spec = _pod(r, PLANNER)
    mount = next(m for m in spec["containers"][0]["volumeMounts"] if env_path.startswith(m["mountPath"] + "/"))
    vol = next(v for v in spec["volumes"] if v["name"] == mount["name"])["configMap"]
    rel = env_path[len(mount["mountPath"]) + 1:]
    (item,) = [i for i in vol["items"] if i["path"] == rel]
    return r.get("ConfigMap", vol["name"])["data"][item["key"]]


# The planner's settings the chart owns
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("profile", ["planner", "planner-keda"])
def test_planner_is_told_this_releases_objects(profile, monkeypatch):
    r = rendered(profile)
    env = {k: v["value"] for k, v in r.container_env("planner").items() if "value" in v}
    for role, name in WORKERS.items():
        assert env[f"TANDEM_PLANNER_{role.upper()}__DEPLOYMENT"] == name and r.get("Deployment", name)
    assert env["TANDEM_PLANNER_KUBERNETES__NAMESPACE"] == NAMESPACE
    assert env["TANDEM_PLANNER_KUBERNETES__LEASE_NAME"] == PLANNER
    assert env["TANDEM_PLANNER_KUBERNETES__RECORD_FILE"] == "", "a record file would stop it scaling"
    spec = _pod(r, PLANNER)
    assert spec["containers"][0]["command"] == ["tandem", "planner"]
    assert spec["containers"][0]["image"] == r.component("gateway")["spec"]["template"]["spec"]["containers"][0]["image"]
    # The chart's settings parse into the class the planner builds.
    for k in list(env):
        monkeypatch.setenv(k, env[k])
    s = PlannerSettings()
    assert (s.prefill.deployment, s.decode.deployment, s.kubernetes.namespace) == (WORKERS["prefill"], WORKERS["decode"], NAMESPACE)
    assert s.mode == ("kubernetes" if profile == "planner" else "off")


def test_inline_profile_is_mounted_where_profile_path_points_and_parses():
    r = rendered("planner")
    path = r.container_env("planner")["TANDEM_PLANNER_PROFILE_PATH"]["value"]
    doc = json.loads(_mounted_file(r, path))
    assert parse_profile(doc, path).slots == r.values["decode"]["settings"]["slots"]
    # The same profile written as a YAML map in values renders the same document.
    as_map = Rendered({"planner": {"enabled": True, "profile": doc}})
    assert json.loads(_mounted_file(as_map, path)) == doc


def test_existing_configmap_profile_and_the_builtin_one():
    r = rendered("planner-keda")
    vol = next(v for v in _pod(r, PLANNER)["volumes"] if v["name"] == "profile")["configMap"]
    assert vol == {"name": "tandem-capacity-profile", "items": [{"key": "v5e-2x4.json", "path": "profile.json"}]}
    assert not [c for c in r.kind("ConfigMap") if c["metadata"]["name"].endswith("-profile")]
    builtin = Rendered({"planner": {"enabled": True}})
    assert builtin.container_env("planner")["TANDEM_PLANNER_PROFILE_PATH"]["value"] == ""
    assert not any(v["name"] == "profile" for v in _pod(builtin, PLANNER)["volumes"])


def test_planner_with_external_redis_gets_the_ca_but_no_grpc_material():
    vals = profile_values("external-redis-tls")
    vals["planner"] = {"enabled": True}
    r = Rendered(vals)
    env = r.container_env("planner")
    url = env["TANDEM_PLANNER_REDIS__URL"]["value"]
    mounts = {m["name"]: m for m in _pod(r, PLANNER)["containers"][0]["volumeMounts"]}
    assert url.split("ssl_ca_certs=")[1] == f"{mounts['redis-ca']['mountPath']}/ca.crt"
    assert env["TANDEM_PLANNER_REDIS__PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "memorystore-auth", "key": "password"}
    assert "grpc-tls" not in mounts and r.values["grpcTLS"]["enabled"]


def test_default_render_has_no_planner_and_no_pool():
    r = rendered("default")
    assert not {"Role", "RoleBinding", "InferencePool", "ClusterRole"} & {d["kind"] for d in r.docs}
    assert not [d for d in r.docs if re.search(r"-(planner|epp)(-|$)", d["metadata"]["name"])]
    assert [sa["metadata"]["name"] for sa in r.kind("ServiceAccount")] == [f"{RELEASE}-tandem"]
    for name in WORKERS.values():
        assert r.get("Deployment", name)["spec"]["replicas"] == 1


# Least privilege
# ------------------------------------------------------------------------------------------------

def _rules(r: Rendered, name: str) -> list[tuple]:
    binding = r.get("RoleBinding", name)
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": name, "namespace": NAMESPACE}]
    return sorted((tuple(x["apiGroups"]), tuple(x["resources"]), tuple(sorted(x.get("resourceNames", []))),
                   tuple(sorted(x["verbs"]))) for x in r.get("Role", name)["rules"])


def test_planner_role_allows_scaling_two_deployments_and_one_lease():
    r = rendered("planner")
    workers = tuple(sorted(WORKERS.values()))
    assert _rules(r, PLANNER) == sorted([
        (("apps",), ("deployments/scale",), workers, ("get", "patch", "update")),
        (("apps",), ("deployments",), workers, ("get",)),
        (("coordination.k8s.io",), ("leases",), (PLANNER,), ("get", "update")),
        (("coordination.k8s.io",), ("leases",), (), ("create",)),  # create cannot name its object
    ])
    assert "cannot be restricted by resourceNames" in r.files["tandem/templates/planner/rbac.yaml"]


def test_epp_role_only_reads_its_namespace():
    r = rendered("planner")
    for _, resources, names, verbs in _rules(r, EPP):
        assert set(verbs) <= {"get", "list", "watch"} and not names
    assert {res for _, rs, _, _ in _rules(r, EPP) for res in rs} >= {"pods", "inferencepools"}


@pytest.mark.parametrize("profile", ["default", "planner", "planner-keda"])
def test_no_cluster_wide_rights_and_tokens_only_where_the_api_is_called(profile):
    r = rendered(profile)
    assert not r.kind("ClusterRole") and not r.kind("ClusterRoleBinding")
    scales = r.values["planner"]["enabled"] and r.values["planner"]["settings"]["mode"] == "kubernetes"
    assert bool(r.kind("Role")) == (scales or r.values["inferencePool"]["enabled"])
    if r.values["planner"]["enabled"] and not scales:
        # Publishing only: no Role, no token, the shared ServiceAccount.
        assert not [x for x in r.kind("Role") if x["metadata"]["name"] == PLANNER]
        assert _pod(r, PLANNER)["serviceAccountName"] == f"{RELEASE}-tandem"
        assert _pod(r, PLANNER)["automountServiceAccountToken"] is False
    for sa in r.kind("ServiceAccount"):
        assert sa["automountServiceAccountToken"] is (sa["metadata"]["name"] in (PLANNER, EPP))


# KEDA follows the planner
# ------------------------------------------------------------------------------------------------

def test_keda_follows_the_planners_keda_endpoint():
    r = rendered("planner-keda")
    svc = r.get("Service", PLANNER)
    port = svc["spec"]["ports"][0]["port"]
    assert port == r.values["planner"]["settings"]["port"]
    for role, name in WORKERS.items():
        so = r.get("ScaledObject", name)["spec"]
        (trig,) = so["triggers"]
        assert trig["type"] == "metrics-api" and trig["metricType"] == "AverageValue"
        assert trig["metadata"] == {"url": f"http://{PLANNER}.{NAMESPACE}.svc:{port}/keda", "format": "json",
                                    "valueLocation": f"{role}.replicas", "targetValue": "1"}
        # The HPA's desired count is ceil(value / target) = the planner's answer, within its bounds.
        answer = {r_: {"replicas": 5} for r_ in ROLES}
        value = answer
        for part in trig["metadata"]["valueLocation"].split("."):
            value = value[part]
        assert -(-value // int(trig["metadata"]["targetValue"])) == 5
        bounds = r.values["planner"]["settings"][role]
        assert (so["minReplicaCount"], so["maxReplicaCount"]) == (bounds["min_replicas"], bounds["max_replicas"])
        behavior = so["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        assert behavior["scaleDown"]["stabilizationWindowSeconds"] == 0 == behavior["scaleUp"]["stabilizationWindowSeconds"]
        assert "replicas" not in r.get("Deployment", name)["spec"]
    assert not r.kind("TriggerAuthentication"), "the planner's endpoint needs no Redis credentials"


def test_planner_scaling_itself_leaves_replicas_to_it():
    r = rendered("planner")
    assert not r.kind("ScaledObject") and not r.kind("HorizontalPodAutoscaler")
    for name in WORKERS.values():
        assert "replicas" not in r.get("Deployment", name)["spec"]


BASE = {"planner": {"enabled": True}}
KUBE = {"planner": {"enabled": True, "settings": {"mode": "kubernetes"}}}


def _with(over: dict, base: dict = BASE) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = {**out.get(k, {}), **v} if isinstance(v, dict) else v
    return out


BAD = [
    ("kube-and-keda", _with({"prefill": {"keda": {"enabled": True}}}, KUBE), "KEDA (prefill.keda.enabled) would scale the same Deployment"),
    ("kube-and-planner-keda", _with({"planner": {"enabled": True, "keda": True, "settings": {"mode": "kubernetes"}}}),
     "KEDA (planner.keda) would scale the same Deployment"),
    ("kube-and-hpa", _with({"decode": {"autoscaling": {"enabled": True}}}, KUBE), "decode.autoscaling.enabled=true gives the same Deployment an HPA"),
    ("planner-keda-and-hpa", _with({"planner": {"enabled": True, "keda": True}, "prefill": {"autoscaling": {"enabled": True}}}),
     "KEDA creates its own HorizontalPodAutoscaler for prefill"),
    ("keda-without-planner", {"planner": {"keda": True}}, "planner.keda=true makes KEDA follow the planner, but planner.enabled=false"),
    ("mode-local", {"planner": {"enabled": True, "settings": {"mode": "local"}}}, "mode=local is for `tandem local --planner`"),
    ("replicas-without-lease", {"planner": {"enabled": True, "replicas": 2}}, "each replica would decide on its own"),
    ("pool", {"planner": {"enabled": True, "settings": {"pool": "chat"}}}, "planner.settings.pool (\"chat\") must equal"),
    ("zero", {"planner": {"enabled": True, "settings": {"decode": {"min_replicas": 0}}}}, "set planner.settings.decode.allow_zero=true"),
    ("min-max", {"planner": {"enabled": True, "settings": {"prefill": {"min_replicas": 9}}}}, "prefill.min_replicas (9) > max_replicas (8)"),
    ("profile-not-json", {"planner": {"enabled": True, "profile": "{not json"}}, "planner.profile is not valid JSON"),
    ("profile-format", {"planner": {"enabled": True, "profile": '{"format": "v0"}'}}, "want \"tandem-capacity-profile/v1\""),
    ("profile-slots", {"planner": {"enabled": True, "profile": json.dumps(
        {"format": "tandem-capacity-profile/v1", "decode": {"slots": 64}})}}, "measured with 64 decode slots but decode.settings.slots=8"),
    ("profile-name", {"planner": {"enabled": True, "profile": "My Profile"}}, "neither JSON"),
    # values.schema.json
    ("settings-typo", {"planner": {"settings": {"interval": 5}}}, "/planner/settings"),
    ("mode-enum", {"planner": {"settings": {"mode": "auto"}}}, "/planner/settings/mode"),
    ("port-zero", {"planner": {"settings": {"port": 0}}}, "/planner/settings/port"),
    ("owned-setting", {"planner": {"settings": {"prefill": {"deployment": "x"}}}}, "/planner/settings/prefill"),
    ("settings-via-extraEnv", {"planner": {"extraEnv": [{"name": "TANDEM_PLANNER_MODE", "value": "kubernetes"}]}},
     "/planner/extraEnv/0/name"),
    ("failure-mode", {"inferencePool": {"failureMode": "Sometimes"}}, "/inferencePool/failureMode"),
    ("epp-tag", {"images": {"epp": {"tag": ""}}}, "/images/epp/tag"),
]


@pytest.mark.parametrize("values,message", [pytest.param(v, m, id=i) for i, v, m in BAD])
def test_bad_planner_values_fail_with_a_clear_message(values, message):
    with pytest.raises(helm.HelmError) as err:
        render(values)
    assert message in str(err.value)


# InferencePool, endpoint picker, HTTPRoute
# ------------------------------------------------------------------------------------------------

def _body(doc: dict) -> dict:
    return {k: v for k, v in doc.items() if k != "_file"}


def test_pool_selects_the_gateways_and_its_picker_watches_it():
    r = rendered("planner")
    pool = r.get("InferencePool", POOL)["spec"]
    gw = r.component("gateway")
    (w,) = [x for x in r.workloads() if selects(pool["selector"]["matchLabels"], pod_labels(x))]
    assert w is gw
    assert pool["targetPorts"] == [{"number": r.values["gateway"]["settings"]["port"]}]
    epp_svc = r.get("Service", pool["endpointPickerRef"]["name"])
    assert pool["endpointPickerRef"]["port"]["number"] in [p["port"] for p in epp_svc["spec"]["ports"]]
    (c,) = containers(r.get("Deployment", EPP))
    args = dict(a.split("=", 1) for a in c["args"])
    assert (args["--pool-name"], args["--pool-namespace"], args["--pool-group"]) == (POOL, NAMESPACE, "inference.networking.k8s.io")
    assert re.fullmatch(r"registry\.k8s\.io/gateway-api-inference-extension/epp:v1\.\d+\.\d+", c["image"])
    # The gauges the picker reads by default are the gateway's (gateway/metrics.py).
    gauges = (ROOT / "gateway" / "metrics.py").read_text()
    for metric in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        assert f'"{metric}"' in gauges
    hc = r.get("HealthCheckPolicy", POOL)["spec"]["targetRef"]
    assert hc == {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": POOL}


def test_route_goes_to_the_pool_when_it_is_on():
    (route,) = rendered("planner").kind("HTTPRoute")
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": POOL}]
    (plain,) = rendered("tpu").kind("HTTPRoute")
    assert plain["spec"]["rules"][0]["backendRefs"][0] == {"name": POOL, "port": 80}
    alone = Rendered({"inferencePool": {"enabled": True}})
    assert alone.kind("InferencePool") and not alone.kind("HTTPRoute")


def test_custom_picker_config_is_mounted():
    cfg = "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- type: queue-scorer\n"
    r = Rendered({"inferencePool": {"enabled": True, "epp": {"pluginsConfig": cfg}}})
    (c,) = containers(r.get("Deployment", EPP))
    assert "--config-file=/config/plugins.yaml" in c["args"]
    assert yaml.safe_load(r.get("ConfigMap", EPP)["data"]["plugins.yaml"])["kind"] == "EndpointPickerConfig"
    assert "--config-file=/config/plugins.yaml" not in containers(rendered("planner").get("Deployment", EPP))[0]["args"]


@pytest.mark.parametrize("kind", ["InferencePool", "HTTPRoute"])
def test_published_schemas_accept_the_chart_and_reject_bad_objects(kind):
    r = rendered("planner")
    (doc,) = r.kind(kind)
    body = _body(doc)
    schema = published_schema(body["apiVersion"], kind)
    jsonschema.validate(body, schema)
    if kind == "InferencePool":
        breakages = [("spec", "targetPorts", []), ("spec", "endpointPickerRef", "failureMode", "Sometimes"),
                     ("spec", "appProtocol", "grpc")]
    else:
        breakages = [("spec", "rules", 0, "backendRefs", 0, "kind", "Inference Pool"),
                     ("spec", "rules", 0, "matches", 0, "path", "type", "Glob")]
    for *path, value in breakages:
        bad = copy.deepcopy(body)
        node = bad
        for p in path[:-1]:
            node = node[p]
        node[path[-1]] = value
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_vendored_crds_are_the_published_files():
    readme = (Path(__file__).parent / "crds" / "README.md").read_text()
    for f in (Path(__file__).parent / "crds").glob("*.yaml"):
        assert hashlib.sha256(f.read_bytes()).hexdigest() in readme, f"{f.name}: not the file the README names"
    version = yaml.safe_load((CHART / "values.yaml").read_text())["images"]["epp"]["tag"]
    pool_crd = yaml.safe_load((Path(__file__).parent / "crds" / "inference.networking.k8s.io_inferencepools.yaml").read_text())
    assert pool_crd["metadata"]["annotations"]["inference.networking.k8s.io/bundle-version"] == version
