"""Admission's shared Redis work (gateway/batching.py), on the plain Redis and on the Redis Cluster:
hundreds of concurrent enqueues go out in a few pipelines from one writer, each request getting
its own entry id (idempotent by request id, as one enqueue is), one request's script error stays
its own, and concurrent reads of the same thing share the one in flight."""
from __future__ import annotations

import asyncio

import pytest
from redis.exceptions import ResponseError

from gateway.batching import EnqueueBatcher, SingleFlight
from tandem_core import keys

KS = keys.KeySpace(1)
from tandem_core.types import GenerationRequest, SamplingParams

POOL = "batching"


def _req(rid: str) -> GenerationRequest:
    return GenerationRequest(rid, [1, 2, 3], 4, SamplingParams())


async def test_a_burst_of_enqueues_goes_out_in_few_pipelines(any_redis):
    r = any_redis
    batcher = EnqueueBatcher(lambda: r, KS, POOL, 10_000, max_batch=64)
    reqs = [_req(f"burst-{i}") for i in range(300)]
    ids = await asyncio.gather(*(batcher.enqueue(q, None, i % 2 == 0) for i, q in enumerate(reqs)))
    assert all(isinstance(x, bytes) for x in ids)
    assert batcher.batches <= 300 // 64 + 2, batcher.batches  # the first alone, then full pipelines
    # each entry is its own request's, in the stream its route chose (ids are per stream)
    for i, (q, entry_id) in enumerate(zip(reqs, ids)):
        shard = KS.request_shard(q.request_id)
        stream = KS.direct_stream(POOL, shard) if i % 2 == 0 else KS.admission_stream(POOL, q.priority, shard)
        (got_id, fields), = await r.xrange(stream, entry_id, entry_id)
        assert fields[b"rid"] == q.request_id.encode()
    # idempotent by request id, as `admission.enqueue` is: the same id again writes nothing
    again = await asyncio.gather(*(batcher.enqueue(q, None, i % 2 == 0) for i, q in enumerate(reqs[:50])))
    assert again == ids[:50]


async def test_one_requests_error_is_its_own(any_redis):
    r = any_redis
    batcher = EnqueueBatcher(lambda: r, KS, POOL, 10_000)
    bad = _req("batch-bad")
    await r.set(KS.direct_stream(POOL, KS.request_shard(bad.request_id)), "not a stream")
    good = [_req(f"batch-good-{i}") for i in range(20)]  # to the admission streams: fine
    out = await asyncio.gather(*(batcher.enqueue(q, None, q is bad) for q in [*good[:10], bad, *good[10:]]),
                               return_exceptions=True)
    assert isinstance(out[10], ResponseError) and "WRONGTYPE" in str(out[10]), out[10]
    assert all(isinstance(x, bytes) for i, x in enumerate(out) if i != 10), out


async def test_concurrent_reads_share_the_one_in_flight():
    flight: SingleFlight = SingleFlight()
    started = asyncio.Event()
    release = asyncio.Event()

    async def read():
        started.set()
        await release.wait()
        return flight.calls

    waiting = [asyncio.ensure_future(flight("k", read)) for _ in range(100)]
    await started.wait()
    release.set()
    assert await asyncio.gather(*waiting) == [1] * 100  # one call, its answer for all
    assert await flight("k", read) == 2  # the next read after it landed is a new one

    async def boom():
        raise ConnectionError("down")

    with pytest.raises(ConnectionError):
        await asyncio.gather(flight("e", boom), flight("e", boom))
