"""The front door's strict input (raw httpx through FastAPI's TestClient, real Redis, nothing
enqueued), the admin key and the metric names. Chat templates, per-key limits and the load gauges,
which need no Redis, are in tests/unit/test_gateway_limits.py."""
from __future__ import annotations

import socket
import uuid

import httpx
import pytest
import redis
from fastapi.testclient import TestClient

from gateway.app import create_app
from gateway.settings import GatewaySettings
from tandem_core import keys
from tandem_core.settings import RedisConfig
from tests.integration.api_errors import assert_api_error

KS = keys.KeySpace(1)  # a plain Redis: one key shard (a service builds its own from its settings)

POOL = f"gwa-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def client(redis_url):
    s = GatewaySettings(
        redis=RedisConfig(url=redis_url), grpc_port=0, pool=POOL, model="tiny", max_prompt_len=64,
        max_context_len=80, max_tokens_limit=20, max_stop_strings=2, max_body_bytes=4096,
    )
    with TestClient(create_app(s)) as c:
        yield c
    r = redis.Redis.from_url(redis_url)
    assert sum(r.xlen(KS.admission_stream(POOL, p, 0)) for p in keys.PRIORITIES) == 0  # nothing enqueued
    assert r.xlen(KS.direct_stream(POOL, 0)) == 0
    r.close()


_err = assert_api_error


USER = [{"role": "user", "content": "hi"}]
CHAT_CASES = [
    ({"messages": []}, "messages", ["empty"]),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", ["system, user, assistant, tool", "robot"]),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", ["required"]),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c1"}]}, "messages[0].tool_call_id", ["tool"]),
    ({"messages": [{"role": "user"}]}, "messages[0].content", ["required"]),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0]", ["only text", "image_url"]),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}, "messages[0].content[0].text",
     ["string"]),
    ({"messages": [{"role": "user", "content": "x", "tool_callz": []}]}, "messages[0].tool_callz",
     ["unknown field"]),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]}]},
     "messages[0].tool_calls[0].function", ["required"]),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages[0].tool_calls", ["only an assistant"]),
    ({"messages": [{"role": "assistant", "content": "x", "annotations": [{"type": "url_citation"}]}]},
     "messages[0].annotations", ["not supported yet"]),
    ({"messages": [{"role": "assistant", "content": "x", "function_call": {"name": "f"}}]},
     "messages[0].function_call", ["not supported yet"]),
    ({"messages": [{"role": "assistant", "content": "x", "refusal": "no"}]}, "messages[0].refusal",
     ["not supported yet"]),
    ({"messages": "hello"}, "messages", []),
    ({"messages": USER, "n": 9}, "n", ["between 1 and 8"]),
    ({"messages": USER, "n": 0}, "n", ["between 1 and 8"]),
    ({"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs", ["between 0 and 20", "21"]),
    ({"messages": USER, "top_logprobs": 2}, "top_logprobs", ["logprobs", "true"]),
    ({"messages": USER, "logprobs": False, "top_logprobs": 2}, "top_logprobs", ["logprobs", "true"]),
    ({"messages": USER, "logprobs": 1}, "logprobs", ["boolean"]),
    ({"messages": USER, "echo": True}, "echo", ["unknown field"]),
    ({"messages": USER, "presence_penalty": 2.5}, "presence_penalty", ["[-2, 2]"]),
    ({"messages": USER, "logit_bias": {"300": 5}}, "logit_bias", ["300", "vocabulary"]),
    ({"messages": USER, "max_completion_tokens": "3"}, "max_completion_tokens", ["integer"]),
    ({"messages": USER, "stream_options": {"include_obfuscation": "no"}}, "stream_options.include_obfuscation",
     ["boolean"]),
    ({"messages": USER, "tools": [{"type": "function"}]}, "tools[0].function", ["required"]),
    ({"messages": USER, "response_format": {"type": "json_schema"}}, "response_format.json_schema", ["required"]),
    ({"messages": USER, "functions": [{"name": "f"}]}, "functions", ["not supported yet"]),
    ({"messages": USER, "max_completion_tokens": 21}, "max_tokens", ["21", "20"]),
    ({"messages": USER, "max_completion_tokens": 3, "max_tokens": 4}, "max_completion_tokens", ["not both"]),
    ({"messages": [{"role": "user", "content": "x" * 100}]}, "messages", ["after the chat template", "64"]),
    ({"messages": USER, "stop": ["a", "b", "c"]}, "stop", ["3", "2"]),
    ({"messages": USER, "temperature": 3}, "temperature", ["[0, 2]"]),
    ({"messages": USER, "resumable": "yes"}, "resumable", []),
    ({"messages": USER, "stream_options": {"include_usage": 1}}, "stream_options.include_usage", []),
]


