"""Cache-aware routing to decode pods, the Redis side (real Redis, real gRPC KV server, real paged
engines): a ready notice steered to a decode pod (`GenerationRequest.decode_pod`) is read by that
pod, never by another while it is there to read it; one its pod leaves unread is taken by a pod
with room after `affinity_wait_ms` and not before; and one a dead pod had read is reclaimed from
its per-pod stream, which is then forgotten.

1. Two pods, four notices steered to each: each pod pulls exactly its own four.
2. A notice steered to a pod that is not running: the running pod takes it after the wait.
3. A notice delivered to a pod that then died: reclaimed, finished, and the dead pod's empty
   stream and set entry deleted.
"""
from __future__ import annotations

import asyncio
import time

import pytest

from decode_svc.recover import reclaim_pending
from decode_svc.settings import DecodeSettings
from prefill_svc.kv_store import KVStore
from tandem_core import keys
from tandem_core.bus import groups, ready
from tandem_core.settings import EngineConfig, RedisConfig
from tandem_core.types import GenerationRequest, SamplingParams
from tandem_engine import load_engine
from tests.integration.test_decode_blocks import BUCKETS, KS, MAX_LEN, _kv_server, _Pod, _tokens

ROWS = 4
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def reference():
    return load_engine("tiny", slots=1, max_len=MAX_LEN, prefill_buckets=BUCKETS)


def _paged():
    return load_engine("tiny", slots=ROWS, max_len=MAX_LEN, prefill_buckets=BUCKETS,
                       kv_block_size=8, kv_blocks=64)


def _settings(redis_url: str, pool: str, wait_ms: int) -> DecodeSettings:
    return DecodeSettings(redis=RedisConfig(url=redis_url), engine=EngineConfig(model="tiny", max_len=MAX_LEN),
                          pool=pool, slots=ROWS, claim_block_ms=50, affinity_wait_ms=wait_ms, reclaim_min_idle_ms=1)


async def _offer(r, pool, store, address, reference, rid: str, to: str | None, i: int) -> None:
    """Prefill as a prefill pod does and write the ready notice steered to decode pod `to` (None:
    the shared ready stream)."""
    req = GenerationRequest(rid, [256, 65 + i, 66], MAX_TOKENS, SamplingParams(), ignore_eos=True, decode_pod=to)
    payload = reference.export_prefix(reference.prefill(req.prompt_ids, req.sampling))
    held = store.put(rid, payload)
    pipe = r.pipeline(transaction=False)
    ready.add_ready(pipe, KS, pool, ready.ReadyNotice(req, address, held.capability, payload.nbytes, "p0",
                                                      payload.first_token), 1000)
    groups.ring(pipe, KS, pool, keys.DECODE_GROUP)
    await pipe.execute()


async def _all_finished(r, rids: list[str], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all([(await _tokens(r, rid))[1] for rid in rids]):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"not finished: {[rid for rid in rids if not (await _tokens(r, rid))[1]]}")


async def test_each_pod_reads_the_notices_steered_to_it(redis_url, redis_client, reference):
    r, pool = redis_client, "affinity-own"
    await groups.ensure_groups(r, KS, pool)
    store = KVStore(1 << 30, 60)
    server, address = await _kv_server(store)
    try:
        # the wait is long: no pod takes another's notice while that pod is there to read it
        async with _Pod(_settings(redis_url, pool, 30_000), r, _paged(), "dec-a") as a, \
                _Pod(_settings(redis_url, pool, 30_000), r, _paged(), "dec-b") as b:
            assert a.io.claims.affinity and b.io.claims.affinity  # paged, kv_reuse: they read their own streams
            rids = []
            for i in range(8):
                rid, to = f"own-{i}", ("dec-a", "dec-b")[i % 2]
                await _offer(r, pool, store, address, reference, rid, to, i)
                rids.append(rid)
            await _all_finished(r, rids)
            assert (a.io.claims.pulled, b.io.claims.pulled) == (4, 4)
            assert a.io.claims.stealer.stolen == b.io.claims.stealer.stolen == 0
        # the notices went to the per-pod streams (the shared one stayed empty), whose owners are known
        assert await r.xlen(KS.ready_stream(pool, 0)) == 0
        assert {m.decode() for m in await r.smembers(KS.pod_ready_set(pool, 0))} == {"dec-a", "dec-b"}
        assert await ready.ready_backlog(r, KS, pool) == 0
    finally:
        await server.stop(None)
    assert store.held_bytes == 0


async def test_a_notice_its_pod_leaves_unread_is_taken_after_the_wait(redis_url, redis_client, reference):
    r, pool, wait_s = redis_client, "affinity-steal", 1.5
    await groups.ensure_groups(r, KS, pool)
    store = KVStore(1 << 30, 60)
    server, address = await _kv_server(store)
    try:
        async with _Pod(_settings(redis_url, pool, int(wait_s * 1000)), r, _paged(), "dec-b") as b:
            t0 = time.monotonic()
            await _offer(r, pool, store, address, reference, "orphan", "dec-gone", 1)  # no such pod runs
            await asyncio.sleep(wait_s / 3)
            stream = KS.pod_ready_stream(pool, "dec-gone", 0)
            assert await ready.ready_backlog(r, KS, pool) == 1  # counted where it waits
            assert b.io.claims.pulled == 0 and (await _tokens(r, "orphan"))[0] == [], "taken before the wait"
            await _all_finished(r, ["orphan"])
            assert time.monotonic() - t0 >= wait_s
            assert b.io.claims.stealer.stolen == 1 and b.io.claims.pulled == 1
            assert await r.xlen(stream) == 0  # acked and deleted from the stream it was stolen from
    finally:
        await server.stop(None)


async def test_a_dead_pods_pending_notice_is_reclaimed_and_its_stream_forgotten(redis_url, redis_client, reference):
    r, pool = redis_client, "affinity-dead"
    await groups.ensure_groups(r, KS, pool)
    store = KVStore(1 << 30, 60)
    server, address = await _kv_server(store)
    stream = KS.pod_ready_stream(pool, "dec-dead", 0)
    try:
        await groups.ensure_group(r, stream, keys.DECODE_GROUP)
        await _offer(r, pool, store, address, reference, "left", "dec-dead", 2)
        # dec-dead read it (it is pending to it), then died: no heartbeat in the registry
        assert len(await groups.claim(r, [stream], keys.DECODE_GROUP, "dec-dead", 1, None)) == 1
        async with _Pod(_settings(redis_url, pool, 30_000), r, _paged(), "dec-b") as b:
            b.io.peers.ttl_s = 0.0
            b.io.peers.beat_ok("run")  # trusts a missing heartbeat as death at once
            got, deadline = 0, time.monotonic() + 10
            while not got and time.monotonic() < deadline:  # (room: the claim loop holds its tickets while it waits)
                got = await reclaim_pending(b.io)
                await asyncio.sleep(0.05)
            assert got == 1
            await _all_finished(r, ["left"])
            assert b.io.claims.pulled == 1 and b.io.claims.stealer.stolen == 0
            await reclaim_pending(b.io)  # the stream is empty now: forgotten
        assert not await r.exists(stream)
        assert not await r.sismember(KS.pod_ready_set(pool, 0), "dec-dead")
    finally:
        await server.stop(None)
