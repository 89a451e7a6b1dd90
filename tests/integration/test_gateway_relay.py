"""The gateway against a real Redis and a scripted worker, over real HTTP and gRPC on loopback.

The worker (a thread with its own event loop) does what prefill + decode do on the wire: it
claims admission entries through the `prefill` group and writes the request's tokens with
`token_stream.add_tokens` on pipelines: index 0 alone, then steps of three, re-publishing one index
(a duplicate the gateway must drop) and finishing with EOS ("stop") or at max_tokens ("length").
It honours the cancel key like a real worker. The gateway is served by uvicorn in a thread.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import grpc
import httpx
import openai
import pytest
import redis
import redis.asyncio as aioredis
import uvicorn
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.app import create_app
from gateway.settings import GatewaySettings
from tandem.redis_proc import free_port
from tandem_core import keys
from tandem_core.bus import admission, groups, registry, token_stream
from tandem_core.models import BYTE_EOS
from tandem_core.settings import RedisConfig
from tandem_core.types import GenerationRequest
from tandem_proto import generate_pb2, generate_pb2_grpc

KS = keys.KeySpace(1)  # a plain Redis: one key shard (a service builds its own from its settings)

OUT = "Hello, wörld ✓ from Tandem!"  # multi-byte characters split across byte tokens
OUT_IDS = list(OUT.encode())
DUP_AFTER = 5  # once index 4 is out, index 3 is published again (with a wrong token)


# ---------------------------------------------------------------- the scripted worker


async def _serve_one(r: aioredis.Redis, req: GenerationRequest) -> None:
    prompt = bytes(t for t in req.prompt_ids if t < 256).decode(errors="replace")
    rid = req.request_id
    if prompt.startswith("fail"):
        pipe = r.pipeline(transaction=False)
        token_stream.add_tokens(pipe, KS, rid, 0, [], "error", 60, 1000, error="engine exploded")
        await pipe.execute()
        return
    toks = OUT_IDS + ([] if req.ignore_eos else [BYTE_EOS])
    finish = "stop"
    if len(toks) > req.max_tokens:
        toks, finish = toks[: req.max_tokens], "length"
    delay = 0.2 if "slow" in prompt else 0.005  # "in": chat prompts are wrapped by a template
    steps = [toks[:1]] + [toks[i : i + 3] for i in range(1, len(toks), 3)]
    sent = 0
    for n, step in enumerate(steps):
        if await r.exists(KS.cancel_key(rid)):
            pipe = r.pipeline(transaction=False)
            token_stream.add_tokens(pipe, KS, rid, sent, [], "cancelled", 60, 1000)
            await pipe.execute()
            return
        pipe = r.pipeline(transaction=False)
        last = n == len(steps) - 1
        token_stream.add_tokens(pipe, KS, rid, sent, step, finish if last else None, 60, 1000)
        if sent < DUP_AFTER <= sent + len(step) and not last:
            token_stream.add_tokens(pipe, KS, rid, 3, [ord("X")], None, 60, 1000)  # duplicate index 3
        await pipe.execute()
        sent += len(step)
        await asyncio.sleep(delay)


async def _worker_loop(redis_url: str, pool: str, stop: threading.Event) -> None:
    r = aioredis.Redis.from_url(redis_url)
    await groups.ensure_groups(r, KS, pool)
    await registry.heartbeat(r, registry.WorkerInfo("prefill", "fake-prefill", 1, "127.0.0.1:1", 0, 0, 0), 30)
    adm = [KS.admission_stream(pool, p, 0) for p in keys.PRIORITIES]
    tasks: set[asyncio.Task] = set()
    while not stop.is_set():
        for c in await groups.claim(r, adm, keys.PREFILL_GROUP, "fake-1", count=8, block_ms=100):
            t = asyncio.create_task(_serve_one(r, GenerationRequest.from_json(c.fields["req"])))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
            await groups.ack(r, c.stream, keys.PREFILL_GROUP, c.entry_id)
    for t in list(tasks):
        t.cancel()
    await registry.deregister(r, "fake-prefill")
    await r.aclose()


# ---------------------------------------------------------------- fixtures


class Gateway:
    """uvicorn serving create_app(settings) in a thread, on free loopback ports."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.app = create_app(settings)
        cfg = uvicorn.Config(
            self.app, host="127.0.0.1", port=0, loop="asyncio", log_level="warning", timeout_graceful_shutdown=3
        )
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> "Gateway":
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "gateway did not start"
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.grpc_port = self.app.state.gateway.grpc_port
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive()


