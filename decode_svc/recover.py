"""Finding and resuming work that a dead decode pod left behind.

Two kinds of leftovers, both found from Redis alone:
1. requests in a dead pod's running hash (`tandem:running:{id}`): they resume from the prompt
   plus the tokens already streamed (tandem_core.bus.recovery), and leave the hash in the same
   transaction, which also fences off the pod if it was only paused;
2. entries of the ready/direct streams (and of every decode pod's per-pod ready stream)
   delivered to a dead consumer and never acked: this pod claims them (XCLAIM) for slots it has
   free, as if it had read them itself. A dead pod's per-pod stream, once empty, is forgotten;
3. colocated (no prefill pods): admission entries a dead colocated pod claimed (under the prefill
   group) and never acked: each request is resumed once, whichever of its two traces (the entry,
   its field in the dead pod's running hash) is found first (`reclaim_admissions`), and the entry
   acked: killed before its ownership write it ran nowhere, killed after it the entry stayed
   pending for ever (counted in the backlog the gateway's 429 and the planner read).
"Dead" means no registry entry (its heartbeat key expired), and counts only once this pod has
itself talked to the same Redis for a heartbeat TTL (`io.peers`, tandem_core.lifecycle.PeerJudge):
after a Redis outage or restart every entry can be gone at once. A pod restarted under the same id
recovers its own previous leftovers at startup, before it claims anything new: as many as it has
rows free then, the rest as rows free (`Claims.own_waiting`).
"""
from __future__ import annotations

import asyncio
import logging

from decode_svc.io import DecodeIO
from tandem_core.bus import admission, dead_letter, groups, ready, reclaim, registry
from tandem_core.types import GenerationRequest, choice_ids

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
                                      busy=io.table.busy_entries(stream), give_back=io.table.unreserve)
        io.table.unreserve(n - len(claimed))
        if include_self and len(taker.owners) > n:  # more left than rows free: taken as rows free
            io.claims.own_waiting = True
            log.info("%d entries of %s wait for a free row (left by this pod's previous incarnation or a dead "
                     "consumer)", len(taker.owners) - n, stream)
        for c in claimed:
            log.info("reclaimed %s entry %s of a dead consumer", stream, c.entry_id)
            await io.claims.dispatch(c, groups.DECODE_GROUP, started)
        got += len(claimed)
    if io.peers.trusted:
        await forget_dead_pod_streams(io, pods)
    if s.colocated:
        got += await reclaim_admissions(io, include_self)
    return got


async def reclaim_admissions(io: DecodeIO, include_self: bool = False) -> int:
    """Colocated pods claim admission entries under the prefill group, and no prefill pod is there
    to reclaim a dead one's: this pod takes them (or, `include_self`, its previous incarnation's)
    and resumes each request instead of running the entry as it is. The resume (recovery.resume,
    owner: the dead pod) takes the request out of the dead pod's running hash and enqueues it again
    in one step; its marker makes the running hash's recovery (`recover_running`) and this one
    resume it once between them, in either order. Then the entry is acked. Returns how many."""
    s, got = io.s, 0
    taker = reclaim.Reclaimer(io.r, groups.PREFILL_GROUP, io.worker_id, int(s.stale_pending_s * 1000),
                              limit=s.reclaim_batch, min_idle_ms=s.reclaim_min_idle_ms)
    for shard in io.ks.all_shards():
        for prio in admission.PRIORITIES:
            stream = io.ks.admission_stream(s.pool, prio, shard)
            claimed, _n = await taker.take(stream, lambda found: found, include_self, others=io.peers.trusted,
                                           busy=io.table.busy_entries(stream))
            for c in claimed:
                owner = taker.owners.get(c.entry_id, io.worker_id)
                if owner == io.worker_id and not include_self:  # a lost reply of this pod's own claim: run it
                    if io.table.reserve(1):  # (a seat for it; none free: pending still, taken up again later)
                        await io.claims.dispatch(c, groups.PREFILL_GROUP, None)
                    continue
                if await _resume_admission(io, c, owner):
                    await io.handback.ack(c.stream, groups.PREFILL_GROUP, c.entry_id)
                got += 1
    return got


async def _resume_admission(io: DecodeIO, c: groups.Claimed, owner: str) -> bool:
    """One admission entry of a dead colocated pod: its request resumed once (see
    `reclaim_admissions`); True when its entry may be acked."""
    try:
        req = GenerationRequest.from_json(c.fields["req"])
    except Exception as e:  # noqa: BLE001 - a dead letter: answered and acked
        await io.claims._bury(dead_letter.read(c.stream, c.entry_id, c.fields, e), c, groups.PREFILL_GROUP)
        return False
    why = f"colocated decode pod {owner} stopped before it finished"
    ids = choice_ids(req.request_id, req.n)
    if req.n > 1:  # each choice was owned (and is resumed from the running hash) on its own
        held = await reclaim.running_requests(io.r, io.ks, owner)
        if any(x in held for x in ids) or await io.r.exists(io.ks.resume_marker(ids[0], req.start_index)):
            log.info("admission entry %s of %s: its choices are recovered from the running hash", c.entry_id, owner)
            return True
    outcome = await io.resume(req, why, owner=owner)
    log.info("recovered request_id=%s from the admission entry %s of %s: %s", req.request_id, c.entry_id, owner,
             outcome)
    return True


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
