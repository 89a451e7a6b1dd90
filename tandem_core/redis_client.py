"""The one Redis client of a process: a plain URL or a Sentinel-managed primary (docs/redis-ha.md).

`connect(cfg)` returns a redis-py asyncio client; with `cfg.sentinel.hosts` it asks the sentinels
for the primary on every new connection, so after a failover it reconnects to the promoted
replica by itself. A short blocking probe first checks that the settings name the right kind of
server (RedisConfigError says what to change); an unreachable Redis passes, services wait for it.
"""
from __future__ import annotations

import redis
import redis.asyncio as aioredis
from redis.asyncio.sentinel import Sentinel, SentinelManagedConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, RedisError, ResponseError

from tandem_core.settings import RedisConfig


class RedisConfigError(ValueError):
    """The Redis settings name the wrong kind of server: fix the settings, retrying cannot help."""


def connect(cfg: RedisConfig) -> aioredis.Redis:
    """One client per process; `decode_responses=False` keeps token ids cheap to parse.

    With `cfg.sentinel.hosts` the client asks the sentinels for the primary of
    `cfg.sentinel.master_name` on every new connection, so after a failover it reconnects to the
    promoted replica by itself; meanwhile its commands raise REDIS_DOWN errors, which services
    ride through as they do a restart. Before returning, one short blocking probe checks the
    settings against what answers (RedisConfigError when a plain URL points at a sentinel, a
    sentinel address is a plain Redis, or no sentinel knows the master name); an unreachable Redis
    passes, since services wait for it.
    """
    common = dict(password=cfg.password, socket_timeout=cfg.socket_timeout_s,
                  socket_connect_timeout=cfg.connect_timeout_s, health_check_interval=30,
                  max_connections=cfg.max_connections)
    if not cfg.sentinel.hosts:
        _check_not_sentinel(cfg)
        return aioredis.Redis.from_url(cfg.url, **common)
    _check_sentinels(cfg)
    sentinel = Sentinel(cfg.sentinel.addresses(), sentinel_kwargs=_sentinel_kwargs(cfg))
    return sentinel.master_for(cfg.sentinel.master_name, connection_class=_FailoverConnection, **common)


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
                password=cfg.password if cfg.sentinel.auth else None)


def _probe_timeout(cfg: RedisConfig) -> float:
    return min(cfg.connect_timeout_s, cfg.socket_timeout_s, 2.0)  # a start-up check, not a wait


def _check_not_sentinel(cfg: RedisConfig) -> None:
    """A URL that reaches a sentinel would fail later with "unknown command": say why now."""
    t = _probe_timeout(cfg)
    r = redis.Redis.from_url(cfg.url, password=cfg.password, socket_timeout=t, socket_connect_timeout=t)
    try:
        mode = r.info("server").get("redis_mode")
    except (RedisError, OSError):
        return  # down, or refused us: the services' own retries and errors say so
    finally:
        r.close()
    if mode == "sentinel":
        raise RedisConfigError(
            f"redis.url {_redact(cfg.url)} is a Redis Sentinel, not a Redis server: set redis.sentinel.hosts "
            f"(TANDEM_<SERVICE>_REDIS__SENTINEL__HOSTS, a JSON list of host:port) and redis.sentinel.master_name")


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


def _redact(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}{rest.rpartition('@')[2]}" if "@" in rest else url
