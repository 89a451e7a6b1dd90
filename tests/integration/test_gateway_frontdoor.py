"""The front door against a real Redis and the scripted worker of test_gateway_relay.py, over real
HTTP and gRPC on loopback: chat completions through the official `openai` client (sync and
async), resumable streams (a resumed stream equals an unbroken one), the grace period, per-key
limits, and gRPC reflection."""
from __future__ import annotations

import asyncio
import json
import time

import grpc
import httpx
import openai
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from tests.integration.test_gateway_relay import (  # noqa: F401 - fixtures shared by import
    OUT, OUT_IDS, _wait_key, gateway_factory, gateway_with_worker, sync_redis,
)

from tandem_core import keys

KS = keys.KeySpace(1)  # a plain Redis: one key shard (a service builds its own from its settings)

N_TOKENS = len(OUT_IDS) + 1  # the text, then EOS


@pytest.fixture(scope="module")
def gw(redis_url):
    with gateway_with_worker(redis_url, "gwfd", resume_grace_s=0.6) as g:
        yield g


def _events(resp: httpx.Response, limit: int | None = None) -> list[tuple[int | None, str]]:
    """(id, data) of each SSE event, stopping after `limit` events that carry an id."""
    out, event_id, with_id = [], None, 0
    for line in resp.iter_lines():
        if line.startswith("id: "):
            event_id = int(line[4:])
        elif line.startswith("data: "):
            out.append((event_id, line[6:]))
            with_id += event_id is not None
            event_id = None
            if limit is not None and with_id >= limit:
                break
    return out


def _text(events: list[tuple[int | None, str]], kind: str) -> str:
    parts = []
    for _, data in events:
        if data == "[DONE]":
            continue
        for c in json.loads(data)["choices"]:
            parts.append(c["delta"].get("content", "") if kind == "chat" else c["text"])
    return "".join(parts)


def _body(kind: str, prompt: str, **kw) -> tuple[str, dict]:
    if kind == "chat":
        return "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": prompt}], **kw}
    return "/v1/completions", {"model": "tiny", "prompt": prompt, **kw}


# ---------------------------------------------------------------- chat through the openai client


def test_chat_with_the_openai_client_sync_and_async(gw):
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=30)
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}],
        max_tokens=64, temperature=0,
    )
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == OUT
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == N_TOKENS
    assert out.usage.prompt_tokens == 1 + len("<|system|>\nbe brief\n<|user|>\nhello\n<|assistant|>\n")

    async def streamed() -> list:
        aclient = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=30)
        stream = await aclient.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": [{"type": "text", "text": "hello"}]}],
            max_completion_tokens=64, stream=True, stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        await aclient.close()
        return chunks

    chunks = asyncio.run(streamed())
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == OUT
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == N_TOKENS


# ---------------------------------------------------------------- resumable streams


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_resumed_stream_equals_an_unbroken_one(gw, sync_redis, kind):
    opts = dict(max_tokens=64, stream=True, resumable=True, stream_options={"include_usage": True})
    path, body = _body(kind, "fast resume", **opts)
    with httpx.stream("POST", gw.url + path, json=body, timeout=30) as resp:
        unbroken = _events(resp)
    k = 8
    path, body = _body(kind, "slow resume", **opts)  # the same tokens, 0.2 s apart
    with httpx.stream("POST", gw.url + path, json=body, timeout=30) as resp:
        rid = resp.headers["x-request-id"]
        first = _events(resp, limit=k)  # ... then the connection drops
    assert json.loads(first[0][1])["id"] == rid  # the completion id is the request id
    time.sleep(0.1)  # the worker keeps going meanwhile (well within the grace period)
    with httpx.stream("GET", f"{gw.url}/v1/requests/{rid}/stream", headers={"Last-Event-ID": str(k - 1)},
                      timeout=30) as resp:
        assert resp.status_code == 200
        rest = _events(resp)
    resumed = first + rest
    assert [i for i, _ in resumed] == [i for i, _ in unbroken] == list(range(N_TOKENS)) + [None, None]
    assert _text(resumed, kind) == _text(unbroken, kind) == OUT
    assert json.loads(resumed[-2][1])["usage"]["completion_tokens"] == N_TOKENS
    time.sleep(0.2)  # past the first connection's grace period: nothing was cancelled
    assert not sync_redis.exists(KS.cancel_key(rid))

    with httpx.stream("GET", f"{gw.url}/v1/requests/{rid}/stream?from=20", timeout=30) as resp:
        tail = _events(resp)  # a finished stream can be replayed from any index
    assert [i for i, _ in tail] == list(range(20, N_TOKENS)) + [None, None]


