"""Every service of a deployment holds its key space to the shard count the deployment recorded
in Redis (`bus.conn.check_shards`, run by `groups.ensure_groups` at start): two services that
disagree cannot both start. Two services in one process, each with its own key space, as a test
or `tandem local` may run them."""
from __future__ import annotations

import pytest

from tandem_core import keys
from tandem_core.bus import conn, groups
from tandem_core.redis_client import RedisConfigError


async def test_a_service_with_another_shard_count_is_refused(redis_client):
    r = redis_client
    first, other = keys.KeySpace(1), keys.KeySpace(4)
    await groups.ensure_groups(r, first, "shards")  # the first to start records its count
    assert int(await r.get(keys.SHARDS_KEY)) == 1
    with pytest.raises(RedisConfigError, match=r"uses 4 key shards but the deployment's services use 1"):
        await groups.ensure_groups(r, other, "shards")
    await conn.check_shards(r, keys.KeySpace(1))  # the same count starts, whoever checks first
    assert int(await r.get(keys.SHARDS_KEY)) == 1  # and the refused one changed nothing
