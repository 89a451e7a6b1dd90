"""The one Redis client of a process: a plain URL, a Sentinel-managed primary, or a Redis Cluster
(docs/redis-ha.md).

`connect(cfg)` returns a redis-py asyncio client; with `cfg.sentinel.hosts` it asks the sentinels
for the primary on every new connection, so after a failover it reconnects to the promoted
replica by itself; with `cfg.cluster` it is redis-py's cluster client, which learns the slot map
from the node the URL names and follows MOVED replies and failovers. A short blocking probe first
checks that the settings name the right kind of server (RedisConfigError says what to change);
an unreachable Redis passes, services wait for it.

Connections are bounded, and a command past the bound waits instead of opening another or failing:
a plain or Sentinel client uses redis-py's BlockingConnectionPool (`max_connections` for the
whole process), and the cluster client (whose per-node pools raise MaxConnectionsError when
full) is `_BoundedCluster`, which lets at most `max_connections` commands and pipelines be in
flight at once, so no node's pool is ever asked for more. Either way a command that finds no
connection free within `socket_timeout_s` raises a ConnectionError (REDIS_DOWN: callers wait it
out as they wait out a restart).

The parts of redis-py used here that are not its documented API (the cluster client's slot-map
manager `_NodesManager` replaces, how it reports a node that refuses CLUSTER SLOTS) are pinned in
pyproject.toml and checked by tests/unit/test_redis_py_canary.py, which fails on an upgrade that
changes them.

`CLUSTER_DOWN` lists what the cluster client raises while a failover or a slot move is under way
(on top of ConnectionError/TimeoutError): callers wait those out like a restart, as REDIS_DOWN.
"""
from __future__ import annotations

import asyncio
import os

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterPipeline, NodesManager, RedisCluster
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool, SentinelManagedConnection
from redis.exceptions import AskError, ClusterError, RedisClusterException, SlotNotCoveredError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, RedisError, ResponseError

from tandem_core.settings import RedisConfig

# Transient errors of the cluster client, none of which ran the command: ClusterError covers
# CLUSTERDOWN (ClusterDownError, MasterDownError: a master failed and no replica has taken over
# yet) and "TTL exhausted" (redirections that did not settle); AskError covers MovedError, which a
# MULTI/EXEC raises once its retries are spent on a slot that changed owner; TryAgainError is a
# multi-key command during a slot migration; SlotNotCoveredError is a slot map with a hole (a
# RedisClusterException, not a RedisError). Not listed, on purpose: the cluster client's usage
# errors (CrossSlotTransactionError, "Keys in request don't hash to the same slot"), which a retry
# cannot fix. A cluster with no reachable node raises ConnectionError (see _NodesManager).
CLUSTER_DOWN = (ClusterError, AskError, TryAgainError, SlotNotCoveredError)


class RedisConfigError(ValueError):
    """The Redis settings name the wrong kind of server: fix the settings, retrying cannot help."""


