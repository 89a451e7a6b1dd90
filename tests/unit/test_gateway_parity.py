"""OpenAI/vLLM parity of the request surface (issue 12): the new fields reach the contract
(`GenerationRequest`, `SamplingParams`, `Prepared`), chat runs to the context end without
max_tokens, non-JSON bodies are 415, `GET /v1/models/{id}`, `/tokenize` and `/detokenize`, and
/openapi.json documents every request body and status code. HTTP through FastAPI's TestClient
against the real test Redis; nothing here reaches a worker."""
from __future__ import annotations

import uuid

import openai
import pytest
import redis
from fastapi.testclient import TestClient

from gateway.app import create_app
from gateway.schemas import ChatBody, CompletionBody
from gateway.settings import GatewaySettings
from gateway.validation import CompletionParams, build_request
from tandem_core import keys
from tandem_core.models import BYTE_BOS, BYTE_EOS, resolve_model
from tandem_core.settings import RedisConfig
from tandem_core.tokenizer import ByteTokenizer

POOL = f"gwp-{uuid.uuid4().hex[:8]}"
TINY = resolve_model("tiny")


@pytest.fixture(scope="module")
def client(redis_url):
    s = GatewaySettings(redis=RedisConfig(url=redis_url), grpc_port=0, pool=POOL, model="tiny", max_prompt_len=64,
                        max_context_len=80, max_tokens_limit=20)
    with TestClient(create_app(s)) as c:
        yield c
    r = redis.Redis.from_url(redis_url)
    assert sum(r.xlen(keys.admission_stream(POOL, p, 0)) for p in keys.PRIORITIES) == 0  # nothing enqueued
    r.close()


def _err(resp, status: int, param: str | None, *words: str) -> None:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    for w in words:
        assert w in err["message"], (w, err["message"])


# ---------------------------------------------------------------- into the contract


def _build(p: CompletionParams, **settings):
    s = GatewaySettings(model="tiny", max_context_len=64, max_prompt_len=32, max_tokens_limit=40, **settings)
    return build_request(p, s, TINY, ByteTokenizer())


def test_new_fields_reach_the_request():
    p = CompletionParams(prompt="hi", max_tokens=8, n=3, presence_penalty=0.5, frequency_penalty=-1,
                         repetition_penalty=1.2, logit_bias={65: 5.0, 10: -100}, min_tokens=2,
                         stop_token_ids=[10, BYTE_EOS, 10], logprobs=4, echo=True, skip_special_tokens=False,
                         continuous_usage=True, seed=7)
    prep = _build(p)
    req, sp = prep.request, prep.request.sampling
    assert (req.n, req.prompt_logprobs, req.stop_token_ids) == (3, 4, [BYTE_EOS, 10])
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, -1.0, 1.2)
    assert sp.logit_bias == ((10, -100.0), (65, 5.0)) and sp.min_tokens == 2 and sp.logprobs == 4 and sp.seed == 7
    assert (prep.echo, prep.logprobs, prep.skip_special_tokens, prep.continuous_usage, prep.n) == (
        True, 4, False, True, 3)
    assert prep.prompt_text == "hi"
    back = type(req).from_json(req.to_json())  # survives the admission stream
    assert back.sampling == sp and back.n == 3 and back.prompt_logprobs == 4


def test_defaults_and_switches():
    plain = _build(CompletionParams(prompt="hi"))
    assert plain.request.n == 1 and plain.request.prompt_logprobs is None and plain.logprobs is None
    assert plain.request.sampling.to_dict() == {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": None}
    assert _build(CompletionParams(prompt="hi", logprobs=2)).request.prompt_logprobs is None  # no echo
    assert _build(CompletionParams(prompt="hi", echo=True)).request.prompt_logprobs is None  # no logprobs
    ign = _build(CompletionParams(prompt="hi", ignore_eos=True, stop_token_ids=[10]))
    assert ign.request.stop_token_ids == [10] and ign.request.ignore_eos  # EOS dropped, the client's kept
    ids = _build(CompletionParams(prompt_ids=[BYTE_BOS, 65], echo=True))
    assert ids.prompt_text is None and ids.echo


def test_chat_without_max_tokens_runs_to_the_context_end():
    chat = CompletionParams(prompt="hello", max_tokens_to_context=True)
    assert _build(chat).request.max_tokens == 40  # max_tokens_limit (64 - 6 would fit 58)
    assert _build(CompletionParams(prompt="x" * 30, max_tokens_to_context=True)).request.max_tokens == 64 - 31
    assert _build(CompletionParams(prompt="hello")).request.max_tokens == 16  # completions: OpenAI's 16
    budget = _build(chat, tokens_per_minute_per_key=20)  # what a per-key token budget can ever admit
    assert budget.request.max_tokens == 20 - 6


def test_bodies_to_params():
    c = CompletionBody.model_validate({"prompt": "x", "logprobs": 5, "echo": True, "n": 2,
                                       "logit_bias": {"7": 1}, "stream_options": {"continuous_usage_stats": True}})
    p = c.to_params()
    assert (p.logprobs, p.echo, p.n, p.logit_bias, p.continuous_usage) == (5, True, 2, {7: 1.0}, True)
    assert not p.max_tokens_to_context
    chat = ChatBody.model_validate({"messages": [{"role": "user", "content": "x"}], "logprobs": True})
    assert chat.to_params().logprobs == 0 and chat.to_params().logprobs_param == "top_logprobs"
    assert chat.to_params().max_tokens_to_context
    top = ChatBody.model_validate({"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                                   "top_logprobs": 20})
    assert top.to_params().logprobs == 20
    off = ChatBody.model_validate({"messages": [{"role": "user", "content": "x"}], "logprobs": False})
    assert off.to_params().logprobs is None
    # 4.0 is the integer 4 in JSON (and JSON Schema); 4.5, "4" and true are refused (test_gateway_validation)
    whole = CompletionBody.model_validate({"prompt": [1.0, 2], "max_tokens": 4.0, "n": 2.0, "seed": -1.0})
    assert (whole.prompt, whole.max_tokens, whole.n, whole.seed) == ([1, 2], 4, 2, -1)
    assert all(type(x) is int for x in (*whole.prompt, whole.max_tokens, whole.n, whole.seed))


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
