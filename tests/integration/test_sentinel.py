"""Failover of one Redis shard under Sentinel, with real processes on loopback (a primary, a
replica, three sentinels; tandem.redis_sentinel.SentinelGroup): the client `conn.connect` builds
from `redis.sentinel` settings follows the sentinels to the promoted replica after the primary is
SIGKILLed, a demoted primary's READONLY is ridden through like a restart (plain commands and Lua
scripts alike), and settings that name the wrong kind of server fail at start, saying which.
"""
from __future__ import annotations

import asyncio
import time

import pytest
import redis

from tandem.redis_proc import free_port
from tandem.redis_sentinel import SentinelGroup
from tandem_core.bus import conn, groups
from tandem_core.settings import RedisConfig, SentinelConfig

def sentinel_cfg(group: SentinelGroup, **kw) -> RedisConfig:
    return RedisConfig(sentinel=SentinelConfig(hosts=group.hosts, master_name=group.master_name, **kw),
                       socket_timeout_s=2, connect_timeout_s=1)


@pytest.fixture
def group():
    g = SentinelGroup().start()
    try:
        yield g
    finally:
        g.stop()


@pytest.fixture(scope="module")
def shared_group():
    """For the checks that only read the topology (nothing fails over here)."""
    g = SentinelGroup().start()
    try:
        yield g
    finally:
        g.stop()


async def test_client_follows_the_sentinels_to_the_promoted_replica(group):
    r = conn.connect(sentinel_cfg(group))
    try:
        await groups.ensure_group(r, "s", "g")
        await r.xadd("s", {"i": 0})
        await r.set("before", "1")
        assert await r.execute_command("WAIT", 1, 2000) == 1  # on the replica too, before the kill

        old = group.kill_primary()
        struck = time.monotonic()
        # The services' own retry: ConnectionError / MasterNotFoundError until a replica is promoted.
        await conn.retry_redis(lambda: r.set("after", "1"), "write after failover", timeout_s=30)
        recovered_s = time.monotonic() - struck
        new = group.master_port()
        assert new is not None and new != old and new == group.replicas[0].port
        assert await r.get("before") == b"1" and await r.get("after") == b"1"
        got = await r.xreadgroup("g", "c", {"s": ">"}, count=10)  # the consumer group came across
        assert [f for _, entries in got for _, f in entries] == [{b"i": b"0"}]
        print(f"primary {old} SIGKILLed; writes answered by {new} after {recovered_s:.2f}s")
        assert recovered_s < 30
    finally:
        await r.aclose()


async def test_manual_failover_is_ridden_through(group):
    """SENTINEL FAILOVER demotes a live primary while the client holds connections to it (the
    sentinels reconfigure it as a replica and kill its clients): writes, plain and from a Lua
    script, go on on the new primary after the services' retry."""
    r = conn.connect(sentinel_cfg(group))
    script = "redis.call('XADD', KEYS[1], '*', 'v', ARGV[1]) return 1"
    try:
        await r.set("k", "0")
        old = group.master_port()
        with redis.Redis(host="127.0.0.1", port=int(group.hosts[0].rpartition(":")[2])) as s:
            assert s.execute_command("SENTINEL", "FAILOVER", group.master_name)
        new = await asyncio.to_thread(group.wait_promoted, old, 30)
        deadline = time.monotonic() + 30
        while _role(old) != "slave" and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert _role(old) == "slave"  # still up, now a replica of the new primary
        await conn.retry_redis(lambda: r.eval(script, 1, "scripted", "x"), "script after failover", timeout_s=30)
        await conn.retry_redis(lambda: r.set("k", "1"), "write after failover", timeout_s=30)
        with redis.Redis(host="127.0.0.1", port=new) as direct:
            assert direct.get("k") == b"1" and direct.xlen("scripted") >= 1
    finally:
        await r.aclose()


