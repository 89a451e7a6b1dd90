"""A Redis outage at the front door, with a real redis-server stopped and started again on its
port: a request sent while Redis is down waits, is enqueued exactly once when Redis is back and
is served; `/readyz` says degraded meanwhile; past `redis_hold_s` the client gets a 503 with
Retry-After; the enqueue itself is idempotent by request id."""
from __future__ import annotations

import asyncio
import threading
import time
import uuid

import httpx
import pytest
import redis
import redis.asyncio as aioredis

from tandem.redis_proc import RedisProcess
from tandem_core import keys
from tandem_core.bus import admission, registry
from tandem_core.types import GenerationRequest
from tests.integration.test_gateway_relay import OUT, Gateway, _settings, _worker_loop

KS = keys.KeySpace(1)  # a plain Redis: one key shard (a service builds its own from its settings)


@pytest.fixture
def own_redis():
    proc = RedisProcess(appendonly=True).start()
    try:
        yield proc
    finally:
        proc.close()


def restart_later(proc: RedisProcess, after_s: float) -> threading.Thread:
    def run():
        time.sleep(after_s)
        proc.start()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_request_sent_while_redis_is_down_waits_and_is_served(own_redis):
    pool = f"hold-{uuid.uuid4().hex[:8]}"
    gw = Gateway(_settings(own_redis.url, pool, redis_hold_s=20)).start()
    stop = threading.Event()
    worker = threading.Thread(target=lambda: asyncio.run(_worker_loop(own_redis.url, pool, stop)), daemon=True)
    try:
        # The worker's registration is on disk before the outage, so the gateway routes the held
        # request to the admission stream the worker reads (with no prefill pod registered it
        # would go to the decode pods' direct stream, which this worker does not read).
        asyncio.run(_register_fake_prefill(own_redis.url))
        own_redis.stop()
        assert httpx.get(gw.url + "/readyz", timeout=10).json()["status"] == "degraded"
        restarted = restart_later(own_redis, 1.5)
        t0 = time.monotonic()
        with httpx.Client(timeout=60) as c:
            def after_restart():
                restarted.join()
                worker.start()  # the scripted worker, once its Redis is back
            threading.Thread(target=after_restart, daemon=True).start()
            resp = c.post(gw.url + "/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 64})
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == OUT
        assert time.monotonic() - t0 >= 1.0  # it waited for Redis, it did not fail
        assert httpx.get(gw.url + "/readyz", timeout=10).json()["status"] == "ready"
        assert "tandem_requests_waiting_for_redis 0.0" in httpx.get(gw.url + "/metrics", timeout=10).text
    finally:
        stop.set()
        gw.stop()
        if worker.is_alive():
            worker.join(timeout=10)


async def _register_fake_prefill(url: str) -> None:
    r = aioredis.Redis.from_url(url)
    try:
        await registry.heartbeat(r, registry.WorkerInfo("prefill", "fake-prefill", 1, "127.0.0.1:1", 0, 0, 0), 60)
    finally:
        await r.aclose()


def test_past_the_hold_a_request_gets_503_with_retry_after(own_redis):
    gw = Gateway(_settings(own_redis.url, f"hold-{uuid.uuid4().hex[:8]}", redis_hold_s=1)).start()
    try:
        own_redis.stop()
        t0 = time.monotonic()
        resp = httpx.post(gw.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 4},
                          timeout=30)
        assert resp.status_code == 503 and resp.headers.get("Retry-After") == "1"
        assert "waited" in resp.json()["error"]["message"] and time.monotonic() - t0 >= 0.9
        time.sleep(1.1)  # longer than redis_hold_s into the outage: not ready any more
        assert httpx.get(gw.url + "/readyz", timeout=10).status_code == 503
    finally:
        gw.stop()


