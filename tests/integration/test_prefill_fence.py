"""The prefill pod's publish is fenced on its admission entry, through real prefill workers and a
real Redis: a pod whose entry another pod reclaimed while it was stalled (SIGSTOP past its
heartbeat) writes no second token 0 and no second ready notice when it wakes, frees the KV it
held, and does not ack the entry away from its new owner; the normal publish still writes one of
each, for every choice of an n > 1 request, and acks; a pod whose per-pod stream was forgotten
while it was taken for dead re-creates its group and serves the stream again."""
from __future__ import annotations

import asyncio

import pytest

from prefill_svc.kv_store import KVStore
from prefill_svc.settings import PrefillSettings
from prefill_svc.worker import PrefillWorker
from tandem_core import keys
from tandem_core.bus import admission, groups, reclaim, registry, token_stream
from tandem_core.settings import EngineConfig, RedisConfig
from tandem_core.types import GenerationRequest, choice_ids
from tandem_engine import load_engine

PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def engine():
    return load_engine("tiny", slots=1, max_len=64, prefill_buckets=(16, 64))


def worker_for(redis_url, r, ks, engine, pool: str, wid: str) -> PrefillWorker:
    s = PrefillSettings(redis=RedisConfig(url=redis_url), engine=EngineConfig(model="tiny", max_len=64), pool=pool,
                        recover_interval_s=0.1, claim_block_ms=50)
    return PrefillWorker(s, engine, r, ks, KVStore(1 << 30, 60), "127.0.0.1:1", wid)


async def admit(r, ks, pool: str, req: GenerationRequest) -> str:
    await groups.ensure_groups(r, ks, pool)
    await admission.enqueue_request(r, ks, pool, req, 1000)
    return ks.admission_stream(pool, req.priority, ks.request_shard(req.request_id))


async def token_indices(r, ks, rid: str) -> list[int]:
    return [token_stream.token_event(eid, f).index for eid, f in await r.xrange(ks.token_stream(rid))]


async def ready_rids(r, ks, pool: str) -> list[str]:
    return [f[b"rid"].decode() for shard in ks.all_shards()
            for _eid, f in await r.xrange(ks.ready_stream(pool, shard))]


async def owner(r, stream: str) -> list[str]:
    """The consumers the stream's entries are pending to, one per entry."""
    rows = await r.xpending_range(stream, keys.PREFILL_GROUP, min="-", max="+", count=10)
    return [row["consumer"].decode() for row in rows]


async def test_normal_publish_writes_token_zero_and_one_notice_per_choice_and_acks(redis_url, any_redis, any_keys, engine):
    ks = any_keys
    r, pool = any_redis, "fence-normal"
    stream = await admit(r, ks, pool, GenerationRequest("two", PROMPT, 8, n=2))
    a = worker_for(redis_url, r, ks, engine, pool, "prefill-a")
    (c,) = await groups.claim(r, [stream], keys.PREFILL_GROUP, a.worker_id, 4, None)
    await a.handler.handle(c)
    for rid in choice_ids("two", 2):
        assert await token_indices(r, ks, rid) == [0]
        assert a.store.get(rid) is not None  # held for the decode pod's pull
    assert sorted(await ready_rids(r, ks, pool)) == choice_ids("two", 2)
    assert await r.xlen(stream) == 0 and await owner(r, stream) == []  # acked and deleted


async def test_a_woken_pod_publishes_nothing_once_its_entry_was_reclaimed(redis_url, any_redis, any_keys, engine):
    """A claims; A stalls past its heartbeat (it has no registry entry: dead to its peers); B
    reclaims the entry the way a live pod does, and publishes; A wakes and finishes its prefill."""
    ks = any_keys
    r, pool = any_redis, "fence-reclaimed"
    stream = await admit(r, ks, pool, GenerationRequest("once", PROMPT, 8, n=2))
    a = worker_for(redis_url, r, ks, engine, pool, "prefill-a")
    b = worker_for(redis_url, r, ks, engine, pool, "prefill-b")
    (c,) = await groups.claim(r, [stream], keys.PREFILL_GROUP, a.worker_id, 4, None)
    await asyncio.sleep(1.1)  # a reclaim takes entries idle for a second
    await registry.heartbeat(r, registry.WorkerInfo("prefill", b.worker_id, 1, b.address), 30)
    await b.takeover.reclaim_pending(stream, False)
    assert sorted(await ready_rids(r, ks, pool)) == choice_ids("once", 2)

    await a.handler.handle(c)  # A wakes: its publish is fenced off

    for rid in choice_ids("once", 2):
        assert await token_indices(r, ks, rid) == [0], "a second token 0"
        assert a.store.get(rid) is None, "the fenced-off pod still holds the KV"
        assert b.store.get(rid) is not None
    assert len(a.store) == 0 and a.store.held_bytes == 0
    assert sorted(await ready_rids(r, ks, pool)) == choice_ids("once", 2), "a second ready notice"


