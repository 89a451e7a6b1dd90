"""The decode pod's writes to Redis: each step's tokens, finishes, and this pod's journal.

`publish_loop` drains the bridge's outputs: one round trip per step (one fenced script call per
shard, plus the acks of the direct entries whose first token the step carries), or for every step
queued meanwhile when Redis is the slower side (FIFO, one pipeline: order is kept). A write refused
by the fence means another pod owns the request now: the engine drops it silently. Every write goes
into the journal, which `decode_svc/resync.py` writes again to a Redis that came back without it;
`rewrite` and `after_replay` are the replay's two halves on this side.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

from decode_svc.bridge import Bridge
from decode_svc.handback import Handback
from decode_svc.items import Preempted
from decode_svc.requests import RequestTable
from decode_svc.resync import Journal, Resync
from decode_svc.settings import DecodeSettings
from tandem_core import faults
from tandem_core.bus import conn, groups, token_stream
from tandem_core.retry import Backoff, retry
from tandem_core.types import GenerationRequest

log = logging.getLogger(__name__)
PUBLISH_BACKOFF = Backoff(first_s=0.2, max_s=2.0, factor=1.5)  # 30 tries (publish_retries): about a minute


class Publisher:
    """Owns the replay's two halves (`rewrite`, `after_replay`), so it builds the pod's `Resync`
    itself: the parts reach each other through constructor arguments, not attributes set later.
    `resume(req)` hands a request fenced off across a Redis change back for recovery; a batch given
    up on (tandem_core/retry.py bounds) goes to `give_up(request ids, why)`, which stops and hands
    back its requests (DecodeIO); `handback` (decode_svc/handback.py) says which are still owed."""

    def __init__(self, s: DecodeSettings, r: aioredis.Redis, owned: token_stream.OwnedPublisher, journal: Journal,
                 table: RequestTable, bridge: Bridge, on_lost: Callable[[set[str]], None],
                 resume: Callable[[GenerationRequest], Awaitable[str]], handback: Handback,
                 give_up: Callable[[set[str], str], Awaitable[None]],
                 on_cancelled: Callable[[set[str]], None] | None = None) -> None:
        self.s, self.r, self.owned, self.journal, self.table, self.bridge = s, r, owned, journal, table, bridge
        self.bounds = token_stream.StreamBounds.of(s)
        self.on_lost = on_lost  # requests the fence refused: the engine drops them (silently)
        self.resync = Resync(r, owned.ks, journal, owned.worker_id, self.rewrite, resume, owned.load, self.after_replay)
        # Requests whose finish this pod wrote while it owned them (rid -> when), for a replay's
        # sake: Redis may have lost their earlier tokens, whose rewrite the fence would refuse
        # once the finish removed the field; bounded, and kept twice the journal's window.
        self.finished_here: OrderedDict[str, float] = OrderedDict()
        self.replay_refused: list = []  # journal token items the fence refused in the replay running
        self.give_up, self.handback = give_up, handback
        # requests a step's write found cancelled by their client (the watch over running requests:
        # DecodeIO.cancel_loop polls only those not running yet)
        self.on_cancelled = on_cancelled

    async def finish(self, rid: str, index: int, reason: str, error: str | None = None) -> None:
        """A finish entry (no token) for a request that ends before or outside the engine."""
        await self._write_finish(rid, index, reason, error)
        self.journal.add("finish", (rid, index, reason, error))

    async def _write_finish(self, rid: str, index: int, reason: str, error: str | None) -> None:
        await token_stream.write_finish(self.r, self.owned.ks, [rid], index, reason, self.bounds, error)

    async def write_tokens(self, items: list, acks: list | None = None, fenced: bool = True) -> list[int]:
        """Token entries (`token_stream.TokenEntry`s or `Emitted`s) and acks in one round trip; a
        Redis without the script gets it first.
        Returns 1 (written) / 0 (fenced off) per item."""
        try:
            return await self._execute_tokens(items, acks or [], fenced)
        except NoScriptError:
            await self.owned.load()
            return await self._execute_tokens(items, acks or [], fenced)

    async def publish_loop(self, done: asyncio.Event) -> None:
        """Drain the engine's outputs; the engine wakes this loop after each step, and the wait's
        timeout only bounds how late `done` is seen."""
        while True:
            self.bridge.publisher_alive()
            batch = self.bridge.take_outputs(self.s.publish_coalesce_steps)
            if not batch:
                if done.is_set():
                    return
                await self.bridge.wait_output(0.2)
                continue
            if isinstance(batch, Preempted):  # its requests' tokens queued before it are written
                for req in batch.reqs:
                    await self.handback.preempt(req, batch.why, batch.counted)
                continue
            batch = self._drop_abandoned(batch)
            if not batch:
                continue
            lost = await self.publish_fenced(batch)
            if lost:  # another pod took these over while this one was stalled: stop decoding them
                log.warning("fenced off %d requests now owned elsewhere: %s", len(lost),
                            sorted({(e.request_id, e.index) for e in batch if e.request_id in lost})[:5])
                self.journal.add("fenced", lost)
                self.on_lost(lost)

    async def publish_fenced(self, batch: list) -> set[str]:
        """Write one batch; the requests whose tokens the fence refused because another pod owns
        them. A refusal because the Redis that came back lacked this pod's running fields is not
        one: once the reconcile has put them back, the refused tokens are written again (the
        batch may have been in flight when the replay took its copy of the journal, and a token
        never written is a gap the relay waits on until its deadline)."""
        gen = self.resync.reconciles
        results = await self._publish(batch)
        if results is None:
            await self._abandon(batch, "its tokens could not be written to Redis")
            return set()
        if 2 in results:  # written, and the client has cancelled (checked in C, as the next)
            self._cancelled(batch, results)
        if 0 not in results:  # the common case
            return set()
        lost = {e.request_id for e, ok in zip(batch, results) if ok == 0}
        try:  # a reconcile ran since `gen`, or runs now (this waits for it)
            changed = await self.resync.current() or self.resync.reconciles != gen
        except Exception as e:  # noqa: BLE001 - Redis went again: its reconcile replays the journal, batch and all
            log.warning("could not read Redis's run_id (%s): refused writes wait for the reconcile", e)
            return set()
        if not changed:
            return lost
        again = [e for e in batch if e.request_id in lost]
        log.info("writing again %d token entries refused across a Redis change: %s", len(again),
                 [(e.request_id, e.index, e.finish) for e in again][:8])
        results = await self._publish(again)
        if results is None:
            await self._abandon(again, "its tokens could not be written to Redis")
            return set()
        if 2 in results:
            self._cancelled(again, results)
        return {e.request_id for e, ok in zip(again, results) if ok == 0}

    def _cancelled(self, batch: list, results: list[int]) -> None:
        if self.on_cancelled is not None:
            self.on_cancelled({e.request_id for e, ok in zip(batch, results) if ok == 2})

    async def _execute_tokens(self, items: list, acks: list, fenced: bool = True, cancels: bool = False) -> list[int]:
        """One script call per shard for the token items, then the acks: one round trip
        (`OwnedPublisher.write`: packed once, on a connection of its own where it can be).
        `cancels`: the items' requests are looked up for a cancel too (2 instead of 1)."""
        return await self.owned.write(items, acks, fenced, cancels)

    async def _publish(self, batch: list) -> list | None:
        """Write one batch, retrying through a Redis restart (tandem_core/retry.py: REDIS_DOWN only,
        `publish_retries` tries); 1 (written) / 2 (written, its client cancelled) / 0 (fenced off)
        per entry, or None when it gave up.
        Each attempt builds its pipeline anew: redis-py empties a pipeline when `execute` fails, so
        re-running the old one would write nothing and silently lose the step's tokens."""
        items, acks = batch, [e.ack for e in batch if e.ack]  # the entries go as they are: no copy per token

        async def attempt() -> list[int]:
            # Never alongside a reconcile's replay: a finish written before the replay has put back
            # the request's earlier tokens would end its ownership and leave them refused (a gap).
            await self.resync.wait_idle()
            faults.hit("decode.publish")
            try:
                return await self._execute_tokens(items, acks, cancels=True)
            except NoScriptError:  # a restarted Redis without the script: load it, write again
                await conn.retry_redis(self.owned.load, "load publish script", log=log)
                return await self._execute_tokens(items, acks, cancels=True)

        try:
            results = await retry(attempt, f"token publish ({len(batch)} entries)", transient=conn.REDIS_DOWN,
                                  attempts=self.s.publish_retries, backoff=PUBLISH_BACKOFF, log=log,
                                  on_retry=lambda _e, _n: self._retrying())
        except Exception as e:  # noqa: BLE001 - given up: the caller hands these requests back
            log.error("token publish gave up (%s: %s) after up to %d tries; handing back its %d requests",
                      type(e).__name__, e, self.s.publish_retries, len({x.request_id for x in batch}))
            return None
        for stream, _group, entry_id in acks:
            self.table.entry_done((stream, entry_id))
        self.journal.add("tokens", (items, acks))
        self.note_finished(items, results)
        return results

    async def _retrying(self) -> None:
        self.bridge.publisher_alive()  # behind, not dead: the engine thread keeps waiting (Bridge.put_output)
        await self._reconcile_if_new()

    async def _abandon(self, batch: list, why: str) -> None:
        """A batch that could not be written: its requests stop here and go back for recovery
        (DecodeIO._give_up), before the loop writes any later step: once a request is resumed its
        field in this pod's running hash is gone, so the fence refuses whatever of it is still
        queued (a finish written behind the gap would end the request with the gap in it). The
        acks the batch carried are owed until their requests are safe."""
        for ack in (e.ack for e in batch if e.ack):
            self.handback.owe_ack(*ack)
        await self.give_up({e.request_id for e in batch}, why)

    def _drop_abandoned(self, batch: list) -> list:
        """Entries of requests whose hand back is still owed (Redis would not take it): not
        written, since this pod still owns them and the fence would let a finish through behind
        the gap (their acks owed too). A resumed request's new run starts only once it is done."""
        hb = self.handback
        if not (hb.owed_resumes or hb.unread):
            return batch
        keep = []
        for e in batch:
            if e.request_id in hb.owed_resumes or e.request_id in hb.unread:
                if e.ack:
                    hb.owe_ack(*e.ack)
            else:
                keep.append(e)
        return keep

    async def _reconcile_if_new(self) -> None:
        """After a failed write: if Redis came back as another server, reconcile before the
        retry lands on it (the heartbeat may notice only later)."""
        try:
            await self.resync.current()
        except Exception:  # noqa: BLE001 - still down: the next attempt looks again
            pass

    def note_finished(self, items: list, results: list) -> None:
        now = time.monotonic()
        for it, ok in zip(items, results):
            if it.finish and ok:  # a finish this pod wrote while it owned the request
                self.finished_here[it.request_id] = now
        horizon = now - 2 * self.journal.window_s
        while self.finished_here and (len(self.finished_here) > self.s.finished_ids_max
                                      or next(iter(self.finished_here.values())) < horizon):
            self.finished_here.popitem(last=False)

    async def rewrite(self, kind: str, payload, fenced: set[str]) -> None:
        """Write one journal entry again (resync.py); requests fenced off in the window are left
        to their new owner."""
        retry = conn.retry_redis
        if log.isEnabledFor(logging.DEBUG):
            log.debug("journal again: %s %s", kind, _journal_summary(kind, payload))
        if kind == "own":
            reqs = [q for q in payload if q.request_id not in fenced]
            if reqs:
                await retry(lambda: self.owned.own(*reqs), "own again")
        elif kind == "disown":
            await retry(lambda: self.owned.disown(payload), "disown again")
        elif kind == "finish":
            await retry(lambda: self._write_finish(*payload), "finish again")
        elif kind == "ack":
            await retry(lambda: groups.ack(self.r, *payload), "ack again")
        elif kind == "tokens":
            items, acks = payload
            items = [it for it in items if it.request_id not in fenced]
            results = await retry(lambda: self.write_tokens(items, acks), "tokens again")
            self.replay_refused += [it for it, ok in zip(items, results) if ok == 0]

    async def after_replay(self) -> None:
        """Journal tokens the fence refused during a replay: those of a request this pod has
        finished since (its finish removed the field, maybe in a write in flight as the replay
        began) are written without the fence, or the relay would wait on the gap forever; the
        rest belong to requests another pod owns now."""
        refused, self.replay_refused = self.replay_refused, []
        mine = [it for it in refused if it.request_id in self.finished_here]
        have = {rid: await conn.retry_redis(lambda rid=rid: self._streamed_indices(rid), "read tokens")
                for rid in {it.request_id for it in mine}}
        missing = [it for it in mine if it.index not in have[it.request_id]]  # most survived: only the gaps
        if missing:
            log.info("writing %d missing journal tokens of %d requests this pod finished meanwhile", len(missing),
                     len({it.request_id for it in missing}))
            await conn.retry_redis(lambda: self.write_tokens(missing, fenced=False), "tokens of finished requests")
        if len(mine) < len(refused):
            log.warning("journal tokens written again were refused (owned elsewhere): %s",
                        sorted({it.request_id for it in refused if it.request_id not in self.finished_here})[:5])

    async def _streamed_indices(self, rid: str) -> set[int]:
        out = set()
        for _id, f in await self.r.xrange(self.owned.ks.token_stream(rid)):
            try:
                out.add(int(f[b"i"]))
            except (KeyError, ValueError):  # a malformed entry: not a token written (the gateway fails on it)
                continue
        return out


def _journal_summary(kind: str, payload) -> object:
    """A journal entry in a log line: request ids, and the index and finish of each token."""
    if kind == "own":
        return [q.request_id for q in payload]
    if kind == "tokens":
        return [(it.request_id, it.index, it.finish) for it in payload[0]]
    return payload
