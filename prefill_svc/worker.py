"""The prefill loop: claim prompts only while the KV budget has room, prefill, publish.

Life of one request here:
1. XREADGROUP from the admission streams (high priority first), at most as many prompts as the
   held-KV budget can take (worst case: the largest bucket).
2. Drop it with a clear error if it is cancelled or past its deadline.
3. Prefill on the engine thread; copy the KV to host memory; hold it in the KVStore with a lease.
4. Commit, in one script: token index 0 on the request's token stream, a ready notice for decode
   unless that token already ends the request (EOS, max_tokens == 1), and the XACK + XDEL of the
   admission entry. A crash before it leaves the entry pending, for this pod's restart or another
   pod to reclaim.
5. The commit is fenced (tandem_core/bus/entry_fence.py): it writes only while the entry is still
   pending to this pod. A pod paused past its heartbeat (SIGSTOP, a VM stall) whose entry another
   pod reclaimed meanwhile writes nothing when it wakes, frees the KV it held and logs it.
"""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from prefill_svc.kv_store import KVStore
from prefill_svc.settings import PrefillSettings
from tandem_core import keys, lifecycle, recovery
from tandem_core.bus import admission, cancel, entry_fence, groups, ready, reclaim, registry, token_stream
from tandem_core.errors import TandemError
from tandem_core.grammar import Grammars
from tandem_core.scheduling import PriorityRotation
from tandem_core.bus.conn import REDIS_DOWN
from tandem_core.sampling_args import first_finish, prefill_args
from tandem_core.types import FINISH_CANCELLED, FINISH_ERROR, GenerationRequest, choice_ids, encode_prompt_logprobs
from tandem_engine.prefix_cache import PrefixCache
from tandem_engine.prefix_cache import prefill as cached_prefill

log = logging.getLogger(__name__)


