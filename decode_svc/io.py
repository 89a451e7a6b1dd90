"""The I/O half of a decode pod, on one asyncio loop beside the engine thread.

`DecodeIO` wires its parts around the request table (decode_svc/requests.py) and the bridge to the
engine thread (decode_svc/bridge.py):
- `claims` (decode_svc/claims.py): claims for free slots; pulls KV or queues prompts to prefill here;
- `publisher` (decode_svc/publisher.py): each step's tokens in one round trip, and the journal;
- `resync` (decode_svc/resync.py): writes the journal again to a Redis that came back without it;
- `cancel_loop`: the pod's one cancellation watch, over every request it holds in any stage.
Every coroutine here ends when its stop event is set; every Redis wait has a timeout.
"""
from __future__ import annotations

import asyncio
import logging

import redis.asyncio as aioredis

from decode_svc.bridge import Bridge
from decode_svc.claims import Claims
from decode_svc.handback import Handback
from decode_svc.loop import EngineLoop
from decode_svc.publisher import Publisher
from decode_svc.requests import RequestTable
from decode_svc.resync import Journal
from decode_svc.settings import DecodeSettings
from tandem_core import lifecycle
from tandem_core.bus import cancel, reclaim, recovery, token_stream
from tandem_core.bus import KeySpace
from tandem_core.types import FINISH_ERROR, GenerationRequest

log = logging.getLogger(__name__)


class DecodeIO:
    def __init__(self, s: DecodeSettings, r: aioredis.Redis, ks: KeySpace, table: RequestTable,
                 engine_loop: EngineLoop | None, bridge: Bridge, worker_id: str) -> None:
        self.s, self.r, self.ks, self.table, self.engine_loop, self.bridge = s, r, ks, table, engine_loop, bridge
        self.worker_id = worker_id
        self.owned = token_stream.OwnedPublisher(r, ks, worker_id, s.token_ttl_s, s.token_maxlen,
                                                 s.token_finished_ttl_s)
        # Whether a missing heartbeat means a dead peer yet (fed by this pod's heartbeat loop).
        self.peers = lifecycle.PeerJudge(lifecycle.heartbeat_ttl_s(s.heartbeat_interval_s))
        # This pod's recent writes, written again when Redis comes back without them (resync.py).
        self.journal = Journal(s.resync_window_s)
        # What this pod could not finish goes back for recovery, its ownership dropped (owed while Redis is down).
        self.handback = Handback(r, ks, worker_id, table, self.journal, self.resume, preempt=self.preempt,
                                 fail=self._fail_owed)
        self.publisher = Publisher(s, r, self.owned, self.journal, table, bridge, self._drop_silently,
                                   lambda req: self.resume(req, "fenced off across a Redis change", owner=worker_id),
                                   self.handback, self._give_up, self._cancel)
        self.resync = self.publisher.resync
        self.claims = Claims(s, r, worker_id, table, bridge, self.owned, self.journal, self.publisher, self.resync,
                             self.resume, lambda: engine_loop is not None and engine_loop.error is not None,
                             self.handback, engine_loop.blocks if engine_loop is not None else None)

    @property
    def puller(self):
        return self.claims.puller

    def _drop_silently(self, request_ids: set[str]) -> None:
        """Requests now owned elsewhere: the engine frees their slots and writes nothing for them."""
        if self.engine_loop is not None:
            self.engine_loop.cancel(request_ids, silent=True)

    async def _give_up(self, request_ids: set[str], why: str) -> None:
        """A step's tokens for these requests could not be written: stop decoding them here and
        hand each back (its ownership dropped, resumed from what was streamed), so nothing waits on
        the gap. Those that finished in that step are found in this pod's running hash."""
        running = {a.req.request_id: a.req for a in self.table.snapshot() if a.req.request_id in request_ids}
        self._drop_silently(request_ids)
        missing = request_ids - set(running)
        if missing:
            try:
                owned = await reclaim.running_requests(self.r, self.ks, self.worker_id)
                running.update({rid: owned[rid] for rid in missing if rid in owned})
            except Exception as e:  # noqa: BLE001 - Redis still down: the recovery round's sweep finds them
                log.error("could not read this pod's running hash for %d requests whose tokens were dropped: %s",
                          len(missing), e)
                self.handback.unread |= missing
        for req in running.values():  # one short try each (Redis has failed for a while): owed past it
            await self.handback.give_back(req, why, timeout_s=1.0)

    async def _fail_owed(self, req: GenerationRequest, error: str) -> None:
        """An owed hand back given up (Handback.settle): out of this pod's running hash, then its
        error finish (unfenced: the pod no longer owns it, and nothing else does)."""
        await self.owned.disown(req.request_id)
        self.journal.add("disown", req.request_id)
        await self.publisher.finish(req.request_id, req.start_index, FINISH_ERROR, error)

    async def resume(self, req: GenerationRequest, why: str, owner: str | None = None) -> str:
        return await recovery.resume(
            self.r, self.ks, self.s.pool, req, max_attempts=self.s.max_attempts, maxlen=self.s.admission_maxlen,
            token_ttl_s=self.s.token_ttl_s, token_maxlen=self.s.token_maxlen, why=why, owner=owner,
            marker_ttl_s=self.s.resume_marker_ttl_s,
        )

    async def preempt(self, req: GenerationRequest, why: str, counted: bool = False) -> str:
        """Hand back a request this pod stopped running (its paged KV ran out): recovery.preempt."""
        return await recovery.preempt(
            self.r, self.ks, self.s.pool, req, owner=self.worker_id, maxlen=self.s.admission_maxlen,
            max_attempts=self.s.max_attempts, token_ttl_s=self.s.token_ttl_s, token_maxlen=self.s.token_maxlen,
            why=why, counted=counted, free_preempts=self.s.max_block_handbacks)

    def _cancel(self, hit: set[str]) -> None:
        """The client cancelled these: freed in whatever stage they are (the engine frees a queued
        or running one within a step, a pull in flight ends cancelled)."""
        to_engine = self.table.cancel(hit) if hit else set()
        if to_engine and self.engine_loop is not None:
            self.engine_loop.cancel(to_engine)

    async def cancel_loop(self, stop: asyncio.Event) -> None:
        """Poll the cancel keys of every request held here and not yet running (claimed, pulling,
        queued); a running request's cancel is found by each step's write of its token (the
        publisher's script looks its key up, `Publisher.on_cancelled`), so a pod whose requests
        all run polls nothing."""
        names: dict[str, bytes] = {}  # cancel keys of the requests held here, encoded once each
        while not stop.is_set():
            rids = self.table.request_ids(running=False)
            if len(names) > 2 * len(rids) + 64:  # bounded: forget those no longer held
                held = set(rids)
                names = {k: v for k, v in names.items() if k in held}
            if rids:
                try:
                    hit = await self._cancelled(rids, names)
                    self._cancel(hit)
                except Exception as e:  # noqa: BLE001
                    log.warning("cancel poll failed: %s", e)
            await asyncio.sleep(self.s.cancel_poll_s)

    async def _cancelled(self, rids: list[str], names: dict[str, bytes]) -> set[str]:
        """`cancel.cancelled`, its MGET on the publisher's own connection where there is one
        (`OwnedPublisher.command`: no pool checkout per poll, 20 polls a second)."""
        if not self.owned.wired:
            return await cancel.cancelled(self.r, self.ks, rids, names)
        for x in rids:
            if x not in names:
                names[x] = self.ks.cancel_key(x).encode()
        vals = await self.owned.command("MGET", *[names[x] for x in rids])
        return {rid for rid, v in zip(rids, vals) if v is not None}