def _settings(redis_url: str, pool: str, **kw) -> GatewaySettings:
    return GatewaySettings(
        redis=RedisConfig(url=redis_url), host="127.0.0.1", port=0, grpc_port=0, pool=pool, model="tiny",
        direct_prefill_max_tokens=0, **kw,  # the fake worker reads the admission streams only
    )


@contextlib.contextmanager
def gateway_with_worker(redis_url: str, prefix: str, **kw):
    """A gateway on a fresh pool with the fake worker thread serving it; both stopped after."""
    pool = f"{prefix}-{uuid.uuid4().hex[:8]}"
    stop = threading.Event()
    worker = threading.Thread(target=lambda: asyncio.run(_worker_loop(redis_url, pool, stop)), daemon=True)
    worker.start()
    gw = Gateway(_settings(redis_url, pool, **kw)).start()
    try:
        yield gw
    finally:
        gw.stop()
        stop.set()
        worker.join(timeout=10)


@pytest.fixture(scope="module")
def cluster(redis_url):
    with gateway_with_worker(redis_url, "gw") as gw:
        yield gw


@pytest.fixture
def gateway_factory(redis_url):
    started: list[Gateway] = []

    def make(**kw) -> Gateway:
        gw = Gateway(_settings(redis_url, f"gw-{uuid.uuid4().hex[:8]}", **kw)).start()
        started.append(gw)
        return gw

    yield make
    for gw in started:
        gw.stop()


@pytest.fixture
def sync_redis(redis_url):
    r = redis.Redis.from_url(redis_url)
    yield r
    r.close()


def _client(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=30)


