"""The prefill loop: claim prompts only while the KV budget has room, prefill, publish.

Life of one request here:
1. XREADGROUP from the admission streams (high priority first), at most as many prompts as the
   held-KV budget can take (worst case: the largest bucket). (This module.)
2. Drop it with a clear error if it is cancelled or past its deadline. (prefill_svc/commit.py)
3. Prefill on the engine thread, together with the other claimed prompts of its length bucket
   (one batched call, up to `prefill_batch_tokens`); copy the KV to host memory; hold it in the
   KVStore with a lease. (prefill_svc/prefill.py)
4. Commit, in one script: token index 0 on the request's token stream, a ready notice for decode
   unless that token already ends the request (EOS, max_tokens == 1), and the XACK + XDEL of the
   admission entry. A crash before it leaves the entry pending, for this pod's restart or another
   pod to reclaim (prefill_svc/takeover.py). (prefill_svc/commit.py)
5. The commit is fenced (tandem_core/bus/entry_fence.py): it writes only while the entry is still
   pending to this pod. A pod paused past its heartbeat (SIGSTOP, a VM stall) whose entry another
   pod reclaimed meanwhile writes nothing when it wakes, frees the KV it held and logs it.
6. A decode pod pulls the KV over gRPC (prefill_svc/service.py), which frees it after the last
   chunk; KV nobody pulls within its lease is freed here and its request failed (`_expire_leases`).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from prefill_svc.commit import REDIS_RETRY_S, EntryHandler
from prefill_svc.kv_store import KVStore
from prefill_svc.prefill import Prefiller
from prefill_svc.settings import PrefillSettings
from prefill_svc.takeover import Takeover
from tandem_core import faults, lifecycle
from tandem_core.bus import admission, groups, recovery, token_stream
from tandem_core.bus.conn import REDIS_DOWN
from tandem_core.bus import KeySpace
from tandem_core.scheduling import PriorityRotation
from tandem_core.types import FINISH_ERROR

if TYPE_CHECKING:  # the types only: no JAX import
    from tandem_engine.api import ServingEngine
    from tandem_engine.prefix_pool import DevicePrefixCache

log = logging.getLogger(__name__)
BUDGET_FULL_POLL_S = 0.02  # with the budget full, look again this soon (pulls free KV meanwhile)
DRAIN_POLL_S = 0.1


class PrefillWorker:
    """One prefill pod's loop: claim rounds (here), the prefill (`prefiller`), the answer and its
    fenced commit (`handler`), and other pods' leftovers (`takeover`)."""

    def __init__(self, settings: PrefillSettings, engine: ServingEngine, r: aioredis.Redis, ks: KeySpace,
                 store: KVStore, address: str, worker_id: str, prefix_cache: DevicePrefixCache | None = None,
                 peers: lifecycle.PeerJudge | None = None) -> None:
        self.s, self.r, self.ks, self.store = settings, r, ks, store
        self.address, self.worker_id = address, worker_id
        self.prefiller = Prefiller(settings, engine, ks, store, address, worker_id, prefix_cache)
        self.handler = EntryHandler(settings, r, ks, self.prefiller, store, worker_id)
        # peers: whether a missing heartbeat means a dead peer yet (None: always; the app passes
        # the judge its heartbeat loop feeds, which waits a TTL after every Redis restart)
        self.takeover = Takeover(settings, r, ks, worker_id, self.prefiller.room, self.handler.handle_until_done, peers,
                                 self.handler.give_up)
        self.bell = groups.Doorbell(r, settings.pool, [groups.PREFILL_GROUP])  # the wait, with several shards

    async def run(self, stop: asyncio.Event) -> None:
        await self._ensure_groups()
        await self.takeover.run(include_self=True)  # a restart under the same id: its own leftovers first
        rotation = PriorityRotation(self.ks, self.s.pool, self.s.priority_high_weight)
        while not stop.is_set():
            try:
                await self.claim_round(rotation)
            except REDIS_DOWN as e:  # Redis restarting: wait for it, never die
                log.warning("redis unavailable: %s; retrying", e)
                # a claim's XREADGROUP may have run with its reply lost on the dying connection:
                # those entries are pending to this pod, which never saw them, and nothing is in
                # hand between rounds, so the next round with budget room takes its own again (not
                # the stale reclaim, `stale_pending_s` later)
                self.takeover.own_waiting = True
                await asyncio.sleep(REDIS_RETRY_S)
            except ResponseError as e:
                if "NOGROUP" not in str(e):
                    raise
                # This pod's per-pod streams were forgotten while it was taken for dead (paused past
                # its heartbeat: another pod drained and deleted them), and a routed XADD may have
                # re-created one without its group; or a Redis without persistence restarted. The
                # failed read dropped what the reads before it in the round delivered: those
                # entries are still pending to this pod (unless a peer took them), and nothing is
                # in hand between rounds, so they are taken up again now, as after a restart.
                log.warning("consumer group gone (%s): re-creating the groups", e)
                await self._ensure_groups()
                await self.takeover.run(include_self=True)

    async def _ensure_groups(self) -> None:
        """The groups of the shared streams and of this pod's own, at id 0: entries already
        there are read too."""
        await groups.ensure_groups(self.r, self.ks, self.s.pool)
        for shard in self.ks.all_shards():
            for prio in admission.PRIORITIES:
                await groups.ensure_group(self.r, self.takeover.own_stream(prio, shard), groups.PREFILL_GROUP)

    async def claim_round(self, rotation: PriorityRotation) -> None:
        """One claim round: leases, budget check, claim, prefill, and a look for dead pods' work."""
        await self._expire_leases()
        if self.takeover.own_due() and self.prefiller.room():  # own leftovers first, as the budget frees
            await self.takeover.run(include_self=True, own_only=True)
        room = min(self.s.max_batch, self.prefiller.room())
        if room == 0:
            await asyncio.sleep(BUDGET_FULL_POLL_S)  # budget full: keep serving pulls, claim nothing
            return
        faults.hit("prefill.claim")
        claimed = await groups.claim(self.r, self._claim_order(rotation), groups.PREFILL_GROUP, self.worker_id, room,
                                     self.s.claim_block_ms, self.bell)
        await self.handler.handle_claimed(claimed)  # together: their prompts share engine calls
        await self.takeover.run()

    def _claim_order(self, rotation: PriorityRotation) -> list[str]:
        """The rotation's order of priorities, each one's per-pod streams (prompts routed here for
        this pod's prefix cache) just before its shared streams, shard by shard."""
        out = []
        prios, shards = rotation.next_priorities(), rotation.shard_order()
        for prio in prios:
            out += [self.takeover.own_stream(prio, s) for s in shards]
            out += [self.ks.admission_stream(self.s.pool, prio, s) for s in shards]
        return out

    async def _expire_leases(self) -> None:
        """Free KV nobody pulled within its lease, and fail its request, unless the request went
        on without it (tokens past the first, or its end, in its stream): after a Redis restart
        that lost this pod's ready notice the prompt is prefilled again, here or on another pod,
        and decoded from that copy. (A resumed request's stream has tokens already: its lease
        ends silently, and the gateway's deadline answers for it if it is stuck.)"""
        for rid in self.store.expired():
            self.store.release(rid)
            tokens, finished = await recovery.streamed_tokens(self.r, self.ks, rid)
            if finished or len(tokens) > 1:
                log.info("KV lease ended unpulled request_id=%s: freed; the request went on without it", rid)
                continue
            log.warning("KV lease ended unpulled request_id=%s: freed", rid)
            await token_stream.write_finish(self.r, self.ks, [rid], 1, FINISH_ERROR, self.prefiller.bounds,
                                            "KV was not pulled by a decode pod within its lease")

    def on_release(self, request_id: str) -> None:
        log.debug("kv released request_id=%s held_bytes=%d", request_id, self.store.held_bytes)

    async def drain(self, timeout_s: float) -> None:
        """Keep serving held KV until pulled or leased out, at most `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while len(self.store) and time.monotonic() < deadline:
            await self._expire_leases()
            await asyncio.sleep(DRAIN_POLL_S)
        self.prefiller.close()
