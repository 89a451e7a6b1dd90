"""The prefill loop: claim prompts only while the KV budget has room, prefill, publish.

Life of one request here:
1. XREADGROUP from the admission streams (high priority first), at most as many prompts as the
   held-KV budget can take (worst case: the largest bucket).
2. Drop it with a clear error if it is cancelled or past its deadline.
3. Prefill on the engine thread; copy the KV to host memory; hold it in the KVStore with a lease.
4. Publish token index 0 on the request's token stream. If that token already ends the request
   (EOS, max_tokens == 1) finish there and free the KV; else XADD a ready notice for decode.
5. XACK the admission entry only after step 4, so a crash before it leaves the entry pending.
"""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import redis.asyncio as aioredis

from prefill_svc.kv_store import KVStore
from prefill_svc.settings import PrefillSettings
from tandem_core import keys, recovery, streams
from tandem_core.errors import TandemError
from tandem_core.grammar import Grammars
from tandem_core.scheduling import PriorityRotation
from tandem_core.streams import REDIS_DOWN
from tandem_core.sampling_args import first_finish, prefill_args
from tandem_core.types import FINISH_CANCELLED, FINISH_ERROR, GenerationRequest, choice_ids, encode_prompt_logprobs
from tandem_engine.prefix_cache import PrefixCache
from tandem_engine.prefix_cache import prefill as cached_prefill

log = logging.getLogger(__name__)


