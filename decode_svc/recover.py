"""Finding and resuming work that a dead decode pod left behind.

Two kinds of leftovers, both found from Redis alone:
1. requests in a dead pod's running hash (`tandem:running:{id}`): they resume from the prompt
   plus the tokens already streamed (tandem_core.bus.recovery), and leave the hash in the same
   transaction, which also fences off the pod if it was only paused;
2. entries of the ready/direct streams (and of every decode pod's per-pod ready stream)
   delivered to a dead consumer and never acked: this pod claims them (XCLAIM) for slots it has
   free, as if it had read them itself. A dead pod's per-pod stream, once empty, is forgotten.
"Dead" means no registry entry (its heartbeat key expired), and counts only once this pod has
itself talked to the same Redis for a heartbeat TTL (`io.peers`, tandem_core.lifecycle.PeerJudge):
after a Redis outage or restart every entry can be gone at once. A pod restarted under the same id
recovers its own previous leftovers once at startup, before it claims anything new.
"""
from __future__ import annotations

import asyncio
import logging

from decode_svc.io import DecodeIO
from tandem_core.bus import groups, ready, reclaim, registry

log = logging.getLogger(__name__)


async def recover_running(io: DecodeIO, include_self: bool = False) -> int:
    r, me = io.r, io.worker_id
    resumed = 0
    owners = await reclaim.running_owners(r)
    for wid in sorted(owners):
        if wid == me and not include_self:
            continue
        if wid != me and (not io.peers.trusted or await registry.worker_alive(r, wid)):
            continue
        if not await reclaim.lock_recovery(r, wid, me, io.s.recovering_lock_ttl_s):
            continue  # another pod is on it
        try:
            for rid, req in (await reclaim.running_requests(r, io.ks, wid)).items():
                outcome = await io.resume(req, f"decode pod {wid} stopped", owner=wid)
                resumed += outcome == "resumed"
                log.info("recovered request_id=%s from %s: %s", rid, wid, outcome)
        finally:
            await reclaim.unlock_recovery(r, wid)
    return resumed


async def reclaim_pending(io: DecodeIO, include_self: bool = False) -> int:
    """Ready and direct entries left pending to dead consumers (or, `include_self`, to this pod's
    previous incarnation): claimed for the slots free, each started as if this pod had read it."""
    got = 0
    s = io.s
    taker = reclaim.Reclaimer(io.r, groups.DECODE_GROUP, io.worker_id, int(s.stale_pending_s * 1000),
                              limit=s.reclaim_batch, min_idle_ms=s.reclaim_min_idle_ms)
    pods = await ready.pod_ready_streams(io.r, io.ks, s.pool)  # (cache-aware routing: steered notices)
    for stream in ready.decode_streams(io.ks, s.pool) + [p.stream for p in pods]:
        started = io.resync.started  # (Claims.dispatch: a reconcile begun after this counts)
        claimed, n = await taker.take(stream, io.table.reserve, include_self, others=io.peers.trusted,
                                      busy=io.table.busy_entries(stream))
        io.table.unreserve(n - len(claimed))
        for c in claimed:
            log.info("reclaimed %s entry %s of a dead consumer", stream, c.entry_id)
            await io.claims.dispatch(c, groups.DECODE_GROUP, started)
        got += len(claimed)
    if io.peers.trusted:
        await forget_dead_pod_streams(io, pods)
    return got


async def forget_dead_pod_streams(io: DecodeIO, pods: list[ready.PodStream]) -> None:
    """Delete the per-pod ready streams of dead decode pods once empty (their entries were taken by
    the steal, and the pending ones by the reclaim above), so the set does not grow with every
    pod that ever lived."""
    alive: dict[str, bool] = {}
    for p in pods:
        if p.owner == io.worker_id:
            continue
        if p.owner not in alive:
            alive[p.owner] = await registry.worker_alive(io.r, p.owner)
        if not alive[p.owner] and await ready.forget_pod_ready(io.r, io.ks, io.s.pool, p.owner, p.shard):
            log.info("forgot the empty ready stream of dead decode pod %s (shard %d)", p.owner, p.shard)


async def recover_loop(io: DecodeIO, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            if io.handback.owed:  # what this pod let go of while Redis would not take it
                await io.handback.settle()
            await recover_running(io)
            await reclaim_pending(io)
        except Exception as e:  # noqa: BLE001 - a Redis blip: try again next round
            log.warning("recovery round failed: %s", e)
        try:
            await asyncio.wait_for(stop.wait(), timeout=io.s.recover_interval_s)
        except asyncio.TimeoutError:
            pass
