"""Steps 2, 4 and 5 of a request's life in a prefill pod (the list is in prefill_svc/worker.py):
decide what answers one claimed admission entry (nothing, its finish, or the prefill's first
tokens and ready notices), then commit that with the entry's ack in one fenced script
(tandem_core/bus/entry_fence.py), so a pod that lost the entry while stalled writes nothing.

Every entry handled here gets an answer or stays pending for a reclaim: failures other than Redis
being down become the request's finish; through a Redis outage the entry is retried until it is
acked or its request is long abandoned.
"""
from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as aioredis

from prefill_svc.kv_store import KVStore
from prefill_svc.prefill import Prefiller
from prefill_svc.settings import PrefillSettings
from tandem_core import faults
from tandem_core.bus import cancel, dead_letter, entry_fence, groups, recovery, token_stream
from tandem_core.bus.conn import REDIS_BACKOFF, REDIS_DOWN
from tandem_core.errors import TandemError
from tandem_core.bus import KeySpace
from tandem_core.retry import retry
from tandem_core.types import FINISH_CANCELLED, FINISH_ERROR, GenerationRequest, choice_ids

log = logging.getLogger(__name__)
REDIS_RETRY_S = 0.5  # the claim loop's pause while Redis is down (prefill_svc/worker.py)


class EntryHandler:
    """Answers claimed admission entries of one prefill pod, each committed with its ack, fenced."""

    def __init__(self, settings: PrefillSettings, r: aioredis.Redis, ks: KeySpace, prefiller: Prefiller,
                 store: KVStore, worker_id: str) -> None:
        self.s, self.r, self.ks, self.prefiller, self.store = settings, r, ks, prefiller, store
        self.worker_id = worker_id
        self.fence = entry_fence.EntryFence(r, groups.PREFILL_GROUP, worker_id)

    async def handle_claimed(self, claimed: list[groups.Claimed]) -> None:
        """Handle entries claimed together, concurrently, so that their prompts reach the engine
        together and share its calls (prefill_svc/prefill.py); each is committed on its own."""
        self.prefiller.expect(len(claimed))
        await asyncio.gather(*(self.handle_until_done(c, counted=True) for c in claimed))

    async def handle_until_done(self, c: groups.Claimed, counted: bool = False) -> None:
        """Handle one entry; through a Redis outage, retry it (as a reclaim, so work already
        published is not done twice: tandem_core/retry.py, REDIS_DOWN only) until it is acked, or
        until its request is abandoned (its deadline plus `abandoned_after_s`; a request without a
        deadline, `abandoned_after_s` from now). Past that the entry stays pending to this pod,
        which takes it up again after `stale_pending_s` (and then only acks it)."""
        reclaimed, waited_for = False, counted

        def arrive() -> None:  # `counted`: the prefiller waits for this entry once, at most until here
            nonlocal waited_for
            if waited_for:
                waited_for = False
                self.prefiller.arrived()

        def as_reclaim(_e: BaseException, _n: int) -> None:
            nonlocal reclaimed
            reclaimed = True
            arrive()  # a retry through a Redis outage holds no other prompt back

        try:
            await retry(lambda: self.handle(c, reclaimed, arrive), f"handling admission entry {_eid(c.entry_id)}",
                        transient=REDIS_DOWN, timeout_s=self._patience_s(c), backoff=REDIS_BACKOFF, log=log,
                        on_retry=as_reclaim)
        except REDIS_DOWN as e:
            log.error("gave up on admission entry %s of %s for now (%s): it stays pending and is taken up again "
                      "after stale_pending_s", _eid(c.entry_id), c.stream, e)
        except Exception:
            log.exception("handling admission entry %s of %s failed: it stays pending and is taken up again after "
                          "stale_pending_s", _eid(c.entry_id), c.stream)
        finally:
            arrive()

    def _patience_s(self, c: groups.Claimed) -> float:
        """How long an entry is retried through an outage: until its request is abandoned."""
        try:
            deadline_ts = GenerationRequest.from_json(c.fields["req"]).deadline_ts
        except Exception:  # noqa: BLE001 - `handle` says what is wrong with it
            deadline_ts = None
        if not deadline_ts:
            return self.s.abandoned_after_s
        return max(1.0, deadline_ts + self.s.abandoned_after_s - time.time())

    async def handle(self, c: groups.Claimed, reclaimed: bool = False, arrive=None) -> None:
        """Work out one admission entry's writes, then commit them with its ack, fenced.
        `arrive`: called once its prompt is queued for the engine (prefill_svc/prefill.py)."""
        try:
            req = GenerationRequest.from_json(c.fields["req"])
        except Exception as e:  # noqa: BLE001 - no request reads from it: answered, acked (a dead letter)
            await self._bury(c, dead_letter.read(c.stream, c.entry_id, c.fields, e))
            return
        writes = entry_fence.EntryWrites()
        held: list[str] = []
        if not (req.deadline_ts and time.time() > req.deadline_ts + self.s.abandoned_after_s):  # else ack only
            writes, held = await self._work(req, reclaimed, arrive)
        try:
            await self._commit(c, req, writes, held)
        except REDIS_DOWN:
            raise
        except Exception as e:
            log.exception("publish failed request_id=%s", req.request_id)
            for rid in held:
                self.store.release(rid)
            failed = self._finish(req, FINISH_ERROR, f"publishing the prefill result failed: {type(e).__name__}: {e}")
            try:
                await self._commit(c, req, failed, [])
            except REDIS_DOWN:
                raise
            except Exception:
                log.exception("could not finish request_id=%s either; its entry stays pending", req.request_id)

    async def _work(self, req: GenerationRequest, reclaimed: bool,
                    arrive=None) -> tuple[entry_fence.EntryWrites, list[str]]:
        """The writes that answer the request (its first tokens and ready notices, or its finish),
        and the ids of the KV now held for it. Any failure but Redis down becomes its finish."""
        rid = req.request_id
        try:
            first_stream = choice_ids(rid, req.n)[0]  # every choice's token 0 is written together
            if reclaimed and len((await recovery.streamed_tokens(self.r, self.ks, first_stream))[0]) > req.start_index:
                log.info("reclaimed request_id=%s was already prefilled by its first owner", rid)
                return entry_fence.EntryWrites(), []
            if await cancel.cancelled(self.r, self.ks, [rid]):
                return self._finish(req, FINISH_CANCELLED), []
            if req.deadline_ts and time.time() > req.deadline_ts:
                return self._finish(req, FINISH_ERROR, "deadline passed before prefill"), []
            faults.hit("prefill.prefill")
            return await self.prefiller.prefill(req, arrive)
        except REDIS_DOWN:
            raise
        except TandemError as e:
            log.info("request failed request_id=%s: %s", rid, e.message)
            return self._finish(req, FINISH_ERROR, e.message), []
        except Exception as e:
            log.exception("prefill crashed request_id=%s", rid)
            return self._finish(req, FINISH_ERROR, f"prefill failed: {type(e).__name__}: {e}"), []

    async def _bury(self, c: groups.Claimed, dl: dead_letter.DeadLetter) -> None:
        """An entry no request reads from: its request's error finish (every choice's stream that
        can still be named) committed with its ack, fenced. Left pending it would be taken up
        again, and fail again, every `stale_pending_s` for ever."""
        writes = entry_fence.EntryWrites()
        token_stream.add_finish(writes, self.ks, dl.token_streams, dl.index, FINISH_ERROR, self.prefiller.bounds,
                                dl.error)
        faults.hit("prefill.commit")
        if not await self.fence.commit(c.stream, c.entry_id, writes):
            log.info("dead letter %s of %s was already acked or taken over", _eid(c.entry_id), c.stream)

    async def give_up(self, c: groups.Claimed, deliveries: int) -> None:
        """An entry delivered `deliveries` times and never answered (the pods that held it died or
        failed on it: prefill_svc/takeover.py MAX_DELIVERIES): not tried again; its request ends
        with a clear error, committed with the ack (as a dead letter's)."""
        cause = RuntimeError(f"delivered {deliveries} times without an answer: the prefill pods that took it "
                             "failed or died on it")
        try:
            req = GenerationRequest.from_json(c.fields["req"])
        except Exception as e:  # noqa: BLE001 - unreadable too: a dead letter
            await self._bury(c, dead_letter.read(c.stream, c.entry_id, c.fields, e))
            return
        log.error("giving up on admission entry %s of %s (request_id=%s): %s", _eid(c.entry_id), c.stream,
                  req.request_id, cause)
        await self._bury(c, dead_letter.DeadLetter(choice_ids(req.request_id, req.n), req.start_index,
                                                   f"prefill failed: {cause}; giving up"))

    def _finish(self, req: GenerationRequest, reason: str, error: str | None = None) -> entry_fence.EntryWrites:
        """The request's end without a token, on every choice's stream, to commit with the ack."""
        writes = entry_fence.EntryWrites()
        token_stream.add_finish(writes, self.ks, choice_ids(req.request_id, req.n), req.start_index, reason,
                                self.prefiller.bounds, error)
        return writes

    async def _commit(self, c: groups.Claimed, req: GenerationRequest, writes: entry_fence.EntryWrites,
                      held: list[str]) -> None:
        """Write and ack, only while the entry is still this pod's; else free the KV held for it."""
        faults.hit("prefill.commit")
        if await self.fence.commit(c.stream, c.entry_id, writes):
            if held:
                await self._ring_decode()
            return
        for rid in held:
            self.store.release(rid)
        eid = _eid(c.entry_id)
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
        if self.ks.shards == 1:
            return
        try:
            pipe = self.r.pipeline(transaction=False)
            groups.ring(pipe, self.ks, self.s.pool, groups.DECODE_GROUP)
            await pipe.execute()
        except Exception as e:  # noqa: BLE001 - Redis down included
            log.debug("could not ring the decode doorbell: %s", e)


def _eid(entry_id) -> str:
    return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
