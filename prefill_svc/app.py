"""Wiring of one prefill pod: engine, KV store, gRPC server (KV transfer + health), Redis,
heartbeats and the prefill loop, with a drain on SIGTERM."""
from __future__ import annotations

import asyncio
import logging
import os
import time

from prefill_svc.kv_store import KVStore
from prefill_svc.service import KVTransferServicer
from prefill_svc.settings import PrefillSettings
from prefill_svc.worker import PrefillWorker
from tandem_core import grpc_util, lifecycle
from tandem_core.bus import conn, groups, registry
from tandem_core.settings import default_worker_id
from tandem_engine.prefix_cache import cache_for
from tandem_proto import kv_pb2

log = logging.getLogger(__name__)
KV_SERVICE = kv_pb2.DESCRIPTOR.services_by_name["KVTransfer"].full_name


def build_engine(settings: PrefillSettings, slots: int = 1):
    from tandem_engine import load_engine

    return load_engine(**settings.engine_kwargs(slots))


async def serve(settings: PrefillSettings) -> int:
    worker_id = settings.worker_id or default_worker_id("prefill")
    engine = build_engine(settings)
    c = settings.prefix_cache
    cache = cache_for(engine, c.block_size, c.budget_bytes, c.enabled)
    # Compile every bucket's prefill (and the prefill over a cached prefix: one shape) before the
    # pod reports ready and claims a prompt, not on a request's clock.
    t0 = time.monotonic()
    await asyncio.to_thread(engine.warmup_prefill)
    if cache.enabled:
        await asyncio.to_thread(engine.warmup_prefix)
    log.info("engine compiled in %.1fs (prefill buckets %s)", time.monotonic() - t0, list(engine.buckets))
    store = KVStore(settings.kv_budget_bytes, settings.kv_lease_s)
    r = conn.connect(settings.redis)
    await groups.ensure_groups(r, settings.pool)

    server = grpc_util.make_server(settings.grpc.max_message_bytes)
    port = grpc_util.bind(server, settings.grpc.host, settings.grpc.port, settings.grpc)
    address = f"{settings.grpc.advertise_host}:{port}"
    peers = lifecycle.PeerJudge(lifecycle.heartbeat_ttl_s(settings.heartbeat_interval_s))
    worker = PrefillWorker(settings, engine, r, store, address, worker_id, cache, peers)
    # PullKV chunks are serialized by kvcodec itself (no protobuf message per chunk)
    KVTransferServicer(store, settings.kv_chunk_bytes, worker.on_release).add_to_server(server)
    health = grpc_util.add_health(server, [KV_SERVICE])
    grpc_util.add_reflection(server, [KV_SERVICE])
    await server.start()

    stop = asyncio.Event()
    lifecycle.install_stop_signals(stop)
    draining = False

    def info() -> registry.WorkerInfo:
        return registry.WorkerInfo(role="prefill", id=worker_id, pid=os.getpid(), address=address,
                                  held_kv_bytes=store.held_bytes, draining=draining,
                                  extra={"pool": settings.pool, "prefix_cache": cache.summary(),
                                         "kv_budget_bytes": store.budget_bytes, "prefilled": worker.prefiller.prefilled,
                                         "prefill_ema_s": round(worker.prefiller.prefill_ema_s, 6)})

    hb_stop = asyncio.Event()
    hb = asyncio.create_task(lifecycle.heartbeat_loop(r, info, settings.heartbeat_interval_s, hb_stop, peers))
    await grpc_util.set_serving(health, [KV_SERVICE], True)
    log.info("prefill ready worker_id=%s kv_address=%s model=%s budget=%d bytes", worker_id, address,
             engine.info.name, store.budget_bytes)
    loop_task = asyncio.create_task(worker.run(stop))
    await stop.wait()
    draining = True
    await grpc_util.set_serving(health, [KV_SERVICE], False)
    await loop_task
    await worker.drain(settings.drain_timeout_s)
    hb_stop.set()
    await hb
    await server.stop(grace=2.0)
    await r.aclose()
    log.info("prefill stopped worker_id=%s prefilled=%d", worker_id, worker.prefiller.prefilled)
    return 0
