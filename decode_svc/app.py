"""Wiring of one decode pod: the engine thread (decode_svc/loop.py) and the I/O side on one
asyncio loop: claim ready notices only for free slots, pull KV, hand it to the engine through a
bounded queue, publish each step's tokens in one pipelined round trip, watch for cancels, beat."""
from __future__ import annotations

import asyncio
import logging
import os
import queue
import time

import redis.asyncio as aioredis

from decode_svc.loop import EngineLoop, Insert
from decode_svc.puller import KVPuller
from decode_svc.settings import DecodeSettings
from decode_svc.slots import SlotTable
from tandem_core import grpc_util, keys, lifecycle, streams
from tandem_core.errors import TandemError
from tandem_core.settings import default_worker_id
from tandem_core.types import FINISH_CANCELLED, FINISH_ERROR

log = logging.getLogger(__name__)
SERVICE = "tandem.v1.Decode"


class DecodeIO:
    """The I/O half of a decode pod. Every coroutine here ends when `stop` is set."""

    def __init__(self, s: DecodeSettings, r: aioredis.Redis, table: SlotTable, loop_: EngineLoop,
                 inserts: queue.Queue, outputs: queue.Queue, worker_id: str) -> None:
        self.s, self.r, self.table, self.engine_loop = s, r, table, loop_
        self.inserts, self.outputs, self.worker_id = inserts, outputs, worker_id
        self.puller = KVPuller(s.grpc.max_message_bytes)
        self.slot_freed = asyncio.Event()
        self.inflight: dict[str, asyncio.Task] = {}
        self.pulled = 0

    def notify_slot_freed(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.call_soon_threadsafe(self.slot_freed.set)

    async def claim_loop(self, stop: asyncio.Event) -> None:
        stream = keys.ready_stream(self.s.pool)
        while not stop.is_set() and self.engine_loop.error is None:
            n = self.table.reserve(self.table.slots)  # pull only for slots that are free
            if n == 0:
                self.slot_freed.clear()
                try:
                    await asyncio.wait_for(self.slot_freed.wait(), timeout=0.1)
                except asyncio.TimeoutError:
                    pass
                continue
            try:
                got = await streams.claim(self.r, [stream], keys.DECODE_GROUP, self.worker_id, n,
                                          self.s.claim_block_ms)
            except Exception as e:  # noqa: BLE001 - Redis blip: retry
                self.table.unreserve(n)
                log.warning("ready claim failed: %s", e)
                await asyncio.sleep(0.5)
                continue
            self.table.unreserve(n - len(got))
            for c in got:
                notice = streams.ReadyNotice.from_json(c.fields["notice"])
                task = asyncio.create_task(self._pull_one(c, notice))
                self.inflight[notice.request.request_id] = task
                task.add_done_callback(lambda _t, rid=notice.request.request_id: self.inflight.pop(rid, None))

    async def _pull_one(self, c: streams.Claimed, notice: streams.ReadyNotice) -> None:
        req = notice.request
        try:
            if await streams.cancelled(self.r, [req.request_id]):
                await self._finish(req.request_id, 1, FINISH_CANCELLED)
                self.table.unreserve()
            else:
                payload = await self.puller.pull(notice, self.s.pull_timeout_s)
                self.pulled += 1
                self.inserts.put_nowait(Insert(payload, req))  # never full: bounded by reservations
        except (TandemError, queue.Full) as e:
            msg = e.message if isinstance(e, TandemError) else "insert queue full"
            log.warning("pull failed request_id=%s: %s", req.request_id, msg)
            self.table.unreserve()
            await self._finish(req.request_id, 1, FINISH_ERROR, msg)
        await streams.ack(self.r, c.stream, keys.DECODE_GROUP, c.entry_id)

    async def _finish(self, rid: str, index: int, reason: str, error: str | None = None) -> None:
        pipe = self.r.pipeline(transaction=False)
        streams.add_tokens(pipe, rid, index, [], reason, self.s.token_ttl_s, self.s.token_maxlen, error=error)
        await pipe.execute()

    async def publish_loop(self, done: asyncio.Event) -> None:
        """Drain the engine's output queue; one pipelined round trip per step."""
        while True:
            try:
                batch = await asyncio.to_thread(self.outputs.get, True, 0.2)
            except queue.Empty:
                if done.is_set():
                    return
                continue
            pipe = self.r.pipeline(transaction=False)
            for e in batch:
                streams.add_tokens(pipe, e.request_id, e.index, [e.token] if e.token >= 0 else [],
                                   e.finish, self.s.token_ttl_s, self.s.token_maxlen)
            for attempt in range(5):
                try:
                    await pipe.execute()
                    break
                except Exception as ex:  # noqa: BLE001 - retry a Redis blip, then give up loudly
                    log.warning("token publish failed (attempt %d): %s", attempt + 1, ex)
                    await asyncio.sleep(0.2 * (attempt + 1))

    async def cancel_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            rids = [a.req.request_id for a in self.table.snapshot()]
            if rids:
                try:
                    hit = await streams.cancelled(self.r, rids)
                    if hit:
                        self.engine_loop.cancel(hit)
                except Exception as e:  # noqa: BLE001
                    log.warning("cancel poll failed: %s", e)
            await asyncio.sleep(0.1)


def build_engine(s: DecodeSettings):
    from tandem_engine import load_engine

    e = s.engine
    return load_engine(e.model, slots=s.slots, max_len=e.max_len, prefill_buckets=tuple(e.prefill_buckets),
                       dtype=e.dtype)


async def serve(s: DecodeSettings) -> int:
    worker_id = s.worker_id or default_worker_id("decode")
    engine = build_engine(s)
    r = streams.connect(s.redis)
    await streams.ensure_groups(r, s.pool)
    table = SlotTable(s.slots)
    inserts: queue.Queue = queue.Queue(maxsize=max(s.insert_queue_size, s.slots))
    outputs: queue.Queue = queue.Queue(maxsize=64)
    loop = asyncio.get_running_loop()
    io: DecodeIO | None = None
    engine_loop = EngineLoop(engine, table, inserts, outputs, lambda: io and io.notify_slot_freed(loop))
    io = DecodeIO(s, r, table, engine_loop, inserts, outputs, worker_id)

    server = grpc_util.make_server(s.grpc.max_message_bytes)
    port = grpc_util.bind(server, s.grpc.host, s.grpc.port)
    health = grpc_util.add_health(server, [SERVICE])
    await server.start()
    address = f"{s.grpc.advertise_host}:{port}"
    stop = asyncio.Event()
    lifecycle.install_stop_signals(stop)
    state = {"draining": False}

    def info() -> streams.WorkerInfo:
        return streams.WorkerInfo(
            role="decode", id=worker_id, pid=os.getpid(), address=address, slots=table.slots,
            free_slots=table.free, draining=state["draining"],
            extra={"steps": engine_loop.stats.steps, "tokens": engine_loop.stats.tokens, "pulled": io.pulled},
        )

    engine_loop.start()
    hb_stop, pub_done = asyncio.Event(), asyncio.Event()
    tasks = [
        asyncio.create_task(lifecycle.heartbeat_loop(r, info, s.heartbeat_interval_s, hb_stop)),
        asyncio.create_task(io.publish_loop(pub_done)),
        asyncio.create_task(io.cancel_loop(hb_stop)),
    ]
    claim = asyncio.create_task(io.claim_loop(stop))
    await grpc_util.set_serving(health, [SERVICE], True)
    log.info("decode ready worker_id=%s slots=%d model=%s", worker_id, s.slots, engine.info.name)
    watch = asyncio.create_task(_watch_engine(engine_loop, stop))
    await stop.wait()
    state["draining"] = True
    await grpc_util.set_serving(health, [SERVICE], False)
    await claim
    await _drain(io, table, s.drain_timeout_s)
    engine_loop.stop()
    pub_done.set()
    hb_stop.set()
    watch.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await io.puller.close()
    await server.stop(grace=1.0)
    await r.aclose()
    log.info("decode stopped worker_id=%s steps=%d tokens=%d", worker_id, engine_loop.stats.steps,
             engine_loop.stats.tokens)
    return 1 if engine_loop.error else 0


async def _watch_engine(engine_loop: EngineLoop, stop: asyncio.Event) -> None:
    while not stop.is_set():
        if engine_loop.error is not None:
            log.error("engine thread failed: %r; stopping", engine_loop.error)
            stop.set()
            return
        await asyncio.sleep(0.2)


async def _drain(io: DecodeIO, table: SlotTable, timeout_s: float) -> None:
    """Finish running requests (and pulls in flight) before exiting, within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while (table.used or io.inflight or table.reserved) and time.monotonic() < deadline:
        if io.engine_loop.error is not None:
            break
        await asyncio.sleep(0.05)
    if table.used:
        log.warning("drain deadline passed with %d running requests", table.used)
