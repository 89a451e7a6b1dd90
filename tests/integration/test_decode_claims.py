"""A decode worker never claims more ready entries than it has free slots (real Redis, real gRPC
KV server, real engine). Sampled from Redis while a backlog of 12 ready notices waits for 2 slots.
It counts the KV bytes it pulled (`pulled_kv_bytes`)."""
from __future__ import annotations

import asyncio
import contextlib

import pytest

from decode_svc.bridge import Bridge
from decode_svc.io import DecodeIO
from decode_svc.loop import EngineLoop
from decode_svc.requests import RequestTable
from decode_svc.settings import DecodeSettings
from prefill_svc.kv_store import KVStore
from prefill_svc.service import KVTransferServicer
from tandem_core import grpc_util, keys
from tandem_core.bus import groups, ready
from tandem_core.settings import EngineConfig, RedisConfig
from tandem_core.types import GenerationRequest, SamplingParams
from tandem_engine import load_engine
from tandem_proto import kv_pb2_grpc

KS = keys.KeySpace(1)  # a plain Redis: one key shard (a service builds its own from its settings)

SLOTS = 2
N = 12
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def engine():
    return load_engine("tiny", slots=SLOTS, max_len=64, prefill_buckets=(16,))


async def _kv_server(store):
    server = grpc_util.make_server(8 << 20)
    kv_pb2_grpc.add_KVTransferServicer_to_server(KVTransferServicer(store, 1 << 16, lambda _r: None), server)
    port = grpc_util.bind(server, "127.0.0.1", 0)
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _publish_backlog(r, engine, store, address, pool):
    for i in range(N):
        req = GenerationRequest(f"req-{i}", [256, 65 + i, 66], MAX_TOKENS, SamplingParams(), ignore_eos=True)
        payload = engine.export_prefix(engine.prefill(req.prompt_ids, req.sampling))
        held = store.put(req.request_id, payload)
        notice = ready.ReadyNotice(req, address, held.capability, payload.nbytes, "p0", payload.first_token)
        pipe = r.pipeline(transaction=False)  # as the prefill pod writes it (without its fence)
        ready.add_ready(pipe, KS, pool, notice, 1000)
        groups.ring(pipe, KS, pool, keys.DECODE_GROUP)
        await pipe.execute()


@contextlib.asynccontextmanager
async def _claiming_pod(redis_url, r, engine, pool: str, worker_id: str, server):
    """A decode pod's claim loop, publisher and engine loop over `engine`, running until the block
    ends; then stopped, with the KV `server` too."""
    s = DecodeSettings(redis=RedisConfig(url=redis_url), engine=EngineConfig(model="tiny", max_len=64),
                       pool=pool, slots=SLOTS, claim_block_ms=50)
    table = RequestTable(SLOTS)
    bridge = Bridge(SLOTS, 64, asyncio.get_running_loop())
    eloop = EngineLoop(engine, table, bridge)
    io = DecodeIO(s, r, KS, table, eloop, bridge, worker_id)
    stop, done = asyncio.Event(), asyncio.Event()
    eloop.start()
    tasks = [asyncio.create_task(io.claims.claim_loop(stop)), asyncio.create_task(io.publisher.publish_loop(done))]
    try:
        yield io
    finally:
        stop.set()
        await tasks[0]
        eloop.stop()
        done.set()
        await tasks[1]
        await io.puller.close()
        await server.stop(None)


async def _claimed_unacked(r, pool) -> int:
    """Ready entries delivered to the pod and not yet acked (acked = inserted into a slot)."""
    return (await r.xpending(KS.ready_stream(pool, 0), keys.DECODE_GROUP))["pending"]