def connect(cfg: RedisConfig, client_name: str | None = None) -> aioredis.Redis | RedisCluster:
    """One client per process; `decode_responses=False` keeps token ids cheap to parse.

    With `cfg.sentinel.hosts` the client asks the sentinels for the primary of
    `cfg.sentinel.master_name` on every new connection, so after a failover it reconnects to the
    promoted replica by itself; meanwhile its commands raise REDIS_DOWN errors, which services
    ride through as they do a restart. With `cfg.cluster` it is redis-py's RedisCluster:
    `cfg.url` names any one node (rediss:// = TLS), `max_connections` bounds each node's pool,
    and during a failover its commands raise ConnectionError or CLUSTER_DOWN errors.
    Before returning, one short blocking probe checks the settings against what answers
    (RedisConfigError when a plain URL points at a sentinel or a cluster node, a cluster URL at
    a plain Redis, a sentinel address is a plain Redis, or no sentinel knows the master name); an
    unreachable Redis passes, since services wait for it.

    At most `cfg.max_connections` connections (per node on a Redis Cluster); past it a command
    waits for a free one, up to `socket_timeout_s`, then raises ConnectionError. `client_name`
    names every connection (CLIENT SETNAME), so CLIENT LIST tells the services apart.
    """
    common = dict(username=cfg.username, password=cfg.password, socket_timeout=cfg.socket_timeout_s,
                  socket_connect_timeout=cfg.connect_timeout_s, health_check_interval=30,
                  max_connections=cfg.max_connections, client_name=client_name)
    if cfg.cluster and cfg.sentinel.hosts:
        raise RedisConfigError(
            "redis.cluster=true and redis.sentinel.hosts are both set: a Redis Cluster fails over by itself, "
            "without sentinels. For a cluster, set redis.url to one of its nodes and leave redis.sentinel.hosts "
            "empty; for Sentinel, set redis.cluster=false (TANDEM_<SERVICE>_REDIS__CLUSTER)")
    if cfg.cluster:
        _check_server(cfg)
        try:
            client = _BoundedCluster.from_url(cfg.url, **common)
        except RedisClusterException as e:  # e.g. a database other than 0, a unix socket
            raise RedisConfigError(f"redis.cluster=true with redis.url {redact_url(cfg.url)}: {e} "
                                   "(a Redis Cluster has database 0 only: redis://HOST:PORT or rediss://HOST:PORT)") from e
        client.nodes_manager.__class__ = _NodesManager
        return client
    if not cfg.sentinel.hosts:
        _check_server(cfg)
        # A blocking pool: past `max_connections` a command waits (up to its socket timeout) for a
        # connection instead of failing with "Too many connections" (a burst of thousands of
        # admissions at once did, measured: bench/token_plane.py burst).
        pool = aioredis.BlockingConnectionPool.from_url(cfg.url, timeout=cfg.socket_timeout_s, **common)
        return aioredis.Redis.from_pool(pool)  # (from_pool: closing the client closes the pool)
    _check_sentinels(cfg)
    sentinel = Sentinel(cfg.sentinel.addresses(), sentinel_kwargs=_sentinel_kwargs(cfg))
    # the same blocking pool as above, its connections found through the sentinels
    return sentinel.master_for(cfg.sentinel.master_name, connection_class=_FailoverConnection,
                               connection_pool_class=_BlockingSentinelPool, timeout=cfg.socket_timeout_s, **common)


