"""The planner against a real Redis and a real gateway: the gateway's load reports become the
planner's observations, a decision is written where its mode says (Redis for `tandem local`,
the scale subresource for Kubernetes, recorded here), and every failure is a hold that says why."""
from __future__ import annotations

import asyncio
import json
import time
import uuid

import httpx
import pytest
import redis.asyncio as aioredis
from fastapi.testclient import TestClient

from planner.app import create_app
from planner.decide import Observation
from planner.kube import RecordingApi
from planner.service import PlannerService, build_connector, build_planner
from planner.settings import KubernetesConfig, PlannerSettings, RoleBounds, SLOConfig
from planner.signals import Signals
from tandem_core import keys, load_report
from tandem_core.bus import KeySpace, registry
from tandem_core.settings import RedisConfig
from tests.integration.test_gateway_relay import gateway_with_worker
from tests.unit.clock import Clock

T0 = time.time()  # report times: the gateway's clock, 10 s apart like the planner's fake one
PROFILE = {
    "format": "tandem-capacity-profile/v1", "model": "test",
    # slow prefill (0.5 s for 64 tokens) so a few requests a second need several prefill pods
    "prefill": {"points": [{"tokens": 16, "seconds": 0.2}, {"tokens": 64, "seconds": 0.5}]},
    "decode": {"slots": 4, "points": [{"batch": 1, "itl_s": 0.01}, {"batch": 4, "itl_s": 0.02}]},
}


@pytest.fixture
def profile_path(tmp_path):
    p = tmp_path / "profile.json"
    p.write_text(json.dumps(PROFILE))
    return str(p)


def settings(redis_url: str, pool: str, profile_path: str, **kw) -> PlannerSettings:
    return PlannerSettings(redis=RedisConfig(url=redis_url), pool=pool, profile_path=profile_path,
                           slo=SLOConfig(ttft_s=2.0, itl_s=0.05), scale_up_cooldown_s=0, scale_down_cooldown_s=0,
                           prefill=RoleBounds(max_replicas=6, deployment="rel-tandem-prefill"),
                           decode=RoleBounds(max_replicas=6, deployment="rel-tandem-decode"), **kw)


async def report(r, gid: str, admitted: float, prompt_tokens: float, finished: float, output_tokens: float,
                 now: float) -> None:
    await load_report.publish(r, gid, 1, {"admitted": admitted, "prompt_tokens": prompt_tokens, "finished": finished,
                                          "admitted_remote": admitted, "prompt_tokens_remote": prompt_tokens,
                                          "output_tokens": output_tokens, "ttft_sum": finished * 0.3,
                                          "ttft_count": finished, "itl_sum": output_tokens * 0.02,
                                          "itl_count": output_tokens}, ttl_s=30, now=now)


def test_a_gateway_reports_what_it_admitted_and_served(redis_url):
    async def reports() -> dict[str, dict]:
        r = aioredis.Redis.from_url(redis_url)
        try:
            return {x["id"]: x for x in await load_report.read(r)}
        finally:
            await r.aclose()

    with gateway_with_worker(redis_url, "plan") as gw:
        before = asyncio.run(reports())  # other tests' gateways report to this Redis too
        for i in range(3):
            resp = httpx.post(f"{gw.url}/v1/completions", json={"prompt": f"count me {i}", "max_tokens": 5}, timeout=30)
            assert resp.status_code == 200, resp.text
        deadline, mine = time.monotonic() + 10, []
        while not mine and time.monotonic() < deadline:
            time.sleep(0.2)
            mine = [x for gid, x in asyncio.run(reports()).items()
                    if x["admitted"] - before.get(gid, {}).get("admitted", 0) == 3 and x["finished"] >= 3]
    assert len(mine) == 1, "the gateway wrote no load report with its 3 requests"
    rep = mine[0]
    assert rep["output_tokens"] >= 3 and rep["prompt_tokens"] >= 3 * 2
    assert rep["ttft_count"] >= 3 and rep["ttft_sum"] > 0
    assert rep["admitted_remote"] == rep["admitted"]  # direct prefill is off in these gateways' settings


