"""The gateway refuses a Redis connection bound its token readers would fill (one blocking read per
key shard), saying which setting to raise."""
from __future__ import annotations

import pytest

from gateway.app import _check_connection_bound
from gateway.settings import GatewaySettings
from tandem_core import keys
from tandem_core.redis_client import RedisConfigError
from tandem_core.settings import RedisConfig


def test_a_bound_the_token_readers_would_fill_is_refused():
    keys.configure(16)
    try:
        with pytest.raises(RedisConfigError, match=r"max_connections 20 is too small for 16 key shards.*"
                                                   r"TANDEM_GATEWAY_REDIS__MAX_CONNECTIONS\) to 24 or more"):
            _check_connection_bound(GatewaySettings(redis=RedisConfig(max_connections=20)))
        _check_connection_bound(GatewaySettings(redis=RedisConfig(max_connections=24)))
        _check_connection_bound(GatewaySettings())  # the default (64) fits the cluster's 16 shards
    finally:
        keys.configure(1)