class PrefillWorker:
    def __init__(self, settings: PrefillSettings, engine, r: aioredis.Redis, store: KVStore,
                 address: str, worker_id: str, prefix_cache: PrefixCache | None = None) -> None:
        self.s = settings
        # the KV of prefixes seen before (None: off; only the prefill tokens computed are counted)
        self.cache = prefix_cache if prefix_cache is not None else PrefixCache(1, 0, enabled=False)
        self.engine = engine
        self.r = r
        self.store = store
        self.address = address
        self.worker_id = worker_id
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
        for prio in keys.PRIORITIES:
            await streams.ensure_group(self.r, self._own_stream(prio), keys.PREFILL_GROUP)
        await self._reclaim(include_self=True)  # a restart under the same id: its own leftovers first
        rotation = PriorityRotation(self.s.pool, self.s.priority_high_weight)
        while not stop.is_set():
            try:
                await self._round(rotation)
            except REDIS_DOWN as e:  # Redis restarting: wait for it, never die
                log.warning("redis unavailable: %s; retrying", e)
                await asyncio.sleep(0.5)

    async def _round(self, rotation: PriorityRotation) -> None:
        """One claim round: leases, budget check, claim, prefill, and a look for dead pods' work."""
        await self._expire_leases()
        room = min(self.s.max_batch, self.store.room_for(self.max_prefix_bytes))
        if room == 0:
            await asyncio.sleep(0.02)  # budget full: keep serving pulls, claim nothing
            return
        claimed = await streams.claim(self.r, self._claim_order(rotation), keys.PREFILL_GROUP, self.worker_id, room,
                                      self.s.claim_block_ms)
        for c in claimed:
            await self._handle_until_done(c)
        await self._reclaim()

    async def _handle_until_done(self, c: streams.Claimed) -> None:
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
            for prio in keys.PRIORITIES:
                for stream in (keys.admission_stream(self.s.pool, prio), self._own_stream(prio)):
                    await self._reclaim_pending(stream, include_self)
            await self._adopt_orphans()
        except Exception as e:  # noqa: BLE001 - Redis down included: the next round looks again
            log.warning("reclaim failed: %s", e)

    async def _reclaim_pending(self, stream: str, include_self: bool) -> None:
        dead = await streams.dead_consumer_entries(
            self.r, stream, keys.PREFILL_GROUP, self.worker_id, include_self,
            stale_self_ms=int(self.s.stale_pending_s * 1000))
        room = min(len(dead), self.store.room_for(self.max_prefix_bytes))
        claimed = await streams.claim_ids(self.r, stream, keys.PREFILL_GROUP, self.worker_id,
                                          [eid for _c, eid in dead[:room]], 0 if include_self else 1000)
        # (own stale entries are re-claimed too: XCLAIM resets their idle time)
        for c in claimed:
            log.info("reclaimed admission entry %s of a dead consumer", c.entry_id)
            await self._handle_until_done(c)

    async def _adopt_orphans(self) -> None:
        """Prompts routed to a prefill pod that is gone or draining: read them here; once a dead
        pod's streams are empty they and its set entry go, atomically (a gateway's routed XADD
        re-adds the entry in the same transaction, so none is stranded)."""
        live = {w["id"]: w for w in await streams.list_workers(self.r) if w["role"] == "prefill"}
        for wid in await streams.pod_stream_owners(self.r, self.s.pool):
            if wid == self.worker_id or (wid in live and not live[wid].get("draining")):
                continue
            for prio in keys.PRIORITIES:
                stream = keys.pod_admission_stream(self.s.pool, prio, wid)
                if wid not in live:
                    await self._reclaim_pending(stream, False)
                room = self.store.room_for(self.max_prefix_bytes)
                if room and await self.r.exists(stream):
                    await streams.ensure_group(self.r, stream, keys.PREFILL_GROUP)  # re-created by a late XADD
                    for c in await streams.claim(self.r, [stream], keys.PREFILL_GROUP, self.worker_id, room, None):
                        log.info("took admission entry %s routed to prefill pod %s (gone or draining)", c.entry_id, wid)
                        await self._handle_until_done(c)
            if wid not in live:
                await streams.forget_pod_streams(self.r, self.s.pool, wid)

    def _own_stream(self, prio: str) -> str:
        return keys.pod_admission_stream(self.s.pool, prio, self.worker_id)

    def _claim_order(self, rotation: PriorityRotation) -> list[str]:
        """The rotation's order, each priority's per-pod stream (prompts routed here for this pod's
        prefix cache) just before its shared stream."""
        by_stream = {keys.admission_stream(self.s.pool, p): p for p in keys.PRIORITIES}
        out = []
        for stream in rotation.next_order():
            out += [self._own_stream(by_stream[stream]), stream]
        return out

    async def _handle(self, c: streams.Claimed, reclaimed: bool = False) -> None:
        req = GenerationRequest.from_json(c.fields["req"])
        rid = req.request_id
        if req.deadline_ts and time.time() > req.deadline_ts + 60:
            await streams.ack(self.r, c.stream, keys.PREFILL_GROUP, c.entry_id)  # long abandoned
            return
        try:
            first_stream = choice_ids(rid, req.n)[0]  # every choice's token 0 is written together
            if reclaimed and len((await recovery.streamed_tokens(self.r, first_stream))[0]) > req.start_index:
                log.info("reclaimed request_id=%s was already prefilled by its first owner", rid)
            elif await streams.cancelled(self.r, [rid]):
                await self._finish(req, FINISH_CANCELLED)
            elif req.deadline_ts and time.time() > req.deadline_ts:
                await self._finish(req, FINISH_ERROR, "deadline passed before prefill")
            else:
                await self._prefill(req)
        except REDIS_DOWN:
            raise
        except TandemError as e:
            log.info("request failed request_id=%s: %s", rid, e.message)
            await self._finish(req, FINISH_ERROR, e.message)
        except Exception as e:  # noqa: BLE001 - the request gets an answer, the worker lives on
            log.exception("prefill crashed request_id=%s", rid)
            await self._finish(req, FINISH_ERROR, f"prefill failed: {type(e).__name__}: {e}")
        await streams.ack(self.r, c.stream, keys.PREFILL_GROUP, c.entry_id)

    async def _prefill(self, req: GenerationRequest) -> None:
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        out = await loop.run_in_executor(self.device, self._prefill_sync, req)
        took = time.perf_counter() - t0
        self.prefill_ema_s = took if not self.prefilled else 0.8 * self.prefill_ema_s + 0.2 * took
        self.prefilled += 1
        log.debug("prefilled request_id=%s len=%d n=%d in %.1f ms", req.request_id, len(req.prompt_ids), req.n,
                  took * 1e3)
        await self._publish_first(req, *out)

    def _prefill_sync(self, req: GenerationRequest):
        """(payload, per-choice first tokens and their logprobs, encoded prompt logprobs or None)."""
        prefix, payload = cached_prefill(self.engine, self.cache, req.prompt_ids, req.sampling, export=True,
                                         **prefill_args(req, self.grammars))
        prompt_lp = None
        if req.prompt_logprobs is not None and req.start_index == 0:
            prompt_lp = encode_prompt_logprobs(self.engine.prompt_logprobs(req.prompt_ids, req.prompt_logprobs))
        return payload, prefix.first_tokens, prefix.first_logprobs, prompt_lp

    async def _publish_first(self, req: GenerationRequest, payload, firsts, logprobs, prompt_lp) -> None:
        """Token `start_index` of every choice, and a ready notice for each choice that goes on.

        One transaction: a choice's token is in its stream if and only if its ready notice is (or
        its finish), so a reclaimed admission entry can tell whether its first owner got this far."""
        at = req.start_index
        choices = [req] if req.n <= 1 else [req.choice(i) for i in range(req.n)]
        pipe = self.r.pipeline(transaction=True)
        if prompt_lp is not None:
            streams.add_prompt_logprobs(pipe, choices[0].request_id, prompt_lp, self.s.token_ttl_s, self.s.token_maxlen)
        going = []
        for c, first, lp in zip(choices, firsts, logprobs):
            reason = first_finish(c, first, payload.true_length, self.engine.max_len)
            streams.add_tokens(pipe, c.request_id, at, [first], reason, self.s.token_ttl_s, self.s.token_maxlen,
                               finished_ttl_s=self.s.token_finished_ttl_s, logprobs=[lp])
            if reason is None:
                going.append((c, first))
        if going:
            held = self.store.put_shared([c.request_id for c, _ in going], payload)
            for (c, first), h in zip(going, held):
                notice = streams.ReadyNotice(
                    request=c, address=self.address, capability=h.capability, kv_bytes=payload.nbytes,
                    prefill_worker=self.worker_id, first_token=first,
                )
                streams.add_ready(pipe, self.s.pool, notice, self.s.ready_maxlen)
        await pipe.execute()

    async def _finish(self, req: GenerationRequest, reason: str, error: str | None = None) -> None:
        """End the request without a token, on every choice's stream."""
        pipe = self.r.pipeline(transaction=False)
        for rid in choice_ids(req.request_id, req.n):
            streams.add_tokens(pipe, rid, req.start_index, [], reason, self.s.token_ttl_s,
                               self.s.token_maxlen, error=error, finished_ttl_s=self.s.token_finished_ttl_s)
        await pipe.execute()

    async def _expire_leases(self) -> None:
        for rid in self.store.expired():
            self.store.release(rid)
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
