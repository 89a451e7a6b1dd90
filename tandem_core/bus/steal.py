"""Taking ready notices another decode pod was steered to but has not read.

The gateway steers a request to the decode pod likeliest to hold its prompt's leading KV blocks
(gateway/decode_route.py); the prefill pod then writes its ready notice to that pod's per-pod
ready stream (`bus.ready.add_ready`). A steered pod reads its own stream first, but only when it
has room: a busy pod (or a dead one, or one paused) would leave the notice there while the
prefill pod's KV lease runs. So every decode pod with room left over after its own and the shared
streams takes entries of other pods' streams that have waited unread for `wait_s` (a miss of the
block cache costs a whole pull, never a lost request). A notice read (delivered) is the steered
pod's until acked; one it died holding is reclaimed as the shared stream's are (decode_svc/recover.py).

How long an entry waited is measured here, on this pod's monotonic clock, from when this pod
first saw it unread: no clock is compared across hosts. So it is at least `wait_s`, and at most
`wait_s` plus one claim pass (the stealer watches the streams it saw, so a new entry wakes it).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from tandem_core import redis_client
from tandem_core.bus import groups, ready
from tandem_core.keys import DECODE_GROUP, KeySpace


@dataclass
class Taken:
    """One steal pass: what was claimed, and when to look again."""

    claimed: list[groups.Claimed] = field(default_factory=list)
    due_s: float | None = None  # seconds until an entry seen unread may be taken; None: none waits
    watch: list[str] = field(default_factory=list)  # other pods' per-pod streams (to wait on)
    error: Exception | None = None  # a later stream's look or claim failed: `claimed` is still this pod's


class Stealer:
    """One decode pod's take of other pods' unread per-pod ready entries. `seen` holds, per
    stream, when this pod first saw each of its oldest unread entries (at most `count` of a pass
    each), and is pruned to what is still unread: bounded by the streams times the room."""

    def __init__(self, r: aioredis.Redis, ks: KeySpace, pool: str, me: str, wait_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.r, self.ks, self.pool, self.me, self.wait_s, self.clock = r, ks, pool, me, wait_s, clock
        self.seen: dict[str, dict[bytes, float]] = {}
        self.stolen = 0  # entries taken from other pods' streams
        # streams whose steal claim failed: its XREADGROUP may have run with the reply lost, its
        # entries pending to this live pod, which never saw them (the claimer's `retake_own` looks)
        self.unsure: set[str] = set()

    async def take(self, count: int) -> Taken:
        """Claim up to `count` entries of other pods' per-pod ready streams that this pod has seen
        unread for `wait_s` or longer, oldest first."""
        others = [p.stream for p in await ready.pod_ready_streams(self.r, self.ks, self.pool) if p.owner != self.me]
        out = Taken(watch=others)
        if not others or count <= 0:
            self.seen = {}
            return out
        pipe = self.r.pipeline(transaction=False)
        for s in others:
            pipe.xlen(s)
        busy = [s for s, n in zip(others, await pipe.execute()) if n]
        self.seen = {s: v for s, v in self.seen.items() if s in busy}
        now = self.clock()
        try:
            await self._take_from(busy, count, now, out)
        except Exception as e:
            if not out.claimed:
                raise
            # Entries claimed before the failure are this pod's in Redis: they go to the caller,
            # which starts them. Dropped, they would wait out the stale reclaim pending to a live
            # pod, while their KV lease runs (issue 42).
            out.error = e
        return out

    async def _take_from(self, busy: list[str], count: int, now: float, out: Taken) -> None:
        for stream in busy:
            want = count - len(out.claimed)
            if want <= 0:
                break
            unread = await self._unread(stream, want)
            seen = self.seen.setdefault(stream, {})
            for eid in list(seen):
                if eid not in unread:
                    del seen[eid]
            ripe, waiting = 0, False
            for eid in unread:  # oldest first, the order XREADGROUP `>` delivers in: take a prefix
                t = seen.setdefault(eid, now)
                if not waiting and now - t >= self.wait_s:
                    ripe += 1
                    continue
                waiting = True
                due = max(0.0, t + self.wait_s - now)
                out.due_s = due if out.due_s is None else min(out.due_s, due)
            if ripe:
                try:
                    got = groups.as_claimed(await redis_client.xreadgroup(self.r, DECODE_GROUP, self.me, stream, ripe))
                except Exception:
                    self.unsure.add(stream)
                    raise
                for c in got:
                    seen.pop(c.entry_id, None)
                self.stolen += len(got)
                out.claimed += got

    async def _unread(self, stream: str, count: int) -> list[bytes]:
        """The ids of the stream's oldest `count` entries not yet delivered to any decode pod."""
        last = await self._last_delivered(stream)
        rows = await self.r.xrange(stream, min=f"({last}", max="+", count=count)
        return [eid if isinstance(eid, bytes) else str(eid).encode() for eid, _f in rows]

    async def _last_delivered(self, stream: str) -> str:
        """The decode group's last delivered id; a stream without the group (its owner's stream was
        forgotten as dead and empty, then a late steered write made it again) gets the group at 0."""
        try:
            info = await self.r.xinfo_groups(stream)
        except ResponseError:
            info = []
        for g in info:
            if _s(g.get("name")) == DECODE_GROUP:
                return _s(g.get("last-delivered-id"))
        await groups.ensure_group(self.r, stream, DECODE_GROUP)
        return "0-0"


def _s(x) -> str:
    return x.decode() if isinstance(x, (bytes, bytearray)) else str(x)