@pytest.mark.parametrize("body,param,words", CHAT_CASES, ids=[str(c[0])[:50] for c in CHAT_CASES])
def test_chat_bad_input(client, body, param, words):
    _err(client.post("/v1/chat/completions", json={"model": "tiny", **body}), 400, param, *words)


RAW_CASES = [  # (body, param, words, whether chat gets the same error: checks before the schema)
    (b'{"prompt": "caf\xe9"}', None, ["UTF-8"], True),  # a latin-1 byte, not UTF-8
    (b'\xff\xfe{\x00}\x00', None, ["UTF-8"], True),
    (b'{"prompt": "\\ud800x"}', "prompt", ["surrogate"], True),
    (b'{"prompt": "hi", "stop": ["\\udfff"]}', "stop[0]", ["surrogate"], True),
    (b'{"prompt": "hi", "temperature": NaN}', None, ["NaN"], True),
    (b'{"prompt": "hi", "top_p": Infinity}', None, ["Infinity"], True),
    (b'{"prompt": "hi", "x": ' + b"[" * 40 + b"]" * 40 + b"}", "x" + "[0]" * 32, ["nested"], True),
    (b'{"prompt": "hi", "x": ' + b"[" * 2000 + b"]" * 2000 + b"}", None, ["nested"], True),
    (b'{"prompt": "hi", "max_tokens": 1e400}', "max_tokens", [], False),
    (b'{"prompt": "hi", "seed": 100000000000000000000000000000}', "seed", ["64-bit"], False),
    (b'{"prompt": "hi", "model": "' + b"m" * 300 + b'"}', "model", ["256"], False),
]


@pytest.mark.parametrize("raw,param,words,same", RAW_CASES, ids=[repr(c[0][:30]) for c in RAW_CASES])
def test_malformed_bodies(client, raw, param, words, same):
    headers = {"content-type": "application/json"}
    _err(client.post("/v1/completions", content=raw, headers=headers), 400, param, *words)
    chat = client.post("/v1/chat/completions", content=raw, headers=headers)
    if same:
        _err(chat, 400, param, *words)
    else:
        assert chat.status_code == 400, chat.text


def test_unsupported_noop_values_are_accepted_as_off(client):
    # Validation passes (the request then fails on the prompt limit, after the no-op fields).
    body = {"prompt": "x" * 100, "logprobs": None, "presence_penalty": 0, "frequency_penalty": 0.0,
            "logit_bias": {}, "echo": False, "best_of": 1, "n": 1, "user": "u1", "suffix": None}
    _err(client.post("/v1/completions", json=body), 400, "prompt", "64")
    chat = {"messages": [{"role": "developer", "content": [{"type": "text", "text": "x" * 100}]}],
            "logprobs": False, "tools": [], "response_format": {"type": "text"},
            "parallel_tool_calls": False, "store": False, "metadata": {"a": "b"}}
    _err(client.post("/v1/chat/completions", json=chat), 400, "messages", "after the chat template")


