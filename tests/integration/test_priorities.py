"""Priority classes through a real prefill worker and real Redis: high is served first, and low is
still served while high keeps coming (not starved forever)."""
from __future__ import annotations

import asyncio

import pytest

from prefill_svc.kv_store import KVStore
from prefill_svc.settings import PrefillSettings
from prefill_svc.worker import PrefillWorker
from tandem_core import keys
from tandem_core.bus import admission, groups
from tandem_core.settings import EngineConfig, RedisConfig
from tandem_core.types import GenerationRequest
from tandem_engine import load_engine

KS = keys.KeySpace(1)  # a plain Redis: one key shard (a service builds its own from its settings)


@pytest.fixture(scope="module")
def engine():
    return load_engine("tiny", slots=1, max_len=64, prefill_buckets=(16,))


async def test_high_first_low_not_starved(redis_url, redis_client, engine):
    r, pool = redis_client, "prio"
    await groups.ensure_groups(r, KS, pool)
    n = 24
    for i in range(n):  # low priority queued first, then a flood of high
        await admission.enqueue_request(r, KS, pool, GenerationRequest(f"low-{i}", [256, 1, 2], 1, priority="normal"), 1000)
    for i in range(n):
        await admission.enqueue_request(r, KS, pool, GenerationRequest(f"high-{i}", [256, 1, 2], 1, priority="high"), 1000)
    s = PrefillSettings(redis=RedisConfig(url=redis_url), engine=EngineConfig(model="tiny", max_len=64), pool=pool,
                        max_batch=2, priority_high_weight=3)
    worker = PrefillWorker(s, engine, r, KS, KVStore(1 << 30, 60), "127.0.0.1:1", "prefill-test")
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    rids = [f"{c}-{i}" for c in ("high", "low") for i in range(n)]
    done: dict[str, tuple[int, int]] = {}  # rid -> the id Redis gave its first token entry
    try:
        for _ in range(600):
            for rid in [x for x in rids if x not in done]:
                first = await r.xrange(KS.token_stream(rid), count=1)
                if first:
                    ms, seq = first[0][0].decode().split("-")
                    done[rid] = (int(ms), int(seq))
            if len(done) == 2 * n:
                break
            await asyncio.sleep(0.02)
    finally:
        stop.set()
        await task
    assert len(done) == 2 * n, f"finished {len(done)} of {2 * n}"
    # The order the prefill pod answered them in, by the time Redis stamped each first token (not
    # by when this loop happened to see them: one slow poll would lump a low one behind highs).
    order = sorted(done, key=done.__getitem__)
    first_low = next(i for i, rid in enumerate(order) if rid.startswith("low"))
    last_high = max(i for i, rid in enumerate(order) if rid.startswith("high"))
    assert first_low >= 6, f"high priority was not served first: {order[:10]}"
    assert first_low < last_high, "low priority waited for the whole high flood (starved)"
    highs_before_last_high = sum(rid.startswith("high") for rid in order[: last_high + 1])
    assert highs_before_last_high / (last_high + 1) >= 0.6, "high priority did not get the larger share"


async def test_unpulled_kv_is_freed_at_lease_end_with_a_clear_error(redis_url, redis_client, engine):
    r, pool = redis_client, "lease"
    await groups.ensure_groups(r, KS, pool)
    await admission.enqueue_request(r, KS, pool, GenerationRequest("orphan", [256, 1, 2, 3], 8), 1000)
    s = PrefillSettings(redis=RedisConfig(url=redis_url), engine=EngineConfig(model="tiny", max_len=64), pool=pool,
                        kv_lease_s=0.5)
    store = KVStore(1 << 30, s.kv_lease_s)
    worker = PrefillWorker(s, engine, r, KS, store, "127.0.0.1:1", "prefill-lease")
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        for _ in range(200):  # no decode pod ever pulls it
            entries = await r.xrange(KS.token_stream("orphan"))
            if entries and b"f" in entries[-1][1]:
                break
            await asyncio.sleep(0.05)
    finally:
        stop.set()
        await task
    fields = entries[-1][1]
    assert fields[b"f"] == b"error" and b"lease" in fields[b"e"]
    assert int(entries[0][1][b"i"]) == 0  # token 0 was published before the lease ran out
    assert store.held_bytes == 0 and len(store) == 0