async def test_local_mode_decides_from_the_reports_and_writes_the_decision(redis_client, redis_url, profile_path):
    pool = f"plan-{uuid.uuid4().hex[:6]}"
    clock = Clock(100.0)
    s = settings(redis_url, pool, profile_path, mode="local", interval_s=10)
    svc = PlannerService(s, redis_client, clock=clock)

    async def beat(tokens: int) -> None:  # a decode pod of this pool, as its heartbeat says
        await registry.heartbeat(redis_client, registry.WorkerInfo(
            "decode", f"{pool}-d0", 7, "127.0.0.1:1", 4, 4, extra={"pool": pool, "tokens": tokens}), 30)

    await report(redis_client, "gw-a", 0, 0, 0, 0, now=T0)
    await beat(100)
    d = await svc.tick()
    assert d.held.startswith("first interval") and svc.metrics.held._value.get() == 1
    clock.t += 10
    # 40 requests of 64 tokens in 10 s: 4 req/s x 0.5 s / 0.8 = 2.5 -> 3 prefill pods (plus the margin)
    await report(redis_client, "gw-a", 40, 40 * 64, 40, 40 * 20, now=T0 + 10)
    await beat(300)
    d = await svc.tick()
    assert svc.history[-1]["observed"]["decoded_tokens_per_s"] == pytest.approx(20.0)
    assert not d.held and d.prefill >= 3 and d.decode >= 1, d
    got = await redis_client.hgetall(keys.planner_decision_key(pool))
    assert int(got[b"prefill"]) == d.prefill and int(got[b"decode"]) == d.decode
    assert svc.history[-1]["observed"]["arrivals"] == 40
    assert svc.history[-1]["observed"]["prompt_tokens_mean"] == 64
    # the next tick reads the replicas back from Redis, not from the live pods (none here)
    assert await svc.connector.current({"prefill": 0, "decode": 0}) == {"prefill": d.prefill, "decode": d.decode}


def paged_kv(blocks_total: int, blocks_free: int, reserve_blocks: int = 1, block_size: int = 16) -> dict:
    """A paged decode pod's `extra.kv`, as decode_svc/blocks.py `BlockBudget.summary()` writes it."""
    return {"layout": "paged", "block_size": block_size, "blocks_total": blocks_total, "blocks_free": blocks_free,
            "blocks_used": blocks_total - blocks_free, "reserve_blocks": reserve_blocks}


async def test_decode_pods_kv_from_their_heartbeats_bounds_the_decode_batch(redis_client, redis_url, profile_path):
    """The live decode pods' heartbeats (real registry entries) become the observation's KV
    capacity: the smallest pool of the pool's live, non-draining decode pods. Long requests on it
    bound the batch below the ITL target's, and the decision, its notes, /decision and the gauges
    say so."""
    pool = f"plan-{uuid.uuid4().hex[:6]}"
    clock = Clock(100.0)
    svc = PlannerService(settings(redis_url, pool, profile_path, mode="local", interval_s=10), redis_client, clock=clock)

    async def beat(wid: str, role: str, slots: int, free: int, kv: dict | None = None, draining: bool = False,
                   in_pool: str = pool) -> None:
        extra = {"pool": in_pool, "tokens": 0, **({"kv": kv} if kv else {})}
        await registry.heartbeat(redis_client, registry.WorkerInfo(role, f"{pool}-{wid}", 7, "127.0.0.1:1", slots, free,
                                                                   draining=draining, extra=extra), 30)

    async def beat_all() -> None:
        await beat("d0", "decode", 8, 2, paged_kv(256, 64))
        await beat("d1", "decode", 8, 8, paged_kv(128, 128))  # the smallest live pool: what is planned with
        await beat("d2", "decode", 8, 8, paged_kv(16, 16), draining=True)  # takes no work: not counted
        await beat("x0", "decode", 8, 8, paged_kv(8, 8), in_pool="another-pool")
        await beat("p0", "prefill", 1, 1)

    await beat_all()
    await report(redis_client, "gw-a", 0, 0, 0, 0, now=T0)
    assert (await svc.tick()).held.startswith("first interval")
    clock.t += 10
    # 40 requests of 64 prompt tokens and 1400 output tokens: a running one holds 64 + 700 = 764
    # positions, 48 blocks + 1 of reserve; 128 blocks hold 2 of them, the ITL target allows 4
    await report(redis_client, "gw-a", 40, 40 * 64, 40, 40 * 1400, now=T0 + 10)
    await beat_all()
    d = await svc.tick()
    assert not d.held, d
    kv = svc.history[-1]["observed"]["kv"]
    assert kv == {"layout": "paged", "rows": 8, "block_size": 16, "blocks_total": 128, "reserve_blocks": 1,
                  "used": pytest.approx((0.75 + 0.0) / 2), "pods": 2}
    assert svc.history[-1]["decode_batch"] == {"itl": 4, "kv": 2, "size": 2, "kv_bound": True, "positions": 764.0}
    assert "decode: KV holds 2 sequences of ~764 positions per pod, below the 4 the ITL target allows" in d.notes
    metrics = svc.metrics.render().decode()
    assert 'tandem_planner_decode_batch{bound="kv"} 2.0' in metrics
    assert 'tandem_planner_decode_batch{bound="itl"} 4.0' in metrics
    assert 'tandem_planner_decode_kv{field="blocks_total"} 128.0' in metrics
    # the same load sized by the ITL target alone (no capacity known) asks for fewer decode pods
    obs = Observation(t=0, interval_s=10, arrivals=40, prompt_tokens_mean=64, output_tokens_mean=1400)
    itl_only = build_planner(svc.s, svc.profile).step(obs, {"prefill": 1, "decode": 1})
    assert itl_only.decode_batch.kv is None and d.wanted_decode > itl_only.wanted_decode


