"""How work reaches a decode pod: claims for free slots, then a pull or a local prefill.

`claim_loop` takes tickets for the free slots (decode_svc/requests.py), then claims that many
entries from, in order: the ready stream (prefilled elsewhere: pull the KV), the direct stream
(short prompts the gateway routed here), and in colocated mode the admission streams (priority
order with anti-starvation). Nothing is claimed while no slot is free: the JetStream rule,
cluster-wide. Each claimed entry becomes a record of the request table:
- a ready notice: PULLING (its KV over gRPC), then owned in this pod's running hash, QUEUED on the
  bridge, and its entry acked only then, so a crash before leaves it to be reclaimed;
- a prompt: owned, QUEUED for the engine thread, which prefills it and acks the entry with its first
  token (decode_svc/publisher.py).
Every Redis step is retried through an outage while the record keeps its seat.
"""
from __future__ import annotations

import asyncio
import logging
import queue

from redis.exceptions import ResponseError

from decode_svc.blocks import BlockBudget
from decode_svc.bridge import Bridge
from decode_svc.handback import Handback
from decode_svc.items import Insert, LocalPrefill
from decode_svc.publisher import Publisher
from decode_svc.puller import KVPuller
from decode_svc.requests import RequestTable, Stage
from decode_svc.resync import Journal, Resync
from decode_svc.settings import DecodeSettings
from tandem_core import faults
from tandem_core.bus import conn, dead_letter, groups, ready, reclaim, steal, token_stream
from tandem_core.errors import KVSuperseded, KVTransferFailed, TandemError
from tandem_core.scheduling import PriorityRotation
from tandem_core.types import FINISH_CANCELLED, FINISH_ERROR, GenerationRequest

log = logging.getLogger(__name__)


