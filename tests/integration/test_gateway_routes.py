"""The front door's answers to what it does not serve (issue 33): /v1/embeddings and any unknown
route get an OpenAI-style 404 that names the routes this server does serve; HEAD works on the
health routes; a /v1/responses body a stateless server cannot honour is a 400 that says why, and
nothing is enqueued. Real Redis, FastAPI's TestClient."""
from __future__ import annotations

import uuid

import pytest
import redis
from fastapi.testclient import TestClient

from gateway.app import create_app
from gateway.settings import GatewaySettings
from tandem_core import keys
from tandem_core.settings import RedisConfig
from tests.integration.api_errors import assert_api_error

KS = keys.KeySpace(1)  # a plain Redis: one key shard (a service builds its own from its settings)

POOL = f"gwr-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def client(redis_url):
    s = GatewaySettings(redis=RedisConfig(url=redis_url), grpc_port=0, pool=POOL, model="tiny")
    with TestClient(create_app(s)) as c:
        yield c
    r = redis.Redis.from_url(redis_url)
    assert sum(r.xlen(KS.admission_stream(POOL, p, 0)) for p in keys.PRIORITIES) == 0  # nothing enqueued
    r.close()


@pytest.mark.parametrize("method, path, words", [
    ("POST", "/v1/embeddings", ["embeddings are not served", "POST /v1/chat/completions", "POST /v1/responses"]),
    ("GET", "/v1/nothing", ["no route GET /v1/nothing", "GET /v1/models", "GET /healthz"]),
    ("POST", "/v2/chat/completions", ["no route POST /v2/chat/completions", "POST /v1/completions"]),
])
def test_a_route_not_served_names_those_that_are(client, method, path, words):
    r = client.request(method, path, json={"model": "tiny", "input": "x"})
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["type"] == "not_found_error" and err["code"] == "not_found_error" and err["param"] == path
    for w in words:
        assert w in err["message"], err["message"]


def test_an_unknown_model_is_still_its_own_404(client):
    r = client.get("/v1/models/gpt-4")
    assert r.status_code == 404 and "is not served here" in r.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/healthz", "/health", "/readyz"])
def test_head_on_the_health_routes(client, path):
    r = client.head(path)
    assert r.status_code == 200 and r.content == b""
    assert client.get(path).status_code == 200


@pytest.mark.parametrize("body, param, words", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id", ["stateless"]),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0]", ["item_reference"]),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type", ["only function tools"]),
    ({"input": "hi", "max_output_tokens": "4"}, "max_output_tokens", []),
    ({"input": "hi", "bogus": 1}, "bogus", ["unknown field"]),
    ({"input": "hi", "model": "gpt-4"}, "model", ["not served here"]),
])
def test_responses_bad_bodies(client, body, param, words):
    status = 404 if param == "model" else 400
    assert_api_error(client.post("/v1/responses", json=body), status, param, *words)


def test_responses_is_in_the_openapi_document(client):
    doc = client.get("/openapi.json").json()
    assert "/v1/responses" in doc["paths"] and "ResponsesBody" in doc["components"]["schemas"]
