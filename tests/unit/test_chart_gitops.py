"""The chart as a GitOps team ships it: `helm template` (Argo CD, Flux post-renderers, CI) renders
the same objects every time, Secrets come from Secrets the team manages (or from values, or a seed)
and reach the pods only by reference, images are pinned by digest, the accelerator is one GKE
knows, and the JAX compilation cache can outlive a pod. Rendered with the real Helm library like
test_chart.py, whose helpers these reuse.
"""
from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.unit.test_chart import (
    CHART, CRD_SCHEMAS, K8S_VERSIONS, NAMESPACE, PROFILES, RELEASE, TEST_SEED, Rendered, _chart,
    containers, render, rendered, seeded,
)

DIGEST = {name: "sha256:" + (c * 64) for name, c in
          (("gateway", "a"), ("workerCpu", "b"), ("workerTpu", "c"), ("epp", "d"), ("redis", "e"))}
REPO = "us-docker.pkg.dev/my-project/tandem"

# A GitOps install: every Secret is one the team manages (External Secrets, Sealed Secrets, SOPS),
# every image pinned by digest, no seed in the repository.
GITOPS = {
    "secretSeed": "",
    "gateway": {"auth": {"existingSecret": "tandem-api-keys"}},
    "redis": {"auth": {"existingSecret": "tandem-redis-auth"},
              "image": {"digest": DIGEST["redis"]}},
    "images": {
        "gateway": {"repository": f"{REPO}/tandem-gateway", "tag": "0.1.0", "digest": DIGEST["gateway"]},
        "workerCpu": {"repository": f"{REPO}/tandem-worker-cpu", "digest": DIGEST["workerCpu"]},
        "workerTpu": {"repository": f"{REPO}/tandem-worker-tpu", "digest": DIGEST["workerTpu"]},
        "epp": {"digest": DIGEST["epp"]},
    },
    # Every image in play: a TPU decode pool, the planner (gateway image), the endpoint picker.
    "decode": {"tpu": {"enabled": True, "accelerator": "tpu-v6e-slice", "topology": "2x2", "chips": 4}},
    "planner": {"enabled": True},
    "inferencePool": {"enabled": True},
    # The internal gRPC mTLS certificate too (or cert-manager: test_cert_manager_renders_are_identical).
    "grpcTLS": {"secretName": "tandem-internal-grpc-tls"},
}


def _validate_all(r: Rendered) -> None:
    for doc in r.docs:
        body = {k: v for k, v in doc.items() if k != "_file"}
        key = (body["apiVersion"], body["kind"])
        if key in CRD_SCHEMAS:
            jsonschema.validate(body, CRD_SCHEMAS[key])
            continue
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(body, version, strict=True)


def _secret_refs(r: Rendered) -> set[str]:
    """Names of the Secrets the workloads read through secretKeyRef."""
    names = set()
    for w in r.workloads():
        for c in containers(w):
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    names.add(ref["name"])
    return names


# ------------------------------------------------------------------------------------------------
# GitOps install: existing Secrets, digests
# ------------------------------------------------------------------------------------------------

def test_gitops_install_with_existing_secrets_and_digests():
    r = Rendered(GITOPS)
    _validate_all(r)
    report = helm.lint(CHART, seeded(GITOPS), strict=True, namespace=NAMESPACE, kube_version=f"v{K8S_VERSIONS[0]}.0")
    assert not report["errors"] and not [m for m in report["messages"] if m["severity"] >= 3], report

    # The chart makes no Secret of its own: the pods read the team's.
    assert r.kind("Secret") == []
    assert _secret_refs(r) == {"tandem-api-keys", "tandem-redis-auth"}
    tls_volumes = {v["secret"]["secretName"] for w in r.workloads() for v in w["spec"]["template"]["spec"]["volumes"]
                   if v["name"] == "grpc-tls"}
    assert tls_volumes == {"tandem-internal-grpc-tls"}
    gw = r.container_env("gateway")
    assert gw["TANDEM_GATEWAY_API_KEYS"]["valueFrom"]["secretKeyRef"] == {"name": "tandem-api-keys", "key": "api-keys"}

    # Every image is repository@digest, the digest winning over a tag.
    images = {c["image"] for w in r.workloads() for c in containers(w)}
    want = {
        f"{REPO}/tandem-gateway@{DIGEST['gateway']}",            # gateway and planner
        f"{REPO}/tandem-worker-cpu@{DIGEST['workerCpu']}",       # prefill (CPU)
        f"{REPO}/tandem-worker-tpu@{DIGEST['workerTpu']}",       # decode (TPU)
        f"registry.k8s.io/gateway-api-inference-extension/epp@{DIGEST['epp']}",
        f"redis@{DIGEST['redis']}",
    }
    assert images == want
    assert r.component("planner")["spec"]["template"]["spec"]["containers"][0]["image"] == f"{REPO}/tandem-gateway@{DIGEST['gateway']}"


