"""Bad input gets a clear 4xx naming the field and the limit, and enqueues nothing.

The app runs in FastAPI's TestClient (lifespan included) against the real test Redis; none of
these requests reaches a worker.
"""
from __future__ import annotations

import json
import uuid

import pytest
import redis
from fastapi.testclient import TestClient

from gateway.app import create_app
from gateway.settings import GatewaySettings
from tandem.redis_proc import free_port
from tandem_core import keys
from tandem_core.settings import RedisConfig

KS = keys.KeySpace(1)  # a plain Redis: one key shard (a service builds its own from its settings)

POOL = f"gwv-{uuid.uuid4().hex[:8]}"


def _settings(redis_url: str, **kw) -> GatewaySettings:
    base = dict(
        redis=RedisConfig(url=redis_url), host="127.0.0.1", grpc_port=0, pool=POOL, model="tiny", max_prompt_len=16,
        max_context_len=24, max_tokens_limit=20, max_stop_strings=2, max_body_bytes=2048,
    )
    base.update(kw)
    return GatewaySettings(**base)


@pytest.fixture(scope="module")
def client(redis_url):
    with TestClient(create_app(_settings(redis_url))) as c:
        yield c
    r = redis.Redis.from_url(redis_url)
    # "changes nothing else": no bad request reached the admission streams
    assert sum(r.xlen(KS.admission_stream(POOL, p, 0)) for p in keys.PRIORITIES) == 0
    r.close()


def _post(client: TestClient, **body):
    return client.post("/v1/completions", json={"model": "tiny", **body})


def _assert_error(resp, status: int, param: str | None, *words: str) -> None:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param
    for w in words:
        assert w in err["message"], (w, err["message"])


