"""Generated junk against both OpenAI endpoints: never a 5xx, and the server stays alive.

Hypothesis builds bodies three ways: arbitrary JSON values, objects over the real field names with
values of every type (huge numbers, lone surrogates, nested junk), and raw bytes. A fast fake
worker (real Redis) answers every request that passes validation with one EOS token at once, so
valid requests finish in milliseconds instead of waiting for a deadline.
"""
from __future__ import annotations

import asyncio
import json
import threading
import uuid

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.app import create_app
from gateway.settings import GatewaySettings
from tandem_core import keys
from tandem_core.bus import groups, token_stream
from tandem_core.models import BYTE_EOS
from tandem_core.settings import RedisConfig
from tandem_core.types import GenerationRequest, choice_ids

KS = keys.KeySpace(1)  # a plain Redis: one key shard (a service builds its own from its settings)

POOL = f"gwf-{uuid.uuid4().hex[:8]}"
FUZZ = settings(max_examples=150, deadline=None, derandomize=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


async def _answer_all(redis_url: str, stop: threading.Event) -> None:
    import redis.asyncio as aioredis

    r = aioredis.Redis.from_url(redis_url)
    await groups.ensure_groups(r, KS, POOL)
    adm = [KS.admission_stream(POOL, p, 0) for p in keys.PRIORITIES]
    while not stop.is_set():
        got = await groups.claim(r, adm, keys.PREFILL_GROUP, "fuzz", count=32, block_ms=None)
        got += await groups.claim(r, [KS.direct_stream(POOL, 0)], keys.DECODE_GROUP, "fuzz", count=32, block_ms=50)
        for c in got:
            req = GenerationRequest.from_json(c.fields["req"])
            pipe = r.pipeline(transaction=False)
            for rid in {req.request_id, *choice_ids(req.request_id, req.n)}:  # n > 1: every choice's stream
                token_stream.add_tokens(pipe, KS, rid, 0, [BYTE_EOS], "stop", 30, 100)
            await pipe.execute()
            await groups.ack(r, c.stream, keys.PREFILL_GROUP if c.stream in adm else keys.DECODE_GROUP, c.entry_id)
    await r.aclose()


@pytest.fixture(scope="module")
def client(redis_url):
    stop = threading.Event()
    worker = threading.Thread(target=lambda: asyncio.run(_answer_all(redis_url, stop)), daemon=True)
    worker.start()
    s = GatewaySettings(
        redis=RedisConfig(url=redis_url), grpc_port=0, pool=POOL, model="tiny", max_prompt_len=64,
        max_context_len=96, max_tokens_limit=32, max_body_bytes=16384, first_token_timeout_s=10,
        request_timeout_s=10, relay_block_ms=50, log_level="WARNING",
    )
    try:
        with TestClient(create_app(s), raise_server_exceptions=False) as c:
            yield c
            assert c.get("/healthz").status_code == 200  # alive after everything
    finally:
        stop.set()
        worker.join(timeout=10)


surrogates = st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=3)
scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.sampled_from([0, 1, -1, 2**31, 2**63, 2**64])
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20) | surrogates)
junk = st.recursive(scalars, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids,
                                                                                       max_size=4), max_leaves=12)
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "seed", "stop", "stream", "stream_options", "n", "user", "ignore_eos", "priority", "resumable",
          "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
          "min_tokens", "stop_token_ids", "skip_special_tokens", "echo", "tools", "response_format"]
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", ""]) | junk},
                                optional={"content": st.text(max_size=30) | junk, "name": junk})
BASES = {"/v1/completions": {"prompt": "hi", "max_tokens": 2},
         "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}


NEAR = {  # values close to valid, per field: many such bodies pass and reach the worker
    "model": st.sampled_from(["tiny", "builtin", "gpt-4"]), "max_tokens": st.integers(-1, 40),
    "temperature": st.floats(-0.5, 2.5), "top_p": st.floats(0, 1.2), "top_k": st.integers(-1, 300),
    "seed": st.integers(-(2**64), 2**64), "stop": st.none() | st.text(max_size=3) | st.lists(st.text(max_size=3),
                                                                                          max_size=3),
    "stream": st.booleans(), "stream_options": st.none() | st.just({"include_usage": True}),
    "n": st.integers(0, 3), "user": st.text(max_size=5), "ignore_eos": st.booleans(),
    "priority": st.sampled_from(["high", "normal", "low"]), "resumable": st.booleans(),
    "logprobs": st.none() | st.booleans() | st.integers(-1, 6), "top_logprobs": st.none() | st.integers(-1, 21),
    "echo": st.booleans(), "presence_penalty": st.floats(-2.5, 2.5), "repetition_penalty": st.floats(-0.1, 2.1),
    "logit_bias": st.dictionaries(st.integers(-1, 300).map(str), st.floats(-110, 110), max_size=3),
    "min_tokens": st.integers(-1, 40), "stop_token_ids": st.lists(st.integers(-1, 300), max_size=3),
    "skip_special_tokens": st.booleans(),
}


def _bodies(path: str):
    """Mostly near-valid bodies (so many reach the worker), then junk of every kind."""
    def on_base(values):
        return st.builds(lambda extra: {**BASES[path], **extra},
                         st.dictionaries(st.sampled_from(FIELDS), values, max_size=3))

    near = st.builds(lambda extra: {**BASES[path], **extra}, st.fixed_dictionaries({}, optional=NEAR))
    broken = on_base(junk | st.lists(message, max_size=3))
    any_json = junk | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), junk, max_size=6)
    escaped = (near | broken | any_json).map(lambda v: json.dumps(v, ensure_ascii=True).encode())  # \\ud800
    raw_utf8 = broken.map(lambda v: json.dumps(v, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    return st.one_of(near.map(lambda v: json.dumps(v).encode()), escaped, raw_utf8, st.binary(max_size=200))


def _check(client: TestClient, path: str, raw: bytes) -> None:
    resp = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert resp.status_code < 500, (raw[:300], resp.status_code, resp.text[:300])
    if resp.status_code >= 400:
        err = resp.json()["error"]
        assert err["message"] and err["type"], err


@FUZZ
@given(raw=_bodies("/v1/completions"))
def test_completions_fuzz(client, raw):
    _check(client, "/v1/completions", raw)


@FUZZ
@given(raw=_bodies("/v1/chat/completions"))
def test_chat_fuzz(client, raw):
    _check(client, "/v1/chat/completions", raw)
