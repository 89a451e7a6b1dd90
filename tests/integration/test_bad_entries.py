"""Issue 42: a bad entry costs one request, never a reader. Entries no request can be read from
(a writer's bug, a pod of another release), written by hand into a real Redis, read by the real
readers: the prefill pod's admission handler answers the request with a clear error and acks the
entry (before: pending, taken up again and failing every `stale_pending_s`, for ever), and one
malformed heartbeat hash leaves every other worker listed (before: every reader of the registry
failed, the gateway's admission among them). The gateway's token reader and the decode pod's
claims have theirs in tests/integration/test_token_mux.py and test_decode_handback.py."""
from __future__ import annotations

import logging

import pytest

from prefill_svc.kv_store import KVStore
from prefill_svc.settings import PrefillSettings
from prefill_svc.worker import PrefillWorker
from tandem_core import keys
from tandem_core.bus import groups, registry
from tandem_core.keys import KeySpace
from tandem_core.settings import EngineConfig, RedisConfig
from tandem_core.types import choice_ids
from tandem_engine import load_engine

KS = KeySpace(1)


@pytest.fixture(scope="module")
def engine():
    return load_engine("tiny", slots=1, max_len=64, prefill_buckets=(16,))


async def test_an_unreadable_admission_entry_is_answered_and_acked(redis_url, redis_client, engine, caplog):
    r, pool = redis_client, "dead-prefill"
    s = PrefillSettings(redis=RedisConfig(url=redis_url), engine=EngineConfig(model="tiny", max_len=64), pool=pool,
                        claim_block_ms=50)
    worker = PrefillWorker(s, engine, r, KS, KVStore(1 << 30, 60), "127.0.0.1:1", "prefill-dead")
    await groups.ensure_groups(r, KS, pool)
    stream = KS.admission_stream(pool, "high", 0)
    # valid JSON without a prompt: no GenerationRequest reads from it; its choices are still known
    await r.xadd(stream, {"rid": "garbled", "req": '{"request_id": "garbled", "n": 2, "from_the_future": 1}'})
    (c,) = await groups.claim(r, [stream], keys.PREFILL_GROUP, worker.worker_id, 4, None)
    caplog.set_level(logging.ERROR)
    await worker.handler.handle_until_done(c)
    assert (await r.xpending(stream, keys.PREFILL_GROUP))["pending"] == 0, \
        "the unreadable entry stays pending: taken up again and failing for ever"
    for rid in choice_ids("garbled", 2):
        ends = [f for _id, f in await r.xrange(KS.token_stream(rid)) if b"f" in f]
        assert ends and ends[-1][b"f"] == b"error" and stream.encode() in ends[-1][b"e"], \
            f"{rid}: no clear error for its client, who waits out its timeout ({ends})"
    assert sum(1 for rec in caplog.records if "dead letter" in rec.getMessage()) == 1, caplog.text


async def test_a_malformed_heartbeat_leaves_every_other_worker_listed(redis_client, caplog):
    r = redis_client
    good = registry.WorkerInfo(role="decode", id="good-pod", pid=1, address="127.0.0.1:1", slots=4, free_slots=4)
    await registry.heartbeat(r, good, 30)
    bad = registry.WorkerInfo(role="decode", id="bad-pod", pid=2, address="127.0.0.1:2", slots=4, free_slots=4)
    await registry.heartbeat(r, bad, 30)
    await r.hset(keys.worker_key("bad-pod"), mapping={"free_slots": "lots", "extra": "{not json"})
    workers = await registry.list_workers(r)
    assert [w["id"] for w in workers] == ["good-pod"], workers
    assert keys.worker_key("bad-pod") in caplog.text


async def test_an_entry_delivered_too_often_is_given_up_with_a_clear_error(redis_url, redis_client, engine):
    """Issue 42 (6): an admission entry that pod after pod took and never answered (each died or
    failed on it: a prompt that kills a pod) was reclaimed and tried again every
    `stale_pending_s`, for ever. Delivered MAX_DELIVERIES times, it is given up: its request gets
    a clear error, its entry is acked, and it is not prefilled again."""
    from prefill_svc.takeover import MAX_DELIVERIES
    from tandem_core.bus import admission
    from tandem_core.types import GenerationRequest

    r, pool = redis_client, "dead-often"
    s = PrefillSettings(redis=RedisConfig(url=redis_url), engine=EngineConfig(model="tiny", max_len=64), pool=pool,
                        claim_block_ms=50)
    worker = PrefillWorker(s, engine, r, KS, KVStore(1 << 30, 60), "127.0.0.1:1", "prefill-survivor")
    await groups.ensure_groups(r, KS, pool)
    await admission.enqueue_request(r, KS, pool, GenerationRequest("poison", [5, 6, 7], 8), 1000)
    stream = KS.admission_stream(pool, "normal", KS.request_shard("poison"))
    (c,) = await groups.claim(r, [stream], keys.PREFILL_GROUP, "prefill-gone-0", 1, None)
    for k in range(1, MAX_DELIVERIES):  # taken by pod after pod, each of which died on it
        await r.xclaim(stream, keys.PREFILL_GROUP, f"prefill-gone-{k}", 0, [c.entry_id])
    await worker.takeover.run(include_self=True)
    assert (await r.xpending(stream, keys.PREFILL_GROUP))["pending"] == 0, "the entry is still pending: tried again"
    ends = [f for _id, f in await r.xrange(KS.token_stream("poison"))]
    assert [f.get(b"f") for f in ends] == [b"error"] and b"giving up" in ends[0][b"e"], \
        f"not given up with a clear error (prefilled once more?): {ends}"
    assert len(worker.store) == 0
