"""Per-pod admission streams (prefix routing) through a real prefill worker and real Redis: a pod
serves its own stream, adopts the stream of a dead pod and then forgets it, takes prompts queued
for a draining pod without forgetting it, and its prefix cache hits on a shared prefix."""
from __future__ import annotations

import asyncio

import pytest

from prefill_svc.kv_store import KVStore
from prefill_svc.settings import PrefillSettings
from prefill_svc.worker import PrefillWorker
from tandem_core import keys
from tandem_core.bus import admission, groups, registry
from tandem_core.settings import EngineConfig, RedisConfig
from tandem_core.types import GenerationRequest
from tandem_engine import load_engine
from tandem_engine.prefix_pool import device_cache_for

KS = keys.KeySpace(1)  # a plain Redis: one key shard (a service builds its own from its settings)


@pytest.fixture(scope="module")
def engine():
    return load_engine("tiny", slots=1, max_len=64, prefill_buckets=(16, 64), prefix_chunk=16)


async def route_to(r, pool: str, pod: str, req: GenerationRequest) -> None:
    """What the gateway does for a routed prompt: XADD to the pod's stream and SADD, together."""
    pipe = r.pipeline(transaction=True)
    pipe.xadd(KS.pod_admission_stream(pool, req.priority, pod, 0), {"rid": req.request_id, "req": req.to_json()})
    pipe.sadd(KS.pod_streams_set(pool, 0), pod)
    await pipe.execute()


async def first_tokens(r, rids: list[str], timeout_s: float = 30.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if all([await r.exists(KS.token_stream(rid)) for rid in rids]):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"not all of {rids} got a first token within {timeout_s}s")


def worker_for(redis_url, r, engine, pool: str, wid: str, cache=None) -> PrefillWorker:
    s = PrefillSettings(redis=RedisConfig(url=redis_url), engine=EngineConfig(model="tiny", max_len=64), pool=pool,
                        recover_interval_s=0.1, claim_block_ms=50)
    return PrefillWorker(s, engine, r, KS, KVStore(1 << 30, 60), "127.0.0.1:1", wid, cache)


async def running(worker: PrefillWorker):
    stop = asyncio.Event()
    await registry.heartbeat(worker.r, registry.WorkerInfo("prefill", worker.worker_id, 1, worker.address), 30)
    return stop, asyncio.create_task(worker.run(stop))


async def test_own_stream_and_a_dead_pods_stream_are_served(redis_url, redis_client, engine):
    r, pool = redis_client, "podstreams"
    await groups.ensure_groups(r, KS, pool)
    worker = worker_for(redis_url, r, engine, pool, "prefill-live")
    stop, task = await running(worker)
    try:
        await route_to(r, pool, "prefill-live", GenerationRequest("mine", [5, 6, 7], 4))
        await route_to(r, pool, "prefill-gone", GenerationRequest("orphan", [5, 6, 8], 4, priority="high"))
        await first_tokens(r, ["mine", "orphan"])
        for _ in range(100):  # the dead pod's streams and set entry go once empty
            if await admission.pod_stream_owners(r, KS, pool) == ["prefill-live"]:
                break
            await asyncio.sleep(0.05)
        assert await admission.pod_stream_owners(r, KS, pool) == ["prefill-live"]
        assert not await r.exists(KS.pod_admission_stream(pool, "high", "prefill-gone", 0))
        assert await r.xlen(KS.pod_admission_stream(pool, "normal", "prefill-live", 0)) == 0  # acked = deleted
    finally:
        stop.set()
        await task


async def test_a_draining_pods_prompts_are_taken_and_it_is_not_forgotten(redis_url, redis_client, engine):
    r, pool = redis_client, "podstreams-drain"
    await groups.ensure_groups(r, KS, pool)
    await registry.heartbeat(r, registry.WorkerInfo("prefill", "prefill-draining", 1, "x", draining=True), 30)
    await route_to(r, pool, "prefill-draining", GenerationRequest("queued-there", [9, 9, 9], 4))
    worker = worker_for(redis_url, r, engine, pool, "prefill-other")
    stop, task = await running(worker)
    try:
        await first_tokens(r, ["queued-there"])
        assert "prefill-draining" in await admission.pod_stream_owners(r, KS, pool)
    finally:
        stop.set()
        await task


async def test_forget_refuses_while_a_stream_has_entries(redis_client):
    r, pool = redis_client, "podstreams-forget"
    await route_to(r, pool, "prefill-x", GenerationRequest("waiting", [1, 2], 1))
    assert not await admission.forget_pod_streams(r, KS, pool, "prefill-x")
    assert await admission.pod_stream_owners(r, KS, pool) == ["prefill-x"]
    await r.delete(KS.pod_admission_stream(pool, "normal", "prefill-x", 0))
    assert await admission.forget_pod_streams(r, KS, pool, "prefill-x")
    assert await admission.pod_stream_owners(r, KS, pool) == []


async def test_the_pods_cache_hits_on_a_shared_prefix(redis_url, redis_client, engine):
    r, pool = redis_client, "podstreams-cache"
    await groups.ensure_groups(r, KS, pool)
    cache = device_cache_for(engine, 16, 1 << 24)
    worker = worker_for(redis_url, r, engine, pool, "prefill-cache", cache)
    stop, task = await running(worker)
    shared = list(range(2, 34))  # two blocks
    try:
        await route_to(r, pool, "prefill-cache", GenerationRequest("turn-1", shared + [40, 41], 4))
        await first_tokens(r, ["turn-1"])
        await route_to(r, pool, "prefill-cache", GenerationRequest("turn-2", shared + [40, 41, 50, 51, 52], 4))
        await first_tokens(r, ["turn-2"])
    finally:
        stop.set()
        await task
    s = cache.summary()
    assert (s["queries"], s["hits"], s["computed"]) == (34 + 37, 32, 34 + 5)