def _wait_key(r: redis.Redis, key: str, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if r.exists(key):
            return True
        time.sleep(0.05)
    return False


# ---------------------------------------------------------------- HTTP


def test_stream_and_nonstream_return_the_same_text(cluster):
    client = _client(cluster)
    full = client.completions.create(model="tiny", prompt="hello", max_tokens=64, temperature=0)
    assert full.choices[0].text == OUT
    assert full.choices[0].finish_reason == "stop"
    assert full.usage.prompt_tokens == 6  # BOS + 5 bytes
    assert full.usage.completion_tokens == len(OUT_IDS) + 1  # EOS counts, but is not text

    chunks = list(client.completions.create(
        model="tiny", prompt="hello", max_tokens=64, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == OUT
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(OUT_IDS) + 1


def test_sse_ids_are_token_indices_exactly_once(cluster):
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 64, "stream": True}
    ids, data = [], []
    with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line.startswith("id: "):
                ids.append(int(line[4:]))
            elif line.startswith("data: "):
                data.append(line[6:])
    assert ids == list(range(len(OUT_IDS) + 1))  # the duplicate index 3 is dropped
    assert data[-1] == "[DONE]"


def test_max_tokens_finishes_with_length(cluster):
    out = _client(cluster).completions.create(model="tiny", prompt="hello", max_tokens=5)
    assert out.choices[0].text == OUT.encode()[:5].decode()
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 5


def test_stop_string_truncates_and_cancels(cluster, sync_redis):
    client = _client(cluster)
    out = client.completions.create(model="tiny", prompt="slow stop", max_tokens=64, stop=["wörld", "zzz"])
    assert out.choices[0].text == "Hello, "
    assert out.choices[0].finish_reason == "stop"
    assert _wait_key(sync_redis, KS.cancel_key(out.id))
    # the same across stream chunk boundaries ("ö" is split over two byte tokens)
    chunks = list(client.completions.create(model="tiny", prompt="hello", max_tokens=64, stop="ö", stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "Hello, w"
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_client_disconnect_sets_cancel_key(cluster, sync_redis):
    body = {"model": "tiny", "prompt": "slow disconnect", "max_tokens": 64, "stream": True}
    with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=30) as resp:
        rid = resp.headers["x-request-id"]
        next(resp.iter_lines())  # the first token arrived; now hang up
    assert _wait_key(sync_redis, KS.cancel_key(rid))


def test_nonstream_client_disconnect_sets_cancel_key(cluster, sync_redis):
    rid_before = set(sync_redis.keys("tandem:*:tok:*"))
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{cluster.url}/v1/completions", json={"prompt": "slow gone", "max_tokens": 64}, timeout=0.6)
    new = [k.decode().rsplit(":", 1)[1] for k in set(sync_redis.keys("tandem:*:tok:*")) - rid_before]
    assert len(new) == 1
    assert _wait_key(sync_redis, KS.cancel_key(new[0]))


def test_worker_error_is_reported(cluster):
    client = _client(cluster)
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model="tiny", prompt="fail please", max_tokens=8)
    assert "engine exploded" in str(e.value)
    with pytest.raises(openai.APIError, match="engine exploded"):
        list(client.completions.create(model="tiny", prompt="fail please", max_tokens=8, stream=True))


def test_metrics_and_cluster_view(cluster):
    _client(cluster).completions.create(model="tiny", prompt="hello", max_tokens=64)
    text = httpx.get(f"{cluster.url}/metrics").text
    for name in ("tandem_ttft_seconds_count", "tandem_itl_seconds_count", "tandem_e2e_seconds_count",
                 "tandem_queue_seconds_count", "tandem_requests_running", "tandem_admission_backlog"):
        assert name in text
    assert 'tandem_requests_total{outcome="stop"}' in text
    view = httpx.get(f"{cluster.url}/admin/cluster").json()
    assert [w["id"] for w in view["workers"]] == ["fake-prefill"]
    assert {"role", "pid", "address", "slots", "free_slots", "held_kv_bytes", "heartbeat_age_s"} <= set(
        view["workers"][0]
    )
    assert view["model"]["name"] == "tiny"


def test_backlog_over_bound_is_429(gateway_factory, redis_url):
    gw = gateway_factory(admission_max_backlog=2, retry_after_s=3)

    async def fill() -> None:
        r = aioredis.Redis.from_url(redis_url)
        for i in range(3):
            req = GenerationRequest(request_id=f"filler-{uuid.uuid4().hex}", prompt_ids=[1], max_tokens=1)
            await admission.enqueue_request(r, KS, gw.app.state.gateway.settings.pool, req, maxlen=100)
        await r.aclose()

    asyncio.run(fill())
    resp = httpx.post(f"{gw.url}/v1/completions", json={"prompt": "hello"})
    assert resp.status_code == 429
    assert resp.headers["retry-after"] == "3"
    assert "backlog is 3" in resp.json()["error"]["message"]


def test_first_token_deadline_is_504(gateway_factory):
    gw = gateway_factory(first_token_timeout_s=0.5)  # no worker serves this pool
    t0 = time.monotonic()
    resp = httpx.post(f"{gw.url}/v1/completions", json={"prompt": "hello"}, timeout=30)
    assert resp.status_code == 504
    assert "first token" in resp.json()["error"]["message"]
    assert time.monotonic() - t0 < 10


# ---------------------------------------------------------------- gRPC


def test_grpc_generate_streams_the_same_tokens(cluster):
    with grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_port}") as ch:
        stub = generate_pb2_grpc.TandemStub(ch)
        resps = list(stub.Generate(generate_pb2.GenerateRequest(prompt="hello", max_tokens=64), timeout=30))
        assert [r.index for r in resps] == list(range(len(OUT_IDS) + 1))
        assert [r.token_id for r in resps] == OUT_IDS + [BYTE_EOS]
        assert "".join(r.text for r in resps) == OUT
        assert resps[-1].finish_reason == "stop" and resps[-1].prompt_tokens == 6
        assert all(r.finish_reason == "" for r in resps[:-1])

        ids = list(stub.Generate(generate_pb2.GenerateRequest(prompt_token_ids=[256, 104, 105], max_tokens=4)))
        assert "".join(r.text for r in ids) == "Hell" and ids[-1].finish_reason == "length"

        stopped = list(stub.Generate(generate_pb2.GenerateRequest(prompt="hello", stop=["wör"], max_tokens=64)))
        assert "".join(r.text for r in stopped) == "Hello, " and stopped[-1].finish_reason == "stop"


def test_grpc_bad_input_is_invalid_argument(cluster):
    with grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_port}") as ch:
        stub = generate_pb2_grpc.TandemStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(generate_pb2.GenerateRequest(prompt="hello", max_tokens=100000), timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "max_tokens" in e.value.details() and "4096" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(generate_pb2.GenerateRequest(prompt=""), timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(generate_pb2.GenerateRequest(prompt="x", model="gpt-9"), timeout=10))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_grpc_cancel_sets_cancel_key(cluster, sync_redis):
    with grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_port}") as ch:
        stub = generate_pb2_grpc.TandemStub(ch)
        rid = f"grpc-{uuid.uuid4().hex}"
        call = stub.Generate(generate_pb2.GenerateRequest(prompt="slow", max_tokens=64, request_id=rid), timeout=30)
        first = next(call)
        assert (first.request_id, first.index) == (rid, 0)
        call.cancel()
        assert _wait_key(sync_redis, KS.cancel_key(rid))
        with pytest.raises(grpc.RpcError) as e:  # a client-chosen id cannot be reused
            list(stub.Generate(generate_pb2.GenerateRequest(prompt="x", request_id=rid), timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "already in use" in e.value.details()


def test_grpc_health_is_serving(cluster):
    with grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for name in ("", "tandem.v1.Tandem"):
            resp = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING


# ---------------------------------------------------------------- the process


def test_main_serves_and_sigterm_finishes_open_streams(redis_url):
    pool, port = f"gw-{uuid.uuid4().hex[:8]}", free_port()
    stop = threading.Event()
    worker = threading.Thread(target=lambda: asyncio.run(_worker_loop(redis_url, pool, stop)), daemon=True)
    worker.start()
    env = dict(os.environ, TANDEM_GATEWAY_REDIS__URL=redis_url, TANDEM_GATEWAY_PORT=str(port), TANDEM_GATEWAY_MODEL="tiny",
               TANDEM_GATEWAY_DIRECT_PREFILL_MAX_TOKENS="0",
               TANDEM_GATEWAY_GRPC_PORT="0", TANDEM_GATEWAY_POOL=pool, TANDEM_GATEWAY_LOG_LEVEL="WARNING")
    proc = subprocess.Popen([sys.executable, "-m", "gateway"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith(f"gateway listening http=127.0.0.1:{port} grpc=127.0.0.1:"), line
        body = {"prompt": "slow", "max_tokens": 64, "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30) as resp:
            lines = resp.iter_lines()
            assert next(lines) == "id: 0"
            proc.send_signal(signal.SIGTERM)  # stop accepting, but let this stream finish
            rest = [x for x in lines if x]
        assert rest[-1] == "data: [DONE]"
        ids = [0] + [int(x[4:]) for x in rest if x.startswith("id: ")]
        assert ids == list(range(len(OUT_IDS) + 1))
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        stop.set()
        worker.join(timeout=10)