def test_supported_parity_fields_pass_validation(client):
    """Every issue-12 field with a real value is accepted (the request then fails on the prompt
    limit, which is checked after them), and so is an assistant message as the SDK dumps it."""
    body = {"prompt": "x" * 100, "logprobs": 5, "echo": True, "n": 8, "presence_penalty": -2,
            "frequency_penalty": 2, "repetition_penalty": 1.3, "logit_bias": {"65": -100, "66": 100},
            "min_tokens": 2, "stop_token_ids": [10, 13], "skip_special_tokens": False, "ignore_eos": True,
            "temperature": 1, "top_p": 1, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True, "include_obfuscation": False}}
    _err(client.post("/v1/completions", json=body), 400, "prompt", "64")
    dumped = {"content": "hello", "refusal": None, "role": "assistant", "annotations": [], "audio": None,
              "function_call": None, "tool_calls": []}
    chat = {"messages": [{"role": "user", "content": "x" * 100}, dumped, {**dumped, "annotations": None,
                                                                          "tool_calls": None}],
            "logprobs": True, "top_logprobs": 20, "n": 2, "presence_penalty": 0.5}
    _err(client.post("/v1/chat/completions", json=chat), 400, "messages", "after the chat template")


def test_resume_unknown_and_bad_ids(client):
    _err(client.get("/v1/requests/cmpl-nope/stream"), 404, "request_id", "resumable")
    _err(client.get("/v1/requests/cmpl-nope/stream", headers={"Last-Event-ID": "x1"}), 400, "Last-Event-ID")
    _err(client.get("/v1/requests/cmpl-nope/stream?from=-3"), 400, "from")


def test_admin_is_refused_when_api_keys_are_set_but_no_admin_key(redis_url):
    """An API key is a client's: it never opens /admin/*. With keys but no admin key the admin
    routes are off for everyone, with a 403 that says which setting opens them."""
    s = GatewaySettings(redis=RedisConfig(url=redis_url), grpc_port=0, pool=POOL, model="tiny", api_keys=["k1"])
    with TestClient(create_app(s)) as c:
        for headers in ({}, {"Authorization": "Bearer k1"}, {"Authorization": "Bearer nope"}):
            _err(c.get("/admin/cluster", headers=headers), 403, None, "set admin_key")
        assert c.get("/v1/models", headers={"Authorization": "Bearer k1"}).status_code == 200  # the key still works
    s = GatewaySettings(redis=RedisConfig(url=redis_url), grpc_port=0, pool=POOL, model="tiny", api_keys=["k1"],
                        admin_key="adm")
    with TestClient(create_app(s)) as c:
        _err(c.get("/admin/cluster", headers={"Authorization": "Bearer k1"}), 401, None, "admin key")
        view = c.get("/admin/cluster", headers={"Authorization": "Bearer adm"}).json()
        assert view["model"]["name"] == "tiny" and {"waiting", "running", "kv_cache_usage"} <= set(view["load"])


def test_metrics_on_their_own_port(redis_url):
    """metrics_port: /metrics there (real HTTP on loopback, the same text), and the API port
    answers /metrics with 404 naming the port; other paths and a garbage request on the metrics
    port get their answer and leave it serving."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    s = GatewaySettings(redis=RedisConfig(url=redis_url), grpc_port=0, pool=POOL, model="tiny", metrics_port=port)
    with TestClient(create_app(s)) as c:
        _err(c.get("/metrics"), 404, None, f"port {port}", "metrics_port")
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:  # not HTTP at all
            raw.sendall(b"\x00garbage\r\n\r\n")
            assert raw.recv(100).startswith(b"HTTP/1.1 404")
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).status_code == 404
        assert httpx.post(f"http://127.0.0.1:{port}/metrics", timeout=5).status_code == 405
        got = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
        assert got.status_code == 200 and got.headers["content-type"].startswith("text/plain")
        for name in ("vllm:num_requests_waiting{", "vllm:kv_cache_usage_perc{", "tandem_ttft_seconds"):
            assert name in got.text, name


def test_metrics_names(client):
    text = client.get("/metrics").text
    for name in ("vllm:num_requests_waiting{", "vllm:num_requests_running{", "vllm:kv_cache_usage_perc{",
                 "vllm:gpu_cache_usage_perc{", "vllm:lora_requests_info{", "tandem_ttft_seconds"):
        assert name in text, name