class _BlockingSentinelPool(SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """Sentinel's pool (connections to whichever node the sentinels call the primary) with the
    BlockingConnectionPool's wait for a free connection: redis-py's SentinelConnectionPool is a
    plain ConnectionPool, which raises "Too many connections" past `max_connections`."""


class _BoundedCluster(RedisCluster):
    """redis-py's cluster client with its connections bounded the way a BlockingConnectionPool
    bounds a plain client's. Its per-node pools hold `max_connections` each and raise
    MaxConnectionsError when a command finds them full (redis-py has no blocking pool for the
    cluster client); here a gate lets at most `max_connections` commands or pipelines be in
    flight in the whole client, each holding at most one connection per node, so a node's pool
    is never asked for more, and the rest wait their turn (up to `socket_timeout_s`, then a
    ConnectionError, REDIS_DOWN). One place is left for the connection redis-py keeps to the
    node it learns the slot map from (CLUSTER SLOTS, under a lock: one at a time), which is a
    pool of its own: measured, a node held bound + 1 without it. Only public methods are
    overridden: `execute_command` (every command and script goes through it) and `pipeline`
    (whose `execute` takes the gate)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        bound = kwargs.get("max_connections") or 100  # redis-py's own default per node
        self.max_in_flight = max(1, bound - 1)
        self._gate_timeout_s = kwargs.get("socket_timeout") or None
        self._gate = asyncio.Semaphore(self.max_in_flight)

    async def _take_gate(self) -> None:
        try:
            await asyncio.wait_for(self._gate.acquire(), self._gate_timeout_s)
        except asyncio.TimeoutError:
            raise RedisConnectionError(
                f"no Redis connection came free within {self._gate_timeout_s} s: all {self.max_in_flight} "
                "(redis.max_connections) are busy; retry, or raise redis.max_connections") from None

    async def execute_command(self, *args, **kwargs):
        await self._take_gate()
        try:
            return await super().execute_command(*args, **kwargs)
        except (AttributeError, RuntimeError) as e:
            _raise_if_torn(e)
            raise
        finally:
            self._gate.release()

    def pipeline(self, transaction=None, shard_hint=None) -> ClusterPipeline:
        if shard_hint:  # what the stock method says
            return super().pipeline(transaction, shard_hint)
        return _BoundedPipeline(self, transaction)


class _BoundedPipeline(ClusterPipeline):
    """A pipeline of `_BoundedCluster`: its `execute` waits for the client's gate."""

    async def execute(self, *args, **kwargs):
        client: _BoundedCluster = self.cluster_client
        await client._take_gate()
        try:
            return await super().execute(*args, **kwargs)
        except (AttributeError, RuntimeError) as e:
            _raise_if_torn(e)
            raise
        finally:
            client._gate.release()


_REDIS_PY = os.path.dirname(redis.__file__) + os.sep


def _raise_if_torn(e: BaseException) -> None:
    """An AttributeError or RuntimeError raised inside redis-py's cluster client is, during a
    failover, a connection torn down under a command: one task's error handling disconnects a
    node's connections (`disconnect_free_connections`, or `aclose` on CLUSTERDOWN) while another
    task is still connecting or writing on one of them, which then finds its stream gone
    ("'NoneType' object has no attribute 'writelines'"; reproduced with 300 tasks on one client
    and a master SIGKILLed: 14 escaped, each a gateway 500 before). Like a dropped connection,
    the command may or may not have run: a ConnectionError (REDIS_DOWN), which every caller
    already waits out and retries. Raised from anywhere else (not redis-py's own frame), it is a
    bug and stays what it is."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is not None and tb.tb_frame.f_code.co_filename.startswith(_REDIS_PY):
        raise RedisConnectionError(f"a Redis Cluster connection was torn down under this command during a "
                                   f"topology change ({type(e).__name__}: {e}); retry") from e


class _NodesManager(NodesManager):
    """redis-py's cluster slot map, refreshed on every topology change, but saying why it could
    not be. The stock one raises RedisClusterException (not a RedisError) when no node answers,
    which would end a service that is waiting for Redis to come up: here that is a
    ConnectionError (REDIS_DOWN), and a node that answers but is not in cluster mode (a plain
    Redis brought up where the cluster was expected) is a RedisConfigError. Every path that
    refreshes the map (commands, pipelines, MULTI/EXEC retries) goes through this `initialize`,
    which is why the manager, not the client, is subclassed (`__class__` is swapped after
    construction: redis-py builds the manager itself, and no slots are added)."""

    __slots__ = ()

    async def initialize(self, *args, **kwargs) -> None:
        try:
            await super().initialize(*args, **kwargs)
        except RedisClusterException as e:
            if type(e) is not RedisClusterException:  # SlotNotCoveredError etc. keep their type
                raise
            # the last node's failure (redis-py raises the last one `from` it). A node that refuses
            # CLUSTER SLOTS answered with a ResponseError, which redis-py re-raises inside its
            # handler as a bare RedisClusterException: the ResponseError is that one's context.
            cause = e.__cause__
            if type(cause) is RedisClusterException and isinstance(cause.__context__, ResponseError):
                raise RedisConfigError(
                    f"redis.cluster=true but the Redis at {', '.join(self.startup_nodes)} refuses CLUSTER SLOTS "
                    f"({cause.__context__ or cause}): it is not a cluster node; set redis.cluster=false "
                    "(TANDEM_<SERVICE>_REDIS__CLUSTER), or point redis.url at a node of the Redis Cluster") from e
            raise RedisConnectionError(f"no Redis Cluster node answered with the slot map: {e}") from e


class _FailoverConnection(SentinelManagedConnection):
    """redis-py turns a demoted primary's READONLY reply into a reconnection through Sentinel,
    but only for plain commands: a Lua script's write fails with an ERR that merely quotes it.
    Treat that the same way (disconnect, ConnectionError), so scripts ride through a failover too."""

    async def read_response(self, *args, **kwargs):
        try:
            return await super().read_response(*args, **kwargs)
        except ResponseError as e:
            if "READONLY" not in str(e) or isinstance(e, ReadOnlyError):
                raise
            await self.disconnect()
            raise RedisConnectionError(f"the primary is now a read-only replica: {e}") from e


def _sentinel_kwargs(cfg: RedisConfig) -> dict:
    return dict(socket_timeout=cfg.socket_timeout_s, socket_connect_timeout=cfg.connect_timeout_s,
                password=cfg.password if cfg.sentinel.auth else None)  # a sentinel's own (default) user


def _probe_timeout(cfg: RedisConfig) -> float:
    return min(cfg.connect_timeout_s, cfg.socket_timeout_s, 2.0)  # a start-up check, not a wait


def _check_server(cfg: RedisConfig) -> None:
    """A URL that reaches the wrong kind of server would fail later with "unknown command" (a
    sentinel), MOVED replies (a cluster node used as a plain Redis) or "cluster support disabled"
    (the reverse): say why now. One INFO; a Redis that is down or refuses INFO passes."""
    t = _probe_timeout(cfg)
    r = redis.Redis.from_url(cfg.url, username=cfg.username, password=cfg.password, socket_timeout=t, socket_connect_timeout=t)
    try:
        info = r.info()  # the default sections: server (redis_mode) and cluster (cluster_enabled)
    except (RedisError, OSError):
        return  # down, or refused us: the services' own retries and errors say so
    finally:
        r.close()
    url = redact_url(cfg.url)
    if info.get("redis_mode") == "sentinel":
        raise RedisConfigError(
            f"redis.url {url} is a Redis Sentinel, not a Redis server: set redis.sentinel.hosts "
            f"(TANDEM_<SERVICE>_REDIS__SENTINEL__HOSTS, a JSON list of host:port) and redis.sentinel.master_name"
            + (" and redis.cluster=false" if cfg.cluster else ""))
    enabled = bool(info.get("cluster_enabled"))
    if cfg.cluster and not enabled:
        raise RedisConfigError(
            f"redis.cluster=true but redis.url {url} is a plain Redis (INFO cluster: cluster_enabled:0): set "
            "redis.cluster=false (TANDEM_<SERVICE>_REDIS__CLUSTER=false), or point redis.url at a node of the Redis Cluster")
    if enabled and not cfg.cluster:
        raise RedisConfigError(
            f"redis.url {url} is a Redis Cluster node (INFO cluster: cluster_enabled:1) but redis.cluster is false: "
            "set redis.cluster=true (TANDEM_<SERVICE>_REDIS__CLUSTER=true) so the services use the cluster client, "
            "which sends each key to the node that owns its slot")


def _check_sentinels(cfg: RedisConfig) -> None:
    """Every answering sentinel must be a sentinel, and one of them must know the master name."""
    t, name = _probe_timeout(cfg), cfg.sentinel.master_name
    kw = {**_sentinel_kwargs(cfg), "socket_timeout": t, "socket_connect_timeout": t}
    known: dict[str, list[str]] = {}
    for host, port in cfg.sentinel.addresses():
        r = redis.Redis(host=host, port=port, **kw)
        try:
            masters = r.sentinel_masters()
        except ResponseError as e:  # a Redis server answers "unknown command" to SENTINEL
            raise RedisConfigError(f"redis.sentinel.hosts: {host}:{port} is not a Redis Sentinel ({e}); "
                                   "list the sentinels' addresses (port 26379 by default)") from e
        except redis.AuthenticationError as e:  # retrying would fail the same way, forever
            raise RedisConfigError(
                f"sentinel {host}:{port} refused authentication ({e}) with redis.sentinel.auth={cfg.sentinel.auth}: "
                "auth=true sends redis.password to the sentinels, auth=false sends none") from e
        except (RedisError, OSError):
            continue  # down: another may answer, or the services wait for them
        finally:
            r.close()
        if name in masters:
            return
        known[f"{host}:{port}"] = sorted(masters)
    if known:
        raise RedisConfigError(
            f"redis.sentinel.master_name {name!r} is unknown to the sentinels "
            + ", ".join(f"{a} (monitors {m or 'nothing'})" for a, m in known.items())
            + "; set redis.sentinel.master_name (TANDEM_<SERVICE>_REDIS__SENTINEL__MASTER_NAME) to one of those")


def redact_url(url: str) -> str:
    """The URL without its password (for messages and logs)."""
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}{rest.rpartition('@')[2]}" if "@" in rest else url


def is_cluster(r) -> bool:
    """Whether `r` is redis-py's cluster client (`connect` with `redis.cluster`)."""
    return isinstance(r, RedisCluster)


async def xread(r, streams: dict, count: int | None = None, block: int | None = None):
    """XREAD of streams that share one slot. On a Redis Cluster it goes straight to the slot's
    node: redis-py would first ask a node for the command's keys (COMMAND GETKEYS: XREAD's keys
    move), one more round trip for every read."""
    if not is_cluster(r):
        return await r.xread(streams, count=count, block=block)
    pieces: list = []
    if count is not None:
        pieces += ["COUNT", count]
    if block is not None:
        pieces += ["BLOCK", block]
    pieces += ["STREAMS", *streams.keys(), *streams.values()]
    return await r.execute_command("XREAD", *pieces, target_nodes=await _node_of(r, next(iter(streams))))


async def xreadgroup(r, group: str, consumer: str, stream: str, count: int):
    """XREADGROUP `>` of one stream, straight to its node on a Redis Cluster (see `xread`)."""
    if not is_cluster(r):
        return await r.xreadgroup(group, consumer, {stream: ">"}, count=count)
    return await r.execute_command("XREADGROUP", "GROUP", group, consumer, "COUNT", count, "STREAMS", stream, ">",
                                   target_nodes=await _node_of(r, stream))


async def _node_of(r: RedisCluster, key: str):
    await r.initialize()  # a no-op once the slot map is known
    return r.get_node_from_key(key)
