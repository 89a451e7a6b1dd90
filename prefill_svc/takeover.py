"""A prefill pod's share of the work other pods left: admission entries a dead pod claimed and
never acked (shared streams and this pod's own, after a restart under the same id or a lost
delivery), and the per-pod admission streams of a prefill pod that is gone or draining (prompts
the gateway routed there for its prefix cache). Each entry taken is handled like one this pod
claimed itself (prefill_svc/commit.py), as far as the held-KV budget has room.

"Dead" is judged from the registry's heartbeats, and only once the pod's own heartbeat loop says
peers can be judged at all (tandem_core.lifecycle.PeerJudge: after a Redis restart every pod looks
gone for a heartbeat TTL).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis

from prefill_svc.settings import PrefillSettings
from tandem_core import lifecycle
from tandem_core.bus import admission, groups, reclaim, registry
from tandem_core.bus import KeySpace

log = logging.getLogger(__name__)
# An admission entry delivered this many times (its first read, then each reclaim) was never
# answered by the pods that held it: each died or failed on it. It is not tried again (a prompt
# that kills a pod would go round every pod for ever, each try `stale_pending_s` apart): its
# request gets a clear error instead (`give_up`, prefill_svc/commit.py).
MAX_DELIVERIES = 5


class Takeover:
    """Finds and takes over dead or draining prefill pods' admission entries, at most every
    `recover_interval_s` (besides the startup and NOGROUP passes, which include this pod's own)."""

    def __init__(self, settings: PrefillSettings, r: aioredis.Redis, ks: KeySpace, worker_id: str,
                 room: Callable[[], int], handle: Callable[[groups.Claimed], Awaitable[None]],
                 peers: lifecycle.PeerJudge | None = None,
                 give_up: Callable[[groups.Claimed, int], Awaitable[None]] | None = None) -> None:
        self.s, self.r, self.ks, self.worker_id = settings, r, ks, worker_id
        self.room, self.handle = room, handle  # budget room (prompts), and how a taken entry is handled
        # whether a missing heartbeat means a dead peer yet (None: always)
        self.peers = peers
        self.give_up = give_up  # (entry, times delivered): its request's error, its ack (None: tried again)
        self.reclaimer = reclaim.Reclaimer(r, groups.PREFILL_GROUP, worker_id,
                                           stale_self_ms=int(settings.stale_pending_s * 1000),
                                           limit=settings.reclaim_batch, min_idle_ms=settings.reclaim_min_idle_ms)
        self._last = 0.0
        # This pod's own entries pending with nothing here working on them: a previous incarnation's
        # (a restart, a NOGROUP) the budget had too little room to take all of, or a claim's whose
        # reply a dying connection lost (PrefillWorker.run sets it on Redis down). The claim rounds
        # take them as the budget frees (`own_due`), not `stale_pending_s` later
        self.own_waiting = False
        self._own_retry_at = 0.0  # a pass that failed (Redis still away) is tried again from then on

    def own_stream(self, prio: str, shard: int) -> str:
        return self.ks.pod_admission_stream(self.s.pool, prio, self.worker_id, shard)

    async def run(self, include_self: bool = False, own_only: bool = False) -> None:
        """Take over admission entries claimed by a dead pod (never acked), and the per-pod streams
        of a dead or draining pod, budget permitting. Never raises: the next round looks again.
        `own_only` (with `include_self`: the claim rounds' pass for `own_waiting`): this pod's own
        entries alone; dead pods' stay with the periodic pass, whose XCLAIM waits out
        `reclaim_min_idle_ms` (an own pass claims at any idle time: pods that all lost Redis
        together and all looked at once would take a dead pod's entries from each other)."""
        now = time.monotonic()
        if not include_self and now - self._last < self.s.recover_interval_s:
            return
        if not own_only:  # (an own pass leaves the periodic one its turn)
            self._last = now
        left = False
        try:
            for shard in self.ks.all_shards():
                for prio in admission.PRIORITIES:
                    for stream in (self.ks.admission_stream(self.s.pool, prio, shard), self.own_stream(prio, shard)):
                        left |= await self.reclaim_pending(stream, include_self, own_only)
            if not own_only:
                await self._adopt_orphans()
        except Exception as e:  # noqa: BLE001 - Redis down included: the next round looks again
            log.warning("reclaim failed: %s", e)
            left = True  # (read only for an own pass: it is tried again)
            self._own_retry_at = now + self.s.recover_interval_s
        if include_self:
            self.own_waiting = left

    def own_due(self) -> bool:
        """Whether this pod's own leftovers wait (`own_waiting`) and may be looked for now."""
        return self.own_waiting and time.monotonic() >= self._own_retry_at

    async def reclaim_pending(self, stream: str, include_self: bool, own_only: bool = False) -> bool:
        """The entries of `stream` pending to dead consumers (and this pod's own lost or, with
        `include_self`, all of its own), as many as the budget has room for. Returns whether,
        with `include_self`, some of this pod's own are left for lack of room (or may be: as many
        were found as one pass looks at)."""
        claimed, n = await self.reclaimer.take(stream, lambda found: min(found, self.room()), include_self,
                                               others=self._peers_trusted() and not own_only)
        owners = list(self.reclaimer.owners.values())  # each found entry's consumer, in the order taken
        own_left = owners[n:].count(self.worker_id)
        left = include_self and (own_left > 0 or (len(owners) >= self.reclaimer.limit and self.worker_id in owners))
        if own_left and include_self:
            log.info("%d of this pod's own entries of %s (a previous incarnation's, or a lost claim reply's) wait "
                     "for room in the KV budget: taken as it frees", own_left, stream)
        # (own stale entries are re-claimed too: XCLAIM resets their idle time)
        for c in claimed:
            deliveries = await self._deliveries(stream, c.entry_id)
            if self.give_up is not None and deliveries >= MAX_DELIVERIES:
                await self.give_up(c, deliveries)
                continue
            log.info("reclaimed admission entry %s of a dead consumer", c.entry_id)
            await self.handle(c)
        return left

    async def _deliveries(self, stream: str, entry_id: bytes) -> int:
        """How many times the entry was delivered (its read, and every reclaim's XCLAIM)."""
        rows = await self.r.xpending_range(stream, groups.PREFILL_GROUP, min=entry_id, max=entry_id, count=1)
        return int(rows[0]["times_delivered"]) if rows else 0

    def _peers_trusted(self) -> bool:
        return self.peers is None or self.peers.trusted

    async def _adopt_orphans(self) -> None:
        """Prompts routed to a prefill pod that is gone or draining: read them here; once a dead
        pod's streams are empty they and its set entry go, atomically (a gateway's routed XADD
        re-adds the entry in the same transaction, so none is stranded)."""
        if not self._peers_trusted():
            return  # right after a Redis restart every pod looks gone
        live = {w["id"]: w for w in await registry.list_workers(self.r) if w["role"] == "prefill"}
        for wid in await admission.pod_stream_owners(self.r, self.ks, self.s.pool):
            if wid == self.worker_id or (wid in live and not live[wid].get("draining")):
                continue
            for stream in [self.ks.pod_admission_stream(self.s.pool, prio, wid, shard)
                           for shard in self.ks.all_shards() for prio in admission.PRIORITIES]:
                if wid not in live:
                    await self.reclaim_pending(stream, False)
                room = self.room()
                if room and await self.r.exists(stream):
                    await groups.ensure_group(self.r, stream, groups.PREFILL_GROUP)  # re-created by a late XADD
                    for c in await groups.claim(self.r, [stream], groups.PREFILL_GROUP, self.worker_id, room, None):
                        log.info("took admission entry %s routed to prefill pod %s (gone or draining)", c.entry_id, wid)
                        await self.handle(c)
            if wid not in live:
                await admission.forget_pod_streams(self.r, self.ks, self.s.pool, wid)
