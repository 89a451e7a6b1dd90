"""`redis.sentinel` settings: how they arrive from the environment (a JSON list, as the chart and
`tandem local --redis-sentinel` write them), what a bad host is told, and what the launcher passes
its children."""
from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from decode_svc.settings import DecodeSettings
from gateway.settings import GatewaySettings
from prefill_svc.settings import PrefillSettings
from tandem.local import Cluster, _parse
from tandem_core.settings import RedisConfig, SentinelConfig


@pytest.mark.parametrize("cls,prefix", [(GatewaySettings, "TANDEM_GATEWAY_"), (PrefillSettings, "TANDEM_PREFILL_"),
                                        (DecodeSettings, "TANDEM_DECODE_")])
def test_sentinel_settings_from_the_environment(cls, prefix, monkeypatch):
    monkeypatch.setenv(prefix + "REDIS__SENTINEL__HOSTS", '["10.0.0.5:26379", "redis-sentinel.ns.svc:26379"]')
    monkeypatch.setenv(prefix + "REDIS__SENTINEL__MASTER_NAME", "shard0")
    monkeypatch.setenv(prefix + "REDIS__SENTINEL__AUTH", "true")
    s = cls().redis.sentinel
    assert s.hosts == ["10.0.0.5:26379", "redis-sentinel.ns.svc:26379"]
    assert s.addresses() == [("10.0.0.5", 26379), ("redis-sentinel.ns.svc", 26379)]
    assert (s.master_name, s.auth) == ("shard0", True)


def test_defaults_mean_no_sentinel():
    s = RedisConfig().sentinel
    assert (s.hosts, s.master_name, s.auth) == ([], "tandem", False)


@pytest.mark.parametrize("bad", ["10.0.0.5", "10.0.0.5:", ":26379", "host:port", "h:70000"])
def test_a_host_without_a_port_is_refused_with_the_form_to_use(bad):
    with pytest.raises(ValidationError, match="is not host:port"):
        SentinelConfig(hosts=[bad])


def test_ipv6_host():
    assert SentinelConfig(hosts=["[::1]:26379"]).addresses() == [("::1", 26379)]


def test_local_passes_the_sentinels_instead_of_starting_redis(monkeypatch):
    monkeypatch.delenv("TANDEM_DECODE_REDIS__URL", raising=False)
    c = Cluster(_parse(["--redis-sentinel", "127.0.0.1:26379, 127.0.0.1:26380", "--redis-master", "shard0"]))
    assert c.redis is None
    env = c._env("TANDEM_DECODE_", {})
    assert json.loads(env["TANDEM_DECODE_REDIS__SENTINEL__HOSTS"]) == ["127.0.0.1:26379", "127.0.0.1:26380"]
    assert env["TANDEM_DECODE_REDIS__SENTINEL__MASTER_NAME"] == "shard0"
    assert "TANDEM_DECODE_REDIS__URL" not in env  # the url is not used with sentinels


def test_local_refuses_a_bad_sentinel_address():
    with pytest.raises(SystemExit, match="not HOST:PORT"):
        Cluster(_parse(["--redis-sentinel", "127.0.0.1"]))


def test_local_help_names_the_sentinel_options(capsys):
    with pytest.raises(SystemExit):
        _parse(["--help"])
    out = capsys.readouterr().out
    assert "--redis-sentinel HOST:PORT[,HOST:PORT...]" in out and "--redis-master NAME" in out
