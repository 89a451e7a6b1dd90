"""Typed operations on the Redis streams of `tandem_core.keys` (redis-py asyncio).

Every read has a block timeout; every stream has a MAXLEN; token streams expire. Services call
these functions instead of building keys or fields themselves.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.asyncio.sentinel import MasterNotFoundError
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tandem_core import keys, redis_client, registry
from tandem_core.redis_client import RedisConfigError
from tandem_core.settings import RedisConfig
from tandem_core.types import GenerationRequest, TokenLogprobs


# What a Redis restart, a network blip or a Sentinel failover raises: callers wait and retry
# these, and only these. During a failover the Sentinel client raises MasterNotFoundError (a
# ConnectionError: no sentinel reports a healthy primary yet), and a primary demoted to replica
# answers writes with READONLY (the Sentinel client turns that into a ConnectionError and asks
# the sentinels again; a plain client gets ReadOnlyError).
# On a Redis Cluster, a failover or slot move raises redis_client.CLUSTER_DOWN until the client
# has found the new owner of the slot.
REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, MasterNotFoundError, ReadOnlyError, ConnectionError, OSError,
              *redis_client.CLUSTER_DOWN)


async def retry_redis(fn, what: str, timeout_s: float = 120.0, log=None):
    """Call `await fn()` until Redis answers (a restart takes seconds), at most `timeout_s`."""
    import asyncio

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await fn()
        except REDIS_DOWN as e:
            if time.monotonic() > deadline:
                raise
            if log:
                log.warning("redis unavailable during %s: %s; retrying", what, e)
            await asyncio.sleep(0.5)


def connect(cfg: RedisConfig) -> aioredis.Redis:
    """The process's Redis client (tandem_core.redis_client.connect); also sets the key shard
    count, which `check_shards` then holds to the deployment's."""
    keys.configure(cfg.shard_count())
    return redis_client.connect(cfg)


async def check_shards(r: aioredis.Redis) -> None:
    """Record this deployment's shard count in Redis (the first service to start does), and refuse
    to start with another: a pod reading 8 shards would never see what a gateway writes to shard 12."""
    mine = keys.shard_count()
    await r.set(keys.SHARDS_KEY, mine, nx=True)
    theirs = await r.get(keys.SHARDS_KEY)
    if theirs is not None and int(theirs) != mine:
        raise RedisConfigError(
            f"this service uses {mine} key shards but the deployment's services use {int(theirs)} "
            f"({keys.SHARDS_KEY} in Redis): set redis.shards (TANDEM_<SERVICE>_REDIS__SHARDS) to {int(theirs)} "
            "everywhere, or drain the deployment and delete the key to change it")


async def ensure_group(r: aioredis.Redis, stream: str, group: str) -> None:
    """Create the consumer group (and the stream) if missing; idempotent."""
    try:
        await r.xgroup_create(stream, group, id="0", mkstream=True)
    except ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise


async def ensure_groups(r: aioredis.Redis, pool: str) -> None:
    """Every shard's admission, ready and direct stream groups (after checking the shard count)."""
    await check_shards(r)
    for shard in keys.all_shards():
        for prio in keys.PRIORITIES:
            await ensure_group(r, keys.admission_stream(pool, prio, shard), keys.PREFILL_GROUP)
        await ensure_group(r, keys.ready_stream(pool, shard), keys.DECODE_GROUP)
        await ensure_group(r, keys.direct_stream(pool, shard), keys.DECODE_GROUP)


def ring(pipe, pool: str, group: str) -> None:
    """Queue a ring of `group`'s doorbell (keys.doorbell) after an enqueue, when there is more
    than one shard; with one, readers block on the streams themselves and no bell is needed."""
    if keys.shard_count() > 1:
        pipe.xadd(keys.doorbell(pool, group), {"r": 1}, maxlen=64, approximate=True)


# ---------------------------------------------------------------- admission


async def enqueue_request(r: aioredis.Redis, pool: str, req: GenerationRequest, maxlen: int,
                          direct: bool = False) -> bytes:
    """XADD to the admission stream of the request's priority, or to the direct stream (decode
    pods prefill those themselves)."""
    shard = keys.request_shard(req.request_id)
    stream = keys.direct_stream(pool, shard) if direct else keys.admission_stream(pool, req.priority, shard)
    pipe = r.pipeline(transaction=False)
    pipe.xadd(stream, {"rid": req.request_id, "req": req.to_json()}, maxlen=maxlen, approximate=True)
    ring(pipe, pool, keys.DECODE_GROUP if direct else keys.PREFILL_GROUP)
    return (await pipe.execute())[0]


