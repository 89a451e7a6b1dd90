"""`tandem local --redis-url URL [--redis-cluster]`: an external Redis (or Redis Cluster) instead of
the embedded one. What the launcher passes its children, that it starts and supervises no Redis of
its own, and what a combination that cannot work is told. (The cluster client itself:
tests/integration/test_redis_cluster_client.py.)"""
from __future__ import annotations

import shutil

import pytest

from decode_svc.settings import DecodeSettings
from tandem.local import Cluster, _parse

PREFIXES = ("TANDEM_GATEWAY_", "TANDEM_PREFILL_", "TANDEM_DECODE_", "TANDEM_PLANNER_")


@pytest.mark.parametrize("cluster", [False, True])
def test_every_child_gets_the_url_and_whether_it_is_a_cluster(cluster, monkeypatch):
    for p in PREFIXES:
        monkeypatch.setenv(p + "REDIS__CLUSTER", "false" if cluster else "true")  # a stale shell says otherwise
    argv = ["--redis-url", "redis://:pw@10.0.0.3:7000"] + (["--redis-cluster"] if cluster else [])
    c = Cluster(_parse(argv))
    assert c.redis is None and c.redis_url == "redis://:pw@10.0.0.3:7000"
    for prefix in PREFIXES:
        env = c._env(prefix, {})
        assert env[prefix + "REDIS__URL"] == "redis://:pw@10.0.0.3:7000"
        assert env[prefix + "REDIS__CLUSTER"] == ("true" if cluster else "false")
        assert prefix + "REDIS__SENTINEL__HOSTS" not in env
    for k, v in c._env("TANDEM_DECODE_", {}).items():
        if k.startswith("TANDEM_DECODE_REDIS__"):
            monkeypatch.setenv(k, v)
    monkeypatch.setenv("TANDEM_DECODE_GRPC__ADVERTISE_HOST", "127.0.0.1")
    assert DecodeSettings().redis.cluster is cluster  # what the decode worker will build


def test_no_redis_is_started_or_restarted():
    """The supervision tick with an external Redis touches no Redis process (there is none)."""
    c = Cluster(_parse(["--redis-url", "redis://127.0.0.1:1/0"]))
    c.check_children()
    c.stop(grace_s=1)
    assert c.redis is None


def test_the_embedded_redis_says_not_a_cluster():
    c = Cluster(_parse([]))
    try:
        assert c.redis is not None and c._env("TANDEM_GATEWAY_", {})["TANDEM_GATEWAY_REDIS__CLUSTER"] == "false"
    finally:
        shutil.rmtree(c.redis.dir)  # never started: only its data folder to remove


def test_the_planner_may_follow_an_external_plain_redis():
    a = _parse(["--redis-url", "redis://10.0.0.3:6379/0", "--planner"])
    assert a.planner and Cluster(a).redis_url == "redis://10.0.0.3:6379/0"


BAD = [
    (["--redis-cluster"],
     "--redis-cluster says the external Redis is a Redis Cluster: give one of its nodes with --redis-url"),
    (["--redis-url", "redis://a:1", "--redis-sentinel", "b:26379"],
     "--redis-url and --redis-sentinel both name the Redis"),
    (["--redis-url", "10.0.0.3:6379"], "must start with redis:// (or rediss:// for TLS)"),
    (["--redis-url", "redis://a:1", "--redis-cluster", "--planner"],
     "not with --colocated, --redis-sentinel or --redis-cluster"),
]


@pytest.mark.parametrize("argv,message", BAD)
def test_combinations_that_cannot_work_are_refused_saying_why(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        _parse(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_pinning_a_redis_there_is_not():
    with pytest.raises(SystemExit, match="no embedded Redis to pin"):
        Cluster(_parse(["--redis-url", "redis://a:1", "--pin", "redis=0"]))


def test_help_names_both_options(capsys):
    with pytest.raises(SystemExit):
        _parse(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--redis-url URL use this external Redis instead of the embedded one" in out
    assert "--redis-cluster with --redis-url: that URL is one node of a Redis Cluster" in out
