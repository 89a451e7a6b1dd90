"""OpenAI/vLLM parity of the HTTP surface (issue 12): non-JSON bodies are 415,
`GET /v1/models/{id}`, `/tokenize` and `/detokenize`, and /openapi.json documents every request
body and status code. HTTP through FastAPI's TestClient against the real test Redis; nothing here
reaches a worker. The new fields' way into the contract, which needs no Redis, is
tests/unit/test_gateway_parity_fields.py."""
from __future__ import annotations

import uuid

import openai
import pytest
import redis
from fastapi.testclient import TestClient

from gateway.app import create_app
from gateway.settings import GatewaySettings
from tandem_core import keys
from tandem_core.models import BYTE_BOS, BYTE_EOS
from tandem_core.settings import RedisConfig
from tests.integration.api_errors import assert_api_error

KS = keys.KeySpace(1)  # a plain Redis: one key shard (a service builds its own from its settings)

POOL = f"gwp-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def client(redis_url):
    s = GatewaySettings(redis=RedisConfig(url=redis_url), grpc_port=0, pool=POOL, model="tiny", max_prompt_len=64,
                        max_context_len=80, max_tokens_limit=20)
    with TestClient(create_app(s)) as c:
        yield c
    r = redis.Redis.from_url(redis_url)
    assert sum(r.xlen(KS.admission_stream(POOL, p, 0)) for p in keys.PRIORITIES) == 0  # nothing enqueued
    r.close()


_err = assert_api_error


# ---------------------------------------------------------------- content type


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
def test_non_json_content_type_is_415(client, path, ctype):
    resp = client.post(path, content=b'{"prompt": "hi"}', headers={"content-type": ctype})
    _err(resp, 415, "Content-Type", ctype, "application/json")
    assert resp.json()["error"]["type"] == "unsupported_media_type"


def test_json_content_types_pass(client):
    for ctype in ("application/json; charset=utf-8", "Application/JSON", "application/merge-patch+json", None):
        headers = {"content-type": ctype} if ctype else {}
        resp = client.post("/v1/completions", content=b'{"prompt": "hi", "max_tokens": 99}', headers=headers)
        _err(resp, 400, "max_tokens", "99")  # parsed, then validated


# ---------------------------------------------------------------- models, tokenize, detokenize


def test_model_retrieve(client):
    for name in ("tiny", "builtin"):
        assert client.get(f"/v1/models/{name}").json() == client.get("/v1/models").json()["data"][0]
    _err(client.get("/v1/models/gpt-4o"), 404, "model", "gpt-4o", "tiny")
    _err(client.get("/v1/models/org/gpt-4o"), 404, "model", "org/gpt-4o")
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)
    card = sdk.models.retrieve("tiny")
    assert card.id == "tiny" and card.object == "model"
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("nope")


def test_tokenize_and_detokenize(client):
    got = client.post("/tokenize", json={"model": "tiny", "prompt": "hello"}).json()
    assert got == {"count": 6, "max_model_len": 80, "tokens": [BYTE_BOS, *b"hello"]}
    raw = client.post("/tokenize", json={"prompt": "hello", "add_special_tokens": False}).json()
    assert raw["tokens"] == list(b"hello")
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == [BYTE_BOS, *b"<|user|>\nhi\n<|assistant|>\n"]
    fn = {"type": "function", "function": {"name": "f"}}
    with_tools = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}], "tools": [fn]})
    assert bytes(with_tools.json()["tokens"][1:]).decode().startswith("<|system|>\n# Tools\n"), with_tools.text
    _err(client.post("/tokenize", json={"prompt": "a", "tools": [fn]}), 400, "tools", "messages")
    text = client.post("/detokenize", json={"tokens": [BYTE_BOS, *b"h\xc3\xa9llo", BYTE_EOS]}).json()
    assert text == {"prompt": "héllo"}
    _err(client.post("/detokenize", json={"tokens": [1, 258]}), 400, "tokens", "258", "vocabulary")
    _err(client.post("/detokenize", json={"tokens": ["1"]}), 400, "tokens[0]", "integer")
    _err(client.post("/tokenize", json={"prompt": "a", "messages": []}), 400, "prompt", "either")
    _err(client.post("/tokenize", json={}), 400, "prompt", "either")
    _err(client.post("/tokenize", json={"model": "gpt-4", "prompt": "a"}), 404, "model", "gpt-4")
    _err(client.post("/tokenize", json={"prompt": "a", "extra": 1}), 400, "extra", "unknown field")


# ---------------------------------------------------------------- /openapi.json


def test_openapi_documents_bodies_and_status_codes(client):
    schema = client.get("/openapi.json").json()
    components = schema["components"]["schemas"]
    want = {"/v1/completions": "CompletionBody", "/v1/chat/completions": "ChatBody",
            "/tokenize": "TokenizeBody", "/detokenize": "DetokenizeBody"}
    for path, model in want.items():
        op = schema["paths"][path]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{model}" and op["requestBody"]["required"]
        assert {"400", "401", "404", "413", "415"} <= set(op["responses"]), path
        assert op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert {"429", "503", "504"} <= set(schema["paths"][path]["post"]["responses"])
    assert {"CompletionBody", "ChatBody", "ChatMessage", "StreamOptions", "ErrorResponse"} <= set(components)
    assert "logprobs" in components["CompletionBody"]["properties"]
    assert components["ChatBody"]["additionalProperties"] is False  # unknown fields are refused
    assert "/v1/models/{model_id}" in schema["paths"]
    assert not any("422" in op["responses"] for p in schema["paths"].values() for op in p.values())
