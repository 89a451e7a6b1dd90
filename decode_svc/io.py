"""The I/O half of a decode pod, on one asyncio loop beside the engine thread.

- `claim_loop`: reserves free slots, then claims that many entries from, in order: the ready
  stream (prefilled elsewhere: pull the KV), the direct stream (short prompts the gateway routed
  here), and in colocated mode the admission streams (priority order with anti-starvation).
  Nothing is claimed while no slot is free: the JetStream rule, cluster-wide.
- `_pull_one`: pulls one KV over gRPC and hands it to the engine through the bounded queue.
- `publish_loop`: writes each step's tokens in one pipelined round trip, then acks the entries
  whose first token it carried.
- `cancel_loop`: polls cancel keys of running requests; the engine frees their slots.
Every coroutine here ends when its stop event is set; every Redis wait has a timeout.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import time
from collections import OrderedDict

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

from decode_svc.loop import EngineLoop, Insert, LocalPrefill
from decode_svc.puller import KVPuller
from decode_svc.resync import Journal, Resync
from decode_svc.settings import DecodeSettings
from decode_svc.slots import SlotTable
from tandem_core import keys, lifecycle, recovery
from tandem_core.bus import cancel, conn, groups, ready, token_stream
from tandem_core.errors import KVTransferFailed, TandemError
from tandem_core.scheduling import PriorityRotation
from tandem_core.types import FINISH_CANCELLED, FINISH_ERROR, GenerationRequest

log = logging.getLogger(__name__)

MAX_FINISHED = 10_000  # `DecodeIO.finished_here` holds at most this many request ids


class DecodeIO:
    def __init__(self, s: DecodeSettings, r: aioredis.Redis, table: SlotTable, loop_: EngineLoop,
                 inserts: queue.Queue, outputs: queue.Queue, worker_id: str) -> None:
        self.s, self.r, self.table, self.engine_loop = s, r, table, loop_
        self.inserts, self.outputs, self.worker_id = inserts, outputs, worker_id
        self.puller = KVPuller(s.grpc.max_message_bytes, tls=s.grpc)
        self.owned = token_stream.OwnedPublisher(r, worker_id, s.token_ttl_s, s.token_maxlen,
                                                 s.token_finished_ttl_s)
        self.rotation = PriorityRotation(s.pool, s.priority_high_weight)
        # the wait when the sources span shards of a Redis Cluster: colocated, both groups' rings
        self.bell = groups.Doorbell(r, s.pool, [keys.DECODE_GROUP] + ([keys.PREFILL_GROUP] if s.colocated else []))
        self.slot_freed = asyncio.Event()
        self.output_ready = asyncio.Event()  # set (thread-safely) by the engine after each step
        self.inflight: dict[str, asyncio.Task] = {}
        # (stream, entry id) claimed and not yet acked: pulling, or awaiting token 0. Entry ids are
        # only unique within a stream (ready and direct can share one), hence the pair.
        self.busy_entries: set[tuple[str, bytes]] = set()
        self.pulled = 0
        # Whether a missing heartbeat means a dead peer yet (fed by this pod's heartbeat loop).
        self.peers = lifecycle.PeerJudge(lifecycle.heartbeat_ttl_s(s.heartbeat_interval_s))
        # This pod's recent writes, written again when Redis comes back without them (resync.py).
        self.journal = Journal(s.resync_window_s)
        # Requests whose finish this pod wrote while it owned them (rid -> when), for a replay's
        # sake: Redis may have lost their earlier tokens, whose rewrite the fence would refuse
        # once the finish removed the field (resync.py); bounded, and kept twice the window.
        self.finished_here: OrderedDict[str, float] = OrderedDict()
        self.replay_refused: list = []  # journal token items the fence refused in the replay running
        self.resync = Resync(r, self.journal, worker_id, self._rewrite,
                             lambda req: self.resume(req, "fenced off across a Redis change", owner=worker_id),
                             self.owned.load, self._after_replay)

    def notify_slot_freed(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.call_soon_threadsafe(self.slot_freed.set)

    def notify_output(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.call_soon_threadsafe(self.output_ready.set)

    def _sources(self) -> list[tuple[list[str], str]]:
        out = []
        pool, shards = self.s.pool, self.rotation.shard_order()  # (the previous pass's start: fine)
        if not self.s.colocated:
            out.append(([keys.ready_stream(pool, s) for s in shards], keys.DECODE_GROUP))
        if self.s.direct_prefill or self.s.colocated:
            out.append(([keys.direct_stream(pool, s) for s in shards], keys.DECODE_GROUP))
        if self.s.colocated:
            out.append((self.rotation.next_order(), keys.PREFILL_GROUP))
        return out

    async def claim_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set() and self.engine_loop.error is None:
            n = self.table.reserve(self.table.slots)  # pull only for slots that are free
            if n == 0:
                self.slot_freed.clear()
                try:
                    await asyncio.wait_for(self.slot_freed.wait(), timeout=0.1)
                except asyncio.TimeoutError:
                    pass
                continue
            started = self.resync.started  # before the claim: a reconcile during it counts too
            try:
                got = await self._claim(n)
            except Exception as e:  # noqa: BLE001 - Redis blip: retry
                self.table.unreserve(n)
                log.warning("claim failed: %s", e)
                await asyncio.sleep(0.5)
                continue
            self.table.unreserve(n - len(got))
            for c, group in got:
                try:
                    await self._dispatch(c, group, started)
                except Exception:  # noqa: BLE001 - one bad entry must not stop the claim loop
                    log.exception("dispatch failed for %s %s", c.stream, c.entry_id)
                    self.table.unreserve()
                    self.busy_entries.discard((c.stream, c.entry_id))

    async def _claim(self, n: int) -> list[tuple[groups.Claimed, str]]:
        """Up to `n` entries: one non-blocking pass over every source in order; if that finds
        nothing, wait briefly on all streams of the first source's group at once, and return
        (claim_loop's next pass claims what woke it)."""
        got: list[tuple[groups.Claimed, str]] = []
        sources = self._sources()
        for names, group in sources:
            want = n - len(got)
            if want <= 0:
                break
            got += [(c, group) for c in await groups.claim(self.r, names, group, self.worker_id, want, None)]
        if not got:
            group = sources[0][1]
            names = [s for ns, g in sources if g == group for s in ns]
            await groups.wait(self.r, names, self.s.claim_block_ms, self.bell)
        return got

    async def _dispatch(self, c: groups.Claimed, group: str, started: int | None = None) -> None:
        """Start one claimed entry; the caller holds a slot reservation for it. `started`: the
        reconciles begun (Resync.started) before it was claimed (default: now)."""
        started = self.resync.started if started is None else started
        if (c.stream, c.entry_id) in self.busy_entries:  # re-claimed while still being worked on
            self.table.unreserve()
            return
        self.busy_entries.add((c.stream, c.entry_id))
        if "notice" in c.fields:
            notice = ready.ReadyNotice.from_json(c.fields["notice"])
            rid = notice.request.request_id
            task = asyncio.create_task(self._pull_one(c, notice, started))
            self.inflight[rid] = task
            task.add_done_callback(lambda _t, rid=rid: self.inflight.pop(rid, None))
            return
        req = GenerationRequest.from_json(c.fields["req"])
        owned = [req] if req.n <= 1 else [req.choice(i) for i in range(req.n)]  # each choice resumes alone
        await conn.retry_redis(lambda: self.owned.own(*owned), "own", log=log)
        self.journal.add("own", owned)
        # Never full: the queue holds at least `slots` items and every item holds a reservation.
        self.inserts.put_nowait(LocalPrefill(req, (c.stream, group, c.entry_id)))

    async def _pull_one(self, c: groups.Claimed, notice: ready.ReadyNotice, started: int) -> None:
        """Pull, own, insert, ack. Each Redis step is retried through an outage; the slot stays
        reserved meanwhile, and the entry is acked only once the request is safely owned."""
        req = notice.request
        retry = conn.retry_redis
        try:
            if await retry(lambda: cancel.cancelled(self.r, [req.request_id]), "cancel check", log=log):
                self.table.unreserve()
                await self.puller.release(notice)
                await retry(lambda: self._finish(req.request_id, req.start_index + 1, FINISH_CANCELLED), "finish")
            else:
                payload = await self.puller.pull(notice, self.s.pull_timeout_s)
                payload.first_token = notice.first_token  # choice i of n shares the KV, not token 0
                self.pulled += 1
                # Own before the ack: from here a crash is recovered from the running hash.
                await retry(lambda: self.owned.own(req), "own", log=log)
                self.journal.add("own", [req])
                log.debug("pulled and owned request_id=%s (entry %s, from index %d)", req.request_id, c.entry_id,
                          req.start_index)
                # and the first token, which the prefill pod wrote: a Redis that lost that write
                # (and the admission) gets it back from here, since no one else still has it
                first = [(req.request_id, req.start_index, notice.first_token, None, None, None, None)]
                self.journal.add("tokens", (first, []))
                if self.resync.missed_since(started):  # read from a Redis gone since: its replay may miss it
                    await retry(lambda: self._write_tokens(first), "first token again", log=log)
                self.inserts.put_nowait(Insert(payload, req))
        except KVTransferFailed as e:
            # The prefill pod is gone (or its KV is): prefill again from what was streamed.
            why = f"KV pull failed: {e.message}"
            log.warning("pull failed request_id=%s: %s; resuming", req.request_id, why)
            self.table.unreserve()
            await retry(lambda: self.resume(req, why), "resume", log=log)
        except (TandemError, queue.Full) as e:
            msg = e.message if isinstance(e, TandemError) else "insert queue full"
            log.warning("insert failed request_id=%s: %s", req.request_id, msg)
            self.table.unreserve()
            await retry(lambda: self.owned.disown(req.request_id), "disown")
            self.journal.add("disown", req.request_id)
            await retry(lambda: self._finish(req.request_id, req.start_index + 1, FINISH_ERROR, msg), "finish")
        await retry(lambda: groups.ack(self.r, c.stream, keys.DECODE_GROUP, c.entry_id), "ack", log=log)
        self.journal.add("ack", (c.stream, keys.DECODE_GROUP, c.entry_id))
        self.busy_entries.discard((c.stream, c.entry_id))

    async def resume(self, req: GenerationRequest, why: str, owner: str | None = None) -> str:
        return await recovery.resume(
            self.r, self.s.pool, req, max_attempts=self.s.max_attempts, maxlen=self.s.admission_maxlen,
            token_ttl_s=self.s.token_ttl_s, token_maxlen=self.s.token_maxlen, why=why, owner=owner,
        )

    async def _finish(self, rid: str, index: int, reason: str, error: str | None = None) -> None:
        await self._write_finish(rid, index, reason, error)
        self.journal.add("finish", (rid, index, reason, error))

    async def _write_finish(self, rid: str, index: int, reason: str, error: str | None) -> None:
        pipe = self.r.pipeline(transaction=False)
        token_stream.add_tokens(pipe, rid, index, [], reason, self.s.token_ttl_s, self.s.token_maxlen, error=error,
                           finished_ttl_s=self.s.token_finished_ttl_s)
        await pipe.execute()

    async def _rewrite(self, kind: str, payload, fenced: set[str]) -> None:
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
            items = [it for it in items if it[0] not in fenced]
            results = await retry(lambda: self._write_tokens(items, acks), "tokens again")
            self.replay_refused += [it for it, ok in zip(items, results) if ok == 0]

    async def _after_replay(self) -> None:
        """Journal tokens the fence refused during a replay: those of a request this pod has
        finished since (its finish removed the field, maybe in a write in flight as the replay
        began) are written without the fence, or the relay would wait on the gap forever; the
        rest belong to requests another pod owns now."""
        refused, self.replay_refused = self.replay_refused, []
        mine = [it for it in refused if it[0] in self.finished_here]
        have = {rid: await conn.retry_redis(lambda rid=rid: self._streamed_indices(rid), "read tokens")
                for rid in {it[0] for it in mine}}
        missing = [it for it in mine if it[1] not in have[it[0]]]  # most survived: only the gaps
        if missing:
            log.info("writing %d missing journal tokens of %d requests this pod finished meanwhile", len(missing),
                     len({it[0] for it in missing}))
            await conn.retry_redis(lambda: self._write_tokens(missing, fenced=False), "tokens of finished requests")
        if len(mine) < len(refused):
            log.warning("journal tokens written again were refused (owned elsewhere): %s",
                        sorted({it[0] for it in refused if it[0] not in self.finished_here})[:5])

    async def _streamed_indices(self, rid: str) -> set[int]:
        return {int(f[b"i"]) for _id, f in await self.r.xrange(keys.token_stream(rid))}

    async def _write_tokens(self, items: list, acks: list | None = None, fenced: bool = True) -> list[int]:
        """Token items (and acks) in one round trip; a Redis without the script gets it first.
        Returns 1 (written) / 0 (fenced off) per item."""
        try:
            return await self._execute_tokens(items, acks or [], fenced)
        except NoScriptError:
            await self.owned.load()
            return await self._execute_tokens(items, acks or [], fenced)

    async def publish_loop(self, done: asyncio.Event) -> None:
        """Drain the engine's output queue: one round trip per step, or for every step queued
        meanwhile when Redis is the slower side (order is kept: FIFO, one pipeline). The engine
        wakes this loop after each step; the 0.2 s timeout only bounds how late `done` is seen."""
        while True:
            batch: list = []
            for _ in range(32):
                try:
                    batch += self.outputs.get_nowait()
                except queue.Empty:
                    break
            if not batch:
                if done.is_set():
                    return
                self.output_ready.clear()
                if self.outputs.empty():
                    try:
                        await asyncio.wait_for(self.output_ready.wait(), timeout=0.2)
                    except asyncio.TimeoutError:
                        pass
                continue
            lost = await self._publish_fenced(batch)
            if lost:  # another pod took these over while this one was stalled: stop decoding them
                log.warning("fenced off %d requests now owned elsewhere: %s", len(lost),
                            sorted({(e.request_id, e.index) for e in batch if e.request_id in lost})[:5])
                self.journal.add("fenced", lost)
                self.engine_loop.cancel(lost, silent=True)

    async def _publish_fenced(self, batch: list) -> set[str]:
        """Write one batch; the requests whose tokens the fence refused because another pod owns
        them. A refusal because the Redis that came back lacked this pod's running fields is not
        one: once the reconcile has put them back, the refused tokens are written again (the
        batch may have been in flight when the replay took its copy of the journal, and a token
        never written is a gap the relay waits on until its deadline)."""
        gen = self.resync.reconciles
        results = await self._publish(batch)
        lost = {e.request_id for e, ok in zip(batch, results or []) if ok == 0}
        if not lost:
            return lost
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
        return {e.request_id for e, ok in zip(again, results or []) if ok == 0}

    async def _execute_tokens(self, items: list, acks: list, fenced: bool = True) -> list[int]:
        """One script call per shard for the token items, then the acks: one round trip. Returns
        1 (written) / 0 (fenced off) per item."""
        pipe = self.r.pipeline(transaction=False)
        placed = self.owned.add_batch(pipe, items, fenced)
        for stream, group, entry_id in acks:
            pipe.xack(stream, group, entry_id)
            pipe.xdel(stream, entry_id)
        return placed.results(await pipe.execute())

    async def _publish(self, batch: list) -> list | None:
        """Write one batch, retrying through a Redis restart; 1 (written) / 0 (fenced off) per
        entry. Each attempt builds its pipeline anew: redis-py empties a pipeline when `execute`
        fails, so re-running the old one would write nothing and silently lose the step's tokens."""
        for attempt in range(self.s.publish_retries):
            # Never alongside a reconcile's replay: a finish written before the replay has put back
            # the request's earlier tokens would end its ownership and leave them refused (a gap).
            await self.resync.wait_idle()
            try:
                items, acks = [e.item() for e in batch], [e.ack for e in batch if e.ack]
                results = await self._execute_tokens(items, acks)
            except NoScriptError:  # a restarted Redis without the script: load it, write again
                await conn.retry_redis(self.owned.load, "load publish script", log=log)
                continue
            except Exception as ex:  # noqa: BLE001 - retry through a Redis restart, then give up loudly
                log.warning("token publish failed (attempt %d): %s", attempt + 1, ex)
                await asyncio.sleep(min(2.0, 0.2 * (attempt + 1)))
                await self._reconcile_if_new()
                continue
            for e in batch:
                if e.ack:
                    self.busy_entries.discard((e.ack[0], e.ack[2]))
            self.journal.add("tokens", (items, acks))
            self._note_finished(items, results)
            return results
        log.error("token publish gave up after %d attempts; these requests resume elsewhere or time out",
                  self.s.publish_retries)
        return None

    async def _reconcile_if_new(self) -> None:
        """After a failed write: if Redis came back as another server, reconcile before the
        retry lands on it (the heartbeat may notice only later)."""
        try:
            await self.resync.current()
        except Exception:  # noqa: BLE001 - still down: the next attempt looks again
            pass

    def _note_finished(self, items: list, results: list) -> None:
        now = time.monotonic()
        for it, ok in zip(items, results):
            if it[3] and ok == 1:  # a finish this pod wrote while it owned the request
                self.finished_here[it[0]] = now
        horizon = now - 2 * self.journal.window_s
        while self.finished_here and (len(self.finished_here) > MAX_FINISHED
                                      or next(iter(self.finished_here.values())) < horizon):
            self.finished_here.popitem(last=False)

    async def cancel_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            rids = [a.req.request_id for a in self.table.snapshot()]
            if rids:
                try:
                    hit = await cancel.cancelled(self.r, rids)
                    if hit:
                        self.engine_loop.cancel(hit)
                except Exception as e:  # noqa: BLE001
                    log.warning("cancel poll failed: %s", e)
            await asyncio.sleep(self.s.cancel_poll_s)


def _journal_summary(kind: str, payload) -> object:
    """A journal entry in a log line: request ids, and the index and finish of each token."""
    if kind == "own":
        return [q.request_id for q in payload]
    if kind == "tokens":
        return [(it[0], it[1], it[3]) for it in payload[0]]
    return payload