async def test_the_enqueue_is_idempotent_by_request_id(redis_url):
    r = aioredis.Redis.from_url(redis_url)
    pool = f"idem-{uuid.uuid4().hex[:8]}"
    req = GenerationRequest(f"req-{uuid.uuid4().hex[:6]}", [1, 2, 3], 4)
    try:
        first = await admission.enqueue(r, KS, pool, req, 1000)
        again = await admission.enqueue(r, KS, pool, req, 1000, pod="prefill-x")  # a retry, routed elsewhere
        assert first == again
        assert await r.xlen(KS.admission_stream(pool, "normal", 0)) == 1
        assert not await r.exists(KS.pod_admission_stream(pool, "normal", "prefill-x", 0))
        assert 0 < await r.ttl(KS.admitted_key(req.request_id)) <= admission.MARKER_TTL_S
        other = GenerationRequest(f"req-{uuid.uuid4().hex[:6]}", [1, 2, 3], 4)
        await admission.enqueue(r, KS, pool, other, 1000, pod="prefill-x")
        assert await r.sismember(KS.pod_streams_set(pool, 0), "prefill-x")
    finally:
        await r.aclose()


def test_sync_client_sees_the_marker(redis_url):
    """The marker is a plain string key holding the entry id (what keys.py documents)."""
    r = redis.Redis.from_url(redis_url)
    req = GenerationRequest(f"req-{uuid.uuid4().hex[:6]}", [5], 1)
    entry = asyncio.run(_enqueue_once(redis_url, req))
    assert r.get(KS.admitted_key(req.request_id)) == entry
    r.close()


async def _enqueue_once(url: str, req: GenerationRequest) -> bytes:
    r = aioredis.Redis.from_url(url)
    try:
        return await admission.enqueue(r, KS, f"idem-{uuid.uuid4().hex[:8]}", req, 1000)
    finally:
        await r.aclose()



@pytest.mark.parametrize("appendonly", [False, True])
async def test_admissions_a_restarted_redis_lost_are_enqueued_again_once(appendonly):
    """Redis restarted without persistence (every admission lost): the open ones are enqueued
    again, where they were routed; restarted from its AOF (nothing lost): none is enqueued twice.
    A request whose relay ended is not this gateway's to readmit."""
    from gateway.readmit import Readmitter

    proc = RedisProcess(appendonly=appendonly).start()
    r = aioredis.Redis.from_url(proc.url)
    pool = f"readmit-{uuid.uuid4().hex[:8]}"
    rm = Readmitter(lambda: r, KS, pool, 1000, grace_s=0.1)
    try:
        assert await rm.check() == 0  # the first look only learns the run_id
        reqs = [GenerationRequest(f"req-{i}-{uuid.uuid4().hex[:6]}", [1, 2, 3], 4) for i in range(3)]
        for q, pod in zip(reqs, (None, "prefill-x", None)):
            await admission.enqueue(r, KS, pool, q, 1000, pod=pod)
            rm.add(q, pod, False)
        rm.discard(reqs[2].request_id)  # its relay ended
        proc.stop()
        proc.start()  # a new run_id
        with pytest.raises(redis.exceptions.ConnectionError):
            await rm.check()  # the old connection is gone (the watch loop looks again next round)
        assert await rm.check() == (0 if appendonly else 2)
        shared = await r.xlen(KS.admission_stream(pool, "normal", 0))
        routed = await r.xlen(KS.pod_admission_stream(pool, "normal", "prefill-x", 0))
        assert (shared, routed) == ((2, 1) if appendonly else (1, 1))  # kept, or back once
        assert await r.sismember(KS.pod_streams_set(pool, 0), "prefill-x")
        assert await rm.check() == 0  # the same Redis again: nothing
    finally:
        await r.aclose()
        proc.close()


async def test_readmission_does_not_wait_a_round_for_the_connections_of_before():
    """The pool still holds connections from before the restart, each of which fails once when
    first used; readmission closes them and goes on at once instead of waiting for the next look."""
    from gateway.readmit import Readmitter

    proc = RedisProcess(appendonly=False).start()
    r = aioredis.Redis.from_url(proc.url)
    pool = f"readmit-{uuid.uuid4().hex[:8]}"
    rm = Readmitter(lambda: r, KS, pool, 1000, grace_s=0.1)
    try:
        await rm.check()
        req = GenerationRequest(f"req-{uuid.uuid4().hex[:6]}", [1, 2, 3], 4)
        await admission.enqueue(r, KS, pool, req, 1000)
        rm.add(req, None, False)
        await asyncio.gather(*[r.ping() for _ in range(4)])  # four idle connections in the pool
        proc.stop()
        proc.start()  # everything lost (no persistence)
        assert await rm._readmit_soon("after") == 1
        assert await r.xlen(KS.admission_stream(pool, "normal", 0)) == 1
    finally:
        await r.aclose()
        proc.close()