def test_resumable_request_is_cancelled_after_the_grace_period(gateway_factory, sync_redis):
    g = gateway_factory(resume_grace_s=0.4)  # no worker: the request stays queued
    body = {"prompt": "hello", "max_tokens": 8, "stream": True, "resumable": True}
    with httpx.stream("POST", f"{g.url}/v1/completions", json=body, timeout=30) as resp:
        rid = resp.headers["x-request-id"]
    # a client resumes within the grace period: no cancel while it is attached
    with httpx.stream("GET", f"{g.url}/v1/requests/{rid}/stream", timeout=30) as resp:
        assert resp.status_code == 200
        time.sleep(0.8)
        assert not sync_redis.exists(KS.cancel_key(rid))
    assert _wait_key(sync_redis, KS.cancel_key(rid), timeout_s=5)  # ... it left: cancelled after the grace


def test_only_resumable_requests_of_the_same_key_resume(gateway_factory):
    g = gateway_factory(api_keys=["k1", "k2"])
    h1, h2 = {"Authorization": "Bearer k1"}, {"Authorization": "Bearer k2"}

    def start(resumable: bool) -> str:
        body = {"prompt": "hi", "max_tokens": 2, "stream": True, "resumable": resumable}
        with httpx.stream("POST", f"{g.url}/v1/completions", json=body, headers=h1, timeout=30) as resp:
            return resp.headers["x-request-id"]

    rid = start(True)
    assert httpx.get(f"{g.url}/v1/requests/{rid}/stream", headers=h2).status_code == 404  # another key
    assert httpx.get(f"{g.url}/v1/requests/{rid}/stream").status_code == 401
    with httpx.stream("GET", f"{g.url}/v1/requests/{rid}/stream", headers=h1, timeout=30) as resp:
        assert resp.status_code == 200
    plain = start(False)
    resp = httpx.get(f"{g.url}/v1/requests/{plain}/stream", headers=h1)
    assert resp.status_code == 404 and "resumable" in resp.json()["error"]["message"]


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_post_sent_again_with_its_request_id_is_replayed_not_run_twice(gw, sync_redis, kind):
    """A client that lost its POST unanswered (the gateway died) sends it again with the same
    X-Request-Id: a resumable one already admitted is replayed from its first event."""
    rid = f"client-chosen-{kind}"
    path, body = _body(kind, "resend me", max_tokens=64, stream=True, resumable=True)
    with httpx.stream("POST", gw.url + path, json=body, headers={"X-Request-Id": rid}, timeout=30) as resp:
        assert resp.status_code == 200 and resp.headers["x-request-id"] == rid
        first = _events(resp, limit=3)  # ... then the connection drops
    assert json.loads(first[0][1])["id"] == rid
    entries_before = sync_redis.xlen(KS.admission_stream("gwfd", "normal", 0))
    with httpx.stream("POST", gw.url + path, json=body, headers={"X-Request-Id": rid}, timeout=30) as resp:
        assert resp.status_code == 200
        again = _events(resp)
    assert [i for i, _ in again] == list(range(N_TOKENS)) + [None]  # the whole stream, from index 0
    assert _text(again, kind) == OUT
    assert sync_redis.xlen(KS.admission_stream("gwfd", "normal", 0)) <= entries_before  # not enqueued again
    whole = httpx.post(gw.url + path, json={**body, "stream": False}, headers={"X-Request-Id": rid}, timeout=30)
    assert whole.status_code == 200 and whole.json()["id"] == rid  # a whole-response resend replays too
    content = whole.json()["choices"][0]
    assert (content["message"]["content"] if kind == "chat" else content["text"]) == OUT

    plain = {**body, "resumable": False}  # without resumable the id may not be reused
    resp = httpx.post(gw.url + path, json=plain, headers={"X-Request-Id": rid}, timeout=30)
    assert resp.status_code == 400 and "already in use" in resp.json()["error"]["message"]
    bad = httpx.post(gw.url + path, json=body, headers={"X-Request-Id": "no spaces allowed"}, timeout=30)
    assert bad.status_code == 400 and "X-Request-Id" in bad.json()["error"]["message"]


