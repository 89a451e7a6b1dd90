"""Schemathesis against the gateway's own /openapi.json, over real HTTP on loopback (uvicorn in a
thread, real Redis, a fake worker that answers every admitted request with EOS at once).

Every operation gets a bounded number of generated requests, valid by the schema and not
(`positive` and `negative` modes), and every response must be: no 5xx, a status code the schema
lists, the content type it lists, and a body that matches the schema for that status code.
Negative data (what the schema forbids) must be rejected. Semantic limits (max_tokens against the
context, n against max_n ...) are the gateway's to enforce with a 400, so "valid by the schema
must be accepted" is not checked. Bounded to stay well under a minute on two slow cores.
"""
from __future__ import annotations

import asyncio
import os
import threading
import uuid

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import checks as st_checks
from schemathesis.generation import GenerationMode

from tandem_core import keys
from tandem_core.bus import groups, token_stream
from tandem_core.models import BYTE_EOS
from tandem_core.types import GenerationRequest, choice_ids
from tests.integration.test_gateway_relay import Gateway, _settings

KS = keys.KeySpace(1)  # a plain Redis: one key shard (a service builds its own from its settings)

EXAMPLES = int(os.environ.get("TANDEM_SCHEMA_FUZZ_EXAMPLES", "30"))  # per operation and generation mode
def _negative_data_rejection(ctx, response, case):
    """Schemathesis' check, with 413 counted as a rejection too: a schema field that takes any JSON
    (a structured-output schema) lets the generator build bodies past max_body_bytes."""
    if response.status_code == 413:
        return None
    return st_checks.negative_data_rejection(ctx, response, case)


CHECKS = [st_checks.not_a_server_error, st_checks.status_code_conformance, st_checks.content_type_conformance,
          st_checks.response_schema_conformance, _negative_data_rejection]


async def _answer_all(redis_url: str, pool: str, stop: threading.Event) -> None:
    """Admission and direct streams: every request (each choice of n) gets EOS at once."""
    import redis.asyncio as aioredis

    r = aioredis.Redis.from_url(redis_url)
    await groups.ensure_groups(r, KS, pool)
    adm = [KS.admission_stream(pool, p, 0) for p in keys.PRIORITIES]
    while not stop.is_set():
        got = await groups.claim(r, adm, keys.PREFILL_GROUP, "st", count=32, block_ms=None)
        got += await groups.claim(r, [KS.direct_stream(pool, 0)], keys.DECODE_GROUP, "st", count=32, block_ms=50)
        for c in got:
            req = GenerationRequest.from_json(c.fields["req"])
            pipe = r.pipeline(transaction=False)
            for rid in {req.request_id, *choice_ids(req.request_id, req.n)}:
                token_stream.add_tokens(pipe, KS, rid, 0, [BYTE_EOS], "stop", 30, 100)
            await pipe.execute()
            await groups.ack(r, c.stream, keys.PREFILL_GROUP if c.stream in adm else keys.DECODE_GROUP, c.entry_id)
    await r.aclose()


@pytest.fixture(scope="module")
def gw(redis_url):
    pool = f"gst-{uuid.uuid4().hex[:8]}"
    stop = threading.Event()
    worker = threading.Thread(target=lambda: asyncio.run(_answer_all(redis_url, pool, stop)), daemon=True)
    worker.start()
    g = Gateway(_settings(redis_url, pool, max_prompt_len=64, max_context_len=96, max_tokens_limit=32,
                          max_body_bytes=65536, first_token_timeout_s=10, request_timeout_s=10, relay_block_ms=50,
                          log_level="WARNING")).start()
    try:
        yield g
    finally:
        g.stop()
        stop.set()
        worker.join(timeout=10)


def _fuzz(operation, mode: GenerationMode, statuses: dict[int, int]) -> None:
    @settings(max_examples=EXAMPLES, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case) -> None:
        resp = case.call_and_validate(checks=CHECKS, timeout=20)
        statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1

    try:
        run()
    except Unsatisfiable:  # nothing in this operation can be made invalid (no body, free-form strings)
        assert mode == GenerationMode.NEGATIVE, operation.label


def test_openapi_schema_fuzz(gw):
    """Every operation in the served schema, both modes; the failures of all of them reported."""
    api = schemathesis.openapi.from_url(f"{gw.url}/openapi.json")
    failures, ran, seen = [], [], {}
    for result in api.get_all_operations():
        op = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            try:
                _fuzz(op, mode, seen.setdefault(f"{op.label} [{mode.value}]", {}))
            except Exception as e:  # noqa: BLE001 - collected, reported together below
                failures.append(f"{op.label} [{mode.value}]: {e}")
        ran.append(op.label)
    assert {"POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize", "GET /v1/models/{model_id}"} <= set(ran)
    assert not failures, "\n\n".join(failures)
    print("statuses per operation:", seen)
    assert seen["POST /v1/completions [positive]"].get(200), seen  # some requests got through to the worker
