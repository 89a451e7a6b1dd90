"""The chart with an external Redis Cluster (`redis.cluster`, ci/external-redis-cluster-values.yaml:
a Valkey or Redis OSS cluster over TLS with a password) and key shards (`redis.shards`): every service
gets the same redis.cluster and redis.shards from the one value of each and parses them back, the
rendered TLS URL builds redis-py's cluster client with the mounted CA, and values that cannot work
with a cluster fail at install saying what to change. The ci profile also runs through every
PROFILES check of test_chart.py (lint, Kubernetes schemas, settings round trip).
"""
from __future__ import annotations

import copy
import os

import helm_python as helm
import pytest
from redis.asyncio.connection import SSLConnection

from tandem.redis_proc import free_port
from tandem_core.redis_client import connect
from tests.unit.test_chart import SERVICES, Rendered, env_name, profile_values, render

VALUES = {**profile_values("external-redis-cluster"), "planner": {"enabled": True}}


@pytest.fixture(scope="module")
def r() -> Rendered:
    return Rendered(copy.deepcopy(VALUES))


def _parse(cls, env: dict[str, dict], monkeypatch, prefix: str):
    """The settings object a pod builds from this environment (Secrets and the downward API faked)."""
    for k in [k for k in os.environ if k.startswith("TANDEM_")]:
        monkeypatch.delenv(k)
    for name, e in env.items():
        if name.startswith("TANDEM_"):
            monkeypatch.setenv(name, e.get("value", "s3cret" if "PASSWORD" in name else '["k"]' if "KEYS" in name else "x"))
    if "GRPC__ADVERTISE_HOST" in {n.removeprefix(prefix) for n in env}:
        monkeypatch.setenv(prefix + "GRPC__ADVERTISE_HOST", "10.0.0.7")
    return cls()


@pytest.mark.parametrize("component", SERVICES)
def test_every_service_gets_cluster_and_shards_and_parses_them(r, component, monkeypatch):
    cls, prefix, _ = SERVICES[component]
    env = r.container_env(component)
    assert env[env_name(prefix, "redis.cluster")]["value"] == "true"
    assert env[env_name(prefix, "redis.shards")]["value"] == "32"
    assert env[env_name(prefix, "redis.url")]["value"] == "rediss://10.0.0.3:6379?ssl_ca_certs=/etc/tandem/redis-ca/ca.crt"
    assert env[env_name(prefix, "redis.password")]["valueFrom"]["secretKeyRef"] == {
        "name": "valkey-cluster", "key": "password"}
    c = r.component(component)["spec"]["template"]["spec"]["containers"][0]
    assert any(m["name"] == "redis-ca" and m["mountPath"] == "/etc/tandem/redis-ca" for m in c["volumeMounts"])
    redis = _parse(cls, env, monkeypatch, prefix).redis
    assert (redis.cluster, redis.shards, redis.shard_count()) == (True, 32, 32)


@pytest.mark.parametrize("component", SERVICES)
def test_default_render_is_a_plain_redis_with_automatic_shards(component, monkeypatch):
    cls, prefix, _ = SERVICES[component]
    env = Rendered({"planner": {"enabled": True}}).container_env(component)
    assert env[env_name(prefix, "redis.cluster")]["value"] == "false"
    assert env[env_name(prefix, "redis.shards")]["value"] == "0"
    redis = _parse(cls, env, monkeypatch, prefix).redis
    assert (redis.cluster, redis.shard_count()) == (False, 1)


async def test_the_rendered_url_builds_a_tls_cluster_client_with_the_ca(r):
    """What a pod does with the rendered settings, up to the first connection: the cluster client,
    TLS, the mounted CA, the per-node pool bound. (The host is swapped for a closed loopback port
    so that the start-up probe finds nothing to check, as with a Redis not up yet.)"""
    cls, prefix, _ = SERVICES["decode"]
    env = r.container_env("decode")
    url = env[env_name(prefix, "redis.url")]["value"].replace("10.0.0.3:6379", f"127.0.0.1:{free_port()}")
    cfg = cls.model_fields["redis"].annotation(url=url, cluster=True, connect_timeout_s=0.5, socket_timeout_s=0.5)
    client = connect(cfg)
    try:
        kw = client.get_connection_kwargs()
        assert kw["connection_class"] is SSLConnection
        assert kw["ssl_ca_certs"] == "/etc/tandem/redis-ca/ca.crt" and kw["ssl_cert_reqs"] == "required"
        assert kw["max_connections"] == cfg.max_connections
    finally:
        await client.aclose()


def test_notes_say_redis_cluster(r):
    assert "external Redis Cluster through 10.0.0.3:6379 (TLS)" in r.files["tandem/templates/NOTES.txt"]


CLUSTER = {"redis": {"enabled": False, "cluster": True}, "externalRedis": {"url": "redis://10.0.0.3:6379"}}
BAD = [
    ("bundled-and-cluster", {"redis": {"cluster": True}}, "set redis.enabled=false and externalRedis.url"),
    ("cluster-and-sentinel", {"redis": {"enabled": False, "cluster": True},
                              "externalRedis": {"sentinel": {"hosts": ["10.0.0.5:26379"]}}},
     "a Redis Cluster fails over by itself"),
    ("cluster-database", {**CLUSTER, "externalRedis": {"url": "redis://10.0.0.3:6379/2"}},
     "selects database 2, but a Redis Cluster has database 0 only"),
    ("shards-too-many", {"redis": {"shards": 4096}}, "/redis/shards"),
    ("cluster-not-a-bool", {**CLUSTER, "redis": {"enabled": False, "cluster": "yes"}}, "/redis/cluster"),
]


@pytest.mark.parametrize("values,message", [pytest.param(v, m, id=i) for i, v, m in BAD])
def test_bad_cluster_values_fail_with_a_clear_message(values, message):
    with pytest.raises(helm.HelmError) as err:
        render(values)
    assert message in str(err.value)


def test_the_planner_keda_path_is_allowed_with_a_cluster():
    got = Rendered({**CLUSTER, "planner": {"enabled": True, "keda": True}})
    triggers = [t["type"] for so in got.kind("ScaledObject") for t in so["spec"]["triggers"]]
    assert triggers == ["metrics-api", "metrics-api"]  # the planner's /keda, not a Redis scaler
