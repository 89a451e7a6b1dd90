"""Cancellation: the gateway sets a request's cancel key (a client went away, a deadline passed);
the pods working on it check for it (`cancelled`, many requests in one round trip)."""
from __future__ import annotations

import redis.asyncio as aioredis

from tandem_core import redis_client
from tandem_core.keys import KeySpace


async def request_cancel(r: aioredis.Redis, ks: KeySpace, request_id: str, ttl_s: int) -> None:
    await r.set(ks.cancel_key(request_id), "1", ex=ttl_s)


async def cancelled(r: aioredis.Redis, ks: KeySpace, request_ids: list[str],
                    names: dict[str, bytes] | None = None) -> set[str]:
    """The requests of `request_ids` with a cancel key, in one round trip: one MGET, or on a
    Redis Cluster (whose pipelines refuse MGET) one GET per request. `names`: a cache of cancel
    keys by request id (encoded once), for a caller that polls the same requests again and again;
    the caller bounds it."""
    if not request_ids:
        return set()
    if names is None:
        names = {}
    for x in request_ids:
        if x not in names:
            names[x] = ks.cancel_key(x).encode()
    names_now = [names[x] for x in request_ids]
    if redis_client.is_cluster(r):
        pipe = r.pipeline(transaction=False)
        for name in names_now:
            pipe.get(name)
        vals = await pipe.execute()
    else:
        vals = await r.mget(names_now)
    return {rid for rid, v in zip(request_ids, vals) if v is not None}
