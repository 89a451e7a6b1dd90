"""The gateway refuses a Redis connection bound its token readers would fill (one blocking read per
key shard), saying which setting to raise."""
from __future__ import annotations

import pytest

from gateway.app import _check_connection_bound
from gateway.settings import GatewaySettings
from tandem_core.redis_client import RedisConfigError
from tandem_core.settings import RedisConfig


def test_a_bound_the_token_readers_would_fill_is_refused():
    with pytest.raises(RedisConfigError, match=r"max_connections 20 is too small for 16 key shards.*"
                                               r"TANDEM_GATEWAY_REDIS__MAX_CONNECTIONS\) to 24 or more"):
        _check_connection_bound(GatewaySettings(redis=RedisConfig(shards=16, max_connections=20)))
    _check_connection_bound(GatewaySettings(redis=RedisConfig(shards=16, max_connections=24)))
    _check_connection_bound(GatewaySettings(redis=RedisConfig(shards=16)))  # the default (64) fits 16 shards