async def ready_backlog(r: aioredis.Redis, pool: str) -> int:
    """Ready notices waiting for a decode slot (or pulled and not yet acked), every shard."""
    pipe = r.pipeline(transaction=False)
    for shard in keys.all_shards():
        pipe.xlen(keys.ready_stream(pool, shard))
    return int(sum(await pipe.execute()))


async def admission_backlog(r: aioredis.Redis, pool: str) -> int:
    """Admission entries not yet finished by a prefill, over all priorities.

    Workers XDEL every entry they ack, so XLEN is exactly undelivered + delivered-but-unacked
    (XINFO GROUPS' `lag` is unusable after deletions, and absent before Redis 7).
    """
    pipe = r.pipeline(transaction=False)
    for shard in keys.all_shards():
        for prio in keys.PRIORITIES:
            pipe.xlen(keys.admission_stream(pool, prio, shard))
        pipe.xlen(keys.direct_stream(pool, shard))
    return int(sum(await pipe.execute()))


@dataclass
class Claimed:
    """One entry read through a consumer group: ack it once handled."""

    stream: str
    entry_id: bytes
    fields: dict[str, bytes]


class Doorbell:
    """An idle reader's wait on the doorbells of its groups (keys.doorbell), from the last ring it
    saw: a ring that came while it was reading the streams ends the next wait at once. So the
    wait can be long (`block_ms`): its timeout only bounds how late an entry whose writer died
    between its enqueue and its ring is seen."""

    def __init__(self, r: aioredis.Redis, pool: str, groups: list[str], block_ms: int = 500) -> None:
        self.r, self.block_ms = r, block_ms
        self.last: dict[str, bytes | str] = {keys.doorbell(pool, g): "$" for g in dict.fromkeys(groups)}

    async def wait(self, block_ms: int) -> None:
        got = await redis_client.xread(self.r, dict(self.last), count=64, block=block_ms)
        for name, entries in got or []:
            if entries:
                self.last[_s(name)] = entries[-1][0]


async def claim(
    r: aioredis.Redis, streams: list[str], group: str, consumer: str, count: int, block_ms: int | None,
    bell: Doorbell | None = None,
) -> list[Claimed]:
    """XREADGROUP new entries from `streams` (in order of preference), at most `count` in total.

    First a non-blocking pass, stream by stream, so an earlier (higher-priority) stream is drained
    first. If that finds nothing and `block_ms` is set, a plain XREAD over *all* the streams waits
    until any of them gets a new entry (or the timeout), then the pass runs again. The wait
    delivers nothing: a multi-stream XREADGROUP would, and its COUNT is per stream, so it could
    hand back more entries than the caller has room for. (None or 0: never block.)

    Over more than a few streams (several shards) the pass first reads every stream's length in
    one pipeline (one round trip; on a Redis Cluster node by node in parallel) and reads only the
    non-empty ones. Streams of several slots cannot share one command on a Redis Cluster: there
    the wait is on `bell`, which the writers ring after they enqueue (required then), for the
    longer of `block_ms` and the bell's own.
    """
    spread = redis_client.is_cluster(r) and len({key_slot(s.encode()) for s in streams}) > 1
    prefilter = spread or len(streams) > 4
    out = await _read_each(r, streams, group, consumer, count, prefilter)
    if out or not block_ms:
        return out
    if spread:
        if bell is None:
            raise ValueError("claim over several shards needs a Doorbell to wait on")
        await bell.wait(max(block_ms, bell.block_ms))
    else:
        await redis_client.xread(r, {s: "$" for s in streams}, count=1, block=block_ms)
    return await _read_each(r, streams, group, consumer, count, prefilter)


async def _read_each(r: aioredis.Redis, streams: list[str], group: str, consumer: str, count: int,
                     prefilter: bool = False) -> list[Claimed]:
    out: list[Claimed] = []
    if prefilter:  # XLEN counts entries pending to others too: a non-empty stream may still give none
        pipe = r.pipeline(transaction=False)
        for stream in streams:
            pipe.xlen(stream)
        streams = [s for s, n in zip(streams, await pipe.execute()) if n]
    for stream in streams:
        want = count - len(out)
        if want <= 0:
            break
        out += _claimed(await redis_client.xreadgroup(r, group, consumer, stream, want))
    return out


def _claimed(resp) -> list[Claimed]:
    """XREADGROUP's reply as Claimed entries."""
    out = []
    for name, entries in resp or []:
        for entry_id, fields in entries:
            out.append(Claimed(_s(name), entry_id, {_s(k): v for k, v in fields.items()}))
    return out


