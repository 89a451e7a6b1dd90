"""Cache-aware routing against a real Redis: `GatewayService` routes a prompt to the per-pod
admission stream of the prefill pod likeliest to hold its prefix (and adds the pod to the set in
the same transaction), falls back to the shared stream when that pod is busy, and counts every
per-pod entry, live pod's or dead pod's, in the admission backlog it bounds and reports."""
from __future__ import annotations

import json

import pytest

from gateway.auth import ANONYMOUS
from gateway.service import GatewayService
from gateway.settings import GatewaySettings
from gateway.validation import CompletionParams
from tandem_core import keys
from tandem_core.bus import admission, registry
from tandem_core.errors import AdmissionRejected
from tandem_core.settings import RedisConfig

KS = keys.KeySpace(1)  # a plain Redis: one key shard (a service builds its own from its settings)

POOL = "pr"
PROMPT = list(range(10, 10 + 40))  # 2 full blocks of 16 and a partial one


@pytest.fixture(autouse=True)
async def _no_workers_left(redis_client):
    """The registry is shared by all pools: leave no registered pod behind for later tests."""
    yield
    await redis_client.flushdb()


def _cache(queries: int = 0, hits: int = 0, computed: int = 0) -> dict:
    return {"pool": POOL, "prefix_cache": {"enabled": True, "block_size": 16, "queries": queries, "hits": hits,
                             "computed": computed, "bytes": 1024, "budget_bytes": 4096, "blocks": 2, "evicted": 0}}


async def _workers(r, *prefill: str, extra=None) -> None:
    for wid in prefill:
        await registry.heartbeat(r, registry.WorkerInfo("prefill", wid, 1, "127.0.0.1:1", extra=extra or _cache()), 30)
    await registry.heartbeat(r, registry.WorkerInfo("decode", "dec", 1, "127.0.0.1:2", 4, 0, extra=_cache()), 30)


def _svc(redis_url, r, **kw) -> GatewayService:
    s = GatewaySettings(redis=RedisConfig(url=redis_url), pool=POOL, model="tiny", direct_prefill_max_tokens=0,
                        cluster_view_ttl_s=0.01, **kw)
    svc = GatewayService(s)
    svc.redis = r
    return svc


async def _submit(svc: GatewayService, ids: list[int], priority: str = "normal") -> str:
    prep = await svc.prepare(CompletionParams(prompt_ids=ids, max_tokens=4, priority=priority))
    await svc.admission.submit(prep, fresh_id=True, api_key=ANONYMOUS)
    return prep.request.request_id


async def _pod_entries(r, pod: str, priority: str = "normal") -> list[str]:
    return [f[b"rid"].decode() for _, f in await r.xrange(KS.pod_admission_stream(POOL, priority, pod, 0))]


async def test_routed_entry_lands_in_the_pods_stream_and_set(redis_url, redis_client):
    r = redis_client
    await _workers(r, "pa", "pb")
    svc = _svc(redis_url, r)
    rid = await _submit(svc, PROMPT)
    members = {m.decode() for m in await r.smembers(KS.pod_streams_set(POOL, 0))}
    assert len(members) == 1
    pod = members.pop()
    assert await _pod_entries(r, pod) == [rid]
    _, fields = (await r.xrange(KS.pod_admission_stream(POOL, "normal", pod, 0)))[0]
    assert json.loads(fields[b"req"])["request_id"] == rid
    assert await r.xlen(KS.admission_stream(POOL, "normal", 0)) == 0
    # The same prefix, another tail: the same pod (learned), whatever the tail.
    rid2 = await _submit(svc, PROMPT[:32] + [7, 8, 9])
    assert await _pod_entries(r, pod) == [rid, rid2]
    text = svc.metrics.render().decode()
    assert 'tandem_prefix_route_total{reason="rendezvous"} 1.0' in text
    assert 'tandem_prefix_route_total{reason="prefix_hit"} 1.0' in text


