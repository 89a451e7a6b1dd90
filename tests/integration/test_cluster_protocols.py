"""The Redis protocols on a real Redis Cluster (3 masters with a replica each, 16 key shards):
every multi-key script and transaction is single-slot (a cross-slot one fails with CROSSSLOT, so
these tests fail if a key escapes its request's tag), the shards spread over the masters, and the
reads that span shards (claims, backlogs, cancel checks, token readers) see every shard.

Each test runs through `conn.connect` with `redis.cluster`, as the services do."""
from __future__ import annotations

import asyncio
import time

import pytest
from redis.crc import key_slot

from gateway.tokens import TokenMux
from prefill_svc.kv_store import KVStore
from prefill_svc.settings import PrefillSettings
from prefill_svc.worker import PrefillWorker
from tandem_core import keys
from tandem_core.bus import recovery
from tandem_core.bus import admission, cancel, conn, groups, ready, reclaim, token_stream
from tandem_core.scheduling import PriorityRotation
from tandem_core.settings import EngineConfig, RedisConfig
from tandem_core.types import GenerationRequest, choice_ids
from tandem_engine import load_engine

POOL = "cl"
RIDS = [f"cl-{i}" for i in range(48)]
KS = keys.KeySpace(RedisConfig(cluster=True).shard_count())  # what the services build on a cluster: 16 shards


@pytest.fixture(scope="module")
def engine():
    return load_engine("tiny", slots=1, max_len=64, prefill_buckets=(16, 64))


@pytest.fixture
async def rc(redis_cluster):
    redis_cluster.flushall()
    cfg = RedisConfig(url=redis_cluster.url, cluster=True)
    r = conn.connect(cfg)
    try:
        yield r
    finally:
        await r.aclose()


def slot(k: str) -> int:
    return key_slot(k.encode())


def test_a_requests_keys_share_its_shards_slot():
    for rid in RIDS + choice_ids(RIDS[0], 2):
        s = KS.request_shard(rid)
        same = [KS.token_stream(rid), KS.cancel_key(rid), KS.admitted_key(rid), KS.resume_marker(rid, 3),
                KS.gateway_resume_key(rid), KS.admission_stream(POOL, "high", s),
                KS.admission_stream(POOL, "normal", s), KS.ready_stream(POOL, s), KS.direct_stream(POOL, s),
                KS.running_key("decode-x", s), KS.pod_admission_stream(POOL, "normal", "prefill-x", s),
                KS.pod_streams_set(POOL, s), KS.gateway_wake_stream("gw", s)]
        assert len({slot(k) for k in same}) == 1, rid
    assert KS.request_shard(choice_ids(RIDS[0], 2)[1]) == KS.request_shard(RIDS[0])  # choices write together
    assert len({KS.request_shard(rid) for rid in RIDS}) >= 12  # requests spread over the shards


async def test_shards_spread_evenly_over_the_masters(rc, redis_cluster):
    slots = await rc.cluster_slots(target_nodes=rc.get_default_node())
    per_master: dict[int, int] = {}
    for shard in KS.all_shards():
        s = slot(KS.tag(shard))
        (port,) = [info["primary"][1] for (lo, hi), info in slots.items() if lo <= s <= hi]
        per_master[port] = per_master.get(port, 0) + 1
    assert len(per_master) == 3 and sorted(per_master.values()) == [5, 5, 6]


