"""Wiring of one prefill pod in the shared worker skeleton (tandem_core/worker_pod.py): engine
(compiled before the pod reports ready), KV store, the KV transfer service, the prefill loop, and a
drain on SIGTERM that keeps serving held KV until it is pulled or its lease ends."""
from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prefill_svc.kv_store import KVStore
from prefill_svc.service import KVTransferServicer
from prefill_svc.settings import PrefillSettings
from prefill_svc.worker import PrefillWorker
from tandem_core import grpc_util, lifecycle
from tandem_core.bus import conn, groups, registry
from tandem_core.bus import KeySpace
from tandem_core.settings import default_worker_id
from tandem_core.worker_pod import WorkerPod
from tandem_proto import kv_pb2

if TYPE_CHECKING:  # the type only: no JAX import
    from tandem_engine.api import ServingEngine

log = logging.getLogger(__name__)
KV_SERVICE = kv_pb2.DESCRIPTOR.services_by_name["KVTransfer"].full_name


def build_engine(settings: PrefillSettings, slots: int = 1) -> ServingEngine:
    from tandem_engine import load_engine

    return load_engine(**settings.engine_kwargs(slots))


@dataclass
class BatchCompiles:
    """How far the pod's compiles of its batched prefill shapes have come (`_warm_batches`, after
    the pod is ready): in its heartbeat's `extra` (`/admin/cluster`), so an operator sees the
    background work, and a benchmark waits for done == total before it measures (until then the
    compiles take CPU from serving and prompts run in smaller groups)."""

    total: int
    done: int = 0
    failed: int = 0
    seconds: float = 0.0

    def summary(self) -> dict:
        return {"done": self.done, "total": self.total, "failed": self.failed, "seconds": round(self.seconds, 1)}


def _warm_batches(engine: ServingEngine, max_tokens: int, stop: asyncio.Event, progress: BatchCompiles) -> None:
    """On a thread of its own after the pod is ready: compile every batched prefill shape the
    prefill loop may group (prompts run alone, or in the groups already compiled, meanwhile), so
    no request waits for a compilation; `progress` counts them. Stops early when the pod stops."""
    shapes = engine.batch_shapes(max_tokens)
    progress.total = len(shapes)
    t0 = last = time.monotonic()
    for i, (bucket, rows) in enumerate(shapes):
        if stop.is_set():
            return
        try:
            engine.warm_batch(bucket, rows)
        except Exception:  # that shape stays uncompiled: its prompts run in smaller groups
            progress.failed += 1
            log.exception("compiling the batched prefill of %d x %d tokens failed; it is not used", rows, bucket)
        progress.done = i + 1
        progress.seconds = time.monotonic() - t0
        if time.monotonic() - last >= 10.0:
            last = time.monotonic()
            log.info("batched prefills: %d/%d shapes compiled, %.1fs", i + 1, len(shapes), last - t0)
    log.info("batched prefills compiled in %.1fs (%d shapes: %s)", time.monotonic() - t0, len(shapes),
             ", ".join(f"{rows}x{bucket}" for bucket, rows in shapes))


async def serve(settings: PrefillSettings) -> int:
    worker_id = settings.worker_id or default_worker_id("prefill")
    engine = build_engine(settings)
    c = settings.prefix_cache
    # the pool of blocks in device memory that a hit's prefill reads in place (tandem_engine/prefix_pool.py)
    from tandem_engine.prefix_pool import device_cache_for

    cache = device_cache_for(engine, c.block_size, c.budget_bytes, c.enabled)  # type: ignore[arg-type]
    # Compile every bucket's prefill (and the prefill over a cached prefix: one shape) before the
    # pod reports ready and claims a prompt, not on a request's clock.
    t0 = time.monotonic()
    await asyncio.to_thread(engine.warmup_prefill)
    if cache.enabled:
        await asyncio.to_thread(cache.warmup)
    log.info("engine compiled in %.1fs (prefill buckets %s)", time.monotonic() - t0, list(engine.buckets))
    store = KVStore(settings.kv_budget_bytes, settings.kv_lease_s)
    r = conn.connect(settings.redis)
    ks = KeySpace(settings.redis.shard_count())
    await groups.ensure_groups(r, ks, settings.pool)
    pod = WorkerPod(settings, r, [KV_SERVICE])
    address = pod.bind()
    peers = lifecycle.PeerJudge(lifecycle.heartbeat_ttl_s(settings.heartbeat_interval_s))
    worker = PrefillWorker(settings, engine, r, ks, store, address, worker_id, cache, peers)
    # PullKV chunks are serialized by kvcodec itself (no protobuf message per chunk)
    KVTransferServicer(store, settings.kv_chunk_bytes, worker.on_release).add_to_server(pod.server)
    grpc_util.add_reflection(pod.server, [KV_SERVICE])
    await pod.start()

    compiles = BatchCompiles(total=len(engine.batch_shapes(settings.prefill_batch_tokens)))

    def info() -> registry.WorkerInfo:
        return registry.WorkerInfo(role="prefill", id=worker_id, pid=os.getpid(), address=address,
                                  held_kv_bytes=store.held_bytes, draining=pod.draining,
                                  extra={"pool": settings.pool, "prefix_cache": cache.summary(),
                                         "kv_budget_bytes": store.budget_bytes, "prefilled": worker.prefiller.prefilled,
                                         "prefill_ema_s": round(worker.prefiller.prefill_ema_s, 6),
                                         "batch_compiles": compiles.summary()})

    pod.beat(info, peers)
    engine.defer_batch_compiles()  # batched prefills group only the row counts compiled below
    await pod.ready()
    log.info("prefill ready worker_id=%s kv_address=%s model=%s budget=%d bytes", worker_id, address,
             engine.info.name, store.budget_bytes)
    batches = asyncio.create_task(asyncio.to_thread(_warm_batches, engine, settings.prefill_batch_tokens, pod.stop,
                                                     compiles))
    # a loop that died must not leave a pod that claims nothing: "prefill loop failed: ...; stopping"
    # (restarted, the pod takes back what it had claimed)
    loop_task = pod.supervise(asyncio.create_task(worker.run(pod.stop)), "prefill loop")
    await pod.stop.wait()
    await pod.drain()
    await asyncio.gather(loop_task, return_exceptions=True)  # (a failure was said by `supervise`: drain on)
    await batches
    await worker.drain(settings.drain_timeout_s)
    await pod.close(grace_s=2.0)
    log.info("prefill stopped worker_id=%s prefilled=%d", worker_id, worker.prefiller.prefilled)
    if pod.failed:
        log.error("prefill pod exits after a failure: %s", "; ".join(pod.failed))
    return 1 if pod.failed else 0
