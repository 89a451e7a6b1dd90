"""The worker registry: each worker's heartbeat hash (keys.worker_key) and the sorted set of
live ids (keys.WORKERS), and which Redis answers (`server_id`, which changes when it restarts or
fails over: the pods' and gateways' signal to reconcile)."""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from tandem_core import keys, redis_client

log = logging.getLogger(__name__)


async def worker_alive(r: aioredis.Redis, worker_id: str) -> bool:
    return bool(await r.exists(keys.worker_key(worker_id)))


@dataclass
class WorkerInfo:
    role: str  # "prefill" | "decode"
    id: str
    pid: int
    address: str
    slots: int = 0
    free_slots: int = 0
    held_kv_bytes: int = 0
    draining: bool = False
    extra: dict = field(default_factory=dict)


async def heartbeat(r: aioredis.Redis, w: WorkerInfo, ttl_s: int) -> str | None:
    """Write `w`'s registry entry; returns the Redis server's run_id (it changes on a restart)."""
    now = time.time()
    fields = {
        "role": w.role, "id": w.id, "pid": w.pid, "address": w.address, "slots": w.slots,
        "free_slots": w.free_slots, "held_kv_bytes": w.held_kv_bytes, "draining": int(w.draining),
        "ts": now, "extra": json.dumps(w.extra),
    }
    pipe = r.pipeline(transaction=False)
    pipe.hset(keys.worker_key(w.id), mapping=fields)
    pipe.expire(keys.worker_key(w.id), ttl_s)
    pipe.zadd(keys.WORKERS, {w.id: now})
    if redis_client.is_cluster(r):
        await pipe.execute()
        return await server_id(r)
    pipe.info("server")
    server = (await pipe.execute())[-1]
    return str(server.get("run_id")) if isinstance(server, dict) and server.get("run_id") else None


async def server_id(r: aioredis.Redis) -> str | None:
    """Which Redis answers: its run_id, which changes when it restarts or fails over; on a Redis
    Cluster every primary's, joined, so a failover of any one of them changes it too."""
    if not redis_client.is_cluster(r):
        info = await r.info("server")
        return str(info.get("run_id")) if info.get("run_id") else None
    per_node = await r.info("server", target_nodes=RedisCluster.PRIMARIES)
    ids = sorted(str(v.get("run_id")) for v in per_node.values() if isinstance(v, dict) and v.get("run_id"))
    return ",".join(ids) or None


async def deregister(r: aioredis.Redis, worker_id: str) -> None:
    pipe = r.pipeline(transaction=False)
    pipe.delete(keys.worker_key(worker_id))
    pipe.zrem(keys.WORKERS, worker_id)
    await pipe.execute()


async def list_workers(r: aioredis.Redis) -> list[dict]:
    """Live workers with `heartbeat_age_s`; entries whose hash expired are pruned."""
    ids = [_s(x) for x in await r.zrange(keys.WORKERS, 0, -1)]
    if not ids:
        return []
    pipe = r.pipeline(transaction=False)
    for wid in ids:
        pipe.hgetall(keys.worker_key(wid))
    hashes = await pipe.execute()
    now = time.time()
    out, dead = [], []
    for wid, h in zip(ids, hashes):
        if not h:
            dead.append(wid)
            continue
        try:  # one worker's malformed hash (a bug, another release) drops that worker, not the list
            h = {_s(k): _s(v) for k, v in h.items()}
            extra = json.loads(h.get("extra") or "{}")
            out.append(
                {
                    "role": h["role"], "id": h["id"], "pid": int(h["pid"]), "address": h["address"],
                    "slots": int(h["slots"]), "free_slots": int(h["free_slots"]),
                    "held_kv_bytes": int(h["held_kv_bytes"]), "draining": h.get("draining") == "1",
                    "heartbeat_age_s": round(now - float(h["ts"]), 3),
                    "extra": extra if isinstance(extra, dict) else {},
                }
            )
        except Exception as e:  # noqa: BLE001 - whatever is wrong with it
            _log_bad_heartbeat(wid, e)
    if dead:
        await r.zrem(keys.WORKERS, *dead)
    return out


_bad_logged: set[str] = set()  # workers whose malformed heartbeat was logged (once each; bounded below)


def _log_bad_heartbeat(wid: str, e: Exception) -> None:
    if wid in _bad_logged:
        return
    if len(_bad_logged) > 1024:
        _bad_logged.clear()
    _bad_logged.add(wid)
    log.error("malformed heartbeat %s (%s: %s): the worker is left out of the registry until it writes a good one",
              keys.worker_key(wid), type(e).__name__, e)


def _s(x) -> str:
    return x.decode() if isinstance(x, (bytes, bytearray)) else str(x)
