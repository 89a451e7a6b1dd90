"""Round trips of what crosses process boundaries: Redis messages, keys, the KV codec, text."""
from __future__ import annotations

import numpy as np
import pytest

from tandem_core import keys, kvcodec
from tandem_core.models import resolve_model
from tandem_core.bus.ready import ReadyNotice
from tandem_core.tokenizer import ByteTokenizer, Detokenizer
from tandem_core.types import GenerationRequest, KVPayload, SamplingParams

KS = keys.KeySpace(1)  # a plain Redis: one key shard (a service builds its own from its settings)


def test_generation_request_round_trip():
    req = GenerationRequest("r1", [256, 1, 2], 7, SamplingParams(0.5, 3, 0.9, 1234), [257], True, "high", 1.5, 1.0)
    assert GenerationRequest.from_json(req.to_json()) == req


def test_a_steering_hint_travels_only_when_set_and_unknown_fields_are_dropped():
    """`decode_pod` (cache-aware routing to decode pods) is in a request's JSON only when the
    gateway steered it, so unsteered requests stay readable by pods that predate the field; and a
    field this version does not know (a newer gateway's) is dropped, not fatal."""
    plain = GenerationRequest("r", [1, 2], 3)
    assert "decode_pod" not in plain.to_dict()
    steered = GenerationRequest("r", [1, 2], 3, decode_pod="decode-7")
    assert GenerationRequest.from_json(steered.to_json()).decode_pod == "decode-7"
    assert GenerationRequest.from_dict({**plain.to_dict(), "from_a_newer_gateway": 1}) == plain


def test_ready_notice_round_trip():
    n = ReadyNotice(GenerationRequest("r2", [1], 2), "10.0.0.1:50061", "cap", 4096, "prefill-0", 9)
    assert ReadyNotice.from_json(n.to_json()) == n


def test_keys_are_distinct_and_prefixed():
    ks = [KS.admission_stream("p", "high", 0), KS.admission_stream("p", "normal", 0), KS.ready_stream("p", 0),
          KS.token_stream("r"), KS.cancel_key("r"), keys.worker_key("w"), keys.WORKERS]
    assert len(set(ks)) == len(ks) and all(k.startswith("tandem:") for k in ks)


@pytest.mark.parametrize("chunk", [1, 7, 4096, 1 << 20])
def test_kv_codec_round_trip(chunk):
    rng = np.random.default_rng(chunk)
    p = KVPayload(rng.standard_normal((2, 5, 2, 4)).astype(np.float32),
                  rng.standard_normal((2, 5, 2, 4)).astype(np.float32), 4, 11)
    chunks = list(kvcodec.encode(p, chunk))
    assert all(len(c.data) <= chunk for c in chunks) and chunks[-1].seq == chunks[0].total - 1
    q = kvcodec.decode(chunks)
    assert np.array_equal(q.k, p.k) and np.array_equal(q.v, p.v) and (q.true_length, q.first_token) == (4, 11)


def test_detokenizer_holds_back_split_utf8():
    tok = ByteTokenizer()
    d = Detokenizer(tok)
    text = "naïve → 日本"
    out = [d.feed(b) for b in text.encode()]
    assert "".join(out) + d.flush() == text
    assert "\ufffd" not in "".join(out)


def test_builtin_model_resolves():
    info = resolve_model("builtin")
    assert info.vocab_size >= 258 and info.eos_token_ids