async def test_a_connection_left_on_a_demoted_primary_reads_as_redis_down(group):
    """The race the sentinels' client kill leaves open: a pooled connection that still talks to
    the old primary, now a read-only replica. Plain writes (redis-py) and script writes (ours:
    Redis 6.2 wraps the READONLY in an ERR) both raise a REDIS_DOWN error and drop the connection,
    so the retry reconnects through the sentinels instead of failing the request."""
    r = conn.connect(sentinel_cfg(group))
    replica = group.replicas[0].port
    try:
        await r.ping()
        for cmd in (("SET", "k", "1"), ("EVAL", "return redis.call('SET', KEYS[1], '1')", 1, "k")):
            c = await r.connection_pool.get_connection()
            try:
                await c.disconnect()
                await c.connect_to(("127.0.0.1", replica))  # as if its primary had been demoted
                await c.send_command(*cmd)
                with pytest.raises(conn.REDIS_DOWN) as err:
                    await c.read_response()
                assert "READONLY" in str(err.value) or "now a slave" in str(err.value), err.value
                assert not c.is_connected
            finally:
                await r.connection_pool.release(c)
        assert await r.set("k", "2") and await r.get("k") == b"2"  # back on the primary
    finally:
        await r.aclose()


def _role(port: int) -> str | None:
    with redis.Redis(host="127.0.0.1", port=port, socket_timeout=1) as r:
        return r.info("replication").get("role")


async def test_a_plain_url_pointing_at_a_sentinel_fails_at_start(shared_group):
    port = shared_group.hosts[0].rpartition(":")[2]
    with pytest.raises(conn.RedisConfigError, match="is a Redis Sentinel, not a Redis server.*SENTINEL__HOSTS"):
        conn.connect(RedisConfig(url=f"redis://127.0.0.1:{port}/0"))


async def test_an_unknown_master_name_fails_at_start(shared_group):
    cfg = RedisConfig(sentinel=SentinelConfig(hosts=shared_group.hosts, master_name="nope"))
    with pytest.raises(conn.RedisConfigError, match=r"master_name 'nope' is unknown.*monitors \['tandem'\]"):
        conn.connect(cfg)


async def test_a_sentinel_address_that_is_a_plain_redis_fails_at_start(shared_group):
    cfg = RedisConfig(sentinel=SentinelConfig(hosts=[f"127.0.0.1:{shared_group.primary.port}"]))
    with pytest.raises(conn.RedisConfigError, match="is not a Redis Sentinel"):
        conn.connect(cfg)


async def test_sentinels_that_want_a_password_fail_at_start_without_auth(shared_group):
    """Retrying NOAUTH would look like an outage forever: it is a setting to fix. (A sentinel
    without `requirepass` accepts any AUTH, so only this direction can be caught.)"""
    locked = shared_group.add_sentinel("requirepass s3cret\n")
    cfg = RedisConfig(password="s3cret", sentinel=SentinelConfig(hosts=[f"127.0.0.1:{locked.port}"]))
    with pytest.raises(conn.RedisConfigError, match="refused authentication.*auth=False"):
        conn.connect(cfg)
    ok = conn.connect(cfg.model_copy(update={"sentinel": SentinelConfig(hosts=cfg.sentinel.hosts, auth=True)}))
    await ok.aclose()  # with auth the probe passes (this sentinel also monitors `tandem`)


async def test_unreachable_sentinels_are_redis_down_not_a_config_error():
    """Nothing answers yet (a rollout, a restart): the client is built and its commands raise
    what services wait through."""
    r = conn.connect(RedisConfig(sentinel=SentinelConfig(hosts=[f"127.0.0.1:{free_port()}"]),
                                    connect_timeout_s=0.5, socket_timeout_s=0.5))
    try:
        with pytest.raises(conn.REDIS_DOWN):
            await r.ping()
    finally:
        await r.aclose()


async def test_a_plain_url_still_works(shared_group):
    r = conn.connect(RedisConfig(url=f"redis://127.0.0.1:{shared_group.primary.port}/0"))
    try:
        assert await r.ping()
    finally:
        await r.aclose()