async def test_busy_pod_sends_to_the_shared_stream(redis_url, redis_client):
    r = redis_client
    await _workers(r, "pa", "pb")
    svc = _svc(redis_url, r, prefix_route_max_backlog=2)
    rids = [await _submit(svc, PROMPT) for _ in range(3)]
    pod = (await r.smembers(KS.pod_streams_set(POOL, 0))).pop().decode()
    assert await _pod_entries(r, pod) == rids[:2]
    shared = await r.xrange(KS.admission_stream(POOL, "normal", 0))
    assert [f[b"rid"].decode() for _, f in shared] == rids[2:]
    assert 'tandem_prefix_route_total{reason="busy"} 1.0' in svc.metrics.render().decode()
    # Per priority: the pod's high stream is empty, so a high request goes to it.
    rid = await _submit(svc, PROMPT, priority="high")
    assert await _pod_entries(r, pod, "high") == [rid]


async def test_one_pod_or_no_cache_uses_the_shared_stream(redis_url, redis_client):
    r = redis_client
    await _workers(r, "solo")
    svc = _svc(redis_url, r)
    await _submit(svc, PROMPT)
    await _workers(r, "old1", "old2", extra={"kv_budget_bytes": 1})  # pods that publish no prefix cache
    await _workers(r, "other1", "other2", extra={**_cache(), "pool": "another"})  # another pool's pods
    await _submit(svc, PROMPT[:20])
    assert await r.xlen(KS.admission_stream(POOL, "normal", 0)) == 2
    assert not await r.exists(KS.pod_streams_set(POOL, 0))


async def test_backlog_counts_per_pod_entries_of_live_and_dead_pods(redis_url, redis_client):
    r = redis_client
    await _workers(r, "pa", "pb")
    svc = _svc(redis_url, r, admission_max_backlog=3)
    for i in range(2):
        await _submit(svc, [i + 3] * 33)
    await _submit(svc, list(range(5, 9)))  # short: the shared stream
    # A dead pod's undrained entry (it is in the set, not in the registry).
    req = (await svc.prepare(CompletionParams(prompt_ids=PROMPT, max_tokens=4))).request
    await admission.enqueue(r, KS, POOL, req, 100, pod="dead")
    got = await admission.read_backlog(r, KS, POOL, ["pa", "pb"])
    assert got.total == 4 and got.shared["normal"] == 1 and got.pods["dead"]["normal"] == 1
    assert sum(n["normal"] for n in got.pods.values()) == 3
    assert await admission.total_backlog(r, KS, POOL) == 4  # no known pods: all found through the set
    cluster = await svc.report.cluster()
    assert cluster["queues"]["admission_backlog"] == 4
    assert cluster["queues"]["pod_admission"]["dead"] == {"high": 0, "normal": 1}
    assert cluster["load"]["waiting"] == 4
    with pytest.raises(AdmissionRejected, match="admission backlog is 4"):  # per-pod entries count
        await _submit(svc, PROMPT)


async def test_prefix_cache_counters_and_cluster_section(redis_url, redis_client):
    r = redis_client
    await _workers(r, "pa", "pb", extra=_cache(queries=100, hits=60, computed=40))
    svc = _svc(redis_url, r)
    await svc.report.refresh_load()
    await _workers(r, "pa", extra=_cache(queries=150, hits=80, computed=70))
    svc.report.load_ts = -1e9
    await svc.report.refresh_load()
    text = svc.metrics.render().decode()
    # pa 150 + pb 100 queries (the decode pod's cache saw none); hits 80 + 60; computed 70 + 40.
    assert "vllm:prefix_cache_queries_total 250.0" in text and "vllm:prefix_cache_hits_total 140.0" in text
    assert "tandem_prefill_tokens_computed_total 110.0" in text
    section = (await svc.report.cluster())["prefix_cache"]
    assert {w["id"]: w["hit_rate"] for w in section["workers"]} == {"pa": 0.5333, "pb": 0.6, "dec": None}
    assert section["totals"]["bytes"] == 3 * 1024 and section["block_size_mismatch"] == []
    assert "vllm:prefix_cache_queries_total 250.0" in svc.metrics.render().decode()  # no double count
