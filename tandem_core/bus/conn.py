"""Connecting to Redis and telling an outage from an error (redis-py asyncio).

`connect` is every service's client; `check_shards` holds the service's key space (`keys.KeySpace`)
to the deployment's shard count; `REDIS_DOWN` is what callers wait out and retry, and only that.
"""
from __future__ import annotations

import redis.asyncio as aioredis
from redis.asyncio.sentinel import MasterNotFoundError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tandem_core import keys, redis_client
from tandem_core.redis_client import RedisConfigError
from tandem_core.retry import Backoff, retry
from tandem_core.settings import RedisConfig


# What a Redis restart, a network blip or a Sentinel failover raises: callers wait and retry
# these, and only these. During a failover the Sentinel client raises MasterNotFoundError (a
# ConnectionError: no sentinel reports a healthy primary yet), and a primary demoted to replica
# answers writes with READONLY (the Sentinel client turns that into a ConnectionError and asks
# the sentinels again; a plain client gets ReadOnlyError).
# On a Redis Cluster, a failover or slot move raises redis_client.CLUSTER_DOWN until the client
# has found the new owner of the slot.
# Only redis-py's own errors: redis-py wraps every socket failure (OSError, socket.timeout) of a
# connect, a write or a read in its ConnectionError/TimeoutError, so the builtin OSError and
# ConnectionError here could only come from the caller's own code (a prefill's file read, a gRPC
# channel), which a wait for Redis would retry until its deadline while the work stalls behind it.
REDIS_DOWN: tuple[type[BaseException], ...] = (
    RedisConnectionError, RedisTimeoutError, MasterNotFoundError, ReadOnlyError, *redis_client.CLUSTER_DOWN)
REDIS_BACKOFF = Backoff(first_s=0.1, max_s=1.0)  # a restart takes seconds: look again often


async def retry_redis(fn, what: str, timeout_s: float | None = 120.0, log=None):
    """`await fn()` until Redis answers (a restart takes seconds), at most `timeout_s`; the last
    REDIS_DOWN error past it (tandem_core/retry.py)."""
    return await retry(fn, what, transient=REDIS_DOWN, timeout_s=timeout_s, backoff=REDIS_BACKOFF, log=log)


def connect(cfg: RedisConfig, client_name: str | None = None) -> aioredis.Redis:
    """The process's Redis client (tandem_core.redis_client.connect: at most
    `cfg.max_connections` connections, named `client_name`)."""
    return redis_client.connect(cfg, client_name)


async def check_shards(r: aioredis.Redis, ks: keys.KeySpace) -> None:
    """Record this deployment's shard count in Redis (the first service to start does), and refuse
    to start with another: a pod reading 8 shards would never see what a gateway writes to shard 12."""
    mine = ks.shards
    await r.set(keys.SHARDS_KEY, mine, nx=True)
    theirs = await r.get(keys.SHARDS_KEY)
    if theirs is not None and int(theirs) != mine:
        raise RedisConfigError(
            f"this service uses {mine} key shards but the deployment's services use {int(theirs)} "
            f"({keys.SHARDS_KEY} in Redis): set redis.shards (TANDEM_<SERVICE>_REDIS__SHARDS) to {int(theirs)} "
            "everywhere, or drain the deployment and delete the key to change it")