async def test_slot_pods_publish_rows_and_no_decode_pod_means_no_capacity(redis_client, redis_url, profile_path):
    pool = f"plan-{uuid.uuid4().hex[:6]}"
    sig = Signals(redis_client, KeySpace(1), pool)
    await registry.heartbeat(redis_client, registry.WorkerInfo("prefill", f"{pool}-p0", 7, "127.0.0.1:1", 1, 1,
                                                               extra={"pool": pool}), 30)
    assert (await sig.pods()).kv is None  # no decode pod: the planner sizes decode by ITL alone
    await registry.heartbeat(redis_client, registry.WorkerInfo("decode", f"{pool}-d0", 7, "127.0.0.1:1", 3, 2,
                                                               extra={"pool": pool, "tokens": 5}), 30)
    got = (await sig.pods()).kv
    assert got is not None and (got.layout, got.rows, got.blocks_total, got.pods) == ("slots", 3, 0, 1)
    assert got.used == pytest.approx(1 / 3)


async def test_kubernetes_mode_patches_the_scale_subresource_only_as_leader(redis_client, redis_url, profile_path, tmp_path):
    pool = f"plan-{uuid.uuid4().hex[:6]}"
    clock = Clock(time.time())
    rec = tmp_path / "sent.jsonl"
    s = settings(redis_url, pool, profile_path, mode="kubernetes", interval_s=10,
                 kubernetes=KubernetesConfig(namespace="ns", identity="planner-a", record_file=str(rec)))
    api = RecordingApi(str(rec), replicas={"rel-tandem-prefill": 1, "rel-tandem-decode": 1})
    other = RecordingApi(store=api.store)
    svc = PlannerService(s, redis_client, connector=build_connector(s, redis_client, clock=clock, api=api), clock=clock)
    s_b = s.model_copy(update={"kubernetes": KubernetesConfig(namespace="ns", identity="planner-b")})
    svc_b = PlannerService(s_b, redis_client, connector=build_connector(s_b, redis_client, clock=clock, api=other),
                           clock=clock)
    await report(redis_client, "gw-a", 0, 0, 0, 0, now=T0)
    await svc.tick()
    await svc_b.tick()
    clock.t += 10
    await report(redis_client, "gw-a", 40, 40 * 64, 40, 40 * 20, now=T0 + 10)
    d = await svc.tick()
    d_b = await svc_b.tick()
    assert not d.held and d.prefill >= 3
    assert d_b.held.startswith("not the leader")
    sent = [json.loads(line) for line in rec.read_text().splitlines()]
    patches = [c for c in sent if c["verb"] == "PATCH"]
    assert {c["path"] for c in patches} >= {"/apis/apps/v1/namespaces/ns/deployments/rel-tandem-prefill/scale"}
    assert {"spec": {"replicas": d.prefill}} in [c["body"] for c in patches]
    assert not [c for c in other.calls if c["verb"] == "PATCH"]
    assert api.store["scale"]["rel-tandem-prefill"] == d.prefill


async def test_bad_profile_missing_signals_and_redis_down_hold(redis_client, redis_url, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**PROFILE, "decode": {"slots": 4, "points": [{"batch": 9, "itl_s": 0.01}]}}))
    pool = f"plan-{uuid.uuid4().hex[:6]}"
    svc = PlannerService(settings(redis_url, pool, str(bad), mode="local"), redis_client, clock=Clock())
    d = await svc.tick()
    assert "past decode.slots" in d.held and svc.metrics.held._value.get() == 1
    assert not await redis_client.exists(keys.planner_decision_key(pool))

    missing = PlannerService(settings(redis_url, pool, str(tmp_path / "nope.json")), redis_client, clock=Clock())
    assert "no such file" in (await missing.tick()).held

    good = tmp_path / "good.json"
    good.write_text(json.dumps(PROFILE))
    clock = Clock()
    quiet = PlannerService(settings(redis_url, pool, str(good)), redis_client, clock=clock)
    await redis_client.delete(keys.GATEWAYS)  # no gateway reports at all
    await quiet.tick()
    clock.t += 10
    assert (await quiet.tick()).held.startswith("no gateway")

    down = aioredis.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.5)
    gone = PlannerService(settings("redis://127.0.0.1:1/0", pool, str(bad)), down, clock=Clock())
    assert (await gone.tick()).held.startswith("Redis unreachable")
    assert gone.last is None and gone.metrics.held._value.get() == 1  # nothing to publish: not a made-up 0
    await down.aclose()


def test_http_endpoints(redis_url, profile_path):
    pool = f"plan-{uuid.uuid4().hex[:6]}"
    s = settings(redis_url, pool, profile_path, interval_s=0.2)
    with TestClient(create_app(s)) as c:
        deadline = time.monotonic() + 5
        while c.get("/keda").status_code != 200:
            assert time.monotonic() < deadline, "no first decision"
            time.sleep(0.05)
        keda = c.get("/keda").json()
        assert set(keda) == {"prefill", "decode", "held"} and keda["prefill"]["replicas"] >= 1
        assert c.get("/healthz").json() == {"status": "ok"}
        assert "tandem_planner_holding" in c.get("/metrics").text
        assert c.get("/decision").json()["history"]
