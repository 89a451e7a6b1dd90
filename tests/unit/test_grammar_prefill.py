"""The prefill pod's token 0 under a grammar: every choice of an n > 1 request draws only what the
grammar allows first (and a resumed request what follows its streamed output), at temperature 1;
a spec no pod can run fails in the prefill with an InvalidRequest naming it. Real engine on the
built-in model; `prefiller.prefill_sync` is the engine-thread half of the worker (no Redis touched)."""
from __future__ import annotations

import pytest

from prefill_svc.kv_store import KVStore
from prefill_svc.settings import PrefillSettings
from prefill_svc.worker import PrefillWorker
from tandem_core.errors import InvalidRequest
from tandem_core.settings import EngineConfig
from tandem_core.tokenizer import load_tokenizer
from tandem_core.types import GenerationRequest, SamplingParams
from tandem_engine import load_engine
from tandem_core.keys import KeySpace

KS = KeySpace(1)  # a plain Redis: one key shard (a service builds its own from its settings)

SCHEMA = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def worker():
    eng = load_engine("builtin", slots=1, max_len=64, prefill_buckets=(16,))
    s = PrefillSettings(engine=EngineConfig(model="builtin", max_len=64))
    return PrefillWorker(s, eng, None, KS, KVStore(1 << 30, 60), "127.0.0.1:1", "prefill-grammar"), load_tokenizer(eng.info)


def _req(tok, tail: str = "", **kw) -> GenerationRequest:
    ids = [tok.bos_token_id, *tok.encode("x = ", add_special_tokens=False)]
    out = tok.encode(tail, add_special_tokens=False) if tail else []
    return GenerationRequest("p", ids + out, 32, SamplingParams(temperature=1.0, seed=4),
                             grammar={"kind": "json_schema", "schema": SCHEMA}, start_index=len(out), **kw)


def test_every_choice_of_token_zero_is_masked(worker):
    w, tok = worker
    _payload, firsts, _lps, _plp = w.prefiller.prefill_sync(_req(tok, n=4))
    assert [tok.token_bytes(t) for t in firsts] == [b"{"] * 4


def test_resumed_request_continues_its_json(worker):
    w, tok = worker
    _payload, firsts, _lps, _plp = w.prefiller.prefill_sync(_req(tok, tail='{"age":'))
    first = tok.token_bytes(firsts[0])  # an integer's start: a digit, or the minus of a negative one
    assert first == b"-" or first.lstrip(b"-")[:1].isdigit(), first


def test_unsupported_spec_fails_in_prefill(worker):
    w, tok = worker
    req = _req(tok)
    req.grammar = {"kind": "json_schema", "schema": {"not": {"type": "string"}}}
    with pytest.raises(InvalidRequest, match="not"):
        w.prefiller.prefill_sync(req)