async def ack(r: aioredis.Redis, stream: str, group: str, entry_id: bytes) -> None:
    pipe = r.pipeline(transaction=False)
    pipe.xack(stream, group, entry_id)
    pipe.xdel(stream, entry_id)
    await pipe.execute()


async def pod_stream_owners(r: aioredis.Redis, pool: str) -> list[str]:
    """Worker ids that may have per-pod admission streams in any shard (keys.pod_streams_set)."""
    pipe = r.pipeline(transaction=False)
    for shard in keys.all_shards():
        pipe.smembers(keys.pod_streams_set(pool, shard))
    return sorted({_s(x) for members in await pipe.execute() for x in members})


_FORGET_POD = """
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 and redis.call('XLEN', KEYS[i]) > 0 then return 0 end
end
for i = 2, #KEYS do redis.call('DEL', KEYS[i]) end
redis.call('SREM', KEYS[1], ARGV[1])
return 1
"""


async def forget_pod_streams(r: aioredis.Redis, pool: str, worker_id: str) -> bool:
    """Delete a dead pod's per-pod admission streams and its set entry, shard by shard, only if
    every one of the shard is empty (one script per shard: a routed XADD, which re-adds the set
    entry with it, lands before or after). True when no shard has any left."""
    gone = True
    for shard in keys.all_shards():
        names = [keys.pod_admission_stream(pool, p, worker_id, shard) for p in keys.PRIORITIES]
        gone &= bool(await r.eval(_FORGET_POD, 1 + len(names), keys.pod_streams_set(pool, shard), *names, worker_id))
    return gone


# ---------------------------------------------------------------- ready notices


@dataclass
class ReadyNotice:
    """A prefill result waiting for a decode slot; the KV itself stays on the prefill pod."""

    request: GenerationRequest
    address: str  # prefill pod's KV gRPC address host:port
    capability: str  # per-request token the pull must present
    kv_bytes: int
    prefill_worker: str
    first_token: int

    def to_json(self) -> str:
        d = {"request": self.request.to_dict(), "address": self.address, "capability": self.capability,
             "kv_bytes": self.kv_bytes, "prefill_worker": self.prefill_worker, "first_token": self.first_token}
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def from_json(cls, s: str | bytes) -> "ReadyNotice":
        d = json.loads(s)
        d["request"] = GenerationRequest.from_dict(d["request"])
        return cls(**d)


async def publish_ready(r: aioredis.Redis, pool: str, notice: ReadyNotice, maxlen: int) -> bytes:
    pipe = r.pipeline(transaction=False)
    add_ready(pipe, pool, notice, maxlen)
    ring(pipe, pool, keys.DECODE_GROUP)
    return (await pipe.execute())[0]


def add_ready(pipe, pool: str, notice: ReadyNotice, maxlen: int) -> None:
    """Queue the ready XADD, in the request's shard, on a pipeline or transaction (see
    `publish_ready`; the caller rings the doorbell once it is written)."""
    rid = notice.request.request_id
    pipe.xadd(keys.ready_stream(pool, keys.request_shard(rid)), {"rid": rid, "notice": notice.to_json()},
              maxlen=maxlen, approximate=True)


# ---------------------------------------------------------------- token streams


@dataclass
class TokenEvent:
    index: int
    token_id: int
    finish_reason: str | None = None
    error: str | None = None
    entry_id: bytes = b""
    logprobs: TokenLogprobs | None = None  # field `l`, when the request asked for logprobs
    prompt_logprobs: bytes | None = None  # field `p` of the index -1 entry (echo with logprobs)


def add_tokens(
    pipe,
    request_id: str,
    start_index: int,
    token_ids: list[int],
    finish_reason: str | None,
    ttl_s: int,
    maxlen: int,
    error: str | None = None,
    finished_ttl_s: int = 60,
    logprobs: list[TokenLogprobs | None] | None = None,
) -> None:
    """Queue XADDs for consecutive tokens of one request on `pipe` (no round trip here).

    Entry fields: `i` index, `t` token (-1: none), and when set `f` finish, `e` error, `l` the
    token's logprobs (`TokenLogprobs.encode`). An error with no token is written as `t=-1`.
    """
    key = keys.token_stream(request_id)
    ids = token_ids or [-1]
    for n, tok in enumerate(ids):
        fields: dict[str, str | int] = {"i": start_index + n, "t": tok}
        lp = logprobs[n] if logprobs and n < len(logprobs) else None
        if lp is not None:
            fields["l"] = lp.encode()
        if n == len(ids) - 1 and finish_reason:
            fields["f"] = finish_reason
            if error:
                fields["e"] = error
        pipe.xadd(key, fields, maxlen=maxlen, approximate=True)
    # A finished stream stays just long enough for a dropped client to resume and read its end.
    pipe.expire(key, finished_ttl_s if finish_reason else ttl_s)