class Claims:
    def __init__(self, s: DecodeSettings, r, worker_id: str, table: RequestTable, bridge: Bridge,
                 owned: token_stream.OwnedPublisher, journal: Journal, publisher: Publisher, resync: Resync,
                 resume, engine_failed, handback: Handback, blocks: BlockBudget | None = None) -> None:
        self.s, self.r, self.worker_id, self.table, self.bridge = s, r, worker_id, table, bridge
        self.owned, self.journal, self.publisher, self.resync = owned, journal, publisher, resync
        self.resume = resume  # (req, why) -> outcome: prefill again elsewhere from what was streamed
        self.engine_failed = engine_failed  # () -> bool: the engine thread died, stop claiming
        self.handback = handback  # what a failed pull ends with: resumed elsewhere, its entry acked
        # claims stop at the KV block budget too (decode_svc/blocks.py); None: an IO with no engine
        # loop (the Redis side alone), which claims by rows only
        self.blocks = blocks
        self.puller = KVPuller(s.grpc.max_message_bytes, max_channels=s.kv_channels_max, tls=s.grpc)
        self.rotation = PriorityRotation(owned.ks, s.pool, s.priority_high_weight)
        # the wait when the sources span shards of a Redis Cluster: colocated, both groups' rings
        self.bell = groups.Doorbell(r, s.pool, [groups.DECODE_GROUP] + ([groups.PREFILL_GROUP] if s.colocated else []))
        self.pulls: set[asyncio.Task] = set()
        self.pulled = 0
        self.pulled_kv_bytes = 0  # KV bytes of every pull (a whole one padded to the prefill bucket): what moved
        # KV reuse (tandem_engine/block_cache.py): a pull asks only for the positions
        # after the prompt's leading blocks this pod's pool keeps
        self.reuse = blocks.engine if blocks is not None and blocks.engine.kv_reuse else None
        self.reused_tokens = 0  # prompt positions whose KV was not pulled: this pod held them
        self.dead_letters = 0  # entries acked unread: no request could be read from them
        self.superseded = 0  # ready notices acked unpulled: a later prefill of their request replaced the KV
        # Cache-aware routing to decode pods: this pod's own per-pod ready streams come first (when it
        # holds a block cache to steer to), and other pods' entries left unread are taken (steal.py)
        self.affinity = bool(s.ready_affinity and self.reuse is not None and not s.colocated)
        self.stealer = None if s.colocated else steal.Stealer(r, owned.ks, s.pool, worker_id, s.affinity_wait_ms / 1000)
        self._due_s: float | None = None  # the last steal pass: when an unread entry may be taken
        self._watch: list[str] = []  # the last steal pass: other pods' per-pod streams (the wait's)
        self._last_sources: list[tuple[list[str], str]] = []  # the last claim pass's (the wait's)
        self.cancelled = 0  # cancelled before reaching the engine (claimed or pulling)
        # Entries pending to this pod that nothing here works on, found with too few rows free to
        # take them all (a previous incarnation's at a restart, a lost claim reply's while full):
        # `retake_own` takes the rest as rows free, not `stale_pending_s` (60 s) later, by when
        # a ready entry's KV lease has run out too.
        self.own_waiting = False

    def _sources(self) -> list[tuple[list[str], str]]:
        out = []
        pool, shards = self.s.pool, self.rotation.shard_order()  # (the previous pass's start: fine)
        if not self.s.colocated:
            own = [self.owned.ks.pod_ready_stream(pool, self.worker_id, s) for s in shards] if self.affinity else []
            out.append((own + [self.owned.ks.ready_stream(pool, s) for s in shards], groups.DECODE_GROUP))
        if self.s.direct_prefill or self.s.colocated:
            out.append(([self.owned.ks.direct_stream(pool, s) for s in shards], groups.DECODE_GROUP))
        if self.s.colocated:
            out.append((self.rotation.next_order(), groups.PREFILL_GROUP))
        return out

    async def ensure_own_groups(self) -> None:
        """The decode group of this pod's own per-pod ready streams, at id 0 (entries already
        steered here are read too). Again after a NOGROUP: paused past its heartbeat, this pod was
        taken for dead and its empty streams forgotten, and a steered write made one again."""
        if self.affinity:
            for shard in self.owned.ks.all_shards():
                await groups.ensure_group(self.r, self.owned.ks.pod_ready_stream(self.s.pool, self.worker_id, shard),
                                          groups.DECODE_GROUP)

    async def claim_loop(self, stop: asyncio.Event) -> None:
        lost_reply = False  # a claim failed: its XREADGROUP may have run with its reply lost
        while not stop.is_set() and not self.engine_failed():
            if lost_reply or (self.own_waiting and self.table.room):
                try:
                    await self.retake_own()
                    lost_reply = False
                except Exception as e:  # noqa: BLE001 - Redis still away: the next pass tries again
                    log.warning("looking for deliveries lost with a claim's reply failed: %s", e)
                    await asyncio.sleep(0.5)
                    continue
            n = self._tickets()  # pull only for slots (and, paged, KV blocks) that are free
            if n == 0:
                await self.bridge.wait_slot_freed(0.1)
                continue
            started = self.resync.started  # before the claim: a reconcile during it counts too
            try:
                got = await self._claim(n)
            except Exception as e:  # noqa: BLE001 - Redis blip: retry
                self.table.unreserve(n)
                log.warning("claim failed: %s", e)
                lost_reply = isinstance(e, conn.REDIS_DOWN)
                if isinstance(e, ResponseError) and "NOGROUP" in str(e):
                    # (the failed pass may have claimed entries before it: pending here, retaken)
                    lost_reply = True
                    try:
                        await self.ensure_own_groups()
                    except Exception as err:  # noqa: BLE001 - the next pass tries again
                        log.warning("re-creating this pod's ready groups failed: %s", err)
                await asyncio.sleep(0.5)
                continue
            self.table.unreserve(n - len(got))
            if self.stealer is not None and self.stealer.unsure:
                lost_reply = True  # a steal claim failed: its reply may be lost, look at once
            if not got:
                # Wait with no tickets held: the recovery loop's reclaim of a dead pod's pending
                # entries (decode_svc/recover.py) takes its room from the same tickets, and an idle
                # pod that held them through every wait left it none.
                try:
                    await self._wait()
                except Exception as e:  # noqa: BLE001 - Redis blip: the next pass retries
                    log.warning("claim wait failed: %s", e)
                    await asyncio.sleep(0.5)
                continue
            for c, group in got:
                try:
                    await self.dispatch(c, group, started)
                except Exception:
                    log.exception("dispatch failed for %s %s", c.stream, c.entry_id)

    def _tickets(self) -> int:
        """Tickets for one claim: a free row each, and no more than the free KV blocks cover (decode_svc/blocks.py: the prompt plus the reserve of every row)."""
        n = self.table.reserve(self.table.slots)
        if n and self.blocks is not None:
            rows, promised, tickets = self.table.blocks_ahead()  # (tickets: ours included)
            fit = self.blocks.claimable(rows, promised, tickets - n)
            if fit < n:
                self.table.unreserve(n - fit)
                n = fit
        return n

    async def retake_own(self) -> int:
        """Start this pod's own pending entries that nothing here works on (not in the request
        table: not claimed, pulling, owed an ack). After a claim failed on a dying connection its
        XREADGROUP may have run with the reply lost: those entries are pending to this live pod,
        which never saw them. Left to the stale reclaim (`stale_pending_s`, 60 s) a ready
        entry's KV lease (`kv_lease_s`, 60 s, begun before the entry was even written) ran out
        first: "KV was not pulled by a decode pod within its lease" after a Redis restart.
        Those it finds no free row for are taken by a later call (`own_waiting`)."""
        got, waiting = 0, False
        taker = reclaim.Reclaimer(self.r, "", self.worker_id, stale_self_ms=0, limit=self.s.reclaim_batch,
                                  min_idle_ms=0)
        sources = self._sources()
        unsure = set(self.stealer.unsure) if self.stealer is not None else set()
        if unsure:  # other pods' streams whose steal claim failed (its reply may be lost too)
            sources.append((sorted(unsure), groups.DECODE_GROUP))
        for names, group in sources:
            taker.group = group
            for stream in names:
                started = self.resync.started
                claimed, n = await taker.take(stream, self.table.reserve, others=False,
                                              busy=self.table.busy_entries(stream), give_back=self.table.unreserve)
                self.table.unreserve(n - len(claimed))
                waiting = waiting or len(taker.owners) > n
                for c in claimed:
                    log.warning("taking again %s entry %r: pending to this pod, which was not working on it "
                                "(a claim's lost reply, or left by this pod's previous incarnation)", stream, c.entry_id)
                    await self.dispatch(c, group, started)
                got += len(claimed)
        if self.stealer is not None:
            self.stealer.unsure -= unsure
        self.own_waiting = waiting
        return got

    async def _claim(self, n: int) -> list[tuple[groups.Claimed, str]]:
        """Up to `n` entries: one non-blocking pass over every source in order, then other pods'
        steered entries left unread (`_steal`). If that finds nothing, claim_loop gives the
        tickets back and waits (`_wait`)."""
        got: list[tuple[groups.Claimed, str]] = []
        sources = self._last_sources = self._sources()
        for names, group in sources:
            want = n - len(got)
            if want <= 0:
                break
            try:
                faults.hit("decode.claim")
                got += [(c, group) for c in await groups.claim(self.r, names, group, self.worker_id, want, None)]
            except Exception as e:
                if not got:
                    raise
                # Entries already claimed are this pod's in Redis: start them now. Dropped here they
                # would wait, pending to a live consumer, for the stale reclaim (stale_pending_s),
                # which can come after the prefill pod's KV lease has ended.
                log.warning("claim from %s failed after %d entries were claimed: %s; starting those", names[0],
                            len(got), e)
                return got
        if len(got) < n and self.stealer is not None:
            got += await self._steal(n - len(got))
        return got

    async def _wait(self) -> None:
        """Wait briefly for a new entry on all streams of the first source's group at once (the
        next pass claims what woke it)."""
        sources = self._last_sources or self._sources()  # (the pass's: _sources turns the rotation)
        group = sources[0][1]
        names = [s for ns, g in sources if g == group for s in ns]
        # A wait that covers every source ends on any new entry: it may block long (fewer
        # empty passes per second). One that leaves a source out (colocated: the admission
        # streams) returns every claim_block_ms to look at that source again.
        whole = all(g == group for _ns, g in sources)
        block_ms = self.s.claim_wait_ms if whole else self.s.claim_block_ms
        if self._due_s is not None:  # an entry steered elsewhere may be taken then
            block_ms = max(1, min(block_ms, int(self._due_s * 1000) + 1))
        await groups.wait(self.r, names + self._watch, block_ms, self.bell)

    async def _steal(self, want: int) -> list[tuple[groups.Claimed, str]]:
        """Entries other decode pods were steered but left unread for `affinity_wait_ms`."""
        assert self.stealer is not None
        try:
            taken = await self.stealer.take(want)
        except Exception as e:  # noqa: BLE001 - only a look at others' streams: the next pass again
            log.warning("looking at other decode pods' ready streams failed: %s", e)
            self._due_s, self._watch = None, []
            return []
        self._due_s, self._watch = taken.due_s, taken.watch
        if taken.error is not None:  # what it claimed before the failure is started all the same
            log.warning("looking at other decode pods' ready streams failed after %d entries were claimed: %s; "
                        "starting those", len(taken.claimed), taken.error)
        for c in taken.claimed:
            log.info("took %s entry %r, steered to another decode pod and left unread %.0f ms or more", c.stream,
                     c.entry_id, self.s.affinity_wait_ms)
        return [(c, groups.DECODE_GROUP) for c in taken.claimed]

    async def dispatch(self, c: groups.Claimed, group: str, started: int | None = None) -> None:
        """Start one claimed entry. The caller holds a ticket for it, which this spends (or gives
        back); after that every failure is handled here. `started`: the reconciles begun
        (Resync.started) before it was claimed (default: now)."""
        started = self.resync.started if started is None else started
        try:
            notice = ready.ReadyNotice.from_json(c.fields["notice"]) if "notice" in c.fields else None
            req = notice.request if notice is not None else GenerationRequest.from_json(c.fields["req"])
        except Exception as e:  # noqa: BLE001 - no request can be read from it: it could never run
            self.table.unreserve()
            # Left pending it would be reclaimed and fail again every stale_pending_s, for ever;
            # acked silently its client would wait out its timeout. Its request gets a clear error
            # (the log line, with its fields, is the dead letter), then it is acked.
            self.dead_letters += 1
            await self._bury(dead_letter.read(c.stream, c.entry_id, c.fields, e), c, group)
            return
        key = self.table.claim(req.request_id, (c.stream, c.entry_id))
        if key is None:  # delivered again while still being worked on here
            return
        if self.blocks is not None:  # its prompt's blocks are spoken for from now until it runs
            need = self.blocks.blocks_for(len(req.prompt_ids))
            self.table.promise(key, need)
            self.blocks.note(need)
        if notice is not None:
            task = asyncio.create_task(self._pull_one(c, notice, key, started), name=f"pull {req.request_id}")
            self.pulls.add(task)
            task.add_done_callback(self._pull_done)
            return
        owned = [req] if req.n <= 1 else [req.choice(i) for i in range(req.n)]  # each choice resumes alone
        try:
            faults.hit("decode.own")
            await conn.retry_redis(lambda: self.owned.own(*owned), "own", log=log)
        except asyncio.CancelledError:
            self.table.drop(key)
            self.table.entry_done((c.stream, c.entry_id))
            raise
        except Exception as e:  # noqa: BLE001 - hand it back now: left pending it waits for the stale reclaim
            self.table.drop(key)
            why = f"decode pod {self.worker_id} could not own it: {type(e).__name__}: {e}"
            log.error("own failed request_id=%s: %s; handing it back", req.request_id, why)
            if await self.handback.give_back(req, why):
                await self.handback.ack(c.stream, group, c.entry_id)
            else:  # acked once the resume owed is written (Handback.settle), never before
                self.handback.owe_ack(c.stream, group, c.entry_id)
            return
        self.journal.add("own", owned)
        self.table.advance(key, Stage.QUEUED)
        # Never full: the queue holds at least `slots` items and every item holds a seat.
        self.bridge.put_insert(LocalPrefill(req, (c.stream, group, c.entry_id), key))

    async def _bury(self, dl: dead_letter.DeadLetter, c: groups.Claimed, group: str) -> None:
        """A dead letter's request answered with its error, then its entry acked. A finish Redis
        will not take within the retry's bound leaves the entry pending: taken up again later."""
        try:
            for rid in dl.token_streams:
                await conn.retry_redis(lambda rid=rid: self.publisher.finish(rid, dl.index, FINISH_ERROR, dl.error),
                                       "dead letter's finish", timeout_s=10.0, log=log)
        except Exception as e:  # noqa: BLE001 - Redis still away: the entry stays pending
            log.warning("could not answer the dead letter %s %r (%s); it stays pending", c.stream, c.entry_id, e)
            return
        await self.handback.ack(c.stream, group, c.entry_id)

    async def _pull_one(self, c: groups.Claimed, notice: ready.ReadyNotice, key: int, started: int) -> None:
        """One pulled request up to the engine, owned end to end (the task's only exit): queued for
        the engine, or its seat freed and the request handed back for recovery (or failed with a
        clear error); then its entry acked (decode_svc/handback.py: owed if Redis will not take it)."""
        req = notice.request
        entry = (c.stream, groups.DECODE_GROUP, c.entry_id)
        try:
            if await self._pull_and_queue(notice, key, started, entry):
                return  # its entry acked with its ownership (`_own`)
        except KVSuperseded as e:  # a stale notice: the later prefill's notice carries the request on
            self.table.drop(key)
            self.superseded += 1
            log.warning("ready notice of request_id=%s (attempt %d, from index %d) is superseded: %s; acked with no "
                        "resume", req.request_id, req.attempt, req.start_index, e.message)
        except Exception as e:
            self.table.drop(key)
            if isinstance(e, KVTransferFailed):  # the prefill pod is gone (or its KV is)
                why = f"KV pull failed: {e.message}"
                log.warning("pull failed request_id=%s: %s; resuming", req.request_id, why)
            else:
                why = f"decode pod {self.worker_id} could not take it on: {type(e).__name__}: {e}"
                log.error("pull task failed request_id=%s: %s; handing it back", req.request_id, why,
                          exc_info=not isinstance(e, (TandemError, *conn.REDIS_DOWN)))
            if not isinstance(e, KVTransferFailed):  # its KV may still be held for it: free it now, not at its lease
                await self._release_kv(notice)
            if not await self._fail_clearly(req, e) and not await self.handback.give_back(req, why):
                # Acked now, a crash before the owed resume is written would lose the request: not
                # owned, not pending, nothing recovers it. Acked once the resume is written (settle).
                self.handback.owe_ack(*entry)
                return
        await self.handback.ack(*entry)

    async def _release_kv(self, notice: ready.ReadyNotice) -> None:
        try:
            await self.puller.release(notice)
        except Exception as e:  # noqa: BLE001 - best effort: the prefill pod's lease frees it
            log.warning("could not release the KV of request_id=%s: %s", notice.request.request_id, e)

    async def _pull_and_queue(self, notice: ready.ReadyNotice, key: int, started: int,
                              entry: tuple[str, str, bytes]) -> bool:
        """Pull, own, queue (each Redis step waits out an outage, within the retry's bound); the
        caller frees the seat if this raises. True when `entry` was acked with the ownership."""
        req = notice.request
        if not self.table.advance(key, Stage.PULLING):  # cancelled since it was claimed
            await self.puller.release(notice)
            await self._cancelled(key, req)
            return False
        faults.hit("decode.pull")
        match = self.reuse.match_prefix(req.prompt_ids) if self.reuse is not None else None
        try:  # the match's blocks are pinned until the engine thread inserts it (or this lets go)
            payload = await self.puller.pull(notice, self.s.pull_timeout_s, 0 if match is None else match.length)
            self.pulled += 1
            self.pulled_kv_bytes += payload.nbytes
            self.reused_tokens += payload.start
            if self.table.cancelled(key):  # the client left during the pull
                await self._cancelled(key, req)
                self._let_go(match)
                return False
            payload.first_token = notice.first_token  # choice i of n shares the KV, not token 0
            acked = await self._own(req, notice.first_token, started, entry)
            self.table.advance(key, Stage.QUEUED)  # (a cancel meanwhile: the watch tells the engine)
            self.bridge.put_insert(Insert(payload, req, key, match))
        except BaseException:
            self._let_go(match)
            raise
        return acked

    def _let_go(self, match) -> None:
        if match is not None and self.reuse is not None:
            self.reuse.release_prefix(match)

    async def _fail_clearly(self, req: GenerationRequest, e: Exception) -> bool:
        """A request that cannot run anywhere (a TandemError that says so, the insert queue full)
        gets a clear error rather than a resume; True once written."""
        if isinstance(e, KVTransferFailed) or not isinstance(e, (TandemError, queue.Full)):
            return False
        msg = e.message if isinstance(e, TandemError) else "insert queue full"
        log.warning("insert failed request_id=%s: %s", req.request_id, msg)
        try:
            await conn.retry_redis(lambda: self.owned.disown(req.request_id), "disown", timeout_s=10.0, log=log)
            self.journal.add("disown", req.request_id)
            await conn.retry_redis(lambda: self.publisher.finish(req.request_id, req.start_index + 1, FINISH_ERROR, msg),
                                   "finish", timeout_s=10.0, log=log)
        except Exception as err:  # noqa: BLE001 - then it is handed back instead
            log.warning("could not fail request_id=%s clearly (%s); handing it back", req.request_id, err)
            return False
        return True

    def _pull_done(self, task: asyncio.Task) -> None:
        """`_pull_one` handles every failure itself: an exception here is a bug, said loudly."""
        self.pulls.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s ended with an unhandled error", task.get_name(), exc_info=task.exception())

    async def _own(self, req: GenerationRequest, first_token: int, started: int,
                   entry: tuple[str, str, bytes] | None = None) -> bool:
        """Own before the ack: from here a crash is recovered from the running hash. Where the
        running hash and the entry's stream share a slot (always on one Redis; on a Cluster when
        the ready stream is the request's shard's), the entry is acked in the same atomic call:
        one round trip per pulled request instead of two. True when it was."""
        retry = conn.retry_redis
        faults.hit("decode.own")
        acked = False
        if entry is not None and self.owned.can_own_and_ack(req.request_id, entry[0]):
            async def own_and_ack() -> None:
                faults.hit("decode.ack")  # the ack's site, as on the two-write path
                await self.owned.own_and_ack(req, *entry)

            try:
                await retry(own_and_ack, "own and ack", log=log)
                acked = True
            except conn.REDIS_DOWN:
                raise  # past the retry's bound: the caller hands it back (and acks)
            except Exception as e:  # noqa: BLE001 - nothing of it was written (one script): two writes, as before
                log.warning("own and ack of request_id=%s in one call failed (%s: %s); owning it alone, "
                            "its entry acked after", req.request_id, type(e).__name__, e)
        if not acked:
            await retry(lambda: self.owned.own(req), "own", log=log)
        self.journal.add("own", [req])
        if acked and entry is not None:
            self.journal.add("ack", entry)
            self.table.entry_done((entry[0], entry[2]))
        log.debug("pulled and owned request_id=%s (from index %d)", req.request_id, req.start_index)
        # and the first token, which the prefill pod wrote: a Redis that lost that write (and the
        # admission) gets it back from here, since no one else still has it
        first = [token_stream.TokenEntry(req.request_id, req.start_index, first_token)]
        self.journal.add("tokens", (first, []))
        if self.resync.missed_since(started):  # read from a Redis gone since: its replay may miss it
            await retry(lambda: self.publisher.write_tokens(first), "first token again", log=log)
        return acked

    async def _cancelled(self, key: int, req: GenerationRequest) -> None:
        """A request the client left while it was claimed or being pulled: its `cancelled` finish
        (counted with the engine's cancels in the heartbeat)."""
        self.table.drop(key)
        self.cancelled += 1
        await conn.retry_redis(
            lambda: self.publisher.finish(req.request_id, req.start_index + 1, FINISH_CANCELLED), "finish")