async def test_enqueue_prefill_commit_and_claims_never_overfill(rc, redis_cluster, engine):
    """The gateway's enqueue (shared, per-pod and direct), a prefill pod's round (claim over every
    shard, fenced commit of token 0 + ready notice + ack), and a decode claim of exactly its free
    slots over every shard's ready stream."""
    r = rc
    await groups.ensure_groups(r, KS, POOL)
    s = PrefillSettings(redis=RedisConfig(url=redis_cluster.url, cluster=True),
                        engine=EngineConfig(model="tiny", max_len=64), pool=POOL, claim_block_ms=50)
    worker = PrefillWorker(s, engine, r, KS, KVStore(1 << 30, 60), "127.0.0.1:1", "prefill-cl")
    for shard in KS.all_shards():
        for prio in keys.PRIORITIES:
            await groups.ensure_group(r, worker.takeover.own_stream(prio, shard), keys.PREFILL_GROUP)
    reqs = [GenerationRequest(rid, [5, 6, 7, 8], 4, priority="high" if i % 3 == 0 else "normal")
            for i, rid in enumerate(RIDS[:24])]
    for i, q in enumerate(reqs):
        await admission.enqueue(r, KS, POOL, q, 1000, pod="prefill-cl" if i % 4 == 1 else None)
    again = await admission.enqueue(r, KS, POOL, reqs[0], 1000)  # a retried enqueue: the same entry, nothing new
    assert again and (await admission.read_backlog(r, KS, POOL, ["prefill-cl"])).total == 24
    assert await admission.pod_stream_owners(r, KS, POOL) == ["prefill-cl"]

    rotation = PriorityRotation(KS, POOL)
    for _ in range(40):
        if (await admission.read_backlog(r, KS, POOL, ["prefill-cl"])).total == 0:
            break
        await worker.claim_round(rotation)
    assert (await admission.read_backlog(r, KS, POOL, ["prefill-cl"])).total == 0
    for q in reqs:
        assert [token_stream.token_event(e, f).index for e, f in await r.xrange(KS.token_stream(q.request_id))] == [0]
    assert await ready.ready_backlog(r, KS, POOL) == 24

    ready_streams = [KS.ready_stream(POOL, sh) for sh in KS.all_shards()]
    bell = groups.Doorbell(r, POOL, [keys.DECODE_GROUP])
    got = await groups.claim(r, ready_streams, keys.DECODE_GROUP, "decode-cl", 5, 50, bell)
    assert len(got) == 5  # never more than the free slots, though entries wait in many shards
    rest = await groups.claim(r, ready_streams, keys.DECODE_GROUP, "decode-cl", 100, 50, bell)
    assert sorted(ready.ReadyNotice.from_json(c.fields["notice"]).request.request_id for c in got + rest) \
        == sorted(q.request_id for q in reqs)
    assert await admission.forget_pod_streams(r, KS, POOL, "prefill-cl")
    assert await admission.pod_stream_owners(r, KS, POOL) == []


async def test_a_blocked_claim_over_all_shards_wakes_on_the_doorbell(rc):
    r = rc
    await groups.ensure_groups(r, KS, POOL)
    names = [KS.admission_stream(POOL, p, sh) for p in keys.PRIORITIES for sh in KS.all_shards()]
    bell = groups.Doorbell(r, POOL, [keys.PREFILL_GROUP])

    async def later():
        await asyncio.sleep(0.3)
        await admission.enqueue_request(r, KS, POOL, GenerationRequest(RIDS[7], [5, 6], 2), 1000)

    t0 = time.monotonic()
    task = asyncio.create_task(later())
    got = await groups.claim(r, names, keys.PREFILL_GROUP, "prefill-w", 1, 20_000, bell)
    await task
    assert [c.fields["rid"].decode() for c in got] == [RIDS[7]]
    assert time.monotonic() - t0 < 10  # woken by the ring, not the 20 s timeout
    with pytest.raises(ValueError, match="Doorbell"):
        await groups.claim(r, names, keys.PREFILL_GROUP, "prefill-w", 1, 50)


async def test_fenced_token_batches_span_shards_and_keep_order(rc):
    r = rc
    pub = token_stream.OwnedPublisher(r, KS, "decode-cl", ttl_s=60, maxlen=1000)
    await pub.load()
    reqs = [GenerationRequest(rid, [5], 8) for rid in RIDS[:12]]
    await pub.own(*reqs)
    assert sorted(await reclaim.running_requests(r, KS, "decode-cl")) == sorted(RIDS[:12])
    for lost in RIDS[:3]:  # what a recoverer's transaction does to a paused owner
        await r.hdel(pub.running(lost), lost)
    pipe = r.pipeline(transaction=False)
    items = [token_stream.TokenEntry(rid, i, 100 + i) for i in range(2) for rid in RIDS[:12]]
    placed = pub.add_batch(pipe, items)
    assert len(placed) > 1  # one script call per shard
    results = placed.results(await pipe.execute())
    assert results == [0 if it.request_id in RIDS[:3] else 1 for it in items]
    for rid in RIDS[3:12]:
        assert [int(f[b"i"]) for _e, f in await r.xrange(KS.token_stream(rid))] == [0, 1]
    for rid in RIDS[:3]:
        assert not await r.exists(KS.token_stream(rid))


