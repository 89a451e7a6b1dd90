"""One reader for every token stream this gateway relays (the token plane's gateway end).

Before, each relay held its own Redis connection in a blocking XREAD on its own stream: one
round trip per token per request, and a gateway's concurrency capped by its connection pool.
`TokenMux` runs one task that XREADs every subscribed stream in ONE blocking call (one round trip
returns the new entries of all of them) and hands each request's entries to its `Subscription`.
How it keeps the contract:
- Nothing is lost: each subscription keeps the id of the last entry handed over, and the next
  read resumes from it, so entries are delivered once and in stream order (the relay still drops
  duplicate indices and fills gaps, as before).
- Bounded: a subscription holding `max_buffered` undelivered entries (a slow client) is left out
  of reads until its relay catches up; its entries wait in Redis, under the stream's MAXLEN.
- A read in flight does not see a newcomer's stream, so subscribing XADDs to this gateway's wake
  stream, which every read also watches: the read returns at once and the next one includes it.
- Redis down: the reader waits and reads again from the same ids (the streams persist); each
  relay's own deadlines still apply, so no relay waits past them.
- Shards (KeySpace.request_shard): streams of several shards live in different slots, which one
  XREAD may not span on a Redis Cluster, so there is one reader per shard (`ShardReader`), each
  with its own wake stream: a gateway's connections grow with shards, not with streams.
It knows nothing of HTTP, gRPC or detokenization.
"""
from __future__ import annotations

import asyncio
import logging
import uuid

import redis.asyncio as aioredis

from tandem_core import faults, redis_client
from tandem_core.bus import conn, token_stream
from tandem_core.bus import KeySpace

log = logging.getLogger(__name__)


class Subscription:
    """The entries of one request's token stream, as the reader hands them over."""

    def __init__(self, request_id: str, stream: str, after_id: bytes | str, on_drained=None) -> None:
        self.request_id = request_id
        self._on_drained = on_drained  # a paused subscription (buffer full) wants reading again
        self.stream = stream
        self.last_id: bytes | str = after_id  # the reader's cursor: the last entry handed over
        self._events: list[token_stream.TokenEvent] = []
        self._waiter: asyncio.Future | None = None

    def _deliver(self, events: list[token_stream.TokenEvent]) -> None:
        self._events += events
        self.last_id = events[-1].entry_id
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    @property
    def buffered(self) -> int:
        return len(self._events)

    async def get(self, timeout_s: float) -> list[token_stream.TokenEvent]:
        """Everything delivered since the last call; waits at most `timeout_s` for something."""
        if not self._events:
            # a bare future and a timer: asyncio.wait_for would start a task per call
            loop = asyncio.get_running_loop()
            self._waiter = fut = loop.create_future()
            timer = loop.call_later(max(0.0, timeout_s), _wake_up, fut)
            try:
                await fut
            finally:
                timer.cancel()
                self._waiter = None
            if not self._events:
                return []
        out, self._events = self._events, []
        if self._on_drained is not None:
            self._on_drained()
        return out


