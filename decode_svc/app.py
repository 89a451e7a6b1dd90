"""Wiring of one decode pod: the engine thread (decode_svc/loop.py), the I/O side
(decode_svc/io.py), the gRPC health server and heartbeats; a drain on SIGTERM."""
from __future__ import annotations

import asyncio
import logging
import os
import queue
import time

from decode_svc.io import DecodeIO
from decode_svc.loop import EngineLoop
from decode_svc.recover import reclaim_pending, recover_loop, recover_running
from decode_svc.settings import DecodeSettings
from decode_svc.slots import SlotTable
from tandem_core import grpc_util, lifecycle
from tandem_core.bus import conn, groups, registry
from tandem_core.settings import default_worker_id
from tandem_engine.prefix_cache import cache_for

log = logging.getLogger(__name__)
SERVICE = "tandem.v1.Decode"


def build_engine(s: DecodeSettings):
    from tandem_engine import load_engine

    e = s.engine
    return load_engine(e.model, slots=s.slots, max_len=e.max_len, prefill_buckets=tuple(e.prefill_buckets),
                       dtype=e.dtype, tp=e.tp, compile_cache_dir=e.compile_cache_dir,
                       cpu_threads=e.cpu_threads, prefix_chunk=s.prefix_cache.chunk_tokens)


async def serve(s: DecodeSettings) -> int:
    worker_id = s.worker_id or default_worker_id("decode")
    engine = build_engine(s)
    t0 = time.monotonic()
    # Compile the decode shapes now, not on a request's clock (and every prefill when this pod
    # prefills all its prompts; direct short prompts compile their bucket on first use).
    c = s.prefix_cache
    cache = cache_for(engine, c.block_size, c.budget_bytes, c.enabled)
    # plain, logprobs and masked steps; colocated: every prefill bucket and the prefill over a cached prefix
    await asyncio.to_thread(engine.warmup, s.colocated, True, True, s.colocated and cache.enabled)
    log.info("engine compiled in %.1fs (prefill buckets %s, batch buckets %s)", time.monotonic() - t0,
             list(engine.buckets), list(engine.batch_buckets))
    r = conn.connect(s.redis)
    await groups.ensure_groups(r, s.pool)
    table = SlotTable(s.slots)
    inserts: queue.Queue = queue.Queue(maxsize=max(s.insert_queue_size, s.slots))
    outputs: queue.Queue = queue.Queue(maxsize=64)
    loop = asyncio.get_running_loop()
    io: DecodeIO | None = None
    engine_loop = EngineLoop(engine, table, inserts, outputs, lambda: io and io.notify_slot_freed(loop),
                             on_output=lambda: io and io.notify_output(loop),
                             grammar_cache_size=s.engine.grammar_cache_size, mask_deadline_s=s.engine.mask_deadline_s,
                             prefix_cache=cache)
    io = DecodeIO(s, r, table, engine_loop, inserts, outputs, worker_id)
    await conn.retry_redis(io.owned.load, "load publish script", log=log)

    server = grpc_util.make_server(s.grpc.max_message_bytes)
    port = grpc_util.bind(server, s.grpc.host, s.grpc.port, s.grpc)
    health = grpc_util.add_health(server, [SERVICE])
    await server.start()
    address = f"{s.grpc.advertise_host}:{port}"
    stop = asyncio.Event()
    lifecycle.install_stop_signals(stop)
    state = {"draining": False}

    def info() -> registry.WorkerInfo:
        return registry.WorkerInfo(
            role="decode", id=worker_id, pid=os.getpid(), address=address, slots=table.slots,
            free_slots=table.free, draining=state["draining"],
            extra={"pool": s.pool, "prefix_cache": engine_loop.prefix_cache.summary(),
                   "steps": engine_loop.stats.steps, "tokens": engine_loop.stats.tokens, "pulled": io.pulled,
                   "local_prefills": engine_loop.stats.local_prefills, "colocated": s.colocated},
        )

    engine_loop.start()
    hb_stop, pub_done = asyncio.Event(), asyncio.Event()
    tasks = [
        asyncio.create_task(lifecycle.heartbeat_loop(r, info, s.heartbeat_interval_s, hb_stop, io.peers,
                                                           io.resync.kick)),
        asyncio.create_task(io.publish_loop(pub_done)),
        asyncio.create_task(io.cancel_loop(hb_stop)),
    ]
    # A restart under the same id: first resume what the previous incarnation left behind.
    await recover_running(io, include_self=True)
    await reclaim_pending(io, include_self=True)
    tasks.append(asyncio.create_task(recover_loop(io, hb_stop)))
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
        # Hand them back: each resumes on another pod from what it has streamed so far.
        left = table.snapshot()
        log.warning("drain deadline passed with %d running requests: handing them back", len(left))
        for act in left:
            await io.resume(act.req, "decode pod drained before it finished", owner=io.worker_id)
        io.engine_loop.cancel({a.req.request_id for a in left}, silent=True)