async def test_resume_cancel_and_the_token_readers_across_shards(rc):
    r = rc
    await groups.ensure_groups(r, KS, POOL)
    pub = token_stream.OwnedPublisher(r, KS, "decode-dead", ttl_s=60, maxlen=1000)
    await pub.load()
    victims = [GenerationRequest(rid, [5, 6], 6) for rid in RIDS[20:28]]
    await pub.own(*victims)
    pipe = r.pipeline(transaction=False)
    placed = pub.add_batch(pipe, [token_stream.TokenEntry(q.request_id, 0, 40) for q in victims])
    assert placed.results(await pipe.execute()) == [1] * len(victims)
    for q in victims:  # the dead pod's requests resume from what was streamed, in one transaction each
        assert await recovery.resume(r, KS, POOL, q, max_attempts=3, maxlen=1000, token_ttl_s=60, token_maxlen=1000,
                                     why="test", owner="decode-dead") == "resumed"
    assert await reclaim.running_requests(r, KS, "decode-dead") == {}
    assert await admission.admission_backlog(r, KS, POOL) == len(victims)

    await cancel.request_cancel(r, KS, RIDS[21], 60)
    await cancel.request_cancel(r, KS, RIDS[26], 60)
    assert await cancel.cancelled(r, KS, RIDS[20:28]) == {RIDS[21], RIDS[26]}

    mux = TokenMux(r, KS, block_ms=200)
    mux.start()
    try:
        subs = {rid: mux.subscribe(rid) for rid in RIDS[30:46]}
        writer = token_stream.OwnedPublisher(r, KS, "decode-live", ttl_s=60, maxlen=1000)
        await writer.load()
        await writer.own(*(GenerationRequest(rid, [5], 4) for rid in subs))
        for i in range(4):
            pipe = r.pipeline(transaction=False)
            writer.add_batch(pipe, [token_stream.TokenEntry(rid, i, 7 + i, "length" if i == 3 else None) for rid in subs])
            await pipe.execute()
        for rid, sub in subs.items():
            got = []
            while not got or got[-1].finish_reason is None:
                batch = await sub.get(10.0)
                assert batch, f"{rid}: nothing within 10 s after {[e.index for e in got]}"
                got += batch
            assert [e.index for e in got] == [0, 1, 2, 3] and [e.token_id for e in got] == [7, 8, 9, 10]
    finally:
        await mux.stop()
    assert [await r.exists(w) for w in mux.wake_streams] == [0] * 16  # one reader per shard, its stream gone
    assert await conn.check_shards(r, KS) is None  # the deployment's count, recorded by ensure_groups
    with pytest.raises(conn.RedisConfigError, match="16"):
        await conn.check_shards(r, keys.KeySpace(8))


async def test_steered_ready_notices_are_counted_stolen_and_forgotten_across_shards(rc):
    """Cache-aware routing to decode pods on a Cluster: notices steered to a decode pod land in its
    per-pod stream of each request's shard (with its set entry, same slot), count in the ready
    backlog, and another pod takes them only once it has seen them unread for the wait; the dead
    pod's emptied streams are then forgotten, shard by shard."""
    from tandem_core.bus import steal

    r = rc
    reqs = [GenerationRequest(rid, [3, 4], 4, decode_pod="decode-gone") for rid in RIDS[:8]]
    pipe = r.pipeline(transaction=False)
    for q in reqs:
        ready.add_ready(pipe, KS, POOL, ready.ReadyNotice(q, "127.0.0.1:1", "cap", 64, "p0", 7), 1000)
    await pipe.execute()
    shards = {KS.request_shard(q.request_id) for q in reqs}
    assert len(shards) > 1
    assert {p.owner for p in await ready.pod_ready_streams(r, KS, POOL)} == {"decode-gone"}
    assert await ready.ready_backlog(r, KS, POOL) == len(reqs)
    now = [0.0]
    thief = steal.Stealer(r, KS, POOL, "decode-b", wait_s=1.0, clock=lambda: now[0])
    first = await thief.take(100)
    assert first.claimed == [] and first.due_s == 1.0 and len(first.watch) == len(shards)
    now[0] = 1.0
    got = (await thief.take(100)).claimed
    assert sorted(ready.ReadyNotice.from_json(c.fields["notice"]).request.request_id for c in got) \
        == sorted(q.request_id for q in reqs)
    for c in got:
        await groups.ack(r, c.stream, keys.DECODE_GROUP, c.entry_id)
    for shard in sorted(shards):
        assert await ready.forget_pod_ready(r, KS, POOL, "decode-gone", shard)
    assert await ready.pod_ready_streams(r, KS, POOL) == []