def _wake_up(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class TokenMux:
    """Every token stream this gateway relays: one `ShardReader` per key shard."""

    def __init__(self, r: aioredis.Redis, ks: KeySpace, block_ms: int = 1000, count: int = 256,
                 max_buffered: int = 4096, socket_timeout_s: float | None = None) -> None:
        gateway_id = uuid.uuid4().hex[:12]
        self.ks = ks
        self._readers = [ShardReader(r, ks, ks.gateway_wake_stream(gateway_id, shard), block_ms, count, max_buffered,
                                     socket_timeout_s)
                         for shard in ks.all_shards()]

    @property
    def reads(self) -> int:
        """Round trips made by every reader (a metric for benchmarks and tests)."""
        return sum(x.reads for x in self._readers)

    def reader_of(self, request_id: str) -> "ShardReader":
        return self._readers[self.ks.request_shard(request_id)]

    @property
    def wake_streams(self) -> list[str]:
        return [x.wake_stream for x in self._readers]

    def start(self) -> None:
        for x in self._readers:
            x.start()

    async def stop(self, timeout_s: float = 2.0) -> None:
        await asyncio.gather(*(x.stop(timeout_s) for x in self._readers))

    def subscribe(self, request_id: str, after_id: bytes | str = "0-0") -> Subscription:
        return self.reader_of(request_id).subscribe(request_id, after_id)

    def unsubscribe(self, sub: Subscription) -> None:
        self.reader_of(sub.request_id).unsubscribe(sub)


class ShardReader:
    """The streams of one shard, read by one task in one blocking XREAD at a time."""

    def __init__(self, r: aioredis.Redis, ks: KeySpace, wake_stream: str, block_ms: int = 1000, count: int = 256,
                 max_buffered: int = 4096, socket_timeout_s: float | None = None) -> None:
        self.r, self.ks = r, ks
        # a blocking read must end before the client's socket timeout (the client's
        # `redis.socket_timeout_s`, passed in: redis-py has no public getter) calls it a dead connection
        if socket_timeout_s:
            block_ms = max(1, min(block_ms, int(socket_timeout_s * 1000) - 500))
        self.block_ms, self.count, self.max_buffered = block_ms, count, max_buffered
        self.wake_stream = wake_stream
        self._subs: dict[int, Subscription] = {}  # one request may be relayed twice (a resume)
        self._changed = asyncio.Event()
        self._reading = False
        self._stopping = False
        self._poke_due = False
        self.poke_after_s = 0.003
        self._task: asyncio.Task | None = None
        self._pokes: set[asyncio.Task] = set()
        self.reads = 0  # round trips made (a metric for benchmarks and tests)
        self.restarts = 0  # times the reader task ended unexpectedly and was started again

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="token-mux")
            self._task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task) -> None:
        """The reader must outlive every error (its loop catches them): if it ends anyway while
        not stopping, say so and start it again, so no relay of its shard waits for a timeout."""
        if self._stopping or task is not self._task:
            return
        err = None if task.cancelled() else task.exception()
        log.error("token reader of %s ended unexpectedly (%r); starting it again", self.wake_stream, err,
                  exc_info=err)
        self.restarts += 1
        self._task = None
        asyncio.get_running_loop().call_later(0.5, self._restart)  # (not in a tight loop if it fails again)

    def _restart(self) -> None:
        if not self._stopping and self._task is None:
            self.start()

    async def stop(self, timeout_s: float = 2.0) -> None:
        """End the reader: a poke ends its read (a blocking command cancelled mid-read can leave
        redis-py waiting on its socket), then the task is awaited, and cancelled if it must be."""
        if self._task is not None:
            self._stopping = True
            self._changed.set()
            if self._reading:
                self._wake()
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - stopping regardless
                self._task.cancel()
            self._task = None
        try:
            await self.r.delete(self.wake_stream)
        except conn.REDIS_DOWN:
            pass

    def subscribe(self, request_id: str, after_id: bytes | str = "0-0") -> Subscription:
        sub = Subscription(request_id, self.ks.token_stream(request_id), after_id, self._changed.set)
        self._subs[id(sub)] = sub
        self._changed.set()
        if self._reading and not self._poke_due:
            # The read in flight cannot see this stream. Under load it returns within a step
            # anyway; if it has not a few ms later (quiet streams), end it with a poke. A new
            # request's first token is a prefill away, so the delay costs it nothing.
            self._poke_due = True
            asyncio.get_running_loop().call_later(self.poke_after_s, self._poke_if_still_reading, self.reads)
        return sub

    def _poke_if_still_reading(self, reads_then: int) -> None:
        self._poke_due = False
        if self._reading and self.reads == reads_then:
            self._wake()

    def unsubscribe(self, sub: Subscription) -> None:
        self._subs.pop(id(sub), None)

    def _wake(self) -> None:
        async def poke() -> None:
            try:
                pipe = self.r.pipeline(transaction=False)
                pipe.xadd(self.wake_stream, {"w": 1}, maxlen=16, approximate=True)
                pipe.expire(self.wake_stream, 3600)  # outlives no gateway by long
                await pipe.execute()
            except conn.REDIS_DOWN:
                pass  # the read fails too and the reader starts over with every stream

        task = asyncio.get_running_loop().create_task(poke())
        self._pokes.add(task)  # held until done: the loop keeps only weak references to tasks
        task.add_done_callback(self._pokes.discard)

    async def _run(self) -> None:
        wake_id: bytes | str = "0-0"  # this gateway's own, new stream: every poke counts
        failed = 0  # reads failed in a row (Redis down): the first good one after says so
        while not self._stopping:
            want: dict[str, bytes | str] = {}
            for sub in self._subs.values():  # a stream relayed twice is read from the earlier cursor
                if sub.buffered < self.max_buffered:
                    cur = want.get(sub.stream)
                    if cur is None or _id_key(sub.last_id) < _id_key(cur):
                        want[sub.stream] = sub.last_id
            if not want:
                self._changed.clear()
                await self._changed.wait()
                continue
            want[self.wake_stream] = wake_id
            self._reading = True
            try:
                faults.hit("gateway.read")
                resp = await redis_client.xread(self.r, want, count=self.count, block=self.block_ms)
            except conn.REDIS_DOWN as e:
                if not failed:
                    log.warning("redis unavailable while reading token streams: %s; retrying", e)
                failed += 1
                await asyncio.sleep(0.5)
                continue
            except Exception:
                log.exception("token read failed; retrying")
                await asyncio.sleep(0.5)
                continue
            finally:
                self._reading = False
            self.reads += 1
            if failed:
                log.info("reading token streams again after %d failed reads: %d streams", failed, len(want) - 1)
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("token read cursors %s; got %s", want,
                              [(n, len(e), e[0][0], e[-1][0]) for n, e in resp or [] if e])
                failed = 0
            try:
                wake_id = self._dispatch(resp, wake_id, want)
            except Exception:  # a bug, not an entry (those fail their request): said, and read on
                log.exception("handing out token stream entries failed; reading again")
                await asyncio.sleep(0.5)

    def _dispatch(self, resp, wake_id, read_from: dict):
        by_stream: dict[str, list[Subscription]] = {}
        for sub in self._subs.values():
            by_stream.setdefault(sub.stream, []).append(sub)
        for name, entries in resp or []:
            name = name.decode() if isinstance(name, bytes) else name
            if name == self.wake_stream:
                wake_id = entries[-1][0] if entries else wake_id
                continue
            subs = by_stream.get(name)
            if not subs or not entries:
                continue
            events = []
            for eid, f in entries:
                ev, bad = token_stream.read_event(eid, f, name)
                events.append(ev)
                if bad is not None:  # its request ends here (the relay fails it); nothing after it counts
                    log.error("%s; failing request %s", bad, subs[0].request_id)
                    break
            start = _id_key(read_from.get(name, "0-0"))
            for sub in subs:
                after = _id_key(sub.last_id)
                if start > after:  # subscribed after this read began: it has a gap; the next read covers it
                    continue
                mine = events if start == after else [e for e in events if _id_key(e.entry_id) > after]
                if mine:
                    sub._deliver(mine)
        return wake_id


def _id_key(entry_id: bytes | str) -> tuple[int, int]:
    """A stream entry id ("ms-seq") as a comparable pair."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)