def test_a_digest_must_be_a_sha256():
    with pytest.raises(helm.HelmError) as err:
        render({"images": {"gateway": {"digest": "latest"}}})
    assert "/images/gateway/digest" in str(err.value)


# ------------------------------------------------------------------------------------------------
# Secrets: the same on every render, or a clear refusal
# ------------------------------------------------------------------------------------------------

def _secrets(files: dict[str, str]) -> dict[str, dict]:
    out = {}
    for path, text in files.items():
        if path.endswith(".txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc and doc["kind"] == "Secret":
                out[doc["metadata"]["name"]] = doc
    return out


def _pod_annotations(files: dict[str, str]) -> dict[str, dict]:
    out = {}
    for path, text in files.items():
        if path.endswith(".txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc and doc["kind"] in ("Deployment", "StatefulSet"):
                out[doc["metadata"]["name"]] = doc["spec"]["template"]["metadata"].get("annotations", {})
    return out


@pytest.mark.parametrize("values", [
    pytest.param({}, id="derived-from-seed"),
    pytest.param({"secretSeed": "", "gateway": {"auth": {"apiKeys": ["k-one", "k-two"], "adminKey": "adm"}},
                  "redis": {"auth": {"password": "pw-from-values"}}}, id="from-values"),
])
def test_rendering_twice_gives_identical_secrets(values):
    """What `helm template` does on every Argo CD sync: a fresh, offline render. Two of them (a
    fresh Chart load each time, like two syncs) must give byte-identical Secrets and the same
    pod annotations, or every sync would rotate the API key and the Redis password."""
    def template() -> dict[str, str]:
        chart = helm.Chart.load(CHART)
        return chart.render(seeded(values), name=RELEASE, namespace=NAMESPACE, is_install=True)

    first, second = template(), template()
    s1, s2 = _secrets(first), _secrets(second)
    tls = f"{RELEASE}-tandem-grpc-tls"
    assert set(s1) == {f"{RELEASE}-tandem-gateway-auth", f"{RELEASE}-tandem-redis", tls}
    # The one exception, as documented (values.yaml grpcTLS): the chart-made gRPC CA is random and
    # kept across `helm upgrade` by `lookup`, which an offline render cannot do; GitOps installs
    # take it from cert-manager or a Secret of their own (test_cert_manager_renders_are_identical).
    assert s1.pop(tls) != s2.pop(tls)
    assert s1 == s2
    assert _pod_annotations(first) == _pod_annotations(second)
    # An upgrade (is_upgrade) renders them the same too.
    upgrade = helm.Chart.load(CHART).render(seeded(values), name=RELEASE, namespace=NAMESPACE, is_upgrade=True)
    up = _secrets(upgrade)
    up.pop(tls)
    assert up == s1


def test_cert_manager_renders_are_identical():
    """mTLS on as a GitOps install has it: the certificates from cert-manager (auto-detected where
    the cluster serves cert-manager.io/v1; Argo CD passes the cluster's API versions). Two offline
    renders are byte-identical, every file, and no Secret holds a chart-made key."""
    values = {"grpcTLS": {"certManager": {"enabled": True}}}

    def template() -> dict[str, str]:
        return helm.Chart.load(CHART).render(seeded(values), name=RELEASE, namespace=NAMESPACE, is_install=True)

    first = template()
    assert first == template()
    r = Rendered(values)
    assert f"{RELEASE}-tandem-grpc-tls" not in {s["metadata"]["name"] for s in r.kind("Secret")}
    cert = next(d for d in r.docs if d["kind"] == "Certificate" and not d["spec"].get("isCA"))
    assert cert["spec"]["secretName"] == f"{RELEASE}-tandem-grpc-tls"
    assert set(cert["spec"]["usages"]) >= {"server auth", "client auth"}
    server_name = r.container_env("prefill")["TANDEM_PREFILL_GRPC__TLS_SERVER_NAME"]["value"]
    assert cert["spec"]["dnsNames"] == [server_name]


def test_derived_secrets_are_strong_distinct_and_follow_the_seed():
    def secrets(seed: str, name: str = RELEASE) -> tuple[str, str]:
        files = _chart().render({"secretSeed": seed}, name=name, namespace=NAMESPACE, is_install=True)
        s = _secrets(files)
        keys = json.loads(base64.b64decode(s[f"{name}-tandem-gateway-auth"]["data"]["api-keys"]))
        password = base64.b64decode(s[f"{name}-tandem-redis"]["data"]["redis-password"]).decode()
        return keys[0], password

    key, password = secrets(TEST_SEED)
    assert re.fullmatch(r"tdm-[0-9a-f]{40}", key) and re.fullmatch(r"[0-9a-f]{64}", password)
    assert key[4:] not in password, "the API key and the Redis password must not share material"
    assert TEST_SEED not in key + password
    # Another release (or namespace) with the same seed gets other secrets; another seed, others too.
    assert secrets(TEST_SEED, "other") != (key, password)
    other_seed = secrets(TEST_SEED[::-1])
    assert other_seed[0] != key and other_seed[1] != password


def test_a_new_seed_restarts_the_pods_that_read_the_secrets():
    a = _pod_annotations(_chart().render({"secretSeed": TEST_SEED}, name=RELEASE, namespace=NAMESPACE, is_install=True))
    b = _pod_annotations(_chart().render({"secretSeed": TEST_SEED[::-1]}, name=RELEASE, namespace=NAMESPACE, is_install=True))
    for name in (f"{RELEASE}-tandem-gateway", f"{RELEASE}-tandem-prefill", f"{RELEASE}-tandem-decode", f"{RELEASE}-tandem-redis"):
        assert a[name]["checksum/secrets"] != b[name]["checksum/secrets"], name


@pytest.mark.parametrize("values,message", [
    pytest.param({"secretSeed": ""}, "gateway.auth.existingSecret", id="no-api-keys"),
    pytest.param({"secretSeed": "", "gateway": {"auth": {"enabled": False}}}, "redis.auth.existingSecret", id="no-redis-password"),
    pytest.param({"secretSeed": "short"}, "secretSeed is 5 characters", id="short-seed"),
])
def test_no_secret_source_fails_with_what_to_set(values, message):
    with pytest.raises(helm.HelmError) as err:
        render(values)
    assert message in str(err.value)
    assert "openssl rand -hex 32" in str(err.value)


# ------------------------------------------------------------------------------------------------
# No Secret value as a plain env value
# ------------------------------------------------------------------------------------------------

# Literal secrets given as values: they may be in a Secret, nowhere else in a manifest.
EXPLICIT = {"secretSeed": "", "gateway": {"auth": {"apiKeys": ["literal-api-key-1"], "adminKey": "literal-admin-key"}},
            "redis": {"auth": {"password": "literal-redis-password"}}}
SECRET_NAME = re.compile(r"(^|_)(PASSWORD|API_KEYS?|ADMIN_KEY|TOKEN|SECRET)$")  # REDIS__PASSWORD, API_KEYS, HF_TOKEN


def _secret_strings(r: Rendered) -> set[str]:
    out = {TEST_SEED, "literal-api-key-1", "literal-admin-key", "literal-redis-password"}
    for s in r.kind("Secret"):
        for v in (s.get("data") or {}).values():
            text = base64.b64decode(v).decode()
            out.add(text)
            try:
                out.update(x for x in json.loads(text) if isinstance(x, str))
            except (ValueError, TypeError):
                pass
    return {x for x in out if len(x) >= 8}


@pytest.mark.parametrize("profile", [*PROFILES, "explicit-values", "gitops"])
def test_no_secret_value_appears_as_a_plain_env_value(profile):
    r = {"explicit-values": lambda: Rendered(EXPLICIT), "gitops": lambda: Rendered(GITOPS)}.get(profile, lambda: rendered(profile))()
    secrets = _secret_strings(r)
    not_secrets = [d for d in r.docs if d["kind"] != "Secret"]
    for doc in not_secrets:
        text = json.dumps(doc)
        for s in secrets:
            assert s not in text, f"{doc['kind']}/{doc['metadata']['name']} carries a secret value in plain text"
    for w in r.workloads():
        for c in containers(w):
            for e in c.get("env", []):
                if SECRET_NAME.search(e["name"]):
                    assert "value" not in e and "secretKeyRef" in e.get("valueFrom", {}), (
                        f"{w['metadata']['name']}/{c['name']}: {e['name']} must come from a Secret by reference")
    for cm in r.kind("ConfigMap"):
        for k in (cm.get("data") or {}):
            assert not SECRET_NAME.search(k), f"ConfigMap {cm['metadata']['name']} sets {k}"


# ------------------------------------------------------------------------------------------------
# Accelerators
# ------------------------------------------------------------------------------------------------

GKE_TPU_TYPES = ["tpu-v4-podslice", "tpu-v5-lite-device", "tpu-v5-lite-podslice", "tpu-v5p-slice", "tpu-v6e-slice", "tpu7x"]
BAD_TPU = {"prefill": {"tpu": {"enabled": True, "accelerator": "tpu-v6e", "topology": "2x2", "chips": 4}}}


def test_a_bad_accelerator_fails_naming_the_valid_types():
    with pytest.raises(helm.HelmError) as err:
        render(BAD_TPU)
    msg = str(err.value)
    assert "/prefill/tpu/accelerator" in msg and all(t in msg for t in GKE_TPU_TYPES), msg


def test_the_template_check_names_the_types_even_without_the_schema(tmp_path):
    """A renderer that skips values.schema.json (--skip-schema-validation) still meets
    _validate.tpl's own check: the chart copied without its schema."""
    shutil.copytree(CHART, tmp_path / "tandem", ignore=shutil.ignore_patterns("values.schema.json"))
    with pytest.raises(helm.HelmError) as err:
        helm.Chart.load(tmp_path / "tandem").render(seeded(BAD_TPU), name=RELEASE, namespace=NAMESPACE, is_install=True)
    msg = str(err.value)
    assert 'prefill.tpu.accelerator "tpu-v6e" is not a GKE TPU type; use one of ' + ", ".join(GKE_TPU_TYPES) in msg, msg


@pytest.mark.parametrize("accelerator,topology,chips", [
    ("tpu-v4-podslice", "2x2x1", 4), ("tpu-v5-lite-device", "2x4", 8), ("tpu-v5-lite-podslice", "1x1", 1),
    ("tpu-v5p-slice", "2x2x1", 4), ("tpu-v6e-slice", "2x4", 8), ("tpu7x", "2x2x1", 4),
])
def test_every_gke_tpu_type_renders(accelerator, topology, chips):
    r = Rendered({"decode": {"tpu": {"enabled": True, "accelerator": accelerator, "topology": topology, "chips": chips}}})
    sel = r.component("decode")["spec"]["template"]["spec"]["nodeSelector"]
    assert sel == {"cloud.google.com/gke-tpu-accelerator": accelerator, "cloud.google.com/gke-tpu-topology": topology}


def test_schema_enum_and_template_table_agree():
    schema = json.loads((CHART / "values.schema.json").read_text())
    for c in ("prefill", "decode"):
        assert schema["properties"][c]["properties"]["tpu"]["properties"]["accelerator"]["enum"] == GKE_TPU_TYPES
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    table = re.search(r'define "tandem.tpu.hostChips".*?dict (.*?)\) }}', helpers, re.S).group(1)
    assert sorted(re.findall(r'"([a-z0-9-]+)"', table)) == GKE_TPU_TYPES


# ------------------------------------------------------------------------------------------------
# The JAX compilation cache can outlive the pod
# ------------------------------------------------------------------------------------------------

def _cache_volume(r: Rendered, component: str) -> dict:
    vols = r.component(component)["spec"]["template"]["spec"]["volumes"]
    return next(v for v in vols if v["name"] == "jax-cache")


def test_compile_cache_defaults_to_an_emptydir():
    assert _cache_volume(rendered("default"), "decode") == {"name": "jax-cache", "emptyDir": {"sizeLimit": "10Gi"}}


def test_compile_cache_on_a_claim_the_chart_creates():
    r = Rendered({"prefill": {"compilationCache": {"persistentVolumeClaim": {"create": True, "storageClassName": "standard-rwx"}}}})
    _validate_all(r)
    claim = f"{RELEASE}-tandem-prefill-jax-cache"
    assert _cache_volume(r, "prefill") == {"name": "jax-cache", "persistentVolumeClaim": {"claimName": claim}}
    pvc = r.get("PersistentVolumeClaim", claim)
    assert pvc["spec"] == {"accessModes": ["ReadWriteMany"], "storageClassName": "standard-rwx",
                           "resources": {"requests": {"storage": "1Ti"}}}
    c = r.component("prefill")["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "jax-cache", "mountPath": "/var/cache/jax"} in c["volumeMounts"]
    assert r.container_env("prefill")["TANDEM_PREFILL_ENGINE__COMPILE_CACHE_DIR"]["value"] == "/var/cache/jax"
    assert _cache_volume(r, "decode")["emptyDir"], "decode keeps its own default"


def test_compile_cache_on_a_gcs_bucket():
    gcs = {"csi": {"driver": "gcsfuse.csi.storage.gke.io",
                   "volumeAttributes": {"bucketName": "my-jax-cache", "mountOptions": "implicit-dirs,uid=10001,gid=10001"}}}
    r = Rendered({"decode": {"compilationCache": {"volume": gcs}},
                  "model": {"podAnnotations": {"gke-gcsfuse/volumes": "true"}}})
    _validate_all(r)
    assert _cache_volume(r, "decode") == {"name": "jax-cache", **gcs}
    # GKE injects the FUSE sidecar only with this annotation; the chart adds it (once, even when
    # model.podAnnotations has it too).
    assert r.component("decode")["spec"]["template"]["metadata"]["annotations"]["gke-gcsfuse/volumes"] == "true"
    text = r.files[next(f for f in r.files if f.endswith("workers/decode.yaml"))]
    assert text.count("gke-gcsfuse/volumes") == 1
    assert "gke-gcsfuse/volumes" not in rendered("default").component("decode")["spec"]["template"]["metadata"]["annotations"]


def test_compile_cache_refuses_two_sources():
    with pytest.raises(helm.HelmError) as err:
        render({"decode": {"compilationCache": {"volume": {"persistentVolumeClaim": {"claimName": "x"}},
                                                "persistentVolumeClaim": {"create": True}}}})
    assert "decode.compilationCache.volume and decode.compilationCache.persistentVolumeClaim.create are both set" in str(err.value)


# ------------------------------------------------------------------------------------------------
# NOTES.txt: the curl it prints works with auth on
# ------------------------------------------------------------------------------------------------

def _notes(values: dict) -> str:
    files = render(values)
    return files[next(f for f in files if f.endswith("NOTES.txt"))]


@pytest.mark.parametrize("values", [
    pytest.param({}, id="port-forward"),
    pytest.param({"gateway": {"service": {"type": "LoadBalancer"}}}, id="load-balancer"),
    pytest.param({"ingress": {"enabled": True}}, id="ingress"),
    pytest.param({"httpRoute": {"enabled": True, "hostnames": ["tandem.example.com"]}}, id="httproute"),
])
def test_notes_curl_sends_the_api_key(values):
    notes = _notes(values)
    curls = [line for line in notes.splitlines() if line.strip().startswith("curl")]
    assert curls, notes
    for line in curls:
        assert '-H "Authorization: Bearer $TANDEM_API_KEY"' in line, line
    export = next(line for line in notes.splitlines() if "export TANDEM_API_KEY=" in line)
    assert f"get secret {RELEASE}-tandem-gateway-auth" in export and "{.data.api-keys}" in export
    # The pipeline after `kubectl ... | base64 -d` turns the Secret's JSON list into its first key.
    sed = export.split("base64 -d | ", 1)[1].rstrip(")")
    out = subprocess.run(["sh", "-c", sed], input='["tdm-first", "tdm-second"]', capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "tdm-first"


def test_notes_without_auth_say_so_and_send_no_key():
    notes = _notes({"gateway": {"auth": {"enabled": False}}})
    assert "WARNING: gateway.auth.enabled=false" in notes and "Authorization" not in notes