def add_prompt_logprobs(pipe, request_id: str, encoded: str, ttl_s: int, maxlen: int) -> None:
    """Queue the prompt's logprobs (echo) as the stream's index -1 entry, before token 0: readers
    that know nothing of it drop it as a duplicate index, and resumes ignore it (no token)."""
    key = keys.token_stream(request_id)
    pipe.xadd(key, {"i": -1, "t": -1, "p": encoded}, maxlen=maxlen, approximate=True)
    pipe.expire(key, ttl_s)


def token_event(entry_id: bytes, f: dict) -> TokenEvent:
    """One token stream entry (fields i, t and optionally f, e, l, p; see `add_tokens`)."""
    fin, err, lp = f.get(b"f"), f.get(b"e"), f.get(b"l")
    return TokenEvent(index=int(f[b"i"]), token_id=int(f[b"t"]), finish_reason=_s(fin) if fin is not None else None,
                      error=_s(err) if err is not None else None, entry_id=entry_id,
                      logprobs=TokenLogprobs.decode(lp) if lp is not None else None, prompt_logprobs=f.get(b"p"))


async def running_requests(r: aioredis.Redis, worker_id: str) -> dict[str, GenerationRequest]:
    """A decode pod's running hashes, every shard."""
    pipe = r.pipeline(transaction=False)
    for shard in keys.all_shards():
        pipe.hgetall(keys.running_key(worker_id, shard))
    return {_s(k): GenerationRequest.from_json(v) for raw in await pipe.execute() for k, v in raw.items()}


async def dead_consumer_entries(r: aioredis.Redis, stream: str, group: str, me: str,
                                include_self: bool = False, limit: int = 100,
                                stale_self_ms: int | None = None, busy: set[bytes] | None = None,
                                others: bool = True) -> list[tuple[str, bytes]]:
    """Pending entries (consumer, entry id) that nobody is working on: those of consumers with no
    live registry entry, all of `me`'s with `include_self` (a restart under the same id), and with
    `stale_self_ms` those of `me` idle that long and not in `busy` — a delivery whose reply was
    lost (Redis restarted mid-read) stays pending for its live reader, which never saw it.
    `others` False: only `me`'s (the caller cannot yet tell a dead peer from a silent one,
    tandem_core.lifecycle.PeerJudge)."""
    try:
        summary = await r.xpending(stream, group)
    except ResponseError:
        return []
    out: list[tuple[str, bytes]] = []
    for c in summary.get("consumers") or []:
        name = _s(c["name"])
        idle = None
        if name == me and not include_self:
            if stale_self_ms is None:
                continue
            idle = stale_self_ms
        elif name != me and (not others or await registry.worker_alive(r, name)):
            continue
        rows = await r.xpending_range(stream, group, min="-", max="+", count=limit, consumername=name, idle=idle)
        out += [(name, row["message_id"]) for row in rows if not (busy and row["message_id"] in busy)]
    return out[:limit]


async def claim_ids(r: aioredis.Redis, stream: str, group: str, consumer: str, ids: list[bytes],
                    min_idle_ms: int = 1000) -> list[Claimed]:
    """XCLAIM specific pending entries for `consumer` (entries deleted meanwhile are skipped)."""
    if not ids:
        return []
    resp = await r.xclaim(stream, group, consumer, min_idle_time=min_idle_ms, message_ids=ids)
    return [Claimed(stream, eid, {_s(k): v for k, v in f.items()}) for eid, f in resp or [] if f]


# ---------------------------------------------------------------- cancellation


async def request_cancel(r: aioredis.Redis, request_id: str, ttl_s: int) -> None:
    await r.set(keys.cancel_key(request_id), "1", ex=ttl_s)


async def cancelled(r: aioredis.Redis, request_ids: list[str]) -> set[str]:
    """The requests of `request_ids` with a cancel key, in one round trip: one MGET, or on a
    Redis Cluster (whose pipelines refuse MGET) one GET per request."""
    if not request_ids:
        return set()
    names = [keys.cancel_key(x) for x in request_ids]
    if redis_client.is_cluster(r):
        pipe = r.pipeline(transaction=False)
        for name in names:
            pipe.get(name)
        vals = await pipe.execute()
    else:
        vals = await r.mget(names)
    return {rid for rid, v in zip(request_ids, vals) if v is not None}


def _s(x) -> str:
    return x.decode() if isinstance(x, (bytes, bytearray)) else str(x)
