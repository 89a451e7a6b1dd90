"""Putting back what a Redis restart or failover lost, from what this decode pod knows.

Redis runs with `appendfsync everysec`, and a replica that Sentinel promotes trails its primary:
either way the Redis that comes back can hold the state of a moment up to a second or two before
the failure. That state is consistent (the append-only file and the replication stream are ordered
logs: what survives is a prefix of the writes), but this pod's latest writes are missing:
- token entries: a gap in a token stream, which the gateway's relay would wait on until the deadline
  (the first token too: the prefill pod wrote it, but this pod has it from the ready notice, and
  when the admission was lost with it nobody else can write it again);
- running-hash fields: the fence would then throw away this pod's own next tokens as "owned elsewhere";
- acks of ready entries: the entry would be delivered again and the request decoded twice;
- finishes and disowns.

So the pod keeps a journal of its own writes of the last `window_s` seconds (pruned only when a
heartbeat finds the same Redis as before, so neither an outage nor writes that reach a new Redis
before the reconcile push out what it must write again) and, when it meets a Redis it has
not reconciled with (another `run_id`; seen at its heartbeat, or when a write comes back fenced
off), it writes the journal again, in order, before it takes anything as fenced off. Every write
in it is idempotent or harmless twice: HSET/HDEL of running fields, XACK+XDEL, token entries (the
gateway and `recovery.streamed_tokens` drop an index seen before), finishes (a relay ends at the
first). A request fenced off in the window (taken over while this pod was stalled) is not owned
again; if the Redis that came back still lists it in this pod's running hash (the takeover was
lost with the rest), it is resumed from its streamed tokens, as a dead pod's would be.

Order matters as much as content: the replay writes a request's tokens under the fence, and a
finish removes the request's field. So no new step is written while a replay runs (the publish
loop waits for it, and after a failed write it looks at Redis's run_id, reconciling first if the
server changed), and journal tokens the fence refuses during a replay are written without it when
this pod itself wrote that request's finish meanwhile (a write in flight as the replay began):
either way the relay never waits on a gap behind a finish.

No other pod acts on this pod's entries meanwhile: peers take a missing heartbeat for a death only
a heartbeat TTL after they too meet the new Redis (tandem_core.lifecycle.PeerJudge), and this pod
reconciles at its first beat on it or its first write, whichever comes first.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis

from tandem_core.bus.registry import server_id
from tandem_core.bus.reclaim import running_requests
from tandem_core.bus import KeySpace

log = logging.getLogger(__name__)

MAX_ENTRIES = 100_000  # a bound on memory whatever the step rate (about 5 s of 40 slots at 500 tok/s)


class Journal:
    """This pod's recent writes, as (time, kind, payload); `replay` writes them again in order.
    Kinds: "own" ([request json by id]), "disown" (request id), "tokens" (batch items and acks),
    "finish" ((rid, index, reason, error)), "ack" ((stream, group, entry id)), "fenced" (ids)."""

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self.entries: deque[tuple[float, str, Any]] = deque()
        self.dropped = 0  # entries pushed out by MAX_ENTRIES before their window ended

    def add(self, kind: str, payload: Any) -> None:
        self.entries.append((self.clock(), kind, payload))
        if len(self.entries) > MAX_ENTRIES:
            self.entries.popleft()
            self.dropped += 1

    def prune(self) -> None:
        """Forget what is older than the window: call only once Redis is known to be the one
        those writes went to (then they are safely there, fsync window and all)."""
        oldest = self.clock() - self.window_s
        while self.entries and self.entries[0][0] < oldest:
            self.entries.popleft()

    def fenced_ids(self) -> set[str]:
        return {rid for _t, kind, ids in self.entries if kind == "fenced" for rid in ids}


class Resync:
    """Reconciles this pod's part of the state with each new Redis (see the module docstring)."""

    def __init__(self, r: aioredis.Redis, ks: KeySpace, journal: Journal, worker_id: str,
                 write: Callable[[str, Any, set[str]], Awaitable[None]],
                 resume: Callable[[Any], Awaitable[str]], before: Callable[[], Awaitable[None]],
                 after: Callable[[], Awaitable[None]] | None = None) -> None:
        self.r, self.ks, self.journal, self.worker_id = r, ks, journal, worker_id
        # DecodeIO's: write one journal entry again; resume one request; ready a new Redis
        # (scripts); settle what the replay's rewrites left refused
        self._write, self._resume, self._before, self._after = write, resume, before, after
        self.run_id: str | None = None  # the Redis this pod last reconciled with
        self._lock = asyncio.Lock()
        self.reconciles = 0
        # reconciles begun: a write journaled after one began may have missed its replay
        # (`missed_since`); it counts up in the same step as the replay takes its copy of the journal
        self.started = 0
        self._task: asyncio.Task | None = None

    def kick(self, run_id: str | None) -> None:
        """From the heartbeat loop: reconcile in a task of its own, so the beats go on meanwhile."""
        if run_id and run_id == self.run_id:
            self.journal.prune()
        elif run_id and (self._task is None or self._task.done()):
            self._task = asyncio.get_running_loop().create_task(self._seen_logged(run_id))

    async def _seen_logged(self, run_id: str) -> None:
        try:
            await self.seen(run_id)
        except Exception as e:  # noqa: BLE001 - Redis went again: the next beat tries again
            log.warning("reconcile with the new Redis failed: %s; will retry", e)

    async def current(self) -> bool:
        """Reconcile if Redis is not the one last seen; True if it was new."""
        return await self.seen(await server_id(self.r) or "")

    async def seen(self, run_id: str | None) -> bool:
        """Called with each run_id observed (the heartbeat's); reconciles once per new one, and
        prunes the journal when it is the same one."""
        if not run_id:
            return False
        if run_id == self.run_id:
            self.journal.prune()
            return False
        async with self._lock:
            if run_id == self.run_id:
                return False
            first = self.run_id is None
            if not first:
                await self._reconcile(run_id)
            self.run_id = run_id
            return not first

    async def wait_idle(self) -> None:
        """Return once no reconcile is running (at once when none is): the publish loop's writes
        must land after a replay, never among its rewrites."""
        if self._lock.locked():
            async with self._lock:
                pass

    def missed_since(self, started: int) -> bool:
        """Whether a reconcile began after `self.started` read `started`: a write journaled since
        then that belongs to the Redis of before (the first token of a ready notice read there)
        may not be in that reconcile's replay, so its caller writes it itself. (False: the write
        is in the journal before any reconcile still to come takes its copy.)"""
        return self.started != started

    async def _reconcile(self, run_id: str) -> None:
        t0 = time.monotonic()
        self.started += 1
        entries = list(self.journal.entries)
        fenced = self.journal.fenced_ids()
        await self._before()
        for _t, kind, payload in entries:
            await self._write(kind, payload, fenced)
        if self._after is not None:
            await self._after()
        resumed = await self._resume_fenced(fenced)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("after the reconcile this pod's running hash holds %s",
                      sorted(await running_requests(self.r, self.ks, self.worker_id)))
        self.reconciles += 1
        log.warning("Redis changed (run_id %s -> %s): wrote again %d journal entries of the last %gs, "
                    "resumed %d requests fenced off meanwhile, in %.2fs", self.run_id, run_id, len(entries),
                    self.journal.window_s, resumed, time.monotonic() - t0)

    async def _resume_fenced(self, fenced: set[str]) -> int:
        """Requests fenced off in the window that the running hash still lists: their takeover
        was lost, and this pod dropped them, so nobody has them."""
        if not fenced:
            return 0
        held = await running_requests(self.r, self.ks, self.worker_id)
        n = 0
        for rid in sorted(fenced & set(held)):
            outcome = await self._resume(held[rid])
            n += outcome == "resumed"
            log.info("request_id=%s was fenced off but still listed as ours after the Redis change: %s",
                     rid, outcome)
        return n

