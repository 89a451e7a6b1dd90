"""Consumer-group mechanics shared by the admission and ready streams: creating the groups,
claiming entries (in order of preference, never more than the caller has room for), the doorbell
an idle reader waits on when its streams span several Redis Cluster slots, and the ack.

Every read has a block timeout; the streams' writers live in `bus.admission` and `bus.ready`.
"""
from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.crc import key_slot
from redis.exceptions import ResponseError

from tandem_core import keys, redis_client
from tandem_core.keys import DECODE_GROUP, PREFILL_GROUP  # noqa: F401 - the groups' names, for services
from tandem_core.keys import KeySpace
from tandem_core.bus.conn import check_shards


async def ensure_group(r: aioredis.Redis, stream: str, group: str) -> None:
    """Create the consumer group (and the stream) if missing; idempotent."""
    try:
        await r.xgroup_create(stream, group, id="0", mkstream=True)
    except ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise


async def ensure_groups(r: aioredis.Redis, ks: KeySpace, pool: str) -> None:
    """Every shard's admission, ready and direct stream groups (after checking the shard count)."""
    await check_shards(r, ks)
    for shard in ks.all_shards():
        for prio in keys.PRIORITIES:
            await ensure_group(r, ks.admission_stream(pool, prio, shard), keys.PREFILL_GROUP)
        await ensure_group(r, ks.ready_stream(pool, shard), keys.DECODE_GROUP)
        await ensure_group(r, ks.direct_stream(pool, shard), keys.DECODE_GROUP)


def ring(pipe, ks: KeySpace, pool: str, group: str) -> None:
    """Queue a ring of `group`'s doorbell (keys.doorbell) after an enqueue, when there is more
    than one shard; with one, readers block on the streams themselves and no bell is needed."""
    if ks.shards > 1:
        pipe.xadd(keys.doorbell(pool, group), {"r": 1}, maxlen=64, approximate=True)


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

    async def wait(self, block_ms: int) -> bool:
        """True if a bell rang (since the last ring seen), False at the timeout."""
        got = await redis_client.xread(self.r, dict(self.last), count=64, block=block_ms)
        rang = False
        for name, entries in got or []:
            if entries:
                self.last[_s(name)] = entries[-1][0]
                rang = True
        return rang


async def claim(
    r: aioredis.Redis, streams: list[str], group: str, consumer: str, count: int, block_ms: int | None,
    bell: Doorbell | None = None,
) -> list[Claimed]:
    """XREADGROUP new entries from `streams` (in order of preference), at most `count` in total.

    A non-blocking pass, stream by stream, so an earlier (higher-priority) stream is drained
    first. If that finds nothing and `block_ms` is set, `wait` for a new entry in any of them (or
    the timeout), and only if one came, the pass once more. (None or 0: never block.)

    Over more than a few streams (several shards) the pass first reads every stream's length in
    one pipeline (one round trip; on a Redis Cluster node by node in parallel) and reads only the
    non-empty ones.
    """
    prefilter = _spread(r, streams) or len(streams) > 4
    out = await _read_each(r, streams, group, consumer, count, prefilter)
    if out or not block_ms or not await wait(r, streams, block_ms, bell):
        return out
    return await _read_each(r, streams, group, consumer, count, prefilter)


async def wait(r: aioredis.Redis, streams: list[str], block_ms: int, bell: Doorbell | None = None) -> bool:
    """Block until any of `streams` gets a new entry, at most `block_ms`: True if one came (or
    the bell rang), False at the timeout. It delivers nothing: a multi-stream XREADGROUP would, and
    its COUNT is per stream, so it could hand back more entries than the caller has room for; the
    caller's next pass claims what came. Streams of several slots cannot share one command on a
    Redis Cluster: there the wait is on `bell`, which the writers ring after they enqueue
    (required then), for the longer of `block_ms` and the bell's own."""
    if _spread(r, streams):
        if bell is None:
            raise ValueError("a wait over several shards needs a Doorbell")
        return await bell.wait(max(block_ms, bell.block_ms))
    got = await redis_client.xread(r, {s: "$" for s in streams}, count=1, block=block_ms)
    return any(entries for _, entries in got or [])


def _spread(r: aioredis.Redis, streams: list[str]) -> bool:
    """Whether `streams` span several slots of a Redis Cluster."""
    return redis_client.is_cluster(r) and len({key_slot(s.encode()) for s in streams}) > 1


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
        out += as_claimed(await redis_client.xreadgroup(r, group, consumer, stream, want))
    return out


def as_claimed(resp) -> list[Claimed]:
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


def _s(x) -> str:
    return x.decode() if isinstance(x, (bytes, bytearray)) else str(x)