# ---------------------------------------------------------------- per-key limits


def test_concurrent_requests_per_key_429(gateway_factory):
    g = gateway_factory(api_keys=["k1", "k2"], max_concurrent_requests_per_key=1, retry_after_s=2)
    h1, h2 = {"Authorization": "Bearer k1"}, {"Authorization": "Bearer k2"}
    body = {"prompt": "hello", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{g.url}/v1/completions", json=body, headers=h1, timeout=30) as first:
        assert first.status_code == 200  # in flight (no worker answers)
        second = httpx.post(f"{g.url}/v1/completions", json=body, headers=h1)
        assert second.status_code == 429 and second.headers["retry-after"] == "2"
        assert "1 concurrent requests per key" in second.json()["error"]["message"]
        with httpx.stream("POST", f"{g.url}/v1/completions", json=body, headers=h2, timeout=30) as other:
            assert other.status_code == 200  # another key is not affected
    deadline = time.monotonic() + 5
    while True:  # the first stream's lease is released once its relay ends
        with httpx.stream("POST", f"{g.url}/v1/completions", json=body, headers=h1, timeout=30) as again:
            if again.status_code == 200 or time.monotonic() > deadline:
                break
        time.sleep(0.1)
    assert again.status_code == 200


def test_tokens_per_minute_per_key_429(gateway_factory):
    g = gateway_factory(tokens_per_minute_per_key=40, first_token_timeout_s=0.3)
    url = f"{g.url}/v1/completions"
    assert httpx.post(url, json={"prompt": "hello", "max_tokens": 30}, timeout=30).status_code == 504
    resp = httpx.post(url, json={"prompt": "hello", "max_tokens": 30}, timeout=30)  # 6 used + 36 > 40
    assert resp.status_code == 429 and 1 <= int(resp.headers["retry-after"]) <= 60
    assert "tokens per minute" in resp.json()["error"]["message"]
    too_big = httpx.post(url, json={"prompt": "hello", "max_tokens": 40}, timeout=30)
    assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "max_tokens"


# ---------------------------------------------------------------- gRPC reflection, metrics


def test_grpc_reflection_lists_the_services(gw):
    from google.protobuf.descriptor_pool import DescriptorPool

    with grpc.insecure_channel(f"127.0.0.1:{gw.grpc_port}") as ch:
        db = ProtoReflectionDescriptorDatabase(ch)
        services = set(db.get_services())
        assert {"tandem.v1.Tandem", "grpc.health.v1.Health"} <= services
        method = DescriptorPool(db).FindServiceByName("tandem.v1.Tandem").methods_by_name["Generate"]
        assert method.input_type.full_name == "tandem.v1.GenerateRequest" and method.server_streaming


def test_grpc_reflection_v1_beside_v1alpha(gw):
    """A v1 client (its messages built from the v1 descriptors the server serves) lists the
    services and resolves both reflection services and tandem.v1.Tandem."""
    from google.protobuf import descriptor_pool, message_factory

    from tandem_core.grpc_util import REFLECTION_V1

    pool = descriptor_pool.Default()
    req_cls = message_factory.GetMessageClass(pool.FindMessageTypeByName("grpc.reflection.v1.ServerReflectionRequest"))
    resp_cls = message_factory.GetMessageClass(pool.FindMessageTypeByName("grpc.reflection.v1.ServerReflectionResponse"))
    with grpc.insecure_channel(f"127.0.0.1:{gw.grpc_port}") as ch:
        call = ch.stream_stream(f"/{REFLECTION_V1}/ServerReflectionInfo", request_serializer=req_cls.SerializeToString,
                                response_deserializer=resp_cls.FromString)
        asks = [req_cls(list_services=""), req_cls(file_containing_symbol=REFLECTION_V1),
                req_cls(file_containing_symbol="tandem.v1.Tandem")]
        listed, v1_file, tandem_file = list(call(iter(asks), timeout=10))
    names = {s.name for s in listed.list_services_response.service}
    assert {"tandem.v1.Tandem", "grpc.health.v1.Health", REFLECTION_V1, "grpc.reflection.v1alpha.ServerReflection"} <= names
    from google.protobuf import descriptor_pb2

    v1 = descriptor_pb2.FileDescriptorProto.FromString(v1_file.file_descriptor_response.file_descriptor_proto[0])
    assert v1.package == "grpc.reflection.v1" and v1.service[0].method[0].input_type.startswith(".grpc.reflection.v1.")
    files = [descriptor_pb2.FileDescriptorProto.FromString(b).name
             for b in tandem_file.file_descriptor_response.file_descriptor_proto]
    assert "tandem_proto/generate.proto" in files


def test_grpc_generate_takes_the_http_sampling_fields(gw):
    from tandem_proto import generate_pb2, generate_pb2_grpc

    sampling = generate_pb2.SamplingParameters(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1,
                                               logit_bias={65: 1.0}, min_tokens=1, temperature=0)
    with grpc.insecure_channel(f"127.0.0.1:{gw.grpc_port}") as ch:
        stub = generate_pb2_grpc.TandemStub(ch)
        ok = list(stub.Generate(generate_pb2.GenerateRequest(
            prompt="hello", max_tokens=64, sampling=sampling, stop_token_ids=[10], skip_special_tokens=True), timeout=30))
        assert "".join(r.text for r in ok) == OUT and ok[-1].finish_reason == "stop"
        assert all(r.choice_index == 0 for r in ok)
        bad = [({"logprobs": 21}, "logprobs"), ({"n": 99}, "n"), ({"stop_token_ids": [999]}, "stop_token_ids"),
               ({"sampling": generate_pb2.SamplingParameters(logit_bias={999: 1.0})}, "logit_bias"),
               ({"sampling": generate_pb2.SamplingParameters(logit_bias={5: 500.0})}, "[-100, 100]"),
               ({"sampling": generate_pb2.SamplingParameters(presence_penalty=3)}, "presence_penalty"),
               ({"sampling": generate_pb2.SamplingParameters(repetition_penalty=0)}, "repetition_penalty")]
        for fields, word in bad:
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(generate_pb2.GenerateRequest(prompt="hi", **fields), timeout=10))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and word in e.value.details(), fields


def test_chat_without_max_tokens_is_not_cut_at_16(gw):
    """LangChain's ChatOpenAI() sends no max_tokens: the reply runs to its stop, not 16 tokens."""
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=30)
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}])
    assert out.choices[0].message.content == OUT and out.choices[0].finish_reason == "stop"
    # and the SDK's own dump of that reply, sent back as history, is accepted
    history = [{"role": "user", "content": "hello"}, out.choices[0].message.model_dump(), {"role": "user",
                                                                                          "content": "again"}]
    again = client.chat.completions.create(model="tiny", messages=history, max_tokens=64)
    assert again.choices[0].message.content == OUT


def test_inference_extension_gauges(gw):
    text = httpx.get(f"{gw.url}/metrics").text
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "vllm:lora_requests_info"):
        assert f'{name}{{' in text, name
