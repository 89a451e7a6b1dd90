"""Letting go of a request this decode pod cannot finish, so that nothing waits on it in silence.

A request this pod took on (a pulled KV, a prompt to prefill here) normally ends in a slot with
its finish written. When something fails on the way — a pull task's Redis write given up after an
outage, an error nothing expected, a step's tokens that could not be published — the pod MUST
still end it one of two ways, never hold it:
- resume it elsewhere: `tandem_core.recovery.resume(..., owner=this pod)` takes its field out of
  this pod's running hash and enqueues it again from the tokens already streamed, in one
  transaction (or, its attempts spent, writes a clear error the client receives);
- and only then ack the stream entry it came from, so a crash in between leaves it to a reclaim.

Both are Redis writes, and Redis may be the thing that is down. What could not be written is kept
here as owed (`owed_resumes`, `owed_acks`) and written again every recovery round
(decode_svc/recover.py `recover_loop` calls `settle`), resumes before acks. An owed ack keeps its
entry marked busy in the request table, so the stream's redelivery of it is not started twice.
Owed work is bounded by what this pod held: nothing new is claimed while Redis is down.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis

from decode_svc.requests import RequestTable
from decode_svc.resync import Journal
from tandem_core import faults
from tandem_core.bus import conn, groups, reclaim
from tandem_core.bus import KeySpace
from tandem_core.types import GenerationRequest

log = logging.getLogger(__name__)

Ack = tuple[str, str, bytes]  # (stream, group, entry id)
# A hand back owed this long (every recovery round failed to write it: not only Redis down, an
# error that repeats) is given up: its request is failed with a clear error instead (`settle`).
OWED_GIVE_UP_S = 120.0


class Handback:
    def __init__(self, r: aioredis.Redis, ks: KeySpace, worker_id: str, table: RequestTable, journal: Journal,
                 resume: Callable[..., Awaitable[str]], timeout_s: float = 10.0,
                 preempt: Callable[..., Awaitable[str]] | None = None,
                 fail: Callable[[GenerationRequest, str], Awaitable[None]] | None = None) -> None:
        self.r, self.ks, self.worker_id, self.table, self.journal = r, ks, worker_id, table, journal
        self._resume = resume  # DecodeIO.resume: (req, why, owner=) -> "resumed" | "finished" | "failed"
        self.timeout_s = timeout_s  # how long one attempt waits out Redis before the work is owed
        self.owed_resumes: dict[str, tuple[GenerationRequest, str]] = {}
        self.owed_acks: dict[tuple[str, bytes], Ack] = {}
        self.unread: set[str] = set()  # given up on before their request could be read: in the running hash
        self.handed_back = 0  # requests given back (resumed, finished or failed clearly), ever
        # DecodeIO.preempt: (req, why, counted) -> outcome; a pod's own hand-back of a running request
        self._preempt_fn = preempt
        # (req, error) -> its ownership dropped and an error finish written: where an owed hand
        # back ends once it has been owed `give_up_after_s` (None: owed until written)
        self._fail = fail
        self.give_up_after_s = OWED_GIVE_UP_S
        self._owed_since: dict[str, float] = {}

    async def _preempt(self, req: GenerationRequest, why: str, counted: bool) -> str:
        if self._preempt_fn is None:
            return await self._resume(req, why, owner=self.worker_id)
        return await self._preempt_fn(req, why, counted)

    async def give_back(self, req: GenerationRequest, why: str, timeout_s: float | None = None) -> bool:
        """Resume `req` elsewhere, dropping this pod's ownership of it; never raises. False: Redis
        did not take it, and it is owed (written again by `settle`)."""
        rid = req.request_id
        try:
            faults.hit("decode.handback")
            outcome = await conn.retry_redis(lambda: self._resume(req, why, owner=self.worker_id),
                                             f"hand back request_id={rid}", timeout_s=timeout_s or self.timeout_s, log=log)
        except Exception as e:  # noqa: BLE001 - owed, not lost: the next recovery round writes it
            log.error("could not hand back request_id=%s (%s): %s: %s; owed, retried every recovery round",
                      rid, why, type(e).__name__, e)
            self.owed_resumes[rid] = (req, why)
            self._owed_since.setdefault(rid, time.monotonic())
            return False
        self.owed_resumes.pop(rid, None)
        self._owed_since.pop(rid, None)
        self.journal.add("disown", rid)  # a replay to a Redis that lost this must not own it again
        self.handed_back += 1
        log.warning("handed back request_id=%s: %s (%s)", rid, outcome, why)
        return True

    async def preempt(self, req: GenerationRequest, why: str, counted: bool = False) -> bool:
        """Hand back a request this pod stopped running because its paged KV ran out (decode_svc/
        loop.py `_make_room`): resumed elsewhere from its streamed tokens, no attempt spent unless
        `counted` (tandem_core/bus/recovery.py `preempt`); never raises. Redis away: owed, as
        `give_back`'s are (written by `settle` as a plain resume)."""
        rid = req.request_id
        try:
            faults.hit("decode.handback")
            outcome = await conn.retry_redis(lambda: self._preempt(req, why, counted), f"hand back request_id={rid}",
                                             timeout_s=self.timeout_s, log=log)
        except Exception as e:  # noqa: BLE001 - owed, not lost: the next recovery round writes it
            log.error("could not hand back request_id=%s (%s): %s: %s; owed, retried every recovery round",
                      rid, why, type(e).__name__, e)
            self.owed_resumes[rid] = (req, why)
            self._owed_since.setdefault(rid, time.monotonic())
            return False
        self.journal.add("disown", rid)
        self.handed_back += 1
        log.info("handed back request_id=%s: %s (%s)", rid, outcome, why)
        return True

    async def ack(self, stream: str, group: str, entry_id: bytes, timeout_s: float | None = None) -> bool:
        """Ack (and delete) a stream entry whose request is owned, resumed or ended; never raises.
        The entry stays busy in the request table until the ack is written (now or owed)."""
        entry = (stream, entry_id)
        try:
            faults.hit("decode.ack")
            await conn.retry_redis(lambda: groups.ack(self.r, stream, group, entry_id), "ack",
                                   timeout_s=timeout_s or self.timeout_s, log=log)
        except Exception as e:  # noqa: BLE001 - owed: the entry stays busy until it is written
            log.error("could not ack %s entry %r: %s: %s; owed, retried every recovery round", stream, entry_id,
                      type(e).__name__, e)
            self.owed_acks[entry] = (stream, group, entry_id)
            return False
        self.owed_acks.pop(entry, None)
        self.journal.add("ack", (stream, group, entry_id))
        self.table.entry_done(entry)
        return True

    def owe_ack(self, stream: str, group: str, entry_id: bytes) -> None:
        """An ack to write once the requests owed now are safe (`settle`)."""
        self.owed_acks[(stream, entry_id)] = (stream, group, entry_id)

    async def settle(self) -> int:
        """Write what is owed: resumes first (an entry is acked only once its request is safe);
        how many are still owed."""
        if self.unread:
            try:
                owned = await reclaim.running_requests(self.r, self.ks, self.worker_id)
            except Exception as e:  # noqa: BLE001 - still down: next round
                log.warning("still cannot read this pod's running hash: %s", e)
                return self.owed + len(self.unread)
            for rid in self.unread:
                if rid in owned:
                    self.owed_resumes.setdefault(rid, (owned[rid], "its tokens could not be written to Redis"))
            self.unread.clear()
        now = time.monotonic()
        for req, why in list(self.owed_resumes.values()):
            since = self._owed_since.setdefault(req.request_id, now)
            if self._fail is not None and now - since >= self.give_up_after_s:
                await self._give_up(req, why, now - since)
                continue
            await self.give_back(req, why, timeout_s=1.0)
        if not self.owed_resumes:
            for stream, group, entry_id in list(self.owed_acks.values()):
                await self.ack(stream, group, entry_id, timeout_s=1.0)
        return len(self.owed_resumes) + len(self.owed_acks)

    async def _give_up(self, req: GenerationRequest, why: str, owed_s: float) -> None:
        """An owed hand back that every round failed to write: the request ends with a clear error
        (its ownership dropped, its finish written); still owed if that cannot be written either."""
        rid = req.request_id
        msg = f"request could not be handed back for recovery for {owed_s:.0f} s ({why}); giving up"
        assert self._fail is not None
        try:
            await conn.retry_redis(lambda: self._fail(req, msg), f"fail request_id={rid}", timeout_s=1.0, log=log)
        except Exception as e:  # noqa: BLE001 - Redis will not take that either: still owed
            log.warning("could not fail request_id=%s either (%s: %s); still owed", rid, type(e).__name__, e)
            return
        log.error("gave up handing back request_id=%s after %.0f s: failed with a clear error (%s)", rid, owed_s, why)
        self.owed_resumes.pop(rid, None)
        self._owed_since.pop(rid, None)
        self.handed_back += 1

    @property
    def owed(self) -> int:
        return len(self.owed_resumes) + len(self.owed_acks) + len(self.unread)