async def test_a_woken_pod_does_not_ack_the_entry_away_from_its_new_owner(redis_url, any_redis, any_keys, engine):
    """B has reclaimed A's entry but not published yet when A wakes: A writes nothing and leaves
    the entry pending to B, whose own publish then goes through."""
    ks = any_keys
    r, pool = any_redis, "fence-order"
    stream = await admit(r, ks, pool, GenerationRequest("mid", PROMPT, 8))
    a = worker_for(redis_url, r, ks, engine, pool, "prefill-a")
    b = worker_for(redis_url, r, ks, engine, pool, "prefill-b")
    (c,) = await groups.claim(r, [stream], keys.PREFILL_GROUP, a.worker_id, 4, None)
    (taken,) = await reclaim.claim_ids(r, stream, keys.PREFILL_GROUP, b.worker_id, [c.entry_id], 0)

    await a.handler.handle(c)
    assert await token_indices(r, ks, "mid") == [] and await ready_rids(r, ks, pool) == []
    assert await owner(r, stream) == ["prefill-b"]
    assert len(a.store) == 0

    await b.handler.handle(taken, reclaimed=True)
    assert await token_indices(r, ks, "mid") == [0] and await ready_rids(r, ks, pool) == ["mid"]
    assert await r.xlen(stream) == 0


async def test_an_error_finish_is_fenced_too(redis_url, any_redis, any_keys, engine):
    """A request that fails in the prefill (prompt too long for the largest bucket) is finished
    with an error by its owner only: a woken pod does not end a request another pod now serves."""
    ks = any_keys
    r, pool = any_redis, "fence-error"
    stream = await admit(r, ks, pool, GenerationRequest("bad", list(range(2, 90)), 8))
    a = worker_for(redis_url, r, ks, engine, pool, "prefill-a")
    (c,) = await groups.claim(r, [stream], keys.PREFILL_GROUP, a.worker_id, 4, None)
    await reclaim.claim_ids(r, stream, keys.PREFILL_GROUP, "prefill-b", [c.entry_id], 0)
    await a.handler.handle(c)
    assert await token_indices(r, ks, "bad") == []
    assert await owner(r, stream) == ["prefill-b"]


async def test_a_forgotten_pod_stream_gets_its_group_back(redis_url, any_redis, any_keys, engine):
    """While a pod was taken for dead, a peer drained and deleted its per-pod stream; a routed
    XADD then re-created the stream without the consumer group. The pod serves it anyway."""
    ks = any_keys
    r, pool = any_redis, "fence-nogroup"
    await groups.ensure_groups(r, ks, pool)
    a = worker_for(redis_url, r, ks, engine, pool, "prefill-a")
    stop = asyncio.Event()
    task = asyncio.create_task(a.run(stop))
    try:
        await asyncio.sleep(0.3)  # running, its groups created
        req = GenerationRequest("routed", PROMPT, 8)
        own = ks.pod_admission_stream(pool, "normal", a.worker_id, ks.request_shard(req.request_id))
        await r.delete(own)
        await r.xadd(own, {"rid": req.request_id, "req": req.to_json()})
        for _ in range(200):
            if await token_indices(r, ks, "routed"):
                break
            await asyncio.sleep(0.05)
        assert await token_indices(r, ks, "routed") == [0]
        assert not task.done(), "the prefill loop died"
    finally:
        stop.set()
        await task
