"""The Redis Cluster client on a real cluster (3 masters, 3 replicas as redis-server processes on
loopback; tests/conftest.py `redis_cluster`): `redis_client.connect` with `redis.cluster` spreads
keys over the masters, runs cross-slot pipelines, single-slot MULTI/EXEC and Lua on hash-tagged
keys; settings that name the wrong kind of server fail at start saying which; and when a master
is SIGKILLed its replica takes over while the same client keeps working, every error on the way
being one that services wait out (ConnectionError, TimeoutError, CLUSTER_DOWN).
"""
from __future__ import annotations

import asyncio
import time

import pytest
import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import CrossSlotTransactionError, RedisClusterException
from redis.exceptions import TimeoutError as RedisTimeoutError

from tandem.redis_proc import RedisProcess, free_port
from tandem_core.redis_client import CLUSTER_DOWN, RedisConfigError, connect
from tandem_core.settings import RedisConfig, SentinelConfig

TRANSIENT = (RedisConnectionError, RedisTimeoutError, *CLUSTER_DOWN)


def cluster_cfg(url: str, **kw) -> RedisConfig:
    return RedisConfig(**{"url": url, "cluster": True, "socket_timeout_s": 2, "connect_timeout_s": 1, **kw})


@pytest.fixture
async def client(redis_cluster_url):
    r = connect(cluster_cfg(redis_cluster_url, max_connections=32))
    try:
        yield r
    finally:
        await r.aclose()


def test_the_fixture_is_three_masters_with_a_synced_replica_each(redis_cluster):
    roles = [redis_cluster.role(n) for n in redis_cluster.nodes]
    assert sorted(roles) == ["master"] * 3 + ["slave"] * 3
    assert len(set(redis_cluster.pids)) == 6
    # each slot range has a live master among the nodes (after a fault test's heal, a promoted
    # replica may hold the range its killed master had)
    assert len(redis_cluster.masters()) == 3 and {m.port for m in redis_cluster.masters()} <= {n.port for n in redis_cluster.nodes}
    redis_cluster.wait_healthy(timeout_s=1)  # already whole: every replica synced, cluster_state:ok
    with redis.Redis.from_url(redis_cluster.url) as r:
        assert r.info()["cluster_enabled"] == 1 and r.info("replication")["role"] == "master"


async def test_keys_pipelines_transactions_and_scripts(client):
    await client.initialize()
    assert len(client.get_primaries()) == 3 and len(client.get_replicas()) == 3
    assert {n.max_connections for n in client.get_nodes()} == {32}  # the bound is per node
    keys = [f"cl:k{i}" for i in range(30)]
    for i, k in enumerate(keys):
        assert await client.set(k, i)
    assert [await client.get(k) for k in keys] == [str(i).encode() for i in range(30)]
    owners = {client.get_node_from_key(k).name for k in keys}
    assert len(owners) == 3, owners  # the keys really live on every master

    pipe = client.pipeline(transaction=False)  # split per node, answered in order
    for k in keys:
        pipe.incr(k)
    assert await pipe.execute() == list(range(1, 31))

    tag = "{req-7}"
    a, b = f"tandem:{tag}:tokens", f"tandem:{tag}:fence"
    assert client.keyslot(a) == client.keyslot(b)
    async with client.pipeline(transaction=True) as tx:  # MULTI/EXEC on the tag's one node
        tx.set(b, "epoch-1").xadd(a, {"i": 0}).xlen(a)
        _, _, length = await tx.execute()
    assert length == 1

    fenced = client.register_script(
        "if redis.call('GET', KEYS[2]) ~= ARGV[1] then return 0 end "
        "redis.call('XADD', KEYS[1], '*', 'i', ARGV[2]) return redis.call('XLEN', KEYS[1])")
    assert await fenced(keys=[a, b], args=["epoch-1", 1]) == 2
    assert await fenced(keys=[a, b], args=["epoch-0", 2]) == 0  # a stale fence writes nothing
    assert await client.xlen(a) == 2

    with pytest.raises(RedisClusterException, match="same key slot"):  # what the hash tags are for
        await fenced(keys=[a, "tandem:{other}:fence"], args=["epoch-1", 3])
    with pytest.raises(CrossSlotTransactionError):  # refused before anything is sent
        async with client.pipeline(transaction=True) as tx:
            await tx.set(a + ":x", 1).set("tandem:{other}:x", 1).execute()
    assert await client.exists(a + ":x", "tandem:{other}:x") == 0


