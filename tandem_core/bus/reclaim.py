"""Finding and taking over work nobody is doing: consumer-group entries pending to dead consumers
(or lost deliveries of a live one), and a decode pod's running hashes (what it owned when it died).
"""
from __future__ import annotations

from collections.abc import Callable

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from tandem_core import keys
from tandem_core.keys import KeySpace
from tandem_core.bus import registry
from tandem_core.bus.groups import Claimed
from tandem_core.types import GenerationRequest


async def running_owners(r: aioredis.Redis) -> set[str]:
    """Every worker id with a running hash (SCAN over every shard's)."""
    return {keys.running_owner(key) async for key in r.scan_iter(match=keys.RUNNING_PATTERN, count=100)}


async def lock_recovery(r: aioredis.Redis, worker_id: str, me: str, ttl_s: int) -> bool:
    """Take the lock on recovering `worker_id` (False: another pod is on it). Release it with
    `unlock_recovery`; it expires after `ttl_s` if this pod dies first."""
    return bool(await r.set(keys.recovering_key(worker_id), me, nx=True, ex=ttl_s))


async def unlock_recovery(r: aioredis.Redis, worker_id: str) -> None:
    await r.delete(keys.recovering_key(worker_id))


async def running_requests(r: aioredis.Redis, ks: KeySpace, worker_id: str) -> dict[str, GenerationRequest]:
    """A decode pod's running hashes, every shard."""
    pipe = r.pipeline(transaction=False)
    for shard in ks.all_shards():
        pipe.hgetall(ks.running_key(worker_id, shard))
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


class Reclaimer:
    """One worker's take-over of entries of its consumer group left pending to dead consumers:
    find them (`dead_consumer_entries`), take as many as the worker has room for, XCLAIM those.
    Shared by the prefill pods (admission streams) and decode pods (ready and direct streams)."""

    def __init__(self, r: aioredis.Redis, group: str, me: str, stale_self_ms: int, limit: int = 100,
                 min_idle_ms: int = 1000) -> None:
        self.r, self.group, self.me = r, group, me
        self.stale_self_ms, self.limit, self.min_idle_ms = stale_self_ms, limit, min_idle_ms
        self.owners: dict[bytes, str] = {}  # the last `take`: each entry's consumer before this one took it

    async def take(self, stream: str, room: Callable[[int], int], include_self: bool = False, others: bool = True,
                   busy: set[bytes] | None = None,
                   give_back: Callable[[int], None] | None = None) -> tuple[list[Claimed], int]:
        """(the entries now claimed by this worker, the room `room` granted). `room(n)` is called
        with the number found (only when some are) and returns how many of them to take (a decode
        pod reserves slots there and gives back what the claim did not use). `include_self`: a
        restart under the same id takes all of its own, at once; else its own only when idle past
        `stale_self_ms` and not in `busy`, and others' only when idle `min_idle_ms` (XCLAIM resets
        an entry's idle time, so two pods never both take one). `others`: see
        `dead_consumer_entries`. `give_back(n)`: what undoes `room`'s grant when the claim fails
        (a decode pod's tickets: kept, a Redis blip here would shrink the pod for good)."""
        dead = await dead_consumer_entries(self.r, stream, self.group, self.me, include_self, self.limit,
                                           stale_self_ms=self.stale_self_ms, busy=busy, others=others)
        self.owners = {eid: c for c, eid in dead}
        if not dead:
            return [], 0
        n = room(len(dead))
        ids = [eid for _c, eid in dead[:n]]
        try:
            return await claim_ids(self.r, stream, self.group, self.me, ids, 0 if include_self else self.min_idle_ms), n
        except BaseException:
            if give_back is not None:
                give_back(n)
            raise


def _s(x) -> str:
    return x.decode() if isinstance(x, (bytes, bytearray)) else str(x)
