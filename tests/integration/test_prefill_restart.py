"""A prefill pod takes its own admission entries that nothing in it works on again at once: those
its previous incarnation left (a restart under the same id), as its held-KV budget frees, and
those a claim delivered with its reply lost on a dying connection. Real Redis, the real tiny
model, the pod's own claim loop.

The previous incarnation can leave more admission entries pending than the new one's budget has
room for (it claims up to `max_batch` a read, and holds KV until decode pods pull it). The startup
pass takes as many as the budget has room for; before, the rest waited for the stale reclaim
(`stale_pending_s`, 30 s by default) with their clients waiting for a first token. Now the pod
takes them as pulls free its budget, before it claims anything new. A claim's lost reply left its
entries to the stale reclaim as well (docs/limits.md said so); now a claim round failing with Redis
down makes the next round take the pod's own entries again.
"""
from __future__ import annotations

import asyncio
import time

import pytest

from prefill_svc.kv_store import KVStore
from prefill_svc.settings import PrefillSettings
from prefill_svc.worker import PrefillWorker
from tandem_core import faults, keys
from tandem_core.bus import admission, groups
from tandem_core.settings import EngineConfig, RedisConfig
from tandem_core.types import GenerationRequest
from tandem_engine import load_engine

KS = keys.KeySpace(1)
MAX_LEN, BUCKETS = 64, (16, 64)
ROOM = 2  # prompts the budget holds at once


@pytest.fixture(scope="module")
def engine():
    return load_engine("tiny", slots=1, max_len=MAX_LEN, prefill_buckets=BUCKETS)


def _worker(redis_url, r, engine, pool: str, worker_id: str) -> PrefillWorker:
    s = PrefillSettings(redis=RedisConfig(url=redis_url), engine=EngineConfig(model="tiny", max_len=MAX_LEN),
                        pool=pool, recover_interval_s=0.1, claim_block_ms=50,
                        stale_pending_s=600)  # the stale reclaim cannot be what takes the leftovers here
    per_prompt = PrefillWorker(s, engine, r, KS, KVStore(1 << 30, 60), "", worker_id).prefiller.max_prefix_bytes
    return PrefillWorker(s, engine, r, KS, KVStore(ROOM * per_prompt, 60), "127.0.0.1:1", worker_id)


async def _pull_as_decode_pods_do(store: KVStore, rids: list[str], stop: asyncio.Event) -> None:
    """Frees each request's held KV soon after it appears (what a decode pod's pull does)."""
    while not stop.is_set():
        for rid in rids:
            if store.get(rid) is not None:
                store.release(rid)
        await asyncio.sleep(0.05)


async def _answered(r, rid: str) -> bool:
    return await r.xlen(KS.token_stream(rid)) > 0


async def test_a_restart_takes_every_entry_its_previous_life_left_as_the_budget_frees(redis_url, redis_client, engine):
    r, pool, me, n = redis_client, "prefill-restart", "prefill-again", 3 * ROOM + 1
    await groups.ensure_groups(r, KS, pool)
    rids = [f"left-{i}" for i in range(n)]
    for i, rid in enumerate(rids):
        await admission.enqueue_request(r, KS, pool, GenerationRequest(rid, [3 + i] * 20, 4), 1000)
    stream = KS.admission_stream(pool, GenerationRequest(rids[0], [3], 4).priority, 0)
    # the previous incarnation read every entry, then died before it answered any
    assert len(await groups.claim(r, [stream], keys.PREFILL_GROUP, me, n, None)) == n

    w = _worker(redis_url, r, engine, pool, me)
    assert w.prefiller.room() == ROOM
    stop = asyncio.Event()
    tasks = [asyncio.create_task(w.run(stop)), asyncio.create_task(_pull_as_decode_pods_do(w.store, rids, stop))]
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            done = [rid for rid in rids if await _answered(r, rid)]
            if len(done) == n:
                break
            await asyncio.sleep(0.1)
        assert len(done) == n, (f"{n - len(done)} of {n} entries the previous incarnation left were not answered "
                                f"in 30 s (stale_pending_s is 600: left for the stale reclaim)")
        assert not w.takeover.own_waiting
        assert (await r.xpending(stream, keys.PREFILL_GROUP))["pending"] == 0  # every one acked
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)


async def test_a_delivery_whose_claim_reply_was_lost_is_taken_again_at_once(redis_url, redis_client, engine):
    """The claim's XREADGROUP ran, its reply was lost with the dying connection: the entry is
    pending to this live pod, which never saw it. Here every claim round of the pod fails as on a
    dying connection while the delivery is made as its consumer (what the lost reply leaves in
    Redis), then Redis comes back; the stale reclaim is out of reach (600 s)."""
    r, pool, me = redis_client, "prefill-lost-reply", "prefill-lost"
    await groups.ensure_groups(r, KS, pool)
    w = _worker(redis_url, r, engine, pool, me)
    stop = asyncio.Event()
    faults.configure("prefill.claim@1+:down")
    tasks = [asyncio.create_task(w.run(stop)), asyncio.create_task(_pull_as_decode_pods_do(w.store, ["lost"], stop))]
    try:
        deadline = time.monotonic() + 30
        while not faults.raised["prefill.claim"]:  # the pod is past its startup pass, in its claim rounds
            assert time.monotonic() < deadline, "the pod never reached a claim round"
            await asyncio.sleep(0.05)
        await admission.enqueue_request(r, KS, pool, GenerationRequest("lost", [7] * 20, 4), 1000)
        stream = KS.admission_stream(pool, GenerationRequest("lost", [7], 4).priority, 0)
        assert len(await groups.claim(r, [stream], keys.PREFILL_GROUP, me, 1, None)) == 1  # the lost reply's read
        faults.configure("")  # Redis is back
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not await _answered(r, "lost"):
            await asyncio.sleep(0.1)
        assert await _answered(r, "lost"), "a delivery whose claim reply was lost waited for the stale reclaim"
        assert (await r.xpending(stream, keys.PREFILL_GROUP))["pending"] == 0
    finally:
        faults.configure("")
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
