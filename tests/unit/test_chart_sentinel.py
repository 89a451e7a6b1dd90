"""The chart with Redis behind Sentinel (`externalRedis.sentinel`): every service gets the same
`redis.sentinel` settings from the one values block, parses them back, no Redis of the chart's
own is rendered, KEDA scales through the sentinels, every manifest still validates, and values
that cannot work fail at install with the chart's own message. Rendering helpers: test_chart.py.
"""
from __future__ import annotations

import copy
import json
import os

import helm_python as helm
import kubernetes_validate
import pytest

from tests.unit.test_chart import (
    CRD_SCHEMAS, K8S_VERSIONS, NAMESPACE, RELEASE, SERVICES, Rendered, env_name, render,
)

HOSTS = ["redis-node-0.redis-headless.ns.svc:26379", "redis-node-1.redis-headless.ns.svc:26379",
         "redis-node-2.redis-headless.ns.svc:26379"]
VALUES = {
    "redis": {"enabled": False},
    "externalRedis": {"existingSecret": "redis-ha", "existingSecretPasswordKey": "redis-password",
                      "sentinel": {"hosts": HOSTS, "masterName": "mymaster", "auth": True}},
    "prefill": {"keda": {"enabled": True}},
    "decode": {"keda": {"enabled": True}},
    "planner": {"enabled": True},
}


@pytest.fixture(scope="module")
def r() -> Rendered:
    return Rendered(copy.deepcopy(VALUES))


@pytest.mark.parametrize("component", SERVICES)
def test_every_service_gets_the_sentinels_and_parses_them(r, component, monkeypatch):
    cls, prefix, _ = SERVICES[component]
    env = r.container_env(component)
    assert json.loads(env[env_name(prefix, "redis.sentinel.hosts")]["value"]) == HOSTS
    assert env[env_name(prefix, "redis.sentinel.master_name")]["value"] == "mymaster"
    assert env[env_name(prefix, "redis.sentinel.auth")]["value"] == "true"
    assert env[env_name(prefix, "redis.password")]["valueFrom"]["secretKeyRef"] == {
        "name": "redis-ha", "key": "redis-password"}
    for k in [k for k in os.environ if k.startswith("TANDEM_")]:
        monkeypatch.delenv(k)
    for name, e in env.items():
        if name.startswith("TANDEM_"):
            monkeypatch.setenv(name, e.get("value", "s3cret" if "PASSWORD" in name else '["k"]' if "KEYS" in name else "x"))
    if component in ("prefill", "decode"):
        monkeypatch.setenv(prefix + "GRPC__ADVERTISE_HOST", "10.0.0.7")
    s = cls().redis.sentinel
    assert (s.hosts, s.master_name, s.auth) == (HOSTS, "mymaster", True)


def test_no_redis_of_the_charts_own(r):
    assert not r.kind("StatefulSet")
    assert not [d for d in r.docs if d["metadata"]["name"].endswith("-redis")]
    assert "through the sentinels" in r.files["tandem/templates/NOTES.txt"]


def test_keda_scales_through_the_sentinels(r):
    for component in ("prefill", "decode"):
        so = r.get("ScaledObject", f"{RELEASE}-tandem-{component}")
        for t in so["spec"]["triggers"]:
            assert t["type"] == "redis-sentinel-streams"
            assert t["metadata"]["addresses"] == ",".join(HOSTS) and t["metadata"]["sentinelMaster"] == "mymaster"
            assert "address" not in t["metadata"]
        auth = r.get("TriggerAuthentication", f"{RELEASE}-tandem-{component}")
        params = {p["parameter"]: (p["name"], p["key"]) for p in auth["spec"]["secretTargetRef"]}
        assert params == {"password": ("redis-ha", "redis-password"), "sentinelPassword": ("redis-ha", "redis-password")}


def test_every_manifest_validates(r):
    for doc in r.docs:
        body = {k: v for k, v in doc.items() if k != "_file"}
        if (body["apiVersion"], body["kind"]) in CRD_SCHEMAS:
            continue  # KEDA's sentinel trigger is checked above; the CRD schemas there know redis-streams only
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(body, version, strict=True)
        assert body["metadata"]["namespace"] == NAMESPACE


def test_default_render_is_unchanged_by_the_sentinel_values():
    env = Rendered({}).container_env("decode")
    assert json.loads(env["TANDEM_DECODE_REDIS__SENTINEL__HOSTS"]["value"]) == []
    assert env["TANDEM_DECODE_REDIS__URL"]["value"].startswith("redis://")


BAD = [
    ("bundled-and-sentinel", {"externalRedis": {"sentinel": {"hosts": HOSTS}}}, "externalRedis.sentinel.hosts are set"),
    ("url-and-sentinel", {"redis": {"enabled": False},
                          "externalRedis": {"url": "redis://10.0.0.3:6379/0", "sentinel": {"hosts": HOSTS}}},
     "leave externalRedis.url empty"),
    ("sentinel-tls", {"redis": {"enabled": False},
                      "externalRedis": {"sentinel": {"hosts": HOSTS}, "tls": {"caSecret": "ca"}}},
     "TLS through Sentinel is not supported"),
    ("host-without-port", {"redis": {"enabled": False}, "externalRedis": {"sentinel": {"hosts": ["redis-node-0"]}}},
     "/externalRedis/sentinel/hosts/0"),
    ("no-redis", {"redis": {"enabled": False}}, "externalRedis.sentinel.hosts (Redis Sentinel)"),
]


@pytest.mark.parametrize("values,message", [pytest.param(v, m, id=i) for i, v, m in BAD])
def test_bad_sentinel_values_fail_with_a_clear_message(values, message):
    with pytest.raises(helm.HelmError) as err:
        render(values)
    assert message in str(err.value)