async def test_decode_claims_at_most_free_slots(redis_url, redis_client, engine):
    r = redis_client
    pool = "claims"
    await groups.ensure_groups(r, KS, pool)
    store = KVStore(1 << 30, 60)
    server, address = await _kv_server(store)
    await _publish_backlog(r, engine, store, address, pool)

    peak_redis = peak_table = 0
    async with _claiming_pod(redis_url, r, engine, pool, "decode-test", server) as io:
        table = io.table
        for _ in range(400):
            peak_table = max(peak_table, table.used + table.pending)
            peak_redis = max(peak_redis, await _claimed_unacked(r, pool))
            finished = 0
            for i in range(N):
                last = await r.xrevrange(KS.token_stream(f"req-{i}"), count=1)
                finished += bool(last and b"f" in last[0][1])
            if finished == N:
                break
            await asyncio.sleep(0.02)
        assert finished == N, f"only {finished}/{N} requests finished"
    # The pod's own accounting (running + on their way to a slot) and what Redis saw delivered.
    assert 1 <= peak_table <= SLOTS
    assert peak_redis <= SLOTS, f"decode claimed {peak_redis} ready entries with {SLOTS} slots"
    # Every request produced indices 1..MAX_TOKENS-1 exactly once, in order.
    for i in range(N):
        entries = await r.xrange(KS.token_stream(f"req-{i}"))
        assert [int(f[b"i"]) for _id, f in entries] == list(range(1, MAX_TOKENS))
    assert store.held_bytes == 0
    # Every pull counted its KV bytes (bench/kv_capacity.py reads them from the heartbeat).
    one = engine.export_prefix(engine.prefill([256, 65, 66], SamplingParams())).nbytes
    assert io.claims.pulled == N
    assert io.claims.pulled_kv_bytes == N * one, f"{io.claims.pulled_kv_bytes} KV bytes counted for {N} pulls of {one}"


async def test_a_superseded_ready_notice_is_acked_without_a_resume(redis_url, redis_client, engine):
    """Two ready notices for one request: the first one's KV was replaced by a later prefill of the
    same request (a resume, or its admission entry prefilled again), so the prefill pod refuses
    its capability. That notice is stale: acked with no resume (a resume would enqueue the request
    a second time and spend one of its attempts: CI saw a request fail with "request failed 3
    times (... wrong capability ...)"); the later notice serves the request, each token once."""
    r = redis_client
    pool = "superseded"
    await groups.ensure_groups(r, KS, pool)
    store = KVStore(1 << 30, 60)
    server, address = await _kv_server(store)
    req = GenerationRequest("req-stale", [256, 70, 71], MAX_TOKENS, SamplingParams(), ignore_eos=True)
    payload = engine.export_prefix(engine.prefill(req.prompt_ids, req.sampling))
    stale = store.put(req.request_id, payload).capability
    later = store.put(req.request_id, payload).capability  # replaces the first (prefill_svc/kv_store.py)
    for cap in (stale, later):
        notice = ready.ReadyNotice(req, address, cap, payload.nbytes, "p0", payload.first_token)
        pipe = r.pipeline(transaction=False)
        ready.add_ready(pipe, KS, pool, notice, 1000)
        groups.ring(pipe, KS, pool, keys.DECODE_GROUP)
        await pipe.execute()

    async with _claiming_pod(redis_url, r, engine, pool, "decode-stale", server) as io:
        for _ in range(400):
            last = await r.xrevrange(KS.token_stream(req.request_id), count=1)
            if last and b"f" in last[0][1] and io.claims.superseded:
                break
            await asyncio.sleep(0.02)
    assert io.claims.superseded == 1 and io.claims.pulled == 1
    admitted = [await r.xlen(KS.admission_stream(pool, prio, 0)) for prio in keys.PRIORITIES]
    assert admitted == [0, 0], f"a stale notice was resumed: admission streams hold {admitted}"
    entries = await r.xrange(KS.token_stream(req.request_id))
    assert [int(f[b"i"]) for _id, f in entries] == list(range(1, MAX_TOKENS))
    assert (await r.xpending(KS.ready_stream(pool, 0), keys.DECODE_GROUP))["pending"] == 0
    assert store.held_bytes == 0
