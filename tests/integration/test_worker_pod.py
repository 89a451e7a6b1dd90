"""The worker skeleton (tandem_core/worker_pod.py) on a real gRPC server and a real Redis: health
stays NOT_SERVING until `ready`, heartbeats carry `draining` once `drain` runs, and `close` takes
the registry entry away."""
from __future__ import annotations

import asyncio
import os

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem_core.bus import registry
from tandem_core.lifecycle import PeerJudge
from tandem_core.settings import GrpcConfig, RedisConfig, WorkerSettings
from tandem_core.worker_pod import WorkerPod

SERVICE = "tandem.v1.Test"


async def _health(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as ch:
        reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5)
        return reply.status


async def _entry(r, worker_id: str) -> dict | None:
    return next((w for w in await registry.list_workers(r) if w["id"] == worker_id), None)


async def _until(pred, timeout_s: float = 10.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        got = await pred()
        if got:
            return got
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_ready_drain_and_close(redis_url):
    import redis.asyncio as aioredis

    s = WorkerSettings(redis=RedisConfig(url=redis_url), grpc=GrpcConfig(host="127.0.0.1", port=0),
                       heartbeat_interval_s=0.1)
    r = aioredis.Redis.from_url(redis_url)
    pod = WorkerPod(s, r, [SERVICE])
    address = pod.bind()
    assert address.startswith("127.0.0.1:") and not address.endswith(":0")
    await pod.start()
    wid = f"pod-test-{os.getpid()}"
    pod.beat(lambda: registry.WorkerInfo(role="prefill", id=wid, pid=os.getpid(), address=address,
                                         draining=pod.draining), PeerJudge(3.0))
    try:
        assert await _health(address) == health_pb2.HealthCheckResponse.NOT_SERVING  # not ready yet
        first = await _until(lambda: _entry(r, wid))
        assert first["address"] == address and not first["draining"]
        await pod.ready()
        assert await _health(address) == health_pb2.HealthCheckResponse.SERVING
        pod.stop.set()  # what SIGTERM does
        await pod.drain()
        assert await _health(address) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert (await _until(lambda: _draining(r, wid)))["draining"]
    finally:
        await pod.close(grace_s=0.1)
    check = aioredis.Redis.from_url(redis_url)
    try:
        assert await _entry(check, wid) is None  # deregistered, not left to expire
    finally:
        await check.aclose()


async def _draining(r, wid: str) -> dict | None:
    e = await _entry(r, wid)
    return e if e and e["draining"] else None


async def test_a_supervised_task_that_dies_stops_the_pod_loudly(redis_url, caplog):
    """Issue 42 (5): a long-lived loop of a pod (the decode pod's claim loop, the prefill loop)
    that dies of an error must not leave the pod heartbeating and SERVING while it claims nothing:
    health goes NOT_SERVING at once, `stop` is set (the pod drains and exits non-zero: `failed`)."""
    import redis.asyncio as aioredis

    s = WorkerSettings(redis=RedisConfig(url=redis_url), grpc=GrpcConfig(host="127.0.0.1", port=0),
                       heartbeat_interval_s=0.1)
    r = aioredis.Redis.from_url(redis_url)
    pod = WorkerPod(s, r, [SERVICE])
    address = pod.bind()
    await pod.start()
    await pod.ready()
    go = asyncio.Event()

    async def claim_loop() -> None:
        await go.wait()
        raise RuntimeError("a bug in the loop")

    try:
        task = pod.supervise(asyncio.create_task(claim_loop()), "the claim loop")
        assert await _health(address) == health_pb2.HealthCheckResponse.SERVING
        go.set()
        await asyncio.gather(task, return_exceptions=True)
        await _until(lambda: _not_serving(address))
        assert pod.stop.is_set() and pod.failed == ["the claim loop: RuntimeError: a bug in the loop"]
        assert "the claim loop failed" in caplog.text
    finally:
        await pod.close(grace_s=0.1)


async def _not_serving(address: str) -> bool:
    return await _health(address) == health_pb2.HealthCheckResponse.NOT_SERVING