async def test_a_plain_redis_with_cluster_true_fails_at_start_saying_which():
    plain = RedisProcess().start()
    try:
        with pytest.raises(RedisConfigError, match=r"cluster=true but redis.url .* is a plain Redis "
                                                   r"\(INFO cluster: cluster_enabled:0\).*REDIS__CLUSTER=false"):
            connect(cluster_cfg(plain.url))
    finally:
        plain.close()


async def test_a_cluster_node_with_cluster_false_fails_at_start_saying_which(redis_cluster_url):
    with pytest.raises(RedisConfigError, match=r"is a Redis Cluster node \(INFO cluster: cluster_enabled:1\) "
                                               r"but redis.cluster is false.*REDIS__CLUSTER=true"):
        connect(RedisConfig(url=redis_cluster_url))


async def test_cluster_and_sentinel_together_fail_at_start():
    cfg = RedisConfig(cluster=True, sentinel=SentinelConfig(hosts=["127.0.0.1:26379"]))
    with pytest.raises(RedisConfigError, match="both set: a Redis Cluster fails over by itself"):
        connect(cfg)


async def test_a_cluster_url_with_a_database_fails_at_start(redis_cluster_url):
    with pytest.raises(RedisConfigError, match="database 0 only"):
        connect(cluster_cfg(redis_cluster_url + "/2"))


async def test_an_unreachable_cluster_is_redis_down_and_a_plain_redis_there_later_a_config_error():
    """Nothing answers yet: the client is built and its commands raise ConnectionError, which
    services wait through. If what comes up is not a cluster node, waiting would never end: the
    next command says which setting to change."""
    port = free_port()
    r = connect(cluster_cfg(f"redis://127.0.0.1:{port}", connect_timeout_s=0.5))
    plain = RedisProcess(port=port)
    try:
        with pytest.raises(RedisConnectionError, match="no Redis Cluster node answered"):
            await r.set("k", 1)
        plain.start()
        with pytest.raises(RedisConfigError, match="refuses CLUSTER SLOTS .*cluster support disabled.*REDIS__CLUSTER"):
            await r.set("k", 1)
    finally:
        plain.close()
        await r.aclose()