CASES = [
    # (body overrides, status, param, words the message must contain)
    ({"prompt": ""}, 400, "prompt", ["empty"]),
    ({"prompt": []}, 400, "prompt", ["empty"]),
    ({"prompt": ["a", "b"]}, 400, "prompt", ["2 strings"]),
    ({"prompt": "x" * 20}, 400, "prompt", ["21", "16"]),  # BOS + 20 bytes > 16
    ({"prompt": [1, 2, 999]}, 400, "prompt", ["999", "258"]),
    ({"prompt": "hello", "max_tokens": 20}, 400, "max_tokens", ["6", "20", "26", "24"]),
    ({"prompt": "hello", "max_tokens": 0}, 400, "max_tokens", ["at least 1"]),
    ({"prompt": "hello", "max_tokens": -3}, 400, "max_tokens", ["-3"]),
    ({"prompt": "hello", "max_tokens": 21}, 400, "max_tokens", ["21", "20"]),
    ({"prompt": "hello", "temperature": -0.1}, 400, "temperature", ["[0, 2]"]),
    ({"prompt": "hello", "temperature": 2.5}, 400, "temperature", ["[0, 2]", "2.5"]),
    ({"prompt": "hello", "temperature": "hot"}, 400, "temperature", ["temperature"]),
    ({"prompt": "hello", "top_p": 0}, 400, "top_p", ["(0, 1]"]),
    ({"prompt": "hello", "top_p": 1.5}, 400, "top_p", ["(0, 1]"]),
    ({"prompt": "hello", "top_k": -1}, 400, "top_k", [">= 0"]),
    ({"prompt": "hello", "stop": ["a", "b", "c"]}, 400, "stop", ["3", "2"]),
    ({"prompt": "hello", "stop": [""]}, 400, "stop", ["empty"]),
    ({"prompt": "hello", "n": 0}, 400, "n", ["between 1 and 8", "0"]),
    ({"prompt": "hello", "n": 9}, 400, "n", ["between 1 and 8", "9"]),
    ({"prompt": "hello", "n": 2, "resumable": True}, 400, "n", ["resumable", "one choice"]),
    ({"prompt": "hello", "priority": "urgent"}, 400, "priority", ["priority"]),
    ({"prompt": "hello", "best_of": 3}, 400, "best_of", ["not supported yet", "best_of"]),
    ({"prompt": "hello", "suffix": "x"}, 400, "suffix", ["not supported yet"]),
    # issue 12: the sampling extras, bad values (the vocabulary of the "tiny" preset is 258)
    ({"prompt": "hello", "logprobs": 6}, 400, "logprobs", ["between 0 and 5", "6"]),
    ({"prompt": "hello", "logprobs": -1}, 400, "logprobs", ["between 0 and 5"]),
    ({"prompt": "hello", "logprobs": True}, 400, "logprobs", ["integer"]),
    ({"prompt": "hello", "frequency_penalty": 2.5}, 400, "frequency_penalty", ["[-2, 2]", "2.5"]),
    ({"prompt": "hello", "presence_penalty": -3}, 400, "presence_penalty", ["[-2, 2]", "-3"]),
    ({"prompt": "hello", "repetition_penalty": 0}, 400, "repetition_penalty", ["(0, 2]"]),
    ({"prompt": "hello", "repetition_penalty": 2.01}, 400, "repetition_penalty", ["(0, 2]"]),
    ({"prompt": "hello", "logit_bias": {"999": 1}}, 400, "logit_bias", ["999", "vocabulary", "258"]),
    ({"prompt": "hello", "logit_bias": {"5": 101}}, 400, "logit_bias", ["[-100, 100]", "101"]),
    ({"prompt": "hello", "logit_bias": {"5": -100.5}}, 400, "logit_bias", ["[-100, 100]"]),
    ({"prompt": "hello", "logit_bias": {"a5": 1}}, 400, "logit_bias", ["token ids", "a5"]),
    ({"prompt": "hello", "logit_bias": {str(i): 1 for i in range(65)}}, 400, "logit_bias", ["65", "64"]),
    ({"prompt": "hello", "logit_bias": {"5": "1"}}, 400, "logit_bias.5", ["number"]),
    ({"prompt": "hello", "min_tokens": -1}, 400, "min_tokens", [">= 0"]),
    ({"prompt": "hello", "min_tokens": 6, "max_tokens": 5}, 400, "min_tokens", ["6", "5"]),
    ({"prompt": "hello", "stop_token_ids": [258]}, 400, "stop_token_ids", ["258", "vocabulary"]),
    ({"prompt": "hello", "stop_token_ids": list(range(16))}, 400, "stop_token_ids", ["17", "16"]),
    ({"prompt": "hello", "echo": "yes"}, 400, "echo", ["boolean"]),
    ({"prompt": "hello", "skip_special_tokens": 0}, 400, "skip_special_tokens", ["boolean"]),
    ({"prompt": "hello", "stream_options": {"continuous_usage_stats": "y"}}, 400,
     "stream_options.continuous_usage_stats", ["boolean"]),
    # strict types: a string or a boolean where a number is expected
    ({"prompt": "hello", "max_tokens": "4"}, 400, "max_tokens", ["integer"]),
    ({"prompt": "hello", "max_tokens": True}, 400, "max_tokens", ["integer"]),
    ({"prompt": "hello", "max_tokens": 4.5}, 400, "max_tokens", ["integer"]),
    ({"prompt": "hello", "top_p": True}, 400, "top_p", ["number"]),
    ({"prompt": "hello", "temperature": "0.5"}, 400, "temperature", ["number"]),
    ({"prompt": "hello", "n": "2"}, 400, "n", ["integer"]),
    ({"prompt": "hello", "seed": "7"}, 400, "seed", ["integer"]),
    ({"prompt": "hello", "top_k": 1.5}, 400, "top_k", ["integer"]),
    ({"prompt": "hello", "presence_penalty": False}, 400, "presence_penalty", ["number"]),
    ({"prompt": [1, True]}, 400, "prompt", []),
    ({"prompt": 5}, 400, "prompt", []),
    ({"prompt": "hello", "guided_jsonz": {}}, 400, "guided_jsonz", ["unknown field"]),
    ({"prompt": "hello", "guided_json": 3}, 400, "guided_json", []),
    ({"prompt": "hello", "guided_json": "{nope"}, 400, "guided_json", ["not valid JSON"]),
    ({"prompt": "hello", "guided_regex": "a+", "guided_choice": ["a"]}, 400, "guided_choice",
     ["guided_regex", "at most one"]),
    ({"prompt": "hello", "guided_choice": []}, 400, "guided_choice", ["empty"]),
    ({"prompt": "hello", "structured_outputs": {}}, 400, "structured_outputs", ["empty"]),
    ({"prompt": "hello", "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400, "structured_outputs.choice",
     ["at most one"]),
    ({"prompt": "hello", "guided_regex": "a+", "ignore_eos": True}, 400, "ignore_eos", ["guided_regex"]),
    ({"prompt": "hello", "stream_options": {"x": 1}}, 400, "stream_options.x", ["unknown field"]),
    ({"prompt": "hello", "model": "gpt-9"}, 404, "model", ["gpt-9", "tiny"]),
]


@pytest.mark.parametrize("body,status,param,words", CASES, ids=[str(c[0])[:40] for c in CASES])
def test_bad_input(client, body, status, param, words):
    _assert_error(_post(client, **body), status, param, *words)


def test_missing_prompt(client):
    _assert_error(client.post("/v1/completions", json={"model": "tiny"}), 400, "prompt", "required")


def test_invalid_json(client):
    resp = client.post("/v1/completions", content=b'{"prompt": ', headers={"content-type": "application/json"})
    _assert_error(resp, 400, None, "not valid JSON")
    _assert_error(client.post("/v1/completions", content=b"[1, 2]"), 400, None, "JSON object")


def test_body_too_large(client):
    resp = client.post("/v1/completions", content=json.dumps({"prompt": "x" * 4000}).encode())
    _assert_error(resp, 413, None, "2048")


def test_models_health_ready(client):
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").status_code == 200
    data = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["tiny"]
    assert "tandem_requests_running" in client.get("/metrics").text


def test_unknown_route_is_openai_shaped(client):
    resp = client.get("/v1/nope")
    assert resp.status_code == 404 and "error" in resp.json()


def test_api_keys_and_admin_key(redis_url):
    s = _settings(redis_url, api_keys=["k1", "k2"], admin_key="adm", served_model_name="mine")
    with TestClient(create_app(s)) as c:
        _assert_error(_post(c, prompt="hello", max_tokens=99), 401, None, "API key")
        wrong = c.post("/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        ok = c.post("/v1/completions", json={"model": "mine", "prompt": "hi", "max_tokens": 99},
                    headers={"Authorization": "Bearer k2"})
        _assert_error(ok, 400, "max_tokens", "99")  # authenticated, then validated
        assert c.get("/v1/models").status_code == 401
        models = c.get("/v1/models", headers={"Authorization": "Bearer k1"}).json()
        assert models["data"][0]["id"] == "mine"
        assert c.get("/admin/cluster").status_code == 401
        assert c.get("/admin/cluster", headers={"Authorization": "Bearer k1"}).status_code == 401
        view = c.get("/admin/cluster", headers={"Authorization": "Bearer adm"}).json()
        assert set(view) == {"workers", "load", "queues", "model", "prefix_cache"}
        assert c.get("/healthz").status_code == 200  # probes need no key


def test_redis_down_is_degraded_then_not_ready_and_503(redis_url):
    s = _settings(f"redis://127.0.0.1:{free_port()}/0", redis_hold_s=0.3)
    with TestClient(create_app(s)) as c:
        assert c.get("/healthz").status_code == 200
        ready = c.get("/readyz")
        assert ready.status_code == 200 and ready.json()["status"] == "degraded"  # new requests wait for Redis
        resp = _post(c, prompt="hello")  # waits redis_hold_s for Redis, then 503
        message = resp.json()["error"]["message"]
        assert resp.status_code == 503 and "Redis is unreachable" in message and "waited" in message
        assert "retry-after" in resp.headers
        assert c.get("/readyz").status_code == 503  # longer than redis_hold_s into the outage