class PrefillWorker:
    def __init__(self, settings: PrefillSettings, engine, r: aioredis.Redis, store: KVStore,
                 address: str, worker_id: str, prefix_cache: PrefixCache | None = None,
                 peers: lifecycle.PeerJudge | None = None) -> None:
        self.s = settings
        # whether a missing heartbeat means a dead peer yet (None: always; the app passes the
        # judge its heartbeat loop feeds, which waits a TTL after every Redis restart)
        self.peers = peers
        # the KV of prefixes seen before (None: off; only the prefill tokens computed are counted)
        self.cache = prefix_cache if prefix_cache is not None else PrefixCache(1, 0, enabled=False)
        self.engine = engine
        self.r = r
        self.store = store
        self.address = address
        self.worker_id = worker_id
        self.fence = entry_fence.EntryFence(r, keys.PREFILL_GROUP, worker_id)
        self.bell = groups.Doorbell(r, settings.pool, [keys.PREFILL_GROUP])  # the wait, with several shards
        # One thread owns the device: every engine call goes through it.
        self.device = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefill-engine")
        self.max_prefix_bytes = self._max_prefix_bytes()
        self.prefilled = 0
        self._last_reclaim = 0.0
        self.prefill_ema_s = 0.0  # recent per-prompt prefill time, for the gateway's TTFT prediction
        # token 0 of a constrained request is masked too (compiled grammars: LRU, bounded)
        self.grammars = Grammars(engine.info, cache_size=settings.engine.grammar_cache_size,
                                 deadline_s=settings.engine.mask_deadline_s)

    def _max_prefix_bytes(self) -> int:
        i = self.engine.info
        itemsize = 2 if self.s.engine.dtype == "bfloat16" else 4
        return 2 * i.num_layers * max(self.engine.buckets) * i.num_kv_heads * i.head_dim * itemsize

    async def run(self, stop: asyncio.Event) -> None:
        await self._ensure_groups()
        await self._reclaim(include_self=True)  # a restart under the same id: its own leftovers first
        rotation = PriorityRotation(self.s.pool, self.s.priority_high_weight)
        while not stop.is_set():
            try:
                await self._round(rotation)
            except REDIS_DOWN as e:  # Redis restarting: wait for it, never die
                log.warning("redis unavailable: %s; retrying", e)
                await asyncio.sleep(0.5)
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
                await self._reclaim(include_self=True)

    async def _ensure_groups(self) -> None:
        """The groups of the shared streams and of this pod's own, at id 0: entries already
        there are read too."""
        await groups.ensure_groups(self.r, self.s.pool)
        for shard in keys.all_shards():
            for prio in keys.PRIORITIES:
                await groups.ensure_group(self.r, self._own_stream(prio, shard), keys.PREFILL_GROUP)

    async def _round(self, rotation: PriorityRotation) -> None:
        """One claim round: leases, budget check, claim, prefill, and a look for dead pods' work."""
        await self._expire_leases()
        room = min(self.s.max_batch, self.store.room_for(self.max_prefix_bytes))
        if room == 0:
            await asyncio.sleep(0.02)  # budget full: keep serving pulls, claim nothing
            return
        claimed = await groups.claim(self.r, self._claim_order(rotation), keys.PREFILL_GROUP, self.worker_id, room,
                                      self.s.claim_block_ms, self.bell)
        for c in claimed:
            await self._handle_until_done(c)
        await self._reclaim()

    async def _handle_until_done(self, c: groups.Claimed) -> None:
        """Handle one entry; through a Redis outage, retry it (as a reclaim, so work already
        published is not done twice) until it is acked or its request's deadline passes."""
        reclaimed = False
        while True:
            try:
                return await self._handle(c, reclaimed)
            except REDIS_DOWN as e:
                log.warning("redis unavailable while handling %s: %s; retrying", c.entry_id, e)
                reclaimed = True
                await asyncio.sleep(0.5)

    async def _reclaim(self, include_self: bool = False) -> None:
        """Take over admission entries claimed by a dead pod (never acked), and the per-pod streams
        of a dead or draining pod (prompts routed to it for its prefix cache), budget permitting."""
        now = time.monotonic()
        if not include_self and now - self._last_reclaim < self.s.recover_interval_s:
            return
        self._last_reclaim = now
        try:
            for shard in keys.all_shards():
                for prio in keys.PRIORITIES:
                    for stream in (keys.admission_stream(self.s.pool, prio, shard), self._own_stream(prio, shard)):
                        await self._reclaim_pending(stream, include_self)
            await self._adopt_orphans()
        except Exception as e:  # noqa: BLE001 - Redis down included: the next round looks again
            log.warning("reclaim failed: %s", e)

    async def _reclaim_pending(self, stream: str, include_self: bool) -> None:
        dead = await reclaim.dead_consumer_entries(
            self.r, stream, keys.PREFILL_GROUP, self.worker_id, include_self,
            stale_self_ms=int(self.s.stale_pending_s * 1000), others=self._peers_trusted())
        room = min(len(dead), self.store.room_for(self.max_prefix_bytes))
        claimed = await reclaim.claim_ids(self.r, stream, keys.PREFILL_GROUP, self.worker_id,
                                          [eid for _c, eid in dead[:room]], 0 if include_self else 1000)
        # (own stale entries are re-claimed too: XCLAIM resets their idle time)
        for c in claimed:
            log.info("reclaimed admission entry %s of a dead consumer", c.entry_id)
            await self._handle_until_done(c)

    def _peers_trusted(self) -> bool:
        return self.peers is None or self.peers.trusted

    async def _adopt_orphans(self) -> None:
        """Prompts routed to a prefill pod that is gone or draining: read them here; once a dead
        pod's streams are empty they and its set entry go, atomically (a gateway's routed XADD
        re-adds the entry in the same transaction, so none is stranded)."""
        if not self._peers_trusted():
            return  # right after a Redis restart every pod looks gone
        live = {w["id"]: w for w in await registry.list_workers(self.r) if w["role"] == "prefill"}
        for wid in await admission.pod_stream_owners(self.r, self.s.pool):
            if wid == self.worker_id or (wid in live and not live[wid].get("draining")):
                continue
            for stream in [keys.pod_admission_stream(self.s.pool, prio, wid, shard)
                           for shard in keys.all_shards() for prio in keys.PRIORITIES]:
                if wid not in live:
                    await self._reclaim_pending(stream, False)
                room = self.store.room_for(self.max_prefix_bytes)
                if room and await self.r.exists(stream):
                    await groups.ensure_group(self.r, stream, keys.PREFILL_GROUP)  # re-created by a late XADD
                    for c in await groups.claim(self.r, [stream], keys.PREFILL_GROUP, self.worker_id, room, None):
                        log.info("took admission entry %s routed to prefill pod %s (gone or draining)", c.entry_id, wid)
                        await self._handle_until_done(c)
            if wid not in live:
                await admission.forget_pod_streams(self.r, self.s.pool, wid)

    def _own_stream(self, prio: str, shard: int) -> str:
        return keys.pod_admission_stream(self.s.pool, prio, self.worker_id, shard)

    def _claim_order(self, rotation: PriorityRotation) -> list[str]:
        """The rotation's order of priorities, each one's per-pod streams (prompts routed here for
        this pod's prefix cache) just before its shared streams, shard by shard."""
        out = []
        prios, shards = rotation.next_priorities(), rotation.shard_order()
        for prio in prios:
            out += [self._own_stream(prio, s) for s in shards]
            out += [keys.admission_stream(self.s.pool, prio, s) for s in shards]
        return out

    async def _handle(self, c: groups.Claimed, reclaimed: bool = False) -> None:
        """Work out one admission entry's writes, then commit them with its ack, fenced."""
        req = GenerationRequest.from_json(c.fields["req"])
        writes, held = entry_fence.EntryWrites(), []
        if not (req.deadline_ts and time.time() > req.deadline_ts + 60):  # else long abandoned: ack only
            writes, held = await self._work(req, reclaimed)
        try:
            await self._commit(c, req, writes, held)
        except REDIS_DOWN:
            raise
        except ResponseError as e:  # Redis refused the writes (maxmemory, say): the request fails clearly
            log.exception("publish failed request_id=%s", req.request_id)
            for rid in held:
                self.store.release(rid)
            failed = entry_fence.EntryWrites()
            self._add_finish(failed, req, FINISH_ERROR, f"publishing the prefill result failed: {e}")
            try:
                await self._commit(c, req, failed, [])
            except ResponseError:  # left pending: this pod redoes it after stale_pending_s
                log.exception("could not finish request_id=%s either; its entry stays pending", req.request_id)

    async def _work(self, req: GenerationRequest, reclaimed: bool) -> tuple[entry_fence.EntryWrites, list[str]]:
        """The writes that answer the request (its first tokens and ready notices, or its finish),
        and the ids of the KV now held for it. Any failure but Redis down becomes its finish."""
        rid = req.request_id
        writes = entry_fence.EntryWrites()
        try:
            first_stream = choice_ids(rid, req.n)[0]  # every choice's token 0 is written together
            if reclaimed and len((await recovery.streamed_tokens(self.r, first_stream))[0]) > req.start_index:
                log.info("reclaimed request_id=%s was already prefilled by its first owner", rid)
            elif await cancel.cancelled(self.r, [rid]):
                self._add_finish(writes, req, FINISH_CANCELLED)
            elif req.deadline_ts and time.time() > req.deadline_ts:
                self._add_finish(writes, req, FINISH_ERROR, "deadline passed before prefill")
            else:
                return await self._prefill(req)
        except REDIS_DOWN:
            raise
        except TandemError as e:
            log.info("request failed request_id=%s: %s", rid, e.message)
            writes = entry_fence.EntryWrites()
            self._add_finish(writes, req, FINISH_ERROR, e.message)
        except Exception as e:  # noqa: BLE001 - the request gets an answer, the worker lives on
            log.exception("prefill crashed request_id=%s", rid)
            writes = entry_fence.EntryWrites()
            self._add_finish(writes, req, FINISH_ERROR, f"prefill failed: {type(e).__name__}: {e}")
        return writes, []

    async def _commit(self, c: groups.Claimed, req: GenerationRequest, writes: entry_fence.EntryWrites,
                      held: list[str]) -> None:
        """Write and ack, only while the entry is still this pod's; else free the KV held for it."""
        if await self.fence.commit(c.stream, c.entry_id, writes):
            if held:
                await self._ring_decode()
            return
        for rid in held:
            self.store.release(rid)
        eid = c.entry_id.decode() if isinstance(c.entry_id, bytes) else c.entry_id
        if writes:
            log.warning("fenced off request_id=%s: admission entry %s of %s is no longer pending to %s (another "
                        "pod reclaimed it while this one was stalled); published nothing, freed %d held KV",
                        req.request_id, eid, c.stream, self.worker_id, len(held))
        else:
            log.info("admission entry %s of %s (request_id=%s) was already acked or taken over",
                     eid, c.stream, req.request_id)

    async def _ring_decode(self) -> None:
        """Wake idle decode pods for the ready notices just committed (several shards only). A
        hint: failing, it must not fail the commit that is done; their wait times out instead."""
        if keys.shard_count() == 1:
            return
        try:
            pipe = self.r.pipeline(transaction=False)
            groups.ring(pipe, self.s.pool, keys.DECODE_GROUP)
            await pipe.execute()
        except Exception as e:  # noqa: BLE001 - Redis down included
            log.debug("could not ring the decode doorbell: %s", e)

    async def _prefill(self, req: GenerationRequest) -> tuple[entry_fence.EntryWrites, list[str]]:
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        out = await loop.run_in_executor(self.device, self._prefill_sync, req)
        took = time.perf_counter() - t0
        self.prefill_ema_s = took if not self.prefilled else 0.8 * self.prefill_ema_s + 0.2 * took
        self.prefilled += 1
        log.debug("prefilled request_id=%s len=%d n=%d in %.1f ms", req.request_id, len(req.prompt_ids), req.n,
                  took * 1e3)
        return self._first_writes(req, *out)

    def _prefill_sync(self, req: GenerationRequest):
        """(payload, per-choice first tokens and their logprobs, encoded prompt logprobs or None)."""
        prefix, payload = cached_prefill(self.engine, self.cache, req.prompt_ids, req.sampling, export=True,
                                         **prefill_args(req, self.grammars))
        prompt_lp = None
        if req.prompt_logprobs is not None and req.start_index == 0:
            prompt_lp = encode_prompt_logprobs(self.engine.prompt_logprobs(req.prompt_ids, req.prompt_logprobs))
        return payload, prefix.first_tokens, prefix.first_logprobs, prompt_lp

    def _first_writes(self, req: GenerationRequest, payload, firsts, logprobs,
                      prompt_lp) -> tuple[entry_fence.EntryWrites, list[str]]:
        """Token `start_index` of every choice, and a ready notice for each choice that goes on; the
        KV is held for those. All in one commit: a choice's token is in its stream if and only if
        its ready notice is (or its finish), so a reclaimed admission entry can tell whether its
        first owner got this far, and a fenced-off commit leaves no half of it behind."""
        at = req.start_index
        choices = [req] if req.n <= 1 else [req.choice(i) for i in range(req.n)]
        writes = entry_fence.EntryWrites()
        if prompt_lp is not None:
            token_stream.add_prompt_logprobs(writes, choices[0].request_id, prompt_lp, self.s.token_ttl_s,
                                        self.s.token_maxlen)
        going = []
        for c, first, lp in zip(choices, firsts, logprobs):
            reason = first_finish(c, first, payload.true_length, self.engine.max_len)
            token_stream.add_tokens(writes, c.request_id, at, [first], reason, self.s.token_ttl_s, self.s.token_maxlen,
                               finished_ttl_s=self.s.token_finished_ttl_s, logprobs=[lp])
            if reason is None:
                going.append((c, first))
        if not going:
            return writes, []
        held = self.store.put_shared([c.request_id for c, _ in going], payload)
        for (c, first), h in zip(going, held):
            notice = ready.ReadyNotice(
                request=c, address=self.address, capability=h.capability, kv_bytes=payload.nbytes,
                prefill_worker=self.worker_id, first_token=first,
            )
            ready.add_ready(writes, self.s.pool, notice, self.s.ready_maxlen)
        return writes, [h.request_id for h in held]

    def _add_finish(self, pipe, req: GenerationRequest, reason: str, error: str | None = None) -> None:
        """Queue the request's end without a token, on every choice's stream (a pipeline or
        EntryWrites)."""
        for rid in choice_ids(req.request_id, req.n):
            token_stream.add_tokens(pipe, rid, req.start_index, [], reason, self.s.token_ttl_s,
                               self.s.token_maxlen, error=error, finished_ttl_s=self.s.token_finished_ttl_s)

    async def _finish(self, req: GenerationRequest, reason: str, error: str | None = None) -> None:
        """End the request without a token, unfenced (no admission entry goes with it)."""
        pipe = self.r.pipeline(transaction=False)
        self._add_finish(pipe, req, reason, error)
        await pipe.execute()

    async def _expire_leases(self) -> None:
        """Free KV nobody pulled within its lease, and fail its request, unless the request went
        on without it (tokens past the first, or its end, in its stream): after a Redis restart
        that lost this pod's ready notice the prompt is prefilled again, here or on another pod,
        and decoded from that copy. (A resumed request's stream has tokens already: its lease
        ends silently, and the gateway's deadline answers for it if it is stuck.)"""
        for rid in self.store.expired():
            self.store.release(rid)
            tokens, finished = await recovery.streamed_tokens(self.r, rid)
            if finished or len(tokens) > 1:
                log.info("KV lease ended unpulled request_id=%s: freed; the request went on without it", rid)
                continue
            log.warning("KV lease ended unpulled request_id=%s: freed", rid)
            await self._finish(GenerationRequest(rid, [], 1, start_index=1), FINISH_ERROR,
                               "KV was not pulled by a decode pod within its lease")

    def on_release(self, request_id: str) -> None:
        log.debug("kv released request_id=%s held_bytes=%d", request_id, self.store.held_bytes)

    async def drain(self, timeout_s: float) -> None:
        """Keep serving held KV until pulled or leased out, at most `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while len(self.store) and time.monotonic() < deadline:
            await self._expire_leases()
            await asyncio.sleep(0.1)
        self.device.shutdown(wait=False, cancel_futures=True)
