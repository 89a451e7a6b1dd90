"""A service's Redis client holds at most `redis.max_connections` connections (per node on a
Redis Cluster), and commands past the bound wait for one instead of opening more or failing
(tandem_core/redis_client.py): hundreds of concurrent commands, pipelines and scripts on a real
Redis and on a real Redis Cluster all succeed, and CLIENT LIST on every node counts at most the
bound of the client's named connections. redis-py's stock cluster client raises
MaxConnectionsError here instead (its per-node pools do not wait)."""
from __future__ import annotations

import asyncio
import uuid

import pytest
import redis

from tandem_core.bus import conn
from tandem_core.settings import RedisConfig

BOUND = 8
TASKS = 400


@pytest.fixture(params=["redis", "redis-cluster"])
def cfg_and_nodes(request):
    if request.param == "redis":
        url = request.getfixturevalue("redis_url")
        return RedisConfig(url=url, max_connections=BOUND), [url]
    cluster = request.getfixturevalue("redis_cluster")
    return (RedisConfig(url=cluster.url, cluster=True, max_connections=BOUND),
            [f"redis://127.0.0.1:{n.port}" for n in cluster.masters()])


def _named(urls: list[str], name: str) -> list[int]:
    counts = []
    for url in urls:
        with redis.Redis.from_url(url) as r:
            counts.append(sum(1 for c in r.client_list() if c.get("name") == name))
    return counts


async def test_hundreds_of_concurrent_commands_share_a_bounded_pool(cfg_and_nodes):
    cfg, nodes = cfg_and_nodes
    name = f"bound-test-{uuid.uuid4().hex[:8]}"
    r = conn.connect(cfg, client_name=name)
    await r.ping()
    script = r.register_script("redis.call('XADD', KEYS[1], '*', 'i', ARGV[1]) return redis.call('XLEN', KEYS[1])")
    peak: list[int] = []
    stop = asyncio.Event()

    async def watch() -> None:
        while not stop.is_set():
            peak.append(max(await asyncio.to_thread(_named, nodes, name)))
            await asyncio.sleep(0.05)

    async def one(i: int) -> None:
        tag = f"{{bound-{i % 37}}}"
        if i % 3 == 0:
            await r.xadd(f"bound:{tag}:s", {"i": i})
            await r.execute_command("XRANGE", f"bound:{tag}:s", "-", "+", "COUNT", 2)
        elif i % 3 == 1:
            pipe = r.pipeline(transaction=False)  # keys of several slots: several nodes at once
            for j in range(4):
                pipe.incr(f"bound:{{bound-{(i + j) % 37}}}:n")
            assert len(await pipe.execute()) == 4
        else:
            assert await script(keys=[f"bound:{tag}:x"], args=[i]) >= 1

    async def held(i: int) -> None:
        # a blocking read on one key holds its connection for its whole timeout, and every one
        # of them goes to the same node: past the bound they must queue, not open more
        assert await r.blpop([f"bound:{{bound-held}}:{name}"], timeout=0.3) is None

    w = asyncio.create_task(watch())
    try:
        await asyncio.gather(*(one(i) for i in range(TASKS)))  # any error (MaxConnectionsError) fails here
        await asyncio.gather(*(held(i) for i in range(3 * BOUND)))
    finally:
        stop.set()
        await w
    try:
        after = _named(nodes, name)
        assert sum(await asyncio.gather(*(r.exists(f"bound:{{bound-{k}}}:n") for k in range(37)))) == 37
        # the held reads filled the pool on their node (on a cluster the bound keeps one place
        # for the connection the slot map is read through; the mixed load spreads over three
        # nodes and need not fill any), and no node ever held more than the bound
        assert max(after) >= BOUND - 1 and max(peak + after) <= BOUND, (peak, after)
    finally:
        await r.aclose()
