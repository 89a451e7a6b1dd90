"""One relay's attachment against a real Redis, through `GatewayService` without HTTP: `submit`
returns an `Attachment` (gateway/attachment.py) holding the per-key lease and the admission entry
id of the request it enqueued; `stream` relays the tokens, takes the queue time from that entry id
and releases the lease once; a resumable request's `reattach` is a new attachment (its number
counted in Redis) that replays the same text and holds no lease. The validated request itself is
the one object throughout."""
from __future__ import annotations

import dataclasses

import pytest

from gateway.resume import StreamMeta
from gateway.service import GatewayService, RequestNotFound
from gateway.settings import GatewaySettings
from gateway.tokens import TokenMux
from gateway.validation import CompletionParams
from tandem_core import keys
from tandem_core.bus import token_stream
from tandem_core.errors import AdmissionRejected
from tandem_core.settings import RedisConfig

KS = keys.KeySpace(1)  # a plain Redis: one key shard (a service builds its own from its settings)

POOL = "att"


@pytest.fixture
async def svc(redis_url, redis_client):
    s = GatewaySettings(redis=RedisConfig(url=redis_url), pool=POOL, model="tiny", max_concurrent_requests_per_key=1,
                        relay_block_ms=50)
    g = GatewayService(s)
    g.redis, g.mux = redis_client, TokenMux(redis_client, KS, block_ms=50)
    g.mux.start()
    try:
        yield g
    finally:
        await g.mux.stop()
        await g.streaming.drain()


async def _worker_writes(r, rid: str, text: bytes, finish: str = "length") -> None:
    pipe = r.pipeline(transaction=False)
    token_stream.add_tokens(pipe, KS, rid, 0, list(text), finish, 30, 100)
    await pipe.execute()


def _queue_count(svc: GatewayService) -> str:
    line = next(x for x in svc.metrics.render().decode().splitlines() if x.startswith("tandem_queue_seconds_count"))
    return line.split()[-1]


async def test_submit_holds_the_lease_and_entry_id_and_the_relay_releases_it(svc, redis_client):
    r = redis_client
    prep = await svc.prepare(CompletionParams(prompt="hi", max_tokens=2))
    att = await svc.admission.submit(prep, fresh_id=True, api_key="k")
    rid = prep.request.request_id
    assert att.prep is prep and att.request_id == rid and att.attach_no == 0
    (entry_id, fields), = await r.xrange(KS.direct_stream(POOL, 0))  # no prefill pods: the decode pods
    assert att.entry_id == entry_id and fields[b"rid"].decode() == rid
    assert att.lease is not None and svc.admission.limiter.in_flight("k") == 1
    again = await svc.prepare(CompletionParams(prompt="hi", max_tokens=2))
    with pytest.raises(AdmissionRejected, match="1 concurrent"):  # the lease is held until the relay ends
        await svc.admission.submit(again, fresh_id=True, api_key="k")

    await _worker_writes(r, rid, b"ok")
    deltas = [d async for d in svc.streaming.stream(att)]
    assert "".join(d.text for d in deltas) == "ok" and deltas[-1].finish_reason == "length"
    assert att.lease.released and svc.admission.limiter.in_flight("k") == 0 and svc.streaming.open == 0
    assert _queue_count(svc) == "1.0"  # admission entry id -> first token entry id


async def test_reattach_is_a_new_attachment_that_replays_the_same_text(svc, redis_client):
    r = redis_client
    prep = await svc.prepare(CompletionParams(prompt="hi", max_tokens=3))
    rid = prep.request.request_id
    meta = StreamMeta("completion", rid, 0, prep.model, prep.prompt_tokens)
    prep = dataclasses.replace(prep, resumable=True, meta=meta)
    att = await svc.admission.submit(prep, fresh_id=True, api_key="k")
    await _worker_writes(r, rid, b"abc")
    first = [d.text async for d in svc.streaming.stream(att)]

    resumed = await svc.streaming.reattach(rid, "k")
    assert resumed.attach_no == 1 and resumed.lease is None and resumed.entry_id is None
    assert resumed.prep.replay and resumed.prep.resumable and resumed.prep.stop == prep.stop
    assert [d.text async for d in svc.streaming.stream(resumed)] == first == ["a", "b", "c"]
    assert (await svc.streaming.reattach(rid, "k")).attach_no == 2
    assert _queue_count(svc) == "1.0"  # a replay's timing says nothing about the cluster
    with pytest.raises(RequestNotFound):
        await svc.streaming.reattach(rid, "another key")