async def _until_it_works(fn, seen: list[str], timeout_s: float = 15.0):
    """The services' retry, recording what each failure was."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await fn()
        except TRANSIENT as e:
            seen.append(type(e).__name__)
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def test_a_killed_master_is_replaced_and_the_same_client_keeps_working(redis_cluster, client):
    await client.initialize()
    tag0 = next(f"{{r{i}}}" for i in range(1000) if client.keyslot(f"{{r{i}}}") < 5461)  # on master 0
    tag1 = next(f"{{r{i}}}" for i in range(1000) if 5461 <= client.keyslot(f"{{r{i}}}") < 10922)
    before = {f"{tag}:before": tag for tag in (tag0, tag1)}
    for k in before:
        await client.set(k, "1")
    primary, replica = client.nodes_manager.slots_cache[client.keyslot(tag0)][:2]
    assert primary.port == redis_cluster.masters()[0].port
    with redis.Redis(host="127.0.0.1", port=replica.port) as direct:  # replicated before the kill
        direct.execute_command("READONLY")
        deadline = time.monotonic() + 5
        while direct.get(f"{tag0}:before") != b"1" and time.monotonic() < deadline:
            time.sleep(0.05)

    seen: list[str] = []

    async def relay(stream: str) -> list:
        """A gateway-style blocked XREAD, issued again after each transient error until its entry comes."""
        deadline = time.monotonic() + 30
        while True:
            try:
                got = await client.xread({stream: "0-0"}, block=1000)
                if got:
                    return got
            except TRANSIENT as e:
                seen.append(type(e).__name__)
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)

    readers = [asyncio.create_task(relay(f"{tag}:tokens")) for tag in (tag0, tag1)]
    await asyncio.sleep(0.3)  # both blocked in XREAD: one on the master about to die
    try:
        killed = redis_cluster.kill_master(0)
        struck = time.monotonic()
        await _until_it_works(lambda: client.set(f"{tag0}:after", "1"), seen)
        recovered_s = time.monotonic() - struck
        promoted = redis_cluster.wait_failover(timeout_s=15)
        failover_s = time.monotonic() - struck
        assert killed.port not in [m.port for m in promoted] and replica.port == promoted[0].port

        for k in before:  # what was replicated survived; the tags still work as one slot
            assert await _until_it_works(lambda k=k: client.get(k), seen) == b"1"
        async with client.pipeline(transaction=True) as tx:
            tx.xadd(f"{tag0}:tokens", {"i": 0}).get(f"{tag0}:after")
            assert (await _until_it_works(tx.execute, seen))[1] == b"1"
        await _until_it_works(lambda: client.xadd(f"{tag1}:tokens", {"i": 0}), seen)
        got = await asyncio.wait_for(asyncio.gather(*readers), timeout=30)
        assert [[f for _, entries in g for _, f in entries] for g in got] == [[{b"i": b"0"}]] * 2
        pipe = client.pipeline(transaction=False)
        for i in range(30):
            pipe.set(f"cl:after{i}", i)
        assert await _until_it_works(pipe.execute, seen) == [True] * 30
        print(f"master {killed.port} SIGKILLed: writes on its slots answered after {recovered_s:.2f}s, "
              f"replica {replica.port} promoted and cluster_state ok after {failover_s:.2f}s; "
              f"errors on the way: {sorted(set(seen))}")
        assert recovered_s < 15
    finally:
        for t in readers:
            t.cancel()
        redis_cluster.heal()
    assert await _until_it_works(lambda: client.get(f"{tag0}:after"), seen) == b"1"  # and after the rejoin
    assert redis_cluster.role(killed) == "slave"


def test_flushall_empties_every_master(redis_cluster):
    rc = redis.RedisCluster.from_url(redis_cluster.url)
    try:
        for i in range(10):
            rc.set(f"cl:flush{i}", i)
        redis_cluster.flushall()
        assert rc.dbsize(target_nodes=redis.RedisCluster.PRIMARIES) == 0
    finally:
        rc.close()


async def test_hundreds_of_tasks_through_a_failover_see_only_errors_they_wait_out(redis_cluster):
    """As a gateway under load: 300 tasks share one client, each enqueuing, pipelining and reading,
    while a master is SIGKILLed. Every error any of them gets must be one services wait out
    (REDIS_DOWN). Before, redis-py's own error handling tore connections down under other tasks'
    commands and they escaped as AttributeError ("'NoneType' object has no attribute
    'writelines'"): 14 in one such run here, each a gateway 500 (issue 31)."""
    from tandem_core.bus import admission, conn
    from tandem_core.keys import KeySpace

    ks = KeySpace(16)  # a cluster's key shards
    from tandem_core.types import GenerationRequest, SamplingParams

    r = conn.connect(cluster_cfg(redis_cluster.url, max_connections=64))
    await r.ping()
    escaped: list[str] = []
    done, waited = [0], [0]
    killed = asyncio.Event()
    stop_at = [float("inf")]

    async def worker(w: int) -> None:
        i = 0
        while time.monotonic() < stop_at[0]:
            i += 1
            rid = f"fo-{w}-{i}"
            try:
                await admission.enqueue(r, ks, "failover", GenerationRequest(rid, [1, 2, 3], 4, SamplingParams()), 100_000)
                pipe = r.pipeline(transaction=False)
                pipe.xadd(ks.token_stream(rid), {"i": 0}).expire(ks.token_stream(rid), 60)
                await pipe.execute()
                await r.exists(ks.admitted_key(rid))
                done[0] += 1
            except conn.REDIS_DOWN:
                waited[0] += 1
                await asyncio.sleep(0.1)
            except Exception as e:  # noqa: BLE001 - what this test is looking for
                escaped.append(f"{type(e).__name__}: {e}")
                await asyncio.sleep(0.1)

    async def kill() -> None:
        while done[0] < 600:  # the load is running
            await asyncio.sleep(0.05)
        await asyncio.to_thread(redis_cluster.kill_master, 1)
        killed.set()
        await asyncio.to_thread(redis_cluster.wait_failover, 30)
        before = done[0]
        while done[0] < before + 600:  # and it runs on after the failover
            await asyncio.sleep(0.05)
        stop_at[0] = time.monotonic()

    try:
        await asyncio.wait_for(asyncio.gather(kill(), *(worker(w) for w in range(300))), 180)
    finally:
        await r.aclose()
        redis_cluster.heal()
    assert killed.is_set() and waited[0] > 0, "the kill did not land under load: the test proves nothing"
    assert not escaped, f"{len(escaped)} errors no service waits out, e.g. {sorted(set(escaped))[:3]}"
